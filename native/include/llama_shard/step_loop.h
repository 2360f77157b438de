#pragma once

// step_loop: continuous batching over one hot_kv_engine.
//
// Requests (step_ticket) are submitted from any thread: submit() only takes a short lock (no
// Python, no GIL), and the ticket owns its input and output, so nothing the submitter holds has to
// outlive the call. One native thread completes them, forming each engine step from whatever is
// pending:
//  - at most one request per session per step, and a session's requests run in submission order
//    (a later request of a session waits while an earlier one is pending);
//  - at most max_step_sessions sessions and max_step_tokens tokens per step; decodes are taken
//    first (whole), then prefills in arrival order with the room left;
//  - a prefill longer than the room left in a step is cut into chunks, each appended at the
//    position where the previous one ended; while other sessions wait, a chunk is at most
//    prefill_chunk tokens, so a long prompt does not stall the decoders sharing the engine;
//  - after a step, until as many sessions are pending as that step had, the loop waits at most
//    gather_s (and never longer than that step took): callers in lockstep, whose next requests
//    arrive one by one, keep sharing steps. A lone caller that is back, or a micro-batch that
//    arrived while the previous one computed, pays nothing; a released session is not waited for.
//
// Invariants:
//  - a ticket is completed exactly once: with OK (its output holds every chunk's rows, or the
//    tail's logits of the last token), or with the first answer that was not OK. A prefill whose
//    later chunk is refused (budget, invalid input) or fails (compute) is truncated back to where
//    it started, when the session still holds that much;
//  - completion is signalled on the ticket's condition variable and, when set, by one byte
//    written to the ticket's notify_fd (an event loop can wait on it without a thread);
//  - close() refuses new submissions and returns once everything pending was completed.
//
// The engine stays usable directly (open/truncate/release/resolve take its own mutex); a release
// racing a queued step makes that step a RELEASED miss, as if it had arrived later.
//
// Threads: steps run on a step_executor's thread. An engine with one compute thread gets an
// executor of its own; engines with more share one executor per process. Each context computes
// with compute threads of its own (shard_context), which spin at every barrier of a step and poll
// for a few milliseconds after it: two engines stepping at once on two threads would keep two
// such sets busy, taking the cores the other engine computes on (measured with OpenMP teams, which
// behave alike: two 2-thread engines in one process decoded at 0.72 of one engine). On one shared
// thread their steps take turns.

#include "llama_shard/hot_kv_engine.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace llama_shard {

struct step_loop_config {
    int32_t max_step_tokens   = 0;      // 0: the engine's n_batch
    int32_t max_step_sessions = 0;      // 0: the engine's max_sessions
    int32_t prefill_chunk     = 64;     // most tokens of one prefill per step while others wait
    double  gather_s          = 0.010;  // longest wait for as many sessions as the previous step had
};

// one submitted request: the input it owns, the output the loop writes, and its completion
class step_ticket {
public:
    // the request (set before submit; the loop only reads them)
    std::string          session_id;
    int64_t              epoch    = 0;
    hot_kv_step_kind     kind     = HOT_KV_STEP_DECODE;
    int32_t              position = -1;  // prefill: start (-1: append); decode: expected length (-1: unchecked)
    std::vector<int32_t> tokens;         // head shards
    std::vector<float>   hidden;         // other shards: n_tokens rows of n_embd floats
    int64_t              n_tokens = 0;
    // the tail: logits of the last n_logits tokens (1..min(n_tokens, HOT_KV_MAX_LOGIT_ROWS)); a
    // ticket asking for more than one row is computed whole, never cut into chunks
    int32_t              n_logits = 1;
    bool                 row_by_row = false;  // every row a one-token step's bytes (shard_input::row_by_row)
    double               now      = 0.0; // the submitter's clock reading
    int                  notify_fd = -1; // >= 0: one byte is written here on completion

    std::vector<float>   out;            // sized by step_loop::submit; valid once done() with OK
    int64_t              out_cols = 0;   // for readers: row width of out (n_embd), 0 for the tail's logits

    bool done() const;
    // blocks until the ticket is completed; returns its result
    hot_kv_result wait();
    // waits at most `seconds`; true when completed
    bool wait_for(double seconds);
    // the result; meaningful once done()
    hot_kv_result result() const;

private:
    friend class step_loop;
    void complete(hot_kv_result res);

    std::atomic<bool> submitted_{false};  // a ticket is queued once (its output buffer is then fixed)

    // loop-side progress of a chunked prefill (touched by the loop thread only)
    int64_t offset_ = 0;   // tokens already computed
    int32_t start_  = -1;  // position of the first token, once the first chunk ran
    bool    deferred_ = false;  // the engine answered BUSY: it goes first in the next step

    mutable std::mutex      mutex_;
    std::condition_variable cv_;
    bool                    done_ = false;
    hot_kv_result           result_;
};

struct step_loop_stats {
    uint64_t steps         = 0;  // engine steps the loop ran
    uint64_t requests      = 0;  // tickets completed
    uint64_t chunks        = 0;  // request parts computed (a chunked prefill counts each chunk)
    uint64_t tokens        = 0;  // tokens those parts carried
    double   busy_seconds  = 0;  // wall time inside engine steps
    int32_t  pending       = 0;  // tickets waiting now (a computed ticket being handed back is not)
};

class step_loop;

// the thread that runs steps for one or more step_loops, one step at a time, taking turns among
// the loops whose next step is ready
class step_executor {
public:
    // the executor shared by every engine of this process with more than one compute thread
    static std::shared_ptr<step_executor> shared();

    step_executor() = default;
    ~step_executor();  // joins the thread; every loop has detached by then

    step_executor(const step_executor &) = delete;
    step_executor & operator=(const step_executor &) = delete;

private:
    friend class step_loop;
    void attach(step_loop * loop);
    void detach(step_loop * loop);
    void run();

    std::mutex                mutex_;  // guards this and the queues of every attached loop
    std::condition_variable   cv_;     // a submission, a finished step, a close
    std::vector<step_loop *>  loops_;
    size_t                    next_ = 0;  // round-robin start
    bool                      stop_ = false;
    std::thread               thread_;
};

class step_loop {
public:
    step_loop(hot_kv_engine & engine, const step_loop_config & config);
    ~step_loop();  // close()

    step_loop(const step_loop &) = delete;
    step_loop & operator=(const step_loop &) = delete;

    const step_loop_config & config() const { return config_; }
    const hot_kv_engine &    engine() const { return engine_; }

    // validates the ticket's shape, sizes its output and queues it; throws
    // shard_error(SHARD_ERRC_INVALID_ARGUMENT) for a malformed ticket or one submitted before, and
    // shard_error(SHARD_ERRC_CAPACITY) once closed. Key, vocabulary and identity checks are the engine's, answered on the ticket.
    void submit(const std::shared_ptr<step_ticket> & ticket);
    // the shape checks submit() makes, for a caller that wants them before queueing anything
    void check_ticket(const step_ticket & t) const;
    // queues several tickets at once (a micro-batch: they share a step when the caps allow); all
    // are validated before any is queued
    void submit_many(const std::vector<std::shared_ptr<step_ticket>> & tickets);

    // a session that left (released): the loop stops waiting for it to come back after a step
    void session_left(const std::string & session_id);

    // refuses new submissions, completes what is pending, then detaches from its executor; idempotent
    void close();

    step_loop_stats stats() const;

private:
    friend class step_executor;
    using clock = std::chrono::steady_clock;
    using finished_list = std::vector<std::pair<std::shared_ptr<step_ticket>, hot_kv_result>>;

    struct part {  // one ticket's share of a step
        std::shared_ptr<step_ticket> ticket;
        int64_t                      n;  // tokens of this chunk
    };

    // --- called by the executor; *_locked with its mutex held ---
    // whether the next step should run now; otherwise `wake` is when it will be (gather deadline)
    bool ready_locked(clock::time_point now, clock::time_point & wake) const;
    // forms a step, runs it without the lock, books it, completes its tickets; returns with the lock held
    void step_once(std::unique_lock<std::mutex> & lock);

    bool prefill_cannot_fit(const step_ticket & t) const;
    bool previous_step_back_locked() const;
    std::vector<part> form_step_locked() const;
    // runs one step; returns the tickets it completed with their results
    finished_list run_step(const std::vector<part> & parts);
    hot_kv_request request_for(const part & p) const;

    hot_kv_engine &                           engine_;
    step_loop_config                          config_;
    std::shared_ptr<step_executor>            executor_;  // its mutex guards everything below

    std::deque<std::shared_ptr<step_ticket>>  pending_;  // submission order
    size_t                                    handing_back_ = 0;  // computed, in pending_ until completed
    std::vector<std::string>                  last_sessions_;
    clock::time_point                         last_end_{};
    clock::duration                           last_duration_{};
    bool                                      closing_ = false;
    bool                                      detached_ = false;
    step_loop_stats                           stats_{};
};

} // namespace llama_shard
