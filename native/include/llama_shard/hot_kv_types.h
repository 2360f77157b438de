#pragma once

// The outcomes the Hot KV engine and its stores speak in: a call's status, a miss's reason, the tier
// a session's KV is in. Apart from hot_kv_engine.h so that its rooms (warm_tier.h) use them without
// including the engine.

namespace llama_shard {

enum shard_status {
    SHARD_STATUS_OK,
    SHARD_STATUS_CACHE_MISS,       // see the miss reason; the head re-prefills from token zero
    SHARD_STATUS_STALE_EPOCH,      // the request's epoch is older than the session's current one
    SHARD_STATUS_BUDGET_EXCEEDED,  // the step cannot fit even with every other session evicted
    SHARD_STATUS_INVALID_INPUT,    // step(): this request was invalid (single calls throw); import_session: bytes it refuses
    SHARD_STATUS_COMPUTE_ERROR,    // step() only: llama_decode failed; the step was rolled back
    SHARD_STATUS_BUSY,             // step() only, warm tier on: fits alone, not beside this step's admitted sessions
};

// where a session's KV is
enum hot_kv_tier {
    HOT_KV_TIER_NONE,  // nowhere (a miss)
    HOT_KV_TIER_HOT,   // in the llama_context, under a seq id
    HOT_KV_TIER_WARM,  // as bytes in host memory
    HOT_KV_TIER_DISK,  // in a file of the disk tier
};

enum shard_miss_reason {
    SHARD_MISS_NONE,
    SHARD_MISS_UNKNOWN_SESSION,
    SHARD_MISS_EVICTED_TTL,
    SHARD_MISS_EVICTED_LRU,
    SHARD_MISS_RELEASED,
    SHARD_MISS_SUPERSEDED_EPOCH,
    SHARD_MISS_SEQ_LEN_MISMATCH,
    SHARD_MISS_PREFIX_EVICTED,    // open_prefix: the prefix is not in this shard's store (evicted, or never stored here)
    SHARD_MISS_COUNT,
};

const char * shard_status_name(shard_status status);
const char * shard_miss_reason_name(shard_miss_reason reason);

} // namespace llama_shard
