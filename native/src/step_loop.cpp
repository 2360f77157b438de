#include "llama_shard/step_loop.h"

#include <algorithm>
#include <unistd.h>

namespace llama_shard {

// ---------------------------------------------------------------------------------------------
// step_ticket
// ---------------------------------------------------------------------------------------------

bool step_ticket::done() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return done_;
}

hot_kv_result step_ticket::wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [&] { return done_; });
    return result_;
}

bool step_ticket::wait_for(double seconds) {
    std::unique_lock<std::mutex> lock(mutex_);
    return cv_.wait_for(lock, std::chrono::duration<double>(std::max(seconds, 0.0)), [&] { return done_; });
}

hot_kv_result step_ticket::result() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return result_;
}

void step_ticket::complete(hot_kv_result res) {
    {
        std::lock_guard<std::mutex> lock(mutex_);
        result_ = std::move(res);
        done_   = true;
        if (notify_fd >= 0) {
            // written under the lock: once done() is seen true, this ticket never touches the fd
            // again (its owner may close it). A full pipe already holds a wake-up for the reader.
            const char byte = 1;
            ssize_t unused = ::write(notify_fd, &byte, 1);
            (void) unused;
        }
    }
    cv_.notify_all();
}

// ---------------------------------------------------------------------------------------------
// step_loop
// ---------------------------------------------------------------------------------------------

// ---------------------------------------------------------------------------------------------
// step_executor
// ---------------------------------------------------------------------------------------------

std::shared_ptr<step_executor> step_executor::shared() {
    static std::mutex                  mutex;
    static std::weak_ptr<step_executor> current;
    std::lock_guard<std::mutex> lock(mutex);
    std::shared_ptr<step_executor> ex = current.lock();
    if (!ex) {
        ex      = std::make_shared<step_executor>();
        current = ex;
    }
    return ex;
}

step_executor::~step_executor() {
    {
        std::lock_guard<std::mutex> lock(mutex_);
        stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) {
        thread_.join();
    }
}

void step_executor::attach(step_loop * loop) {
    std::lock_guard<std::mutex> lock(mutex_);
    loops_.push_back(loop);
    if (!thread_.joinable()) {
        thread_ = std::thread([this] { run(); });
    }
}

void step_executor::detach(step_loop * loop) {
    std::lock_guard<std::mutex> lock(mutex_);
    loops_.erase(std::remove(loops_.begin(), loops_.end(), loop), loops_.end());
    next_ = 0;
}

void step_executor::run() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stop_) {
        const auto now  = step_loop::clock::now();
        auto       wake = step_loop::clock::time_point::max();
        step_loop * chosen = nullptr;
        for (size_t k = 0; k < loops_.size() && chosen == nullptr; ++k) {  // take turns
            step_loop * loop = loops_[(next_ + k) % loops_.size()];
            if (loop->ready_locked(now, wake)) {
                chosen = loop;
                next_  = (next_ + k + 1) % loops_.size();
            }
        }
        if (chosen == nullptr) {
            if (wake == step_loop::clock::time_point::max()) {
                cv_.wait(lock);
            } else {
                cv_.wait_until(lock, wake);
            }
            continue;
        }
        chosen->step_once(lock);
        cv_.notify_all();  // a closing loop waits for its queue to drain
    }
}

// ---------------------------------------------------------------------------------------------
// step_loop
// ---------------------------------------------------------------------------------------------

step_loop::step_loop(hot_kv_engine & engine, const step_loop_config & config) : engine_(engine), config_(config) {
    if (config_.max_step_tokens < 0 || config_.max_step_sessions < 0 || config_.prefill_chunk < 1 ||
        !(config_.gather_s >= 0.0 && config_.gather_s <= 1.0)) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT,
                          "max_step_tokens and max_step_sessions must be >= 0, prefill_chunk >= 1, gather_s in [0, 1]");
    }
    const hot_kv_config & ec = engine.config();
    config_.max_step_tokens   = config_.max_step_tokens == 0 ? ec.n_batch : std::min(config_.max_step_tokens, ec.n_batch);
    config_.max_step_sessions = config_.max_step_sessions == 0 ? ec.max_sessions
                                                               : std::min(config_.max_step_sessions, ec.max_sessions);
    config_.prefill_chunk     = std::min(config_.prefill_chunk, config_.max_step_tokens);
    const int32_t n_threads   = ec.n_threads > 0 ? ec.n_threads : engine.model().n_threads();
    executor_ = n_threads > 1 ? step_executor::shared() : std::make_shared<step_executor>();
    executor_->attach(this);
}

step_loop::~step_loop() {
    close();
}

void step_loop::close() {
    std::unique_lock<std::mutex> lock(executor_->mutex_);
    closing_ = true;
    executor_->cv_.notify_all();
    executor_->cv_.wait(lock, [&] { return pending_.empty(); });
    if (detached_) {  // another close() got here first
        return;
    }
    detached_ = true;
    lock.unlock();
    executor_->detach(this);
}

void step_loop::session_left(const std::string & session_id) {
    {
        std::lock_guard<std::mutex> lock(executor_->mutex_);
        last_sessions_.erase(std::remove(last_sessions_.begin(), last_sessions_.end(), session_id), last_sessions_.end());
    }
    executor_->cv_.notify_all();
}

step_loop_stats step_loop::stats() const {
    std::lock_guard<std::mutex> lock(executor_->mutex_);
    step_loop_stats st = stats_;
    st.pending = (int32_t) (pending_.size() - handing_back_);  // a woken caller never counts its own ticket
    return st;
}

void step_loop::check_ticket(const step_ticket & t) const {
    const shard_model_info & info = engine_.model().info();
    const bool has_tokens = !t.tokens.empty();
    const bool has_hidden = !t.hidden.empty();
    if (has_tokens == has_hidden) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "a step carries exactly one of tokens or hidden");
    }
    const int64_t n = has_tokens ? (int64_t) t.tokens.size() : (int64_t) t.hidden.size() / std::max(info.n_embd, 1);
    if (has_hidden && (int64_t) t.hidden.size() != n * info.n_embd) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "hidden holds a partial row");
    }
    if (n != t.n_tokens || n < 1) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "a step needs at least one token, and n_tokens must match its input");
    }
    // a decode is computed whole (a prefill is chunked; one too long for a session is refused as
    // over budget, see prefill_cannot_fit)
    if (t.kind == HOT_KV_STEP_DECODE && n > config_.max_step_tokens) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "a decode takes 1 to " + std::to_string(config_.max_step_tokens) +
                                                           " tokens (the step size), got " + std::to_string(n));
    }
    if (t.kind != HOT_KV_STEP_PREFILL && t.kind != HOT_KV_STEP_DECODE) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "unknown step kind");
    }
    // several rows of logits: one computation (a verification), so it fits one step
    if (t.n_logits < 1 || t.n_logits > n || t.n_logits > HOT_KV_MAX_LOGIT_ROWS ||
        (t.n_logits > 1 && n > config_.max_step_tokens)) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "a step returns logits of 1 to min(n_tokens, " +
                                                           std::to_string(HOT_KV_MAX_LOGIT_ROWS) + ") tokens, got " +
                                                           std::to_string(t.n_logits) + " of " + std::to_string(n) +
                                                           " (several rows: at most the step size in tokens)");
    }
}

void step_loop::submit(const std::shared_ptr<step_ticket> & ticket) {
    submit_many({ticket});
}

void step_loop::submit_many(const std::vector<std::shared_ptr<step_ticket>> & tickets) {
    for (const auto & t : tickets) {
        if (!t) {
            throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "no ticket");
        }
        check_ticket(*t);
        if (t->submitted_.load()) {
            throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "a ticket is submitted once");
        }
    }
    for (size_t i = 0; i < tickets.size(); ++i) {
        if (tickets[i]->submitted_.exchange(true)) {  // the same ticket twice in this call, or a race
            for (size_t k = 0; k < i; ++k) {
                tickets[k]->submitted_.store(false);
            }
            throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "a ticket is submitted once");
        }
    }
    std::vector<std::shared_ptr<step_ticket>> queued;
    std::vector<std::shared_ptr<step_ticket>> refused;
    for (const auto & t : tickets) {
        // decided before the output is sized: a refused prefill allocates nothing, however long
        (prefill_cannot_fit(*t) ? refused : queued).push_back(t);
    }
    for (const auto & t : queued) {
        t->out.assign((size_t) engine_.output_size(t->n_tokens, t->n_logits), 0.0f);
    }
    {
        std::lock_guard<std::mutex> lock(executor_->mutex_);
        if (closing_) {
            for (const auto & t : tickets) {
                t->submitted_.store(false);
            }
            throw shard_error(SHARD_ERRC_CAPACITY, "the step loop is closed");
        }
        pending_.insert(pending_.end(), queued.begin(), queued.end());
    }
    executor_->cv_.notify_all();
    for (const auto & t : refused) {
        hot_kv_result res;
        res.status = SHARD_STATUS_BUDGET_EXCEEDED;
        res.detail = std::to_string(t->n_tokens) + " tokens from position " + std::to_string(std::max(t->position, 0)) +
                     " exceed context_tokens " + std::to_string(engine_.config().context_tokens) + " or budget_tokens " +
                     std::to_string(engine_.config().budget_tokens);
        t->complete(std::move(res));
    }
}

// a prefill that cannot fit even alone is refused before any chunk runs (a chunked prefill
// would otherwise get partway first); the engine makes the same check for an unchunked one
bool step_loop::prefill_cannot_fit(const step_ticket & t) const {
    if (t.kind != HOT_KV_STEP_PREFILL) {
        return false;
    }
    const int64_t end = std::max<int64_t>(t.position, 0) + t.n_tokens;
    return end > engine_.config().context_tokens || end > engine_.config().budget_tokens;
}

// as many sessions are pending as the previous step had (its own, or others: a micro-batch that
// arrived while the previous one computed does not wait for it)
bool step_loop::previous_step_back_locked() const {
    const size_t want = std::min(last_sessions_.size(), (size_t) config_.max_step_sessions);
    std::vector<const std::string *> distinct;
    for (const auto & t : pending_) {
        if (std::none_of(distinct.begin(), distinct.end(), [&](const std::string * s) { return *s == t->session_id; })) {
            distinct.push_back(&t->session_id);
            if (distinct.size() >= want) {
                return true;
            }
        }
    }
    return false;
}

std::vector<step_loop::part> step_loop::form_step_locked() const {
    // each session's oldest pending request is the one it may run (order per session)
    std::vector<const std::shared_ptr<step_ticket> *> heads;
    for (const auto & t : pending_) {
        if (std::none_of(heads.begin(), heads.end(), [&](const auto * h) { return (*h)->session_id == t->session_id; })) {
            heads.push_back(&t);
        }
    }
    const bool others_waiting = heads.size() > 1;  // prefills then go in chunks of prefill_chunk
    std::vector<part> parts;
    int64_t room = config_.max_step_tokens;
    // requests the engine deferred (BUSY) first, so the first of them always fits; then decodes,
    // whole (a long prompt never pushes a waiting decoder out of the step), then prefills in
    // arrival order with the room left
    for (const int pass : {0, 1, 2}) {
        const hot_kv_step_kind kind = pass == 2 ? HOT_KV_STEP_PREFILL : HOT_KV_STEP_DECODE;
        for (const auto * h : heads) {
            const step_ticket & t = **h;
            if ((int32_t) parts.size() >= config_.max_step_sessions || room == 0) {
                return parts;
            }
            if (pass == 0 ? !t.deferred_ : (t.deferred_ || t.kind != kind)) {
                continue;
            }
            const int64_t left = t.n_tokens - t.offset_;
            int64_t n = left;
            if (t.kind == HOT_KV_STEP_PREFILL && t.n_logits == 1) {
                n = std::min(left, others_waiting ? std::min<int64_t>(config_.prefill_chunk, room) : room);
            } else if (n > room) {
                continue;  // a decode is not split: it waits for the next step
            }
            parts.push_back({*h, n});
            room -= n;
        }
    }
    return parts;
}

hot_kv_request step_loop::request_for(const part & p) const {
    const step_ticket & t = *p.ticket;
    const int64_t n_embd  = engine_.model().info().n_embd;
    hot_kv_request req;
    req.session_id = t.session_id;
    req.epoch      = t.epoch;
    req.kind       = t.kind;
    // a later chunk continues exactly where the previous one ended (a moved session is a miss)
    req.position   = t.offset_ == 0 ? t.position : t.start_ + (int32_t) t.offset_;
    req.input.n_tokens = p.n;
    if (!t.tokens.empty()) {
        req.input.tokens = t.tokens.data() + t.offset_;
    } else {
        req.input.hidden      = t.hidden.data() + t.offset_ * n_embd;
        req.input.hidden_cols = n_embd;
    }
    req.input.n_logits = t.n_logits;  // > 1 only for a ticket computed whole
    req.input.row_by_row = t.row_by_row;
    const bool tail = engine_.model().info().is_tail;  // the tail writes the last tokens' logits only
    req.out = const_cast<float *>(t.out.data()) + (tail ? 0 : t.offset_ * n_embd);
    return req;
}

std::vector<std::pair<std::shared_ptr<step_ticket>, hot_kv_result>> step_loop::run_step(const std::vector<part> & parts) {
    std::vector<hot_kv_request> requests;
    requests.reserve(parts.size());
    double now = -1e300;
    for (const part & p : parts) {
        requests.push_back(request_for(p));
        now = std::max(now, p.ticket->now);
    }
    std::vector<hot_kv_result> results;
    try {
        results = engine_.step(requests, now);
    } catch (const std::exception & e) {  // the engine answers expected outcomes; anything else fails the step
        hot_kv_result failed;
        failed.status = SHARD_STATUS_COMPUTE_ERROR;
        failed.detail = e.what();
        results.assign(parts.size(), failed);
    }
    std::vector<std::pair<std::shared_ptr<step_ticket>, hot_kv_result>> finished;
    for (size_t i = 0; i < parts.size(); ++i) {
        step_ticket & t = *parts[i].ticket;
        hot_kv_result & r = results[i];
        t.deferred_ = r.status == SHARD_STATUS_BUSY;
        if (t.deferred_) {
            continue;  // stays pending; the next step takes it first
        }
        if (r.status == SHARD_STATUS_OK) {
            if (t.offset_ == 0) {
                t.start_ = r.seq_len - (int32_t) parts[i].n;
            }
            t.offset_ += parts[i].n;
            if (t.offset_ < t.n_tokens) {
                continue;  // more chunks to go
            }
        } else if (t.offset_ > 0 && r.status != SHARD_STATUS_CACHE_MISS && r.status != SHARD_STATUS_STALE_EPOCH) {
            // a refused prefill (budget, compute, invalid rows in a later chunk) keeps nothing it
            // appended; the session may have moved meanwhile (a truncate, a release), so a
            // rollback that no longer applies is skipped, never thrown on this thread
            try {
                const hot_kv_result now_held = engine_.resolve(t.session_id, t.epoch, now);
                if (now_held.status == SHARD_STATUS_OK && now_held.seq_len >= t.start_) {
                    // a session back from the warm tier that cannot be cut exactly is dropped (a miss)
                    const hot_kv_result cut = engine_.truncate(t.session_id, t.epoch, t.start_, now);
                    r.seq_len = cut.status == SHARD_STATUS_OK ? t.start_ : 0;
                }
            } catch (const std::exception &) {
            }
        }
        finished.emplace_back(parts[i].ticket, std::move(r));
    }
    return finished;
}

bool step_loop::ready_locked(clock::time_point now, clock::time_point & wake) const {
    if (pending_.empty()) {
        return false;
    }
    if (closing_ || last_sessions_.empty() || previous_step_back_locked()) {
        return true;
    }
    // wait for the previous step's sessions a little: at most gather_s, never longer than that step took
    const auto gather   = std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(config_.gather_s));
    const auto deadline = last_end_ + std::min(gather, last_duration_);
    if (now >= deadline) {
        return true;
    }
    wake = std::min(wake, deadline);
    return false;
}

void step_loop::step_once(std::unique_lock<std::mutex> & lock) {
    const std::vector<part> parts = form_step_locked();
    lock.unlock();
    const auto t0 = clock::now();
    finished_list finished = run_step(parts);
    const auto t1 = clock::now();
    lock.lock();  // the books first, so a woken caller reads stats that include its step
    last_sessions_.clear();
    uint64_t tokens = 0;
    for (const part & p : parts) {
        last_sessions_.push_back(p.ticket->session_id);
        tokens += (uint64_t) p.n;
    }
    last_end_      = t1;
    last_duration_ = t1 - t0;
    stats_.steps++;
    stats_.requests += finished.size();
    stats_.chunks += parts.size();
    stats_.tokens += tokens;
    stats_.busy_seconds += std::chrono::duration<double>(t1 - t0).count();
    handing_back_ = finished.size();
    lock.unlock();
    for (auto & [ticket, res] : finished) {
        ticket->complete(std::move(res));
    }
    lock.lock();
    // removed only once completed: close() returns when the queue is empty
    for (const auto & [ticket, res] : finished) {
        pending_.erase(std::find(pending_.begin(), pending_.end(), ticket));
    }
    handing_back_ = 0;
}

} // namespace llama_shard
