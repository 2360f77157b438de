#pragma once

// prefix_store: host copies of shared session starts (a system prompt's KV of the owned layers),
// which new sessions open from instead of computing them. A room of hot_kv_engine: the engine holds
// the lock and makes every llama.cpp call (seq_save, seq_restore); the store keeps the bytes,
// accounts for them and chooses what to evict. It has no lock of its own.
//
// Invariants (check() verifies them):
//  - held() is the sum of the entries' bytes (state pages + 8 key bytes), and held() <= capacity();
//  - each entry's length is in [1, context_tokens] and its state is not empty; entries are copies,
//    owned by the store alone (no session refers to one);
//  - eviction drops the entry with the least last_used + HOT_KV_PREFIX_HIT_SECONDS x min(hits,
//    HOT_KV_PREFIX_HIT_CAP), the oldest stored first on a tie;
//  - only insert() (making room) and drop() remove entries: an entry find() returned stays valid
//    while the engine makes room for the session opened from it.

#include "llama_shard/page_buffer.h"

#include <cstdint>
#include <map>

namespace llama_shard {

// the prefix store's eviction: the entry with the least last_used + hits x this (hits counted up to
// HOT_KV_PREFIX_HIT_CAP) goes first, the oldest stored on a tie: least recently used, weighted by
// how often it was opened (a prefix hit 8 times outlives an unused one by 8 minutes of idleness)
constexpr double  HOT_KV_PREFIX_HIT_SECONDS = 60.0;
constexpr int64_t HOT_KV_PREFIX_HIT_CAP     = 8;

struct prefix_entry {
    int32_t     length;
    page_buffer state;      // shard_context::seq_save of the owned layers, positions [0, length)
    double      last_used;
    int64_t     hits  = 0;
    uint64_t    stamp = 0;  // insertion order: the tie-break of eviction
    uint64_t bytes() const { return (uint64_t) state.capacity() + sizeof(uint64_t); }
};

struct prefix_counters {
    uint64_t stores       = 0;  // prefixes stored
    uint64_t hits         = 0;  // sessions opened from a stored prefix
    uint64_t tokens_saved = 0;  // tokens those sessions did not compute
    uint64_t evictions    = 0;  // prefixes dropped (to make room, or whose bytes llama.cpp refused)
};

class prefix_store {
public:
    explicit prefix_store(uint64_t capacity) : capacity_(capacity) {}

    bool     enabled() const { return capacity_ > 0; }
    bool     contains(uint64_t key) const { return entries_.count(key) != 0; }
    // the length of the prefix under `key`, 0 when none
    int32_t  length(uint64_t key) const;
    // the entry under `key` when it holds exactly `length` tokens, else null
    const prefix_entry * find(uint64_t key, int32_t length) const;
    // stores `state` (positions [0, length)) under `key`, evicting to make room; false when it can
    // never fit the capacity (nothing changed then)
    bool     insert(uint64_t key, int32_t length, page_buffer && state, double now);
    // a session was opened from the entry under `key`: its hits and last use, the counters
    void     hit(uint64_t key, double now);
    // the entry's bytes could not be restored: it goes, counted as an eviction
    void     drop(uint64_t key);

    size_t   size() const { return entries_.size(); }
    uint64_t held() const { return held_; }
    uint64_t capacity() const { return capacity_; }
    const prefix_counters & counters() const { return counters_; }
    // throws std::logic_error naming the first invariant violated
    void     check(int32_t context_tokens) const;

private:
    void evict_one();

    uint64_t                         capacity_;
    std::map<uint64_t, prefix_entry> entries_;
    uint64_t                         held_  = 0;
    uint64_t                         stamp_ = 0;
    prefix_counters                  counters_;
};

} // namespace llama_shard
