#pragma once

// warm_tier: sessions that left the hot set, kept as llama.cpp's sequence state of the owned layers:
// in host memory (warm_bytes) or, past that, in files of the disk tier (warm_dir, warm_disk_bytes).
// A room of hot_kv_engine: the engine holds the lock, makes every llama.cpp call (seq_save when a
// session spills, seq_restore when it comes back) and owns the hot set; the tier keeps the bytes and
// files, accounts for them, chooses what leaves, and tells the engine of every session it drops
// (`drop_fn`: the engine remembers the key's epoch and why, for stale-epoch fencing). No lock here.
//
// Invariants (check() verifies them):
//  - a key is in one tier: host entries are in the host LRU list, disk entries in the disk one, and
//    the two lists hold exactly the map's keys, each ordered by last use (front: least recent);
//  - host bytes held are the sum of the host entries' bytes (the state's whole pages and the key:
//    what is resident) and <= host capacity; disk bytes held are the sum of the files' sizes and
//    <= disk capacity; a disk entry holds no state in memory; every length is in [1, context_tokens];
//  - the pinned session (being restored) is never moved out to make room for another;
//  - listed() is false after every change: the engine's published list of warm sessions is rebuilt.

#include "llama_shard/hot_kv_types.h"
#include "llama_shard/kv_file_store.h"
#include "llama_shard/kv_state_check.h"
#include "llama_shard/page_buffer.h"

#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <string>
#include <unordered_map>

namespace llama_shard {

struct warm_entry {
    int64_t                          epoch;
    int32_t                          seq_len;
    double                           last_used;
    page_buffer                      state;      // shard_context::seq_save of the owned layers (empty on disk)
    std::list<std::string>::iterator lru_pos;    // in the host or the disk LRU list
    bool                             on_disk    = false;
    uint64_t                         file_bytes = 0;
    uint64_t bytes() const;  // what its tier charges: state pages + key in memory, the file on disk
};

struct warm_counters {
    uint64_t warm_drops    = 0;  // entries dropped (LRU by bytes, TTL, release, new epoch, a failed restore, replaced)
    uint64_t disk_spills   = 0;  // entries written to the disk tier (spilled past host memory, or demoted)
    uint64_t disk_restores = 0;  // entries restored from the disk tier
    uint64_t disk_loaded   = 0;  // files a restarted engine found and kept
    uint64_t disk_failures = 0;  // disk writes or reads that failed (logged)
};

class warm_tier {
public:
    // told of every session the tier drops, after its entry is gone (`sid` is a copy)
    using drop_fn = std::function<void(const std::string & sid, int64_t epoch, shard_miss_reason reason)>;

    warm_tier(uint64_t host_bytes, uint64_t disk_bytes, double ttl_seconds, drop_fn on_drop);

    // a restarted worker's directory: its valid files become disk entries, oldest first (the oldest
    // dropped as EVICTED_LRU past disk_bytes), idle from the first start_clock()
    void attach_disk(std::unique_ptr<kv_file_store> files, int32_t longest);

    bool enabled() const { return host_bytes_ > 0 || disk_ != nullptr; }
    bool has_disk() const { return disk_ != nullptr; }
    warm_entry *       find(const std::string & sid);
    const warm_entry * find(const std::string & sid) const;
    bool               contains(const std::string & sid) const { return entries_.count(sid) != 0; }

    // a session leaving the hot set: into host memory, else the disk tier (each making room by LRU,
    // host entries demoted to disk); false when neither takes it (nothing changed then)
    bool put(const std::string & sid, int64_t epoch, int32_t seq_len, double last_used, page_buffer && state);
    // drops the entry: a warm drop, the engine told (with `remembered_epoch` when >= 0)
    void drop(const std::string & sid, shard_miss_reason reason, int64_t remembered_epoch = -1);
    // removes the entry whose copy is being replaced (a prefix opened over it): a warm drop, untold
    void discard(const std::string & sid);
    // the state to restore: the host copy, or the file read into `scratch` and checked (its MAC,
    // header and size within [min_bytes, max_bytes]); either checked for its cell positions. Null
    // when unusable (logged; a disk failure counted for a file). Changes no entry. `format`: what
    // the engine's states hold (kv_state_layout::format).
    const page_buffer * restore_source(const std::string & sid, uint64_t min_bytes, uint64_t max_bytes,
                                       page_buffer & scratch, const kv_state_format & format);
    // the entry was restored hot: removed (its file deleted: a stale one must not come back after
    // a restart), a disk restore counted when it was on disk
    void take(const std::string & sid);
    // drops entries idle longer than the TTL (the disk tier's first) as EVICTED_TTL; how many
    int32_t sweep(double now);
    // files loaded at start-up are idle from the engine's first call on
    void start_clock(double now);
    // shutting down: every host entry dropped as RELEASED (no disk tier), or written to the disk tier
    void release_host_all();
    void demote_host_all();

    // pins `sid` (being restored) for a scope: making room never moves it out
    class pin {
    public:
        pin(warm_tier & tier, const std::string * sid) : tier_(tier) { tier_.pinned_ = sid; }
        ~pin() { tier_.pinned_ = nullptr; }
        pin(const pin &) = delete;
        pin & operator=(const pin &) = delete;
    private:
        warm_tier & tier_;
    };

    // host entries then disk entries, each least recently used first: f(sid, entry)
    template <typename F> void for_each(F f) const {
        for (const std::list<std::string> * lru : {&host_lru_, &disk_lru_}) {
            for (const std::string & sid : *lru) {
                f(sid, entries_.at(sid));
            }
        }
    }
    bool listed() const { return listed_; }
    void mark_listed() const { listed_ = true; }

    size_t   size() const { return entries_.size(); }
    size_t   host_sessions() const { return host_lru_.size(); }
    size_t   disk_sessions() const { return disk_lru_.size(); }
    uint64_t host_held() const { return host_held_; }
    uint64_t disk_held() const { return disk_held_; }
    const warm_counters & counters() const { return counters_; }
    // throws std::logic_error naming the first invariant violated
    void check(int32_t context_tokens) const;

private:
    bool store_host(const std::string & sid, warm_entry && w);
    bool store_disk(const std::string & sid, warm_entry && w);
    void demote(const std::string & sid);
    void erase(std::unordered_map<std::string, warm_entry>::iterator it);

    uint64_t                                    host_bytes_;
    uint64_t                                    disk_bytes_;
    double                                      ttl_seconds_;
    drop_fn                                     on_drop_;
    std::unordered_map<std::string, warm_entry> entries_;   // host and disk entries
    std::list<std::string>                      host_lru_;  // host entries, front = least recently used
    std::list<std::string>                      disk_lru_;  // disk entries, front = least recently used
    uint64_t                                    host_held_ = 0;
    uint64_t                                    disk_held_ = 0;
    std::unique_ptr<kv_file_store>              disk_;      // null: no disk tier
    bool                                        clock_pending_ = false;  // loaded files get the first `now` seen
    const std::string *                         pinned_ = nullptr;       // being restored: never moved out
    mutable bool                                listed_ = false;         // the engine's published list is current
    warm_counters                               counters_;
};

} // namespace llama_shard
