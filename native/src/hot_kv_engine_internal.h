#pragma once

// hot_kv_engine's internals shared by its source files (hot_kv_engine.cpp, _step.cpp, _tiers.cpp,
// _check.cpp): the answers several of them give and the leaving counters. Not a public header:
// nothing outside hot_kv_engine includes it.

#include "llama_shard/hot_kv_engine.h"

#include <cstdint>
#include <string>
#include <utility>

namespace llama_shard {

inline std::string str(int64_t v) { return std::to_string(v); }

// the answer for a session that is hot after the call
inline hot_kv_result hot_result(int32_t seq_len, int32_t seq_id) {
    hot_kv_result res;
    res.seq_len = seq_len;
    res.seq_id  = seq_id;
    res.tier    = HOT_KV_TIER_HOT;
    return res;
}

// a cache miss (counted where it is answered: count_miss_locked)
inline hot_kv_result miss_result(shard_miss_reason reason, std::string detail) {
    hot_kv_result res;
    res.status = SHARD_STATUS_CACHE_MISS;
    res.miss   = reason;
    res.detail = std::move(detail);
    return res;
}

// a session that left the hot set or the warm tier, counted by why
inline void count_leaving(hot_kv_stats & c, shard_miss_reason reason) {
    switch (reason) {
        case SHARD_MISS_EVICTED_TTL:      c.evictions_ttl++; break;
        case SHARD_MISS_EVICTED_LRU:      c.evictions_lru++; break;
        case SHARD_MISS_RELEASED:         c.releases++;      break;
        case SHARD_MISS_SUPERSEDED_EPOCH: c.supersessions++; break;
        default: break;
    }
}

} // namespace llama_shard
