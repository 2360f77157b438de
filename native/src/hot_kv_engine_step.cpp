// The Hot KV engine's step (hot_kv_engine.h): validation, identity and admission of each request,
// room made by eviction, seq ids placed, one batched compute, and every cut of a session (a step
// that starts earlier, truncate; a recurrent state through its checkpoint). A file of its own: the
// step is the engine's hot path, read apart from construction (hot_kv_engine.cpp) and the tiers.

#include "llama_shard/hot_kv_engine.h"
#include "hot_kv_engine_internal.h"

#include <algorithm>
#include <cassert>
#include <iterator>
#include <string>
#include <vector>

namespace llama_shard {

// ---------------------------------------------------------------------------------------------
// the step: one request or several, validated, admitted, computed together
// ---------------------------------------------------------------------------------------------

static hot_kv_request single_request(const std::string & sid, int64_t epoch, hot_kv_step_kind kind, int32_t position,
                                     const shard_input & input, float * out) {
    hot_kv_request req;
    req.session_id = sid;
    req.epoch      = epoch;
    req.kind       = kind;
    req.position   = position;
    req.input      = input;
    req.out        = out;
    return req;
}

hot_kv_result hot_kv_engine::prefill(const std::string & sid, int64_t epoch, int32_t start_pos, const shard_input & input,
                                     float * out, double now) {
    std::lock_guard<fair_mutex> lock(mutex_);
    const publisher publish_on_return(*this);  // stats() sees this call once it is done
    return single_locked(single_request(sid, epoch, HOT_KV_STEP_PREFILL, start_pos, input, out), now);
}

hot_kv_result hot_kv_engine::decode(const std::string & sid, int64_t epoch, int32_t expected_seq_len, const shard_input & input,
                                    float * out, double now) {
    std::lock_guard<fair_mutex> lock(mutex_);
    const publisher publish_on_return(*this);  // stats() sees this call once it is done
    return single_locked(single_request(sid, epoch, HOT_KV_STEP_DECODE, expected_seq_len, input, out), now);
}

// a single request: caller mistakes and compute failures are exceptions, as everywhere else
hot_kv_result hot_kv_engine::single_locked(const hot_kv_request & req, double now) {
    hot_kv_result res = step_locked({req}, now)[0];  // validates first; an invalid step changes nothing
    if (res.status == SHARD_STATUS_INVALID_INPUT) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, res.detail);
    }
    if (res.status == SHARD_STATUS_COMPUTE_ERROR) {
        throw shard_error(SHARD_ERRC_COMPUTE, res.detail);
    }
    return res;
}

std::vector<hot_kv_result> hot_kv_engine::step(const std::vector<hot_kv_request> & requests, double now) {
    std::lock_guard<fair_mutex> lock(mutex_);
    const publisher publish_on_return(*this);  // stats() sees this call once it is done
    return step_locked(requests, now);
}

// FNV-1a over a step's input bytes (token ids or hidden rows): identifies a retried step
static uint64_t input_hash(const shard_input & in) {
    const unsigned char * p = in.tokens != nullptr ? reinterpret_cast<const unsigned char *>(in.tokens)
                                                   : reinterpret_cast<const unsigned char *>(in.hidden);
    const size_t n = in.tokens != nullptr ? sizeof(int32_t) * (size_t) in.n_tokens
                                          : sizeof(float) * (size_t) in.n_tokens * (size_t) in.hidden_cols;
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; ++i) {
        h = (h ^ p[i]) * 1099511628211ull;
    }
    return h ^ (uint64_t) in.n_tokens;
}

std::vector<hot_kv_result> hot_kv_engine::step_locked(const std::vector<hot_kv_request> & requests, double now) {
    now = tick_locked(now);
    std::vector<hot_kv_result> results(requests.size());
    std::vector<bool>          valid(requests.size(), false);
    const std::vector<std::string> participants = validate_step(requests, results, valid);
    if (participants.empty()) {
        return results;  // a step with nothing valid in it changes nothing, not even by time
    }
    sweep_locked(now);
    const std::vector<planned> plan = admit_step_locked(requests, valid, participants, now, results);
    if (!plan.empty()) {
        compute_locked(requests, plan, results);
    }
    for (const hot_kv_result & r : results) {
        count_miss_locked(r);
    }
    return results;
}

// every request is checked before anything changes; a bad one is answered on its own
std::vector<std::string> hot_kv_engine::validate_step(const std::vector<hot_kv_request> & requests,
                                                      std::vector<hot_kv_result> & results, std::vector<bool> & valid) const {
    std::vector<std::string> participants;
    for (size_t i = 0; i < requests.size(); ++i) {
        const hot_kv_request & req = requests[i];
        try {
            validate_key(req.session_id, req.epoch);
            ctx_->validate_input(req.input);
            if (req.out == nullptr) {
                throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "no output buffer");
            }
            if (std::find(participants.begin(), participants.end(), req.session_id) != participants.end()) {
                throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "session '" + req.session_id + "' appears twice in one step");
            }
            participants.push_back(req.session_id);
            valid[i] = true;
        } catch (const shard_error & e) {
            results[i].status = SHARD_STATUS_INVALID_INPUT;
            results[i].detail = e.what();
        }
    }
    return participants;
}

// identity and admission, request by request, in order
std::vector<hot_kv_engine::planned> hot_kv_engine::admit_step_locked(const std::vector<hot_kv_request> & requests,
                                                                     const std::vector<bool> & valid,
                                                                     const std::vector<std::string> & participants,
                                                                     double now, std::vector<hot_kv_result> & results) {
    id_placement ids;  // the sessions the step creates or restores: their ids are placed together
    for (size_t i = 0; i < requests.size(); ++i) {
        const hot_kv_request & req = requests[i];
        auto it = live_.find(req.session_id);
        if (valid[i] && (it == live_.end() || it->second.epoch != req.epoch)) {
            const warm_entry * wp = warm_.find(req.session_id);
            const bool warm = wp != nullptr && wp->epoch == req.epoch;
            ids.to_place += (req.kind == HOT_KV_STEP_PREFILL || warm) ? 1 : 0;
        }
    }
    std::vector<planned> plan;
    for (size_t i = 0; i < requests.size(); ++i) {
        if (valid[i]) {
            admit_locked(requests[i], participants, now, plan, i, results[i], ids);
        }
    }
    return plan;
}

// everything admitted in one llama_decode; a failure rolls every planned session back
void hot_kv_engine::compute_locked(const std::vector<hot_kv_request> & requests, const std::vector<planned> & plan,
                                   std::vector<hot_kv_result> & results) {
    std::vector<shard_context::batch_item> items;
    items.reserve(plan.size());
    for (const planned & p : plan) {
        const hot_kv_request & req = requests[p.index];
        items.push_back({p.s->seq_id, p.start, req.input, req.out});
        if (ctx_->recurrent() && p.s->checkpoints.wants(p.start, req.input.n_tokens)) {
            page_buffer state;  // the recurrent state where this step starts (a prompt's, a verification's)
            if (ctx_->seq_save_recurrent(p.s->seq_id, state)) {
                p.s->checkpoints.take(p.start, std::move(state));
                counters_.checkpoints_taken++;
            }
        }
    }
    shard_status status = SHARD_STATUS_OK;
    std::string  detail;
    try {
        // inputs were validated above; forward_batch rolls back every position it added if a decode fails
        ctx_->forward_batch(items, /*inputs_validated*/ true);
    } catch (const shard_error & e) {
        status = SHARD_STATUS_COMPUTE_ERROR;
        detail = e.what();
    }
    std::vector<const std::string *> unrestorable;  // recurrent sessions a failed step left past their length
    for (const planned & p : plan) {
        const int64_t n = requests[p.index].input.n_tokens;
        if (status == SHARD_STATUS_OK) {
            p.s->checkpoints.record(p.start, requests[p.index].input);
            p.s->seq_len = p.start + (int32_t) n;
            // only decodes can be retried (a prefill names its start): hidden rows of a long prefill
            // are not hashed on the way
            const bool decode = requests[p.index].kind == HOT_KV_STEP_DECODE;
            p.s->last_start = decode ? p.start : -1;
            p.s->last_input = decode ? input_hash(requests[p.index].input) : 0;
            counters_.steps++;
            counters_.tokens_computed += (uint64_t) n;
        } else {
            reserved_ -= n;  // reserved at admission, never held
            if (ctx_->recurrent() && !cut_locked(*p.s, p.start)) {
                // forward_batch's roll back cannot cut a recurrent state, a checkpoint usually does;
                // without one the session is dropped below (its next step a miss, never a wrong state)
                unrestorable.push_back(p.sid);
            }
        }
        hot_kv_result & r = results[p.index];
        r = hot_result(p.s->seq_len, p.s->seq_id);
        r.status = status;
        r.detail = detail;
    }
    for (const std::string * sid : unrestorable) {
        drop_locked(*sid, SHARD_MISS_EVICTED_LRU);
    }
}

// the answer to a request that is refused with its session (if any) left as it is
static bool refused(hot_kv_result & res, shard_status status, const std::string & why, int32_t seq_len, int32_t seq_id) {
    res = seq_id >= 0 ? hot_result(seq_len, seq_id) : hot_kv_result{};
    res.status = status;
    res.detail = why;
    return false;
}

bool hot_kv_engine::admit_locked(const hot_kv_request & req, const std::vector<std::string> & participants, double now,
                                 std::vector<planned> & plan, size_t index, hot_kv_result & res, id_placement & ids) {
    const std::string & sid = req.session_id;
    warm_entry * w = nullptr;
    session * s = identify_locked(sid, req.epoch, res, &w);
    int32_t start = 0;
    if (res.status == SHARD_STATUS_STALE_EPOCH || !start_position_locked(req, s, w, res, start)) {
        return false;
    }
    const int64_t new_len = (int64_t) start + req.input.n_tokens;
    if (new_len > config_.context_tokens || new_len > config_.budget_tokens) {
        return refused(res, SHARD_STATUS_BUDGET_EXCEEDED, "the session would hold " + str(new_len) + " tokens; context_tokens is " +
                       str(config_.context_tokens) + " and budget_tokens " + str(config_.budget_tokens),
                       s ? s->seq_len : 0, s ? s->seq_id : -1);
    }
    // hot tokens this request adds at its peak: a warm session comes back whole before it is cut to start
    const int64_t grow = s != nullptr ? new_len - s->seq_len : std::max<int64_t>(w != nullptr ? w->seq_len : 0, new_len);
    if (!room_for_locked(sid, s, w, grow, participants, plan, res)) {
        return false;
    }
    if (w != nullptr) {
        s = restore_locked(sid, now, res, ids);
        if (s == nullptr) {
            return false;  // a miss: the head re-prefills
        }
    } else if (s == nullptr) {
        s = &create_locked(sid, req.epoch, now, ids);
    }
    if (drop_if_cut_inexact_locked(sid, *s, start, res)) {
        return false;  // a miss: the head re-prefills
    }
    if (start < s->seq_len) {
        if (!cut_or_drop_locked(sid, *s, start, res)) {
            return false;  // a miss: the head re-prefills
        }
        reserved_ -= s->seq_len - start;
        s->seq_len = start;
        s->swa_floor = start == 0 ? 0 : s->swa_floor;
    }
    touch_locked(*s, now);
    reserved_ += req.input.n_tokens;  // reserved now, held once computed, returned if the compute fails
    plan.push_back({index, s, start, &sid});
    res = hot_kv_result{};
    return true;
}

// where the request's tokens go: a prefill at its position (or after the cached tokens), a decode
// after the cached tokens (checked against the length the head expects); false with the miss in `res`
bool hot_kv_engine::start_position_locked(const hot_kv_request & req, const session * s, const warm_entry * w,
                                          hot_kv_result & res, int32_t & start) {
    const bool known = s != nullptr || w != nullptr;
    const int32_t held = s != nullptr ? s->seq_len : (w != nullptr ? w->seq_len : 0);  // the cached length, hot or warm
    if (req.kind == HOT_KV_STEP_PREFILL) {
        if (!known && req.position > 0) {
            return false;  // nothing cached to continue from (identify's miss): the head re-prefills from token zero
        }
        start = req.position < 0 ? held : req.position;
        if (start > held) {
            res = miss_result(SHARD_MISS_SEQ_LEN_MISMATCH,
                              "start position " + str(start) + " is past the cached length " + str(held));
            return false;
        }
        return true;
    }
    if (!known) {
        return false;  // identify's miss
    }
    const bool retry = s != nullptr && req.position >= 0 && req.position == s->last_start &&
                       (int64_t) held == (int64_t) s->last_start + req.input.n_tokens && s->last_input == input_hash(req.input);
    if (req.position >= 0 && req.position != held && !retry) {
        res = miss_result(SHARD_MISS_SEQ_LEN_MISMATCH,
                          "expected past length " + str(req.position) + ", cached length is " + str(held));
        return false;
    }
    start = retry ? req.position : held;  // a retry recomputes the applied step from its start
    return true;
}

// room for `grow` more hot tokens (and a seq id when the session is not hot), made by moving
// others out of the hot set; false with the refusal in `res`
bool hot_kv_engine::room_for_locked(const std::string & sid, const session * s, const warm_entry * w, int64_t grow,
                                    const std::vector<std::string> & participants, const std::vector<planned> & plan,
                                    hot_kv_result & res) {
    if (reserved_ + grow <= config_.budget_tokens && (s != nullptr || !free_ids_.empty())) {
        return true;  // the common decode: no one to choose, nothing built
    }
    // who may leave: never the requester or what this step already admitted; the step's other
    // sessions only when they can go to the warm tier
    std::vector<std::string> keep{sid};
    for (const planned & p : plan) {
        keep.push_back(*p.sid);
    }
    if (!warm_.enabled()) {
        keep.insert(keep.end(), participants.begin(), participants.end());
    }
    warm_tier::pin pin(warm_, w != nullptr ? &sid : nullptr);
    if (make_room_locked(grow, s == nullptr, keep, participants)) {
        return true;
    }
    const int32_t seq_len = s ? s->seq_len : 0, seq_id = s ? s->seq_id : -1;
    if (warm_.enabled() && !plan.empty()) {  // it fits alone: it goes first in the next step
        return refused(res, SHARD_STATUS_BUSY, "the sessions this step admitted hold the memory this one needs; it runs in a later step",
                       seq_len, seq_id);
    }
    if (s == nullptr && free_ids_.empty()) {
        return refused(res, SHARD_STATUS_BUDGET_EXCEEDED, "all " + str(config_.max_sessions) + " sessions take part in this step",
                       seq_len, seq_id);
    }
    return refused(res, SHARD_STATUS_BUDGET_EXCEEDED, "the step's sessions together exceed budget_tokens " + str(config_.budget_tokens),
                   seq_len, seq_id);
}

// ---------------------------------------------------------------------------------------------
// room and seq ids for admitted sessions (mutex_ held)
// ---------------------------------------------------------------------------------------------

bool hot_kv_engine::make_room_locked(int64_t tokens, bool need_id, const std::vector<std::string> & keep,
                                     const std::vector<std::string> & later) {
    int64_t over     = reserved_ + tokens - config_.budget_tokens;  // hot tokens that must go
    bool    id_short = need_id && free_ids_.empty();
    if (over <= 0 && !id_short) {
        return true;
    }
    // one pass over the LRU order picks the victims (the sessions in `later` only after every other
    // one); nothing leaves unless they are enough
    auto in = [](const std::vector<std::string> & v, const std::string & sid) {
        return std::find(v.begin(), v.end(), sid) != v.end();
    };
    std::vector<std::string> victims;
    for (const bool later_ones : {false, true}) {
        for (const std::string & sid : lru_) {
            if (over <= 0 && !id_short) {
                break;
            }
            if (!in(keep, sid) && in(later, sid) == later_ones) {
                victims.push_back(sid);
                over -= live_.at(sid).seq_len;
                id_short = false;
            }
        }
    }
    if (over > 0 || id_short) {
        return false;
    }
    for (const std::string & victim : victims) {
        leave_hot_locked(victim, SHARD_MISS_EVICTED_LRU);
    }
    return true;
}

hot_kv_engine::session & hot_kv_engine::create_locked(const std::string & sid, int64_t epoch, double now,
                                                      id_placement & ids) {
    assert(live_.count(sid) == 0);
    if (free_ids_.empty()) {
        const bool room = make_room_locked(0, /*need_id*/ true, {sid}, {});
        assert(room);  // max_sessions >= 1: another session holds an id
        (void) room;
    }
    const int32_t seq_id = take_free_id_locked(ids);
    lru_.push_back(sid);
    session & s = live_[sid];
    s = session{epoch, seq_id, 0, now, std::prev(lru_.end())};
    recent_.erase(sid);  // live again: its dropped record no longer applies
    return s;
}

int32_t hot_kv_engine::take_free_id_locked(id_placement & ids) {
    assert(!free_ids_.empty());
    auto take = [&](std::vector<int32_t>::iterator it) {
        const int32_t id = *it;
        free_ids_.erase(it);
        ids.last     = id;
        ids.to_place = std::max(ids.to_place - 1, 0);
        return id;
    };
    if (ids.last >= 0) {  // next to the session this step created before
        auto it = std::find(free_ids_.begin(), free_ids_.end(), ids.last + 1);
        if (it != free_ids_.end()) {
            return take(it);
        }
    }
    if (ids.to_place > 1) {  // the lowest run long enough for the step's remaining new sessions
        int32_t run_start = -1;
        int32_t run_len   = 0;
        for (auto it = free_ids_.rbegin(); it != free_ids_.rend(); ++it) {  // ascending ids
            if (run_len > 0 && *it == run_start + run_len) {
                ++run_len;
            } else {
                run_start = *it;
                run_len   = 1;
            }
            if (run_len >= ids.to_place) {
                return take(std::find(free_ids_.begin(), free_ids_.end(), run_start));
            }
        }
    }
    return take(std::prev(free_ids_.end()));  // the lowest
}

// ---------------------------------------------------------------------------------------------
// cuts: a step that starts earlier, truncate
// ---------------------------------------------------------------------------------------------

// A session computed here holds every cell (swa_full). One restored from the warm tier holds its
// sliding-window layers from swa_floor only (llama.cpp writes a sequence's state without the cells
// its window has passed): cut to `length`, the next position attends back to length - n_swa + 1
// (a chunked window to its chunk's start, later still), so the cut is exact when those are held.
bool hot_kv_engine::cut_is_exact_locked(const session & s, int32_t length) const {
    if (length == 0 || length >= s.seq_len || s.swa_floor == 0) {
        return true;
    }
    return n_swa_ > 0 && s.swa_floor <= length - n_swa_ + 1;
}

bool hot_kv_engine::drop_if_cut_inexact_locked(const std::string & sid, const session & s, int32_t length,
                                               hot_kv_result & res) {
    if (cut_is_exact_locked(s, length)) {
        return false;
    }
    const int32_t floor = s.swa_floor;
    drop_locked(sid, SHARD_MISS_EVICTED_LRU);
    res = miss_result(SHARD_MISS_EVICTED_LRU, "the session came back from the warm tier with its sliding-window layers "
                      "from position " + str(floor) + " on; a cut to " + str(length) + " needs earlier ones: the head re-prefills");
    return true;
}

bool hot_kv_engine::cut_locked(session & s, int32_t length) {
    if (!ctx_->recurrent() || length == 0) {
        s.checkpoints.cut(length);
        return ctx_->seq_rm(s.seq_id, length);
    }
    const recurrent_checkpoints::checkpoint * c = s.checkpoints.covering(length);
    if (c == nullptr) {
        return false;
    }
    try {
        // the state at the checkpoint (the attention cells from its position on removed: the recurrent
        // state, restored first, is at the position before it and seq_rm leaves it), then its inputs again
        const bool at_start = c->pos == 0 ? ctx_->seq_rm(s.seq_id, 0)
                                          : ctx_->seq_restore_recurrent(s.seq_id, c->state) && ctx_->seq_rm(s.seq_id, c->pos);
        if (!at_start) {
            return false;
        }
        // step by step, each of the rows it had (a kernel may choose by a call's row count: qwen35's
        // delta-net has one for a single token, another for chunks); a step the cut falls inside
        // is computed up to the cut
        int32_t done = 0;
        std::vector<float> discarded;
        for (const int32_t rows : c->steps) {
            const int32_t n = std::min(rows, length - c->pos - done);
            if (n <= 0) {
                break;
            }
            const shard_input in = c->input(done, n);
            discarded.resize((size_t) ctx_->output_size(in.n_tokens));
            ctx_->forward(s.seq_id, c->pos + done, in, discarded.data());
            done += n;
        }
        if (c->pos + done != length) {
            return false;  // (covering() promised the inputs: never)
        }
        counters_.checkpoint_tokens += (uint64_t) done;
    } catch (const shard_error &) {
        return false;
    }
    counters_.checkpoint_restores++;
    s.checkpoints.cut(length);
    return true;
}

bool hot_kv_engine::cut_or_drop_locked(const std::string & sid, session & s, int32_t length, hot_kv_result & res) {
    const int32_t held = s.seq_len;
    if (cut_locked(s, length)) {
        return true;
    }
    drop_locked(sid, SHARD_MISS_EVICTED_LRU);
    res = miss_result(SHARD_MISS_EVICTED_LRU, "the session's recurrent state cannot go back from " + str(held) + " to " +
                      str(length) + " tokens (no checkpoint covers it): the head re-prefills");
    return false;
}

hot_kv_result hot_kv_engine::truncate(const std::string & sid, int64_t epoch, int32_t length, double now) {
    std::lock_guard<fair_mutex> lock(mutex_);
    const publisher publish_on_return(*this);  // stats() sees this call once it is done
    if (length < 0) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "truncate length must be >= 0, got " + str(length));
    }
    now = begin_locked(sid, epoch, now);
    hot_kv_result res;
    warm_entry * w = nullptr;
    session * s = identify_locked(sid, epoch, res, &w);
    if (w != nullptr) {
        if (length > w->seq_len) {  // refused before the warm session is moved
            throw shard_error(SHARD_ERRC_INVALID_ARGUMENT,
                "cannot truncate a session of " + str(w->seq_len) + " tokens to " + str(length));
        }
        s = restore_alone_locked(sid, w->seq_len, now, res);
    }
    if (s == nullptr) {
        count_miss_locked(res);
        return res;
    }
    if (length > s->seq_len) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT,
            "cannot truncate a session of " + str(s->seq_len) + " tokens to " + str(length));
    }
    if (drop_if_cut_inexact_locked(sid, *s, length, res)) {
        count_miss_locked(res);
        return res;
    }
    if (length < s->seq_len) {
        if (!cut_or_drop_locked(sid, *s, length, res)) {
            count_miss_locked(res);
            return res;
        }
        reserved_ -= s->seq_len - length;
        s->seq_len = length;
        s->swa_floor = length == 0 ? 0 : s->swa_floor;
    }
    touch_locked(*s, now);
    return hot_result(s->seq_len, s->seq_id);
}

} // namespace llama_shard
