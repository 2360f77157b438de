#include "llama_shard/warm_tier.h"

#include "llama_shard/kv_state_check.h"

#include <cassert>
#include <cstdio>
#include <iterator>
#include <stdexcept>
#include <utility>

namespace llama_shard {

// puts `sid` into an LRU list at its place by last use (after every entry used no later): a spill
// is usually the most recent, but not always (a step evicts its own later sessions after others)
static std::list<std::string>::iterator insert_by_last_used(std::list<std::string> & lru,
                                                            const std::unordered_map<std::string, warm_entry> & entries,
                                                            const std::string & sid, double last_used) {
    auto pos = lru.end();
    while (pos != lru.begin() && entries.at(*std::prev(pos)).last_used > last_used) {
        --pos;
    }
    return lru.insert(pos, sid);
}

uint64_t warm_entry::bytes() const {
    return on_disk ? file_bytes : (uint64_t) state.capacity() + (uint64_t) lru_pos->size();
}

warm_tier::warm_tier(uint64_t host_bytes, uint64_t disk_bytes, double ttl_seconds, drop_fn on_drop)
    : host_bytes_(host_bytes), disk_bytes_(disk_bytes), ttl_seconds_(ttl_seconds), on_drop_(std::move(on_drop)) {}

void warm_tier::attach_disk(std::unique_ptr<kv_file_store> files, int32_t longest) {
    disk_ = std::move(files);
    for (kv_file_entry & e : disk_->scan(longest)) {
        disk_lru_.push_back(e.session_id);
        warm_entry & w = entries_[e.session_id];
        w = warm_entry{e.epoch, e.seq_len, 0.0, {}, std::prev(disk_lru_.end()), true, e.file_bytes};
        disk_held_ += e.file_bytes;
        counters_.disk_loaded++;
    }
    while (disk_held_ > disk_bytes_) {
        drop(std::string(disk_lru_.front()), SHARD_MISS_EVICTED_LRU);
    }
    clock_pending_ = !disk_lru_.empty();
    listed_        = false;
}

warm_entry * warm_tier::find(const std::string & sid) {
    auto it = entries_.find(sid);
    return it == entries_.end() ? nullptr : &it->second;
}

const warm_entry * warm_tier::find(const std::string & sid) const {
    auto it = entries_.find(sid);
    return it == entries_.end() ? nullptr : &it->second;
}

bool warm_tier::put(const std::string & sid, int64_t epoch, int32_t seq_len, double last_used, page_buffer && state) {
    warm_entry w{epoch, seq_len, last_used, std::move(state), {}, false, 0};
    return store_host(sid, std::move(w)) || store_disk(sid, std::move(w));  // each moves `w` only once it takes it
}

bool warm_tier::store_host(const std::string & sid, warm_entry && w) {
    const uint64_t bytes = (uint64_t) w.state.capacity() + (uint64_t) sid.size();
    // the warm session being restored (pinned) is never moved out to make room for this one
    auto pinned = pinned_ != nullptr ? entries_.find(*pinned_) : entries_.end();
    const uint64_t pinned_bytes = pinned != entries_.end() && !pinned->second.on_disk ? pinned->second.bytes() : 0;
    if (bytes + pinned_bytes > host_bytes_) {
        return false;
    }
    while (host_held_ + bytes > host_bytes_) {
        auto victim = host_lru_.begin();
        if (pinned != entries_.end() && *victim == pinned->first) {
            ++victim;
        }
        demote(std::string(*victim));
    }
    w.lru_pos = insert_by_last_used(host_lru_, entries_, sid, w.last_used);
    entries_[sid] = std::move(w);
    host_held_ += bytes;
    listed_ = false;
    return true;
}

bool warm_tier::store_disk(const std::string & sid, warm_entry && w) {
    if (!disk_) {
        return false;
    }
    // the header is under 256 bytes past the key: room for this much is made before writing
    const uint64_t bound = (uint64_t) w.state.size() + (uint64_t) sid.size() + 256;
    auto pinned = pinned_ != nullptr ? entries_.find(*pinned_) : entries_.end();
    const uint64_t pinned_bytes = pinned != entries_.end() && pinned->second.on_disk ? pinned->second.bytes() : 0;
    if (bound + pinned_bytes > disk_bytes_) {
        return false;
    }
    while (disk_held_ + bound > disk_bytes_) {
        auto victim = disk_lru_.begin();
        if (pinned != entries_.end() && *victim == pinned->first) {
            ++victim;
        }
        drop(std::string(*victim), SHARD_MISS_EVICTED_LRU);
    }
    const uint64_t written = disk_->write(sid, w.epoch, w.seq_len, w.state);
    if (written == 0) {
        counters_.disk_failures++;
        return false;
    }
    w.state.reset();  // unmapped: the file holds it now
    w.on_disk      = true;
    w.file_bytes   = written;
    w.lru_pos      = insert_by_last_used(disk_lru_, entries_, sid, w.last_used);
    entries_[sid]  = std::move(w);
    disk_held_    += written;
    listed_        = false;
    counters_.disk_spills++;
    return true;
}

void warm_tier::demote(const std::string & sid) {
    auto it = entries_.find(sid);
    assert(it != entries_.end() && !it->second.on_disk);
    warm_entry w = std::move(it->second);
    host_held_ -= (uint64_t) w.state.capacity() + (uint64_t) sid.size();
    host_lru_.erase(w.lru_pos);
    entries_.erase(it);
    listed_ = false;
    if (!store_disk(sid, std::move(w))) {
        counters_.warm_drops++;
        on_drop_(sid, w.epoch, SHARD_MISS_EVICTED_LRU);
    }
}

void warm_tier::erase(std::unordered_map<std::string, warm_entry>::iterator it) {
    if (it->second.on_disk) {
        disk_->remove(it->first);
        disk_held_ -= it->second.bytes();
        disk_lru_.erase(it->second.lru_pos);
    } else {
        host_held_ -= it->second.bytes();
        host_lru_.erase(it->second.lru_pos);
    }
    entries_.erase(it);
    listed_ = false;
}

void warm_tier::drop(const std::string & sid, shard_miss_reason reason, int64_t remembered_epoch) {
    auto it = entries_.find(sid);
    assert(it != entries_.end());
    const int64_t epoch = remembered_epoch >= 0 ? remembered_epoch : it->second.epoch;
    const std::string key = sid;  // sid may be the entry's own key, erased below
    erase(it);
    counters_.warm_drops++;
    on_drop_(key, epoch, reason);
}

void warm_tier::discard(const std::string & sid) {
    auto it = entries_.find(sid);
    assert(it != entries_.end());
    erase(it);
    counters_.warm_drops++;
}

const page_buffer * warm_tier::restore_source(const std::string & sid, uint64_t min_bytes, uint64_t max_bytes,
                                              page_buffer & scratch, const kv_state_format & format) {
    const warm_entry & w = entries_.at(sid);
    if (w.on_disk && !disk_->read(sid, w.epoch, w.seq_len, min_bytes, max_bytes, scratch)) {
        counters_.disk_failures++;
        return nullptr;
    }
    const page_buffer & state = w.on_disk ? scratch : w.state;
    std::string why;
    // a file read back is checked to its values (a copy kept in memory is this engine's own bytes)
    if (!(w.on_disk ? kv_state_values_ok(state.data(), state.size(), w.seq_len, why, format)
                    : kv_state_positions_ok(state.data(), state.size(), w.seq_len, why, format))) {
        std::fprintf(stderr, "llama-shard warm tier: refused a state of %d tokens: %s\n", (int) w.seq_len, why.c_str());
        counters_.disk_failures += w.on_disk ? 1 : 0;
        return nullptr;
    }
    return &state;
}

void warm_tier::take(const std::string & sid) {
    auto it = entries_.find(sid);
    assert(it != entries_.end());
    counters_.disk_restores += it->second.on_disk ? 1 : 0;
    erase(it);  // a file is removed: hot again, a stale file must not come back after a restart
}

int32_t warm_tier::sweep(double now) {
    if (ttl_seconds_ <= 0) {
        return 0;
    }
    int32_t n = 0;
    for (std::list<std::string> * lru : {&disk_lru_, &host_lru_}) {
        while (!lru->empty() && now - entries_.at(lru->front()).last_used > ttl_seconds_) {
            drop(std::string(lru->front()), SHARD_MISS_EVICTED_TTL);
            ++n;
        }
    }
    return n;
}

void warm_tier::start_clock(double now) {
    if (!clock_pending_) {
        return;
    }
    for (const std::string & sid : disk_lru_) {
        entries_.at(sid).last_used = now;
    }
    clock_pending_ = false;
    listed_        = false;
}

void warm_tier::release_host_all() {
    while (!host_lru_.empty()) {
        drop(std::string(host_lru_.front()), SHARD_MISS_RELEASED);
    }
}

void warm_tier::demote_host_all() {
    while (!host_lru_.empty()) {
        demote(std::string(host_lru_.front()));
    }
}

void warm_tier::check(int32_t context_tokens) const {
    auto fail = [](const std::string & what) { throw std::logic_error("hot_kv_engine invariant violated: " + what); };
    if (host_lru_.size() + disk_lru_.size() != entries_.size()) fail("warm LRU lists and warm map disagree");
    uint64_t sums[2] = {0, 0};
    for (const bool disk : {false, true}) {
        double prev = -1e300;
        for (const std::string & sid : disk ? disk_lru_ : host_lru_) {
            const warm_entry & w = entries_.at(sid);
            if (*w.lru_pos != sid || w.on_disk != disk) fail("warm LRU position does not point at its session");
            if (w.seq_len < 1 || w.seq_len > context_tokens) fail("warm session length outside [1, context_tokens]");
            if (w.last_used < prev) fail("warm LRU order disagrees with last_used");
            if (disk && !w.state.empty()) fail("a disk session still holds its state in memory");
            prev = w.last_used;
            sums[disk] += w.bytes();
        }
    }
    if (sums[0] != host_held_) fail("warm bytes held != sum of warm entries");
    if (sums[1] != disk_held_) fail("disk bytes held != sum of disk entries");
    if (host_held_ > host_bytes_) fail("warm bytes exceed warm_bytes");
    if (disk_held_ > disk_bytes_) fail("disk bytes exceed warm_disk_bytes");
}

} // namespace llama_shard
