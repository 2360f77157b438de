// The Hot KV engine's tiers (hot_kv_engine.h): a session leaving the hot set (spilled to the warm
// tier or dropped) and coming back (restored), the prefix store's copies, and a session's state
// handed to or taken from another worker. A file of its own: every move of a state between the
// llama_context and the engine's rooms is here, apart from the step (hot_kv_engine_step.cpp).

#include "llama_shard/hot_kv_engine.h"
#include "hot_kv_engine_internal.h"

#include "llama_shard/kv_state_check.h"

#include <algorithm>
#include <cassert>
#include <chrono>
#include <cstring>
#include <iterator>
#include <string>

namespace llama_shard {

// ---------------------------------------------------------------------------------------------
// the hot set and the warm tier (mutex_ held)
// ---------------------------------------------------------------------------------------------

void hot_kv_engine::free_hot_locked(const std::string & sid) {
    auto it = live_.find(sid);
    assert(it != live_.end());
    session & s = it->second;
    ctx_->seq_rm(s.seq_id, 0);
    reserved_ -= s.seq_len;
    // kept in descending order: the lowest free id is handed out next, so live sessions hold a
    // compact run of ids and a batched step over them is one ubatch (see shard_context::forward_batch)
    free_ids_.insert(std::upper_bound(free_ids_.begin(), free_ids_.end(), s.seq_id, std::greater<int32_t>()), s.seq_id);
    lru_.erase(s.lru_pos);
    live_.erase(it);
}


void hot_kv_engine::drop_locked(const std::string & sid, shard_miss_reason reason, int64_t remembered_epoch) {
    const int64_t epoch = remembered_epoch >= 0 ? remembered_epoch : live_.at(sid).epoch;
    free_hot_locked(sid);
    remember_locked(sid, epoch, reason);
    count_leaving(counters_, reason);
}

void hot_kv_engine::leave_hot_locked(const std::string & sid, shard_miss_reason reason) {
    if (!spill_locked(sid, reason)) {
        drop_locked(sid, reason);
    }
}

bool hot_kv_engine::spill_locked(const std::string & sid, shard_miss_reason reason) {
    const session & s = live_.at(sid);
    if (!warm_.enabled() || s.seq_len == 0) {
        return false;  // an empty session costs nothing to re-prefill
    }
    page_buffer state = page_buffer::allocate(ctx_->seq_state_size(s.seq_id));
    if (state.empty() || !ctx_->seq_save(s.seq_id, state.data(), state.size())) {
        return false;  // no memory, or llama.cpp could not write it: the session is dropped
    }
    if (!warm_.put(sid, s.epoch, s.seq_len, s.last_used, std::move(state))) {
        return false;
    }
    counters_.spills++;
    count_leaving(counters_, reason);
    free_hot_locked(sid);
    return true;
}

hot_kv_engine::session * hot_kv_engine::restore_locked(const std::string & sid, double now, hot_kv_result & res,
                                                       id_placement & ids) {
    const warm_entry * w = warm_.find(sid);
    assert(w != nullptr && !free_ids_.empty());
    const auto t0 = std::chrono::steady_clock::now();
    uint64_t min_bytes = 0, max_bytes = 0;
    warm_file_bounds(*w, min_bytes, max_bytes);
    page_buffer from_disk;  // read and verified (MAC, header, size, digest, positions) before llama.cpp sees it
    const page_buffer * state = warm_.restore_source(sid, min_bytes, max_bytes, from_disk, state_layout_.format);
    bool ok = state != nullptr;
    int32_t seq_id = -1;
    if (ok) {
        seq_id = take_free_id_locked(ids);
        try {
            ok = ctx_->seq_restore(seq_id, state->data(), state->size()) && ctx_->seq_pos_max(seq_id) == w->seq_len - 1;
        } catch (const shard_error &) {
            ok = false;
        }
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!ok) {
        if (seq_id >= 0) {
            ctx_->seq_rm(seq_id, 0);
            free_ids_.insert(std::upper_bound(free_ids_.begin(), free_ids_.end(), seq_id, std::greater<int32_t>()), seq_id);
        }
        warm_.drop(sid, SHARD_MISS_EVICTED_LRU);
        res = miss_result(SHARD_MISS_EVICTED_LRU, "the session's warm copy could not be restored");
        return nullptr;
    }
    const int64_t epoch = w->epoch;
    const int32_t seq_len = w->seq_len;
    warm_.take(sid);
    lru_.push_back(sid);
    session & s = live_[sid];
    s = session{epoch, seq_id, seq_len, now, std::prev(lru_.end())};
    s.swa_floor = std::max(0, ctx_->seq_pos_min(seq_id));
    reserved_ += seq_len;
    counters_.restores++;
    counters_.restore_seconds += seconds;
    const auto bucket = std::lower_bound(HOT_KV_RESTORE_BUCKETS.begin(), HOT_KV_RESTORE_BUCKETS.end(), seconds);
    counters_.restore_buckets[(size_t) (bucket - HOT_KV_RESTORE_BUCKETS.begin())]++;
    touch_locked(s, now);
    return &s;
}

void hot_kv_engine::warm_file_bounds(const warm_entry & w, uint64_t & min_bytes, uint64_t & max_bytes) const {
    min_bytes = max_bytes = 0;  // a host copy is the engine's own
    if (w.on_disk) {
        const shard_model_info & info = model_.info();
        // every layer holds the sequence's cells, a sliding-window layer only its window of them
        const int32_t least_cells = n_swa_ > 0 ? std::min(w.seq_len, n_swa_) : w.seq_len;
        min_bytes = (uint64_t) least_cells * counters_.kv_bytes_per_token;
        max_bytes = (uint64_t) w.seq_len * (counters_.kv_bytes_per_token + 64) +
                    4ull * (uint64_t) config_.max_sessions + 64ull * (uint64_t) info.n_owned_layers() + 4096 +
                    state_layout_.recurrent_row_bytes;  // a hybrid's recurrent block: one cell, whatever the length
    }
}

hot_kv_engine::session * hot_kv_engine::restore_alone_locked(const std::string & sid, int32_t seq_len, double now,
                                                             hot_kv_result & res) {
    // a warm session fits alone (it was hot under the same limits), so evicting others makes room
    bool room;
    {
        warm_tier::pin pin(warm_, &sid);
        room = make_room_locked(seq_len, true, {sid}, {});
    }
    res = hot_kv_result{};
    if (!room) {  // larger than this engine's budget (never written by it: a guard, not a path)
        warm_.drop(sid, SHARD_MISS_EVICTED_LRU);
        res = miss_result(SHARD_MISS_EVICTED_LRU, "the session's warm copy does not fit this shard's budget");
        return nullptr;
    }
    id_placement lone;  // outside a step: the lowest free id
    return restore_locked(sid, now, res, lone);
}

// ---------------------------------------------------------------------------------------------
// the prefix store
// ---------------------------------------------------------------------------------------------

hot_kv_result hot_kv_engine::store_prefix(const std::string & sid, int64_t epoch, uint64_t key, int32_t length, double now) {
    std::lock_guard<fair_mutex> lock(mutex_);
    const publisher publish_on_return(*this);  // stats() sees this call once it is done
    if (length < 1 || length > config_.context_tokens) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT,
            "a prefix holds 1 to " + str(config_.context_tokens) + " tokens (context_tokens), got " + str(length));
    }
    now = begin_locked(sid, epoch, now);
    hot_kv_result res;
    warm_entry * w = nullptr;
    session * s = identify_locked(sid, epoch, res, &w, /*query*/ true);
    if (s == nullptr) {
        return res;  // warm (OK, nothing stored), or what a step would get: not counted, nothing moved
    }
    if (s->seq_len != length) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT,
            "the session holds " + str(s->seq_len) + " tokens, not the prefix's " + str(length));
    }
    res = hot_result(s->seq_len, s->seq_id);
    if (!prefixes_.enabled() || prefixes_.contains(key)) {
        return res;
    }
    page_buffer state = page_buffer::allocate(ctx_->seq_state_size(s->seq_id));
    if (state.empty() || !ctx_->seq_save(s->seq_id, state.data(), state.size())) {
        return res;  // no memory, or llama.cpp could not write it: not stored
    }
    res.changed = prefixes_.insert(key, length, std::move(state), now);
    return res;
}

hot_kv_result hot_kv_engine::open_prefix(const std::string & sid, int64_t epoch, uint64_t key, int32_t length, double now) {
    std::lock_guard<fair_mutex> lock(mutex_);
    const publisher publish_on_return(*this);  // stats() sees this call once it is done
    if (length < 1) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "a prefix holds at least 1 token, got " + str(length));
    }
    now = begin_locked(sid, epoch, now);
    hot_kv_result res;
    const prefix_entry * entry = lookup_prefix_locked(sid, epoch, key, length, res);
    if (entry == nullptr) {
        return res;
    }
    session * s = replace_for_prefix_locked(sid, epoch, length, now, res);
    if (s == nullptr || !restore_prefix_locked(*s, key, *entry, now, res)) {
        return res;
    }
    return hot_result(s->seq_len, s->seq_id);
}

const prefix_entry * hot_kv_engine::lookup_prefix_locked(const std::string & sid, int64_t epoch, uint64_t key,
                                                         int32_t length, hot_kv_result & res) {
    identify_locked(sid, epoch, res, nullptr, /*query*/ true);  // a stale epoch is that, whatever the store holds
    if (res.status == SHARD_STATUS_STALE_EPOCH) {
        return nullptr;
    }
    res = hot_kv_result{};
    const prefix_entry * entry = prefixes_.find(key, length);
    if (entry == nullptr) {
        res = miss_result(SHARD_MISS_PREFIX_EVICTED, "this shard does not hold the prefix of " + str(length) +
                                                     " tokens: the head computes it");
        count_miss_locked(res);
        return nullptr;
    }
    if (length > config_.context_tokens || length > config_.budget_tokens) {
        res.status = SHARD_STATUS_BUDGET_EXCEEDED;
        res.detail = "a prefix of " + str(length) + " tokens does not fit this shard's context or budget";
        return nullptr;
    }
    return entry;
}

hot_kv_engine::session * hot_kv_engine::replace_for_prefix_locked(const std::string & sid, int64_t epoch,
                                                                 int32_t length, double now, hot_kv_result & res) {
    warm_entry * w = nullptr;
    session * s = identify_locked(sid, epoch, res, &w);  // supersedes an older epoch (not counted as a miss)
    if (res.status == SHARD_STATUS_STALE_EPOCH) {
        return nullptr;
    }
    if (w != nullptr) {  // its warm copy is about to be replaced: dropped (a warm drop), not restored
        warm_.discard(sid);
        s = nullptr;
    }
    const int32_t held = s != nullptr ? s->seq_len : 0;
    {
        // never touches the prefix store: the entry being opened stays valid
        const bool room = make_room_locked(std::max(0, length - held), s == nullptr, {sid}, {});
        assert(room);  // length <= budget: every other session can leave
        (void) room;
    }
    if (s == nullptr) {
        id_placement lone;
        s = &create_locked(sid, epoch, now, lone);
    } else if (held > 0) {
        ctx_->seq_rm(s->seq_id, 0);
        reserved_ -= held;
        s->seq_len = 0;
    }
    s->swa_floor  = 0;
    s->last_start = -1;
    s->checkpoints.clear();  // another state comes in: the old one's checkpoints are not its
    return s;
}

bool hot_kv_engine::restore_prefix_locked(session & s, uint64_t key, const prefix_entry & entry, double now,
                                          hot_kv_result & res) {
    const int32_t length = entry.length;
    const bool ok = restore_state_locked(s, entry.state.data(), entry.state.size(), length);
    touch_locked(s, now);  // the session was emptied either way: it is used now
    if (!ok) {  // never for the store's own bytes (a guard): the session stays, empty; the entry goes
        prefixes_.drop(key);
        res = miss_result(SHARD_MISS_PREFIX_EVICTED, "the stored prefix could not be restored");
        count_miss_locked(res);
        return false;
    }
    s.seq_len   = length;
    s.swa_floor = std::max(0, ctx_->seq_pos_min(s.seq_id));
    reserved_ += length;
    prefixes_.hit(key, now);
    return true;
}

bool hot_kv_engine::restore_state_locked(session & s, const uint8_t * data, size_t size, int32_t length) {
    bool ok = false;
    try {
        ok = ctx_->seq_restore(s.seq_id, data, size) && ctx_->seq_pos_max(s.seq_id) == length - 1;
    } catch (const shard_error &) {
        ok = false;
    }
    if (!ok) {
        ctx_->seq_rm(s.seq_id, 0);  // whatever llama.cpp placed before it refused
    }
    return ok;
}

int32_t hot_kv_engine::prefix_length(uint64_t key) const {
    std::lock_guard<fair_mutex> lock(mutex_);
    return prefixes_.length(key);
}

// ---------------------------------------------------------------------------------------------
// hand-over
// ---------------------------------------------------------------------------------------------

hot_kv_result hot_kv_engine::export_session(const std::string & sid, int64_t epoch, double now, page_buffer & state) {
    std::lock_guard<fair_mutex> lock(mutex_);
    const publisher publish_on_return(*this);  // stats() sees this call once it is done
    now = begin_locked(sid, epoch, now);
    state.reset();
    hot_kv_result res;
    warm_entry * w = nullptr;
    // a query: a newer epoch supersedes nothing, a warm session stays where it is
    session * s = identify_locked(sid, epoch, res, &w, /*query*/ true);
    if (s == nullptr && w == nullptr) {
        count_miss_locked(res);  // as resolve's
        return res;
    }
    if (s != nullptr) {
        res = hot_result(s->seq_len, s->seq_id);
        if (s->seq_len == 0) {
            return res;  // nothing to hand over: the receiver opens the session
        }
        page_buffer copy = page_buffer::allocate(ctx_->seq_state_size(s->seq_id));
        if (copy.empty() || !ctx_->seq_save(s->seq_id, copy.data(), copy.size())) {
            throw shard_error(SHARD_ERRC_CAPACITY, "could not copy the session's state (" +
                              str((int64_t) ctx_->seq_state_size(s->seq_id)) + " bytes)");
        }
        state = std::move(copy);
        return res;
    }
    // warm: its host copy, or its file read and checked as a restore reads it
    uint64_t min_bytes = 0, max_bytes = 0;
    warm_file_bounds(*w, min_bytes, max_bytes);
    page_buffer scratch;
    const page_buffer * src = warm_.restore_source(sid, min_bytes, max_bytes, scratch, state_layout_.format);
    if (src == nullptr) {  // as a restore that finds its copy unusable: dropped, a miss
        warm_.drop(sid, SHARD_MISS_EVICTED_LRU);
        res = miss_result(SHARD_MISS_EVICTED_LRU, "the session's warm copy could not be read");
        count_miss_locked(res);
        return res;
    }
    if (src == &scratch) {
        state = std::move(scratch);
    } else {
        page_buffer copy = page_buffer::allocate(src->size());
        if (copy.empty()) {
            throw shard_error(SHARD_ERRC_CAPACITY, "could not copy the session's state (" + str((int64_t) src->size()) + " bytes)");
        }
        std::memcpy(copy.data(), src->data(), src->size());
        state = std::move(copy);
    }
    return res;  // identify's: OK, the warm tier and length
}

hot_kv_result hot_kv_engine::import_session(const std::string & sid, int64_t epoch, int32_t seq_len, const uint8_t * data,
                                            size_t size, double now) {
    std::lock_guard<fair_mutex> lock(mutex_);
    const publisher publish_on_return(*this);  // stats() sees this call once it is done
    validate_key(sid, epoch);
    if (seq_len < 1) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "an imported session holds at least 1 token, got " + str(seq_len));
    }
    // every check before anything changes (not even the engine's time) and before llama.cpp reads a
    // byte; identity first, as everywhere (a query: a TTL sweep changes no session's epoch)
    hot_kv_result res;
    identify_locked(sid, epoch, res, nullptr, /*query*/ true);
    if (res.status == SHARD_STATUS_STALE_EPOCH) {
        return res;  // a newer epoch is held: nothing changed
    }
    res = hot_kv_result{};
    if (seq_len > config_.context_tokens || seq_len > config_.budget_tokens) {
        res.status = SHARD_STATUS_BUDGET_EXCEEDED;
        res.detail = "a session of " + str(seq_len) + " tokens does not fit this shard's context_tokens " +
                     str(config_.context_tokens) + " or budget_tokens " + str(config_.budget_tokens);
        return res;
    }
    std::string why;
    if (!kv_state_restorable(data, size, seq_len, state_layout_, why)) {
        res.status = SHARD_STATUS_INVALID_INPUT;
        res.detail = "the state of " + str(seq_len) + " tokens cannot be restored here: " + why;
        return res;
    }
    page_buffer restreamed;  // a state of an engine with another stream count, rewritten for this one
    if (kv_state_streams(data, size) != n_stream_) {
        if (!kv_state_restream(data, size, seq_len, n_stream_, restreamed, state_layout_.format)) {
            throw shard_error(SHARD_ERRC_CAPACITY, "could not copy the state for this engine's streams (" +
                              str((int64_t) size) + " bytes)");
        }
        data = restreamed.data();
        size = restreamed.size();
    }
    now = begin_locked(sid, epoch, now);
    // emptied (an older epoch superseded, a warm copy discarded), room made by evicting others
    session * s = replace_for_prefix_locked(sid, epoch, seq_len, now, res);
    assert(s != nullptr);
    if (!restore_state_locked(*s, data, size, seq_len)) {  // a guard: the checks above passed
        free_hot_locked(sid);
        remember_locked(sid, epoch, SHARD_MISS_EVICTED_LRU);
        res = hot_kv_result{};
        res.status = SHARD_STATUS_INVALID_INPUT;
        res.detail = "llama.cpp refused the state of " + str(seq_len) + " tokens; the session's state is gone";
        return res;
    }
    s->seq_len   = seq_len;
    s->swa_floor = std::max(0, ctx_->seq_pos_min(s->seq_id));
    reserved_ += seq_len;
    touch_locked(*s, now);
    return hot_result(s->seq_len, s->seq_id);
}

} // namespace llama_shard
