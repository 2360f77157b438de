#include "llama_shard/prefix_store.h"

#include <algorithm>
#include <cassert>
#include <stdexcept>
#include <string>
#include <utility>

namespace llama_shard {

int32_t prefix_store::length(uint64_t key) const {
    auto it = entries_.find(key);
    return it == entries_.end() ? 0 : it->second.length;
}

const prefix_entry * prefix_store::find(uint64_t key, int32_t length) const {
    auto it = entries_.find(key);
    return it == entries_.end() || it->second.length != length ? nullptr : &it->second;
}

void prefix_store::evict_one() {
    auto score = [](const prefix_entry & e) {
        return e.last_used + HOT_KV_PREFIX_HIT_SECONDS * (double) std::min(e.hits, HOT_KV_PREFIX_HIT_CAP);
    };
    auto victim = entries_.end();
    for (auto it = entries_.begin(); it != entries_.end(); ++it) {
        if (victim == entries_.end() || score(it->second) < score(victim->second) ||
            (score(it->second) == score(victim->second) && it->second.stamp < victim->second.stamp)) {
            victim = it;
        }
    }
    assert(victim != entries_.end());
    held_ -= victim->second.bytes();
    entries_.erase(victim);
    counters_.evictions++;
}

bool prefix_store::insert(uint64_t key, int32_t length, page_buffer && state, double now) {
    prefix_entry e{length, std::move(state), now, 0, ++stamp_};
    if (e.bytes() > capacity_) {
        return false;
    }
    while (held_ + e.bytes() > capacity_) {
        evict_one();
    }
    held_ += e.bytes();
    entries_.emplace(key, std::move(e));
    counters_.stores++;
    return true;
}

void prefix_store::hit(uint64_t key, double now) {
    prefix_entry & e = entries_.at(key);
    e.hits++;
    e.last_used = now;
    counters_.hits++;
    counters_.tokens_saved += (uint64_t) e.length;
}

void prefix_store::drop(uint64_t key) {
    auto it = entries_.find(key);
    if (it == entries_.end()) {
        return;
    }
    held_ -= it->second.bytes();
    entries_.erase(it);
    counters_.evictions++;
}

void prefix_store::check(int32_t context_tokens) const {
    auto fail = [](const std::string & what) { throw std::logic_error("hot_kv_engine invariant violated: " + what); };
    uint64_t sum = 0;
    for (const auto & [key, e] : entries_) {
        (void) key;
        if (e.length < 1 || e.length > context_tokens) fail("prefix length outside [1, context_tokens]");
        if (e.state.empty()) fail("a prefix entry holds no state");
        sum += e.bytes();
    }
    if (sum != held_) fail("prefix bytes held != sum of prefix entries");
    if (held_ > capacity_) fail("prefix bytes exceed prefix_bytes");
}

} // namespace llama_shard
