#pragma once

// hot_kv_engine: the Hot KV state of one shard. Maps each (route_session_id, route_epoch) to a
// distinct llama_seq_id of one bounded shard_context and owns every cache mutation.
//
// Invariants (check_invariants() verifies them; tests call it after every step):
//  - at most one live epoch per session id; live sessions <= max_sessions; each holds a distinct
//    seq id in [0, max_sessions), and free ids + live ids are exactly that range;
//  - a session's length is the number of positions llama.cpp holds for its seq id (0..len-1), and
//    reserved_tokens, the sum of the lengths, equals the cells the context holds, but for a session
//    restored from the warm tier of a sliding-window model, which holds its sliding layers from
//    swa_floor (llama.cpp's pos_min) on: it counts seq_len - swa_floor cells;
//  - reserved_tokens <= budget_tokens, and every length <= context_tokens <= the cells of the
//    session's own KV stream, so llama_decode never lacks a KV slot once admission said yes;
//  - the table of recently dropped keys holds at most recent_capacity entries: stale-epoch fencing
//    of a session that is in no tier lasts until recent_capacity later keys were dropped (then an
//    old epoch gets UNKNOWN_SESSION, still a miss: the head re-prefills);
//  - free ids are kept in descending order. With one KV stream per sequence, llama.cpp computes
//    sequences in one ubatch only when their ids are consecutive (shard_context::forward_batch
//    orders a step by id), so ids are placed to keep a micro-batch contiguous: a session created
//    by a step takes the id after the one the step created before it when that is free, else the
//    start of the lowest run of free ids long enough for the step's remaining new sessions, else
//    the lowest free id (outside a step: the lowest free id).
//
//  - its rooms keep their own invariants (each check()ed from check_invariants): the prefix store
//    (prefix_store.h: copies of shared starts, bytes <= prefix_bytes) and the warm tier (warm_tier.h:
//    a session that leaves the hot set by LRU or TTL eviction keeps its KV as bytes in host memory
//    or, past that, in a file of the disk tier; bytes <= warm_bytes and warm_disk_bytes). Across
//    them the engine keeps: a key is hot, warm or in the dropped table, never two of these; every
//    spill or loaded file is restored, dropped or still warm (spills + disk_loaded = restores +
//    warm_drops + warm sessions); the rooms make no llama.cpp call and take no lock.
//
// Memory: the context holds max_sessions KV streams of context_tokens cells each (llama.cpp pads a
// stream to a multiple of 256 cells), allocated up front: that is the hot tier's real memory.
// budget_tokens caps the tokens held hot by all sessions together (<= max_sessions x
// context_tokens to mean anything); the warm tier holds at most warm_bytes more.
//
// Admission is by token reservation. Before a step computes, the engine checks that the session's
// new length fits context_tokens and budget_tokens on its own (otherwise: BUDGET_EXCEEDED and
// nothing changes), then evicts least-recently-used sessions other than the requester until the
// step fits. A new session that finds max_sessions live evicts the LRU session the same way.
// In a batched step, sessions outside the step go first; without a warm tier the step's own
// sessions are never evicted (the request gets BUDGET_EXCEEDED instead), with one the step's
// sessions not admitted yet may be, since they only move to the warm tier: a request that fits
// alone but not beside what the step already admitted gets BUSY, and the step loop runs it first
// in its next step (so the first request of a step always fits, and an oversubscribed node serves
// its sessions in turn instead of re-prefilling them).
//
// Spill and restore: an evicted session (LRU or TTL) is copied to the warm tier, making room by
// moving the least recently used warm sessions to disk, or dropping them without a disk tier (they
// become EVICTED_LRU misses); one that cannot be copied or fits no tier is dropped as before. A
// file is read back only after its header, size and checksum check out (kv_file_store.h). A step, truncate or open of a
// warm session restores it into a free seq id first (admitted like a prefill of its length) and
// carries on: the caller sees no miss, and the KV is the same bytes, so the results are
// bit-identical to never having left. One exception keeps that true: llama.cpp saves a sliding-
// window model's sequence without the cells its window has passed, so a restored session that is
// then cut back (a truncate, or a prefill at an earlier position) past what its window still holds
// is dropped as an EVICTED_LRU miss instead (the head re-prefills; cut_is_exact_locked). resolve reports a warm session without moving it. Release
// and supersession drop a warm copy as they drop a hot session; warm sessions idle longer than
// warm_ttl_seconds are dropped as EVICTED_TTL.
//
// Expected outcomes are values (shard_status + shard_miss_reason); caller mistakes throw
// shard_error(SHARD_ERRC_INVALID_ARGUMENT) before any state changes. Time is passed in by the
// caller (`now`, seconds on any monotonic scale), which makes the clock injectable.

#include "llama_shard/hot_kv_types.h"
#include "llama_shard/prefix_store.h"
#include "llama_shard/recurrent_checkpoints.h"
#include "llama_shard/warm_tier.h"
#include "llama_shard/hot_kv_limits.h"
#include "llama_shard/kv_file_store.h"
#include "llama_shard/kv_state_check.h"
#include "llama_shard/shard_context.h"

#include <array>
#include <cstdint>
#include <deque>
#include <list>
#include <map>
#include <memory>
#include <condition_variable>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace llama_shard {

// A mutex that admits waiters in arrival order. The step loop takes the engine lock step after
// step; with a plain std::mutex a release, resolve or stats call could lose every race for it and
// wait until the queue ran dry. Here such a call waits for the step in progress only.
class fair_mutex {
public:
    void lock() {
        std::unique_lock<std::mutex> lock(mutex_);
        const uint64_t mine = next_++;
        cv_.wait(lock, [&] { return serving_ == mine; });
    }
    void unlock() {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            ++serving_;
        }
        cv_.notify_all();
    }

private:
    std::mutex              mutex_;
    std::condition_variable cv_;
    uint64_t                next_    = 0;
    uint64_t                serving_ = 0;
};

enum hot_kv_step_kind {
    HOT_KV_STEP_PREFILL,
    HOT_KV_STEP_DECODE,
};

// one session's part of a batched step
struct hot_kv_request {
    std::string      session_id;
    int64_t          epoch    = 0;
    hot_kv_step_kind kind     = HOT_KV_STEP_DECODE;
    int32_t          position = -1;  // prefill: start position (-1: append); decode: expected past length (-1: unchecked)
    shard_input      input;
    float *          out      = nullptr;  // output_size(input.n_tokens, input.n_logits) floats, written on OK
};


// The engine's one configuration: Python binds this struct (HotKvConfig), its defaults are these,
// and hot_kv_check_config is the one check of its bounds (HotKvStateConfig and the engine run it).
struct hot_kv_config {
    int32_t max_sessions    = 8;
    int32_t context_tokens  = 2048;   // most tokens one session may hold
    int64_t budget_tokens   = 8192;   // most tokens all sessions together may hold
    double  ttl_seconds     = 600.0;  // idle time after which a session is evicted; 0 disables
    int32_t n_batch         = 512;    // most tokens in one step
    int32_t n_threads       = 0;      // 0 = the model's
    int32_t recent_capacity = 4096;   // remembered dropped keys (bounded: a flood cannot grow memory)
    int64_t warm_bytes      = 0;      // host memory for evicted sessions' KV; 0: no warm tier
    double  warm_ttl_seconds = 3600.0; // idle time (since last use) after which a warm session is dropped; 0 disables
    std::string kv_type     = "f16";  // K/V element type: f16, q8_0, q4_0
    // flash attention (llama.cpp's default on a CPU; with an f16 cache patch 0010's kernel,
    // cpu_backend.h). Off stores V transposed (another cache layout: part of the recipe) and
    // changes the logits' rounding; it needs kv_type f16.
    bool        flash_attn  = true;
    // the disk tier: sessions that fall out of the host tier go to files in warm_dir (at most
    // warm_disk_bytes), and a worker restarted on the same directory, model, range and recipe
    // resumes them; empty: no disk tier
    std::string warm_dir;
    int64_t     warm_disk_bytes = 0;
    std::string recipe_fingerprint;   // written into every file and checked on load (required with warm_dir)
    // the prefix store: host memory for shared starts of sessions (a system prompt's KV), which new
    // sessions open from instead of computing them; 0: no prefix store
    int64_t     prefix_bytes = 0;
};

// throws shard_error(SHARD_ERRC_INVALID_ARGUMENT) naming the first field outside its bounds
// (hot_kv_limits.h and the comments above); the recipe fingerprint a warm_dir needs is the
// engine's own check, since the configuration is checked before the model's recipe is known
void hot_kv_check_config(const hot_kv_config & config);

// the cells one hot slot allocates: max(context_tokens, n_batch) rounded up to 256, as
// llama_context sizes each sequence's stream (llama-context.cpp pads n_ctx and n_ctx_seq to 256);
// the hot tier is max_sessions of these, so a byte size buys bytes / (cells x KV bytes per token)
int32_t hot_kv_slot_cells(int32_t context_tokens, int32_t n_batch);

// the context an engine of this configuration creates: one KV stream per session of
// hot_kv_slot_cells cells (see the constructor)
shard_context_params hot_kv_context_params(const hot_kv_config & config);

// the memory an engine of this configuration over that model would hold, from a dry run (nothing
// allocated): the serve's memory plan on a device, checked against its free memory before loading
shard_memory hot_kv_plan_memory(const shard_model_params & model_params, const hot_kv_config & config);

// upper bounds (seconds) of the restore-time histogram buckets; the last bucket is +Inf
constexpr std::array<double, 8> HOT_KV_RESTORE_BUCKETS = {1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 1.0};

struct hot_kv_result {
    shard_status      status = SHARD_STATUS_OK;
    shard_miss_reason miss   = SHARD_MISS_NONE;
    int32_t seq_len       = 0;   // the session's length after the call (0 when not live)
    int32_t seq_id        = -1;  // the llama_seq_id serving the session (-1 when not live)
    int64_t current_epoch = -1;  // on STALE_EPOCH: the session's current epoch
    bool    changed       = false;  // release: whether something was released
    hot_kv_tier tier      = HOT_KV_TIER_NONE;  // where the session is after the call
    std::string detail;          // why, for anything but OK
};

struct hot_kv_session_info {
    std::string session_id;
    int64_t     epoch;
    int32_t     seq_id;
    int32_t     seq_len;
    double      last_used;
    hot_kv_tier tier;     // HOT (seq_id >= 0) or WARM (seq_id -1)
};

struct hot_kv_stats {
    int32_t  live_sessions;
    int32_t  max_sessions;
    int64_t  reserved_tokens;
    int64_t  budget_tokens;
    int32_t  context_tokens;
    uint64_t kv_bytes_per_token;
    uint64_t reserved_bytes;      // reserved_tokens * kv_bytes_per_token
    uint64_t evictions_ttl;
    uint64_t evictions_lru;
    uint64_t releases;
    uint64_t supersessions;
    uint64_t steps;
    uint64_t tokens_computed;
    int32_t  recent_keys;
    std::array<uint64_t, SHARD_MISS_COUNT> misses;  // by reason
    // the warm tier: spills + disk_loaded = restores + warm_drops + warm_sessions + disk_sessions
    uint64_t spills;              // sessions copied to the warm tier (host memory or disk)
    uint64_t restores;            // warm sessions brought back hot
    uint64_t warm_drops;          // warm sessions dropped (LRU by bytes, TTL, release, supersession, a failed restore)
    int32_t  warm_sessions;
    uint64_t warm_bytes;          // held now
    uint64_t warm_capacity;       // config warm_bytes
    double   restore_seconds;     // total time restores took
    std::array<uint64_t, HOT_KV_RESTORE_BUCKETS.size() + 1> restore_buckets;  // restores per bucket (not cumulative)
    int32_t  disk_sessions;       // warm sessions held in files
    uint64_t disk_bytes;          // bytes of those files
    uint64_t disk_capacity;       // config warm_disk_bytes
    uint64_t disk_spills;         // sessions written to disk (from the host tier, or straight from hot)
    uint64_t disk_restores;       // restores read from disk (included in restores)
    uint64_t disk_loaded;         // files found valid at start-up (a restarted worker's sessions)
    uint64_t disk_failures;       // writes or reads that failed (logged; the session became a miss)
    // the prefix store
    int32_t  prefix_entries;      // prefixes held
    uint64_t prefix_bytes;        // held now (state pages + 8 key bytes per entry)
    uint64_t prefix_capacity;     // config prefix_bytes
    uint64_t prefix_stores;       // prefixes stored
    uint64_t prefix_hits;         // sessions opened from a stored prefix
    uint64_t prefix_tokens_saved; // tokens those sessions did not compute
    uint64_t prefix_evictions;    // prefixes dropped to make room
    // a hybrid model's recurrent-state checkpoints (recurrent_checkpoints.h)
    uint64_t checkpoints_taken;   // states saved at a step's start
    uint64_t checkpoint_restores; // cuts made through one
    uint64_t checkpoint_tokens;   // tokens computed again after them
    uint64_t checkpoint_bytes;    // held now (states and recorded inputs)
};

class hot_kv_engine {
public:
    hot_kv_engine(const shard_model & model, const hot_kv_config & config);

    hot_kv_engine(const hot_kv_engine &) = delete;
    hot_kv_engine & operator=(const hot_kv_engine &) = delete;

    const shard_model &   model()  const { return model_; }
    const hot_kv_config & config() const { return config_; }
    int64_t output_size(int64_t n_tokens, int32_t n_logits = 1) const { return ctx_->output_size(n_tokens, n_logits); }

    // makes (sid, epoch) live with length 0 if it is not; a newer epoch supersedes the live one
    hot_kv_result open(const std::string & sid, int64_t epoch, double now);

    // appends `input` at start_pos (< 0: at the session's length); an earlier start truncates
    // first, a later one is a SEQ_LEN_MISMATCH miss. A session that is not live is created when
    // start_pos <= 0. On OK, writes output_size(n_tokens) floats to `out`.
    hot_kv_result prefill(const std::string & sid, int64_t epoch, int32_t start_pos, const shard_input & input,
                          float * out, double now);

    // appends `input` at the session's length; expected_seq_len >= 0 must equal it (else a miss)
    // A retry: a decode whose expected past length is the start of the last step this session
    // applied, with the same input, while the session still ends right after that step (its reply
    // was lost), is recomputed from that start and answered again, bit-exact, instead of a
    // SEQ_LEN_MISMATCH miss. Only for sessions hot since that step.
    hot_kv_result decode(const std::string & sid, int64_t epoch, int32_t expected_seq_len, const shard_input & input,
                         float * out, double now);

    // a batched step: every request is answered on its own (a miss, a stale epoch, an invalid or
    // over-budget request does not spoil the others); the admitted ones are admitted in order,
    // evicting LRU sessions that take no part in the step, and computed together in as few
    // llama_decode calls as n_batch allows. A compute failure rolls back every position the step
    // added and answers COMPUTE_ERROR to every admitted request. A session may appear once.
    std::vector<hot_kv_result> step(const std::vector<hot_kv_request> & requests, double now);

    // llama_decode calls made so far (batching makes this smaller than the steps answered)
    uint64_t n_decode_calls() const { return ctx_->n_decode_calls(); }
    // verifications' rows computed in one call, by row count (shard_context::whole_rows_verdicts)
    std::map<int32_t, std::string> whole_rows_verdicts() const { return ctx_->whole_rows_verdicts(); }
    // the bytes its context and model hold on the device and the host (llama.cpp's account)
    shard_memory memory() const { return ctx_->memory(); }

    // drops positions >= length; length must be in [0, seq_len]
    hot_kv_result truncate(const std::string & sid, int64_t epoch, int32_t length, double now);

    // releases (sid, epoch); an older epoch is stale and releases nothing; a newer epoch supersedes
    // the cached state and releases it (changed = true), and older epochs are stale from then on
    hot_kv_result release(const std::string & sid, int64_t epoch, double now);

    // a query: the session's length and tier, or the miss a step would get; it moves and drops
    // nothing (an epoch newer than the cached one is an UNKNOWN_SESSION miss, the cached state stays)
    hot_kv_result resolve(const std::string & sid, int64_t epoch, double now);

    // evicts every session idle longer than ttl_seconds; returns how many
    int32_t sweep(double now);

    // --- the prefix store (prefix_bytes > 0) ---
    // Keys are the caller's (a chained hash of the prefix's token blocks, scoped by the caller: the
    // engine never sees the tokens); an entry holds llama.cpp's sequence state of the owned layers for
    // positions [0, length), as the warm tier does, so a session opened from it continues bit for bit
    // as the session it was copied from would have (for a sliding-window model the state holds the
    // window only: the opened session's swa_floor is set as after a warm restore, and a later cut
    // below it is a miss). Entries are copies: releasing or superseding the source changes nothing.
    //
    // copies the hot session (sid, epoch), which must hold exactly `length` tokens, into the store
    // under `key`: OK with changed = true when stored; OK with changed = false when the key is held
    // already, the store is off or too small, or the session is warm (nothing moves); a miss or stale
    // epoch as resolve would answer (not counted). Least valuable entries are evicted to make room.
    hot_kv_result store_prefix(const std::string & sid, int64_t epoch, uint64_t key, int32_t length, double now);
    // makes (sid, epoch) hold a copy of the prefix stored under `key` (of `length` tokens), whatever it
    // held before (a warm copy, a live state: replaced; an older epoch: superseded). A stale epoch is
    // STALE_EPOCH; a key not held (or held with another length) is a PREFIX_EVICTED miss and nothing
    // changes; a prefix that cannot fit the budget is BUDGET_EXCEEDED, nothing changed. On OK:
    // seq_len = length. (Should llama.cpp refuse the store's own bytes, a guard, the entry is
    // dropped and the session is left empty, a PREFIX_EVICTED miss.)
    hot_kv_result open_prefix(const std::string & sid, int64_t epoch, uint64_t key, int32_t length, double now);
    // the length of the prefix stored under `key`, 0 when none (a query: nothing moves)
    int32_t prefix_length(uint64_t key) const;

    // --- hand-over: one session's KV out of this engine and into another of the same shard ---
    // The bytes are llama.cpp's sequence state of the owned layers (shard_context::seq_save: what the
    // warm tier and the prefix store keep). They carry no identity: the caller checks that sender
    // and receiver run the same model, range and recipe (HotKvStateManager wraps them in a header
    // that says so). A session continued on the receiver is bit-identical to the source continuing
    // (the same K/V values at the same positions of a stream of its own; a sliding-window model's
    // state holds the window only: the imported session's swa_floor is set as after a warm restore).
    //
    // fills `state` with the state of the live session of exactly (sid, epoch): OK with its length
    // and tier. A hot session is copied where it is; a warm one from its host copy or its file (read
    // and checked as a restore would: a file that fails is dropped, an EVICTED_LRU miss); nothing
    // moves, nothing is touched. An empty session (seq_len 0) has no state: OK, `state` empty. A
    // session not held is the miss resolve() gives (counted as resolve's); an older epoch is
    // STALE_EPOCH; a newer epoch supersedes nothing (resolve's UNKNOWN_SESSION). Throws
    // shard_error(SHARD_ERRC_CAPACITY) if the copy's memory cannot be had (nothing changed).
    hot_kv_result export_session(const std::string & sid, int64_t epoch, double now, page_buffer & state);
    // makes (sid, epoch) hold exactly `data` (an export of seq_len tokens) as a hot session: what it
    // held before at that epoch (hot or warm) is replaced, an older epoch is superseded. Checked
    // before anything changes (not even the engine's time) and before llama.cpp reads a byte, in
    // this order: the key (throws), seq_len >= 1 (throws), a newer epoch held here (STALE_EPOCH),
    // seq_len <= context_tokens and budget_tokens (else BUDGET_EXCEEDED), the state's positions and
    // this context's row layout (kv_state_check.h; else INVALID_INPUT naming what is wrong). A state
    // from an engine with another max_sessions (another stream count) is rewritten for this one
    // (kv_state_restream; throws SHARD_ERRC_CAPACITY, nothing changed, if that copy cannot be had).
    // Then least recently used others leave the hot set to make room (never the session itself),
    // and the state is restored into the session's seq id. Should llama.cpp still refuse it (bytes
    // that pass every check above: a guard), nothing is left half-made: the session is freed
    // entirely (its previous state is gone), the key is remembered as an EVICTED_LRU miss (the head
    // re-prefills, older epochs stay stale) and the answer is INVALID_INPUT. On OK: seq_len, hot.
    hot_kv_result import_session(const std::string & sid, int64_t epoch, int32_t seq_len, const uint8_t * data,
                                 size_t size, double now);

    // a worker shutting down with a disk tier: every hot and host-warm session is written to disk
    // (a restarted worker on the same directory resumes them); returns the sessions on disk
    int32_t persist(double now);

    // the counters as of the last call that finished: never waits for a step in progress
    hot_kv_stats stats() const;
    // hot sessions least recently used first, then warm and disk ones, as of the last call that
    // finished: like stats(), never waits for a step in progress
    std::vector<hot_kv_session_info> sessions() const;

    // throws std::logic_error naming the first violated invariant
    void check_invariants() const;

private:
    struct session {
        int64_t epoch;
        int32_t seq_id;
        int32_t seq_len;
        double  last_used;
        std::list<std::string>::iterator lru_pos;
        // the last decode applied (its start and a hash of its input; -1: none, or a prefill came
        // after it): a decode that repeats it, expecting its start, is a retry (see decode)
        int32_t  last_start = -1;
        uint64_t last_input = 0;
        // the first position its sliding-window layers hold: 0, except after a restore from the
        // warm tier (llama.cpp's sequence state keeps only the window), which cut_is_exact_locked checks
        int32_t  swa_floor = 0;
        // a hybrid model's recurrent state at earlier positions, for cuts (empty otherwise)
        recurrent_checkpoints checkpoints;
    };

    struct dropped {
        int64_t           epoch;
        shard_miss_reason reason;
        uint64_t          stamp;  // matches recent_order_ entries; older order entries are stale
    };

    // where new sessions' seq ids go (see the invariants): a step's placement lives for that step
    // only, a single request's (to_place 0, last -1) takes the lowest free id
    struct id_placement {
        int32_t to_place = 0;   // the step's sessions still to be created or restored
        int32_t last     = -1;  // the id the step gave last (-1: none yet)
    };

    // stats() and sessions() read a snapshot published at the end of every call that holds the engine
    // lock; the warm and disk list is rebuilt only when it changed (warm_listed_ false), so a step
    // pays for its hot sessions, not for every session the warm tier holds
    void publish_locked() const;
    struct publisher {
        const hot_kv_engine & engine;
        explicit publisher(const hot_kv_engine & e) : engine(e) {}
        ~publisher() { engine.publish_locked(); }  // declared after the lock guard: runs before it unlocks
    };

    // --- helpers; all run with mutex_ held ---
    void     validate_key(const std::string & sid, int64_t epoch) const;
    // callers read their clocks before they get the lock, so `now` can arrive out of order across
    // threads; the engine keeps its own time monotone so the LRU order always matches last_used
    double   tick_locked(double now);
    // the prelude of every single-session request: validate the key, advance time, TTL sweep
    double   begin_locked(const std::string & sid, int64_t epoch, double now);
    int32_t  sweep_locked(double now);
    // frees the session's cells, seq id and reservation; remembers (sid, remembered_epoch or its
    // own epoch when < 0) with `reason` for later requests
    void     drop_locked(const std::string & sid, shard_miss_reason reason, int64_t remembered_epoch = -1);
    void     remember_locked(const std::string & sid, int64_t epoch, shard_miss_reason reason);
    // a hot session leaves the hot set for `reason` (EVICTED_LRU/TTL): spilled to the warm tier if
    // it can be, dropped otherwise
    void     leave_hot_locked(const std::string & sid, shard_miss_reason reason);
    bool     spill_locked(const std::string & sid, shard_miss_reason reason);
    // whether cutting `s` to `length` leaves every cell the next positions attend to
    bool     cut_is_exact_locked(const session & s, int32_t length) const;
    // drops `sid` (hot) as a miss when a cut to `length` would not be exact; true when it did
    bool     drop_if_cut_inexact_locked(const std::string & sid, const session & s, int32_t length, hot_kv_result & res);
    // cuts a hot session to `length` (< its length): llama.cpp's seq_rm, or for a recurrent state
    // the checkpoint that covers it, restored and computed on (recurrent_checkpoints.h); false when
    // none covers it or llama.cpp refused, and the session must then be dropped
    bool     cut_locked(session & s, int32_t length);
    // cut_locked, or the session dropped as a miss (EVICTED_LRU: the head re-prefills) in `res`
    bool     cut_or_drop_locked(const std::string & sid, session & s, int32_t length, hot_kv_result & res);
    // frees a hot session's cells, seq id and reservation (no record, no counters)
    void     free_hot_locked(const std::string & sid);
    // removes a warm entry from its tier (no record, no counters)
    // brings a warm session back hot (room and a free id must be there); null with a counted miss
    // in `res` if llama.cpp refused the state (the warm copy is dropped)
    session * restore_locked(const std::string & sid, double now, hot_kv_result & res, id_placement & ids);
    // makes room for `tokens` more hot tokens and, if `need_id`, a free seq id: least recently
    // used sessions outside `keep` leave the hot set (those in `later`, the step's sessions not yet
    // admitted, only after all others); false, with nothing evicted, if that cannot be enough
    bool     make_room_locked(int64_t tokens, bool need_id, const std::vector<std::string> & keep,
                              const std::vector<std::string> & later);
    // puts a spilled session's entry in the host tier (moving its least recently used sessions
    // to disk or dropping them), or on disk; false if neither can take it
    // the host tier's session `sid` moves to disk, or is dropped (EVICTED_LRU) if it cannot
    void     load_disk_tier();
    void     touch_locked(session & s, double now);
    session & create_locked(const std::string & sid, int64_t epoch, double now, id_placement & ids);
    int32_t  take_free_id_locked(id_placement & ids);

    // classifies (sid, epoch): returns the live session of that exact key, or null with `res` saying
    // why (stale, or the miss a step would get; not yet counted: the caller counts what it returns).
    // A warm session of that exact key: null, res OK and *warm set. A newer epoch than the live or
    // warm one drops that state (supersession).
    // query: a newer epoch supersedes nothing (resolve), it is an UNKNOWN_SESSION miss
    session * identify_locked(const std::string & sid, int64_t epoch, hot_kv_result & res, warm_entry ** warm = nullptr,
                              bool query = false);
    // identify_locked, then a warm session is restored (room made by evicting anyone but sid)
    session * restore_alone_locked(const std::string & sid, int32_t seq_len, double now, hot_kv_result & res);
    // the one place a miss is counted: every CACHE_MISS answered to a caller, once, by reason
    // (step results, truncate, resolve; and the lost warm copy an open replaces with a new session)
    void      count_miss_locked(const hot_kv_result & res);

    // a request that passed identity and admission, waiting for compute
    struct planned {
        size_t    index;  // into the requests / results
        session * s;
        int32_t   start;
        const std::string * sid;
    };

    // identity + admission for one validated request; on success appends to `plan` (the session is
    // truncated to its start and touched), otherwise returns the answer
    bool admit_locked(const hot_kv_request & req, const std::vector<std::string> & participants, double now,
                      std::vector<planned> & plan, size_t index, hot_kv_result & res, id_placement & ids);
    bool start_position_locked(const hot_kv_request & req, const session * s, const warm_entry * w, hot_kv_result & res,
                               int32_t & start);
    bool room_for_locked(const std::string & sid, const session * s, const warm_entry * w, int64_t grow,
                         const std::vector<std::string> & participants, const std::vector<planned> & plan,
                         hot_kv_result & res);
    // a step's three phases: validate every request (the valid ones' session ids, in order), admit
    // the valid ones (the plan), compute the plan in one batch
    std::vector<std::string> validate_step(const std::vector<hot_kv_request> & requests, std::vector<hot_kv_result> & results,
                                           std::vector<bool> & valid) const;
    std::vector<planned> admit_step_locked(const std::vector<hot_kv_request> & requests, const std::vector<bool> & valid,
                                           const std::vector<std::string> & participants, double now,
                                           std::vector<hot_kv_result> & results);
    void compute_locked(const std::vector<hot_kv_request> & requests, const std::vector<planned> & plan,
                        std::vector<hot_kv_result> & results);
    std::vector<hot_kv_result> step_locked(const std::vector<hot_kv_request> & requests, double now);
    hot_kv_result single_locked(const hot_kv_request & req, double now);

    const shard_model &            model_;
    hot_kv_config                  config_;
    std::unique_ptr<shard_context> ctx_;
    int32_t                        n_swa_ = 0;  // the model's sliding window (0: none)
    kv_state_layout                state_layout_;  // the rows a state restored on this context has (import_session)
    uint32_t                       n_stream_ = 0;  // the KV streams per cache a state of this context lists

    mutable fair_mutex mutex_;
    mutable std::mutex   stats_mutex_;  // guards published_ and published_sessions_ only; taken with or without mutex_
    mutable hot_kv_stats published_{};
    mutable std::vector<hot_kv_session_info> published_hot_;
    mutable std::vector<hot_kv_session_info> published_warm_;
    std::unordered_map<std::string, session> live_;
    std::list<std::string>                   lru_;       // front = least recently used
    std::vector<int32_t>                     free_ids_;  // descending: back() is the lowest
    int64_t                                  reserved_ = 0;
    double                                   clock_ = -1e300;  // latest `now` seen: engine time never goes back

    // the engine's rooms: each keeps its own bytes, invariants and counters; the engine coordinates
    // them (the lock, every llama.cpp call, the seq ids, the checks across them)
    warm_tier    warm_;      // host memory and the disk tier (warm_tier.h)

    prefix_store prefixes_;  // its own room: bytes, eviction, counters (prefix_store.h)
    // open_prefix's three parts: the entry to open from (or the miss, counted); the session that
    // will hold it, emptied and with room made (a warm copy dropped, an older epoch superseded);
    // the restore into it (false: the entry could not be restored, dropped, the miss counted).
    // import_session empties and makes room for its session with the second as well.
    const prefix_entry * lookup_prefix_locked(const std::string & sid, int64_t epoch, uint64_t key, int32_t length,
                                              hot_kv_result & res);
    session * replace_for_prefix_locked(const std::string & sid, int64_t epoch, int32_t length, double now,
                                        hot_kv_result & res);
    bool restore_prefix_locked(session & s, uint64_t key, const prefix_entry & entry, double now, hot_kv_result & res);
    // restores `data` into the emptied session `s` and checks llama.cpp holds exactly positions
    // 0..length-1; false (the seq id left empty) if it refused. s.seq_len, reserved_ untouched.
    bool restore_state_locked(session & s, const uint8_t * data, size_t size, int32_t length);
    // the bytes a warm entry's file may hold (0, 0 for a host copy: the engine's own bytes)
    void warm_file_bounds(const warm_entry & w, uint64_t & min_bytes, uint64_t & max_bytes) const;

    std::unordered_map<std::string, dropped>         recent_;
    std::deque<std::pair<std::string, uint64_t>>     recent_order_;
    uint64_t                                         recent_stamp_ = 0;

    hot_kv_stats counters_{};
};

} // namespace llama_shard
