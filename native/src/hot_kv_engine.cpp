#include "llama_shard/hot_kv_engine.h"

#include "llama.h"
#include "llama_shard/kv_type.h"
#include "llama_shard/kv_state_check.h"

#include <algorithm>
#include <cassert>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <stdexcept>

namespace llama_shard {

const char * shard_status_name(shard_status status) {
    switch (status) {
        case SHARD_STATUS_OK:              return "OK";
        case SHARD_STATUS_CACHE_MISS:      return "CACHE_MISS";
        case SHARD_STATUS_STALE_EPOCH:     return "STALE_EPOCH";
        case SHARD_STATUS_BUDGET_EXCEEDED: return "BUDGET_EXCEEDED";
        case SHARD_STATUS_INVALID_INPUT:   return "INVALID_INPUT";
        case SHARD_STATUS_COMPUTE_ERROR:   return "COMPUTE_ERROR";
        case SHARD_STATUS_BUSY:            return "BUSY";
    }
    return "UNKNOWN";
}

const char * shard_miss_reason_name(shard_miss_reason reason) {
    switch (reason) {
        case SHARD_MISS_NONE:             return "NONE";
        case SHARD_MISS_UNKNOWN_SESSION:  return "UNKNOWN_SESSION";
        case SHARD_MISS_EVICTED_TTL:      return "EVICTED_TTL";
        case SHARD_MISS_EVICTED_LRU:      return "EVICTED_LRU";
        case SHARD_MISS_RELEASED:         return "RELEASED";
        case SHARD_MISS_SUPERSEDED_EPOCH: return "SUPERSEDED_EPOCH";
        case SHARD_MISS_SEQ_LEN_MISMATCH: return "SEQ_LEN_MISMATCH";
        case SHARD_MISS_PREFIX_EVICTED:   return "PREFIX_EVICTED";
        case SHARD_MISS_COUNT:            break;
    }
    return "UNKNOWN";
}

static std::string str(int64_t v) { return std::to_string(v); }

static hot_kv_result superseded_result(int64_t epoch) {
    hot_kv_result res;
    res.status = SHARD_STATUS_CACHE_MISS;
    res.miss   = SHARD_MISS_SUPERSEDED_EPOCH;
    res.detail = "epoch " + std::to_string(epoch) + " supersedes the cached epoch, whose state was dropped";
    return res;
}

// a query (resolve) at an epoch newer than the cached one: nothing is cached for it, and nothing
// changes (a step at that epoch would supersede the cached state)
static hot_kv_result newer_than_cached_result(int64_t epoch, int64_t cached) {
    hot_kv_result res;
    res.status = SHARD_STATUS_CACHE_MISS;
    res.miss   = SHARD_MISS_UNKNOWN_SESSION;
    res.detail = "nothing is cached for epoch " + std::to_string(epoch) + " (the cached epoch is " +
                 std::to_string(cached) + "; a step at this epoch supersedes it)";
    return res;
}

// the answer to a request whose epoch is older than the session's `current` ("current" while the
// session is live, "last" when only its dropped record remains)
static hot_kv_result stale_result(int64_t epoch, int64_t current, const char * which) {
    hot_kv_result res;
    res.status        = SHARD_STATUS_STALE_EPOCH;
    res.current_epoch = current;
    res.detail        = "route epoch " + std::to_string(epoch) + " is older than the session's " + which + " epoch " +
                        std::to_string(current);
    return res;
}

// the answer for a session that is hot after the call
static hot_kv_result hot_result(int32_t seq_len, int32_t seq_id) {
    hot_kv_result res;
    res.seq_len = seq_len;
    res.seq_id  = seq_id;
    res.tier    = HOT_KV_TIER_HOT;
    return res;
}

// a cache miss (counted where it is answered: count_miss_locked)
static hot_kv_result miss_result(shard_miss_reason reason, std::string detail) {
    hot_kv_result res;
    res.status = SHARD_STATUS_CACHE_MISS;
    res.miss   = reason;
    res.detail = std::move(detail);
    return res;
}

//
// construction
//

void hot_kv_check_config(const hot_kv_config & c) {
    auto bad = [](const std::string & why) { throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, why); };
    if (c.max_sessions < 1 || c.max_sessions > SHARD_MAX_SEQUENCES) {
        bad("max_sessions must be in [1, " + str(SHARD_MAX_SEQUENCES) + "] (llama.cpp's sequence limit), got " + str(c.max_sessions));
    }
    if (c.context_tokens < 1 || c.context_tokens > HOT_KV_MAX_CONTEXT_TOKENS) {
        bad("context_tokens must be in [1, " + str(HOT_KV_MAX_CONTEXT_TOKENS) + "], got " + str(c.context_tokens));
    }
    if (c.budget_tokens < 1 || c.budget_tokens > HOT_KV_MAX_BUDGET_TOKENS) {
        bad("budget_tokens must be in [1, " + str(HOT_KV_MAX_BUDGET_TOKENS) + "], got " + str(c.budget_tokens));
    }
    if (c.n_batch < 1 || c.n_batch > HOT_KV_MAX_CONTEXT_TOKENS) {
        bad("n_batch must be in [1, " + str(HOT_KV_MAX_CONTEXT_TOKENS) + "], got " + str(c.n_batch));
    }
    if (c.n_threads < 0) {
        bad("n_threads must be >= 0 (0: the model's), got " + str(c.n_threads));
    }
    if (c.recent_capacity < 0) {
        bad("recent_capacity must be >= 0, got " + str(c.recent_capacity));
    }
    if (!std::isfinite(c.ttl_seconds) || c.ttl_seconds < 0) {
        bad("ttl_seconds must be a finite number >= 0 (0 disables), got " + std::to_string(c.ttl_seconds));
    }
    if (!std::isfinite(c.warm_ttl_seconds) || c.warm_ttl_seconds < 0) {
        bad("warm_ttl_seconds must be a finite number >= 0 (0 disables), got " + std::to_string(c.warm_ttl_seconds));
    }
    if (c.warm_bytes < 0) {
        bad("warm_bytes must be >= 0, got " + str(c.warm_bytes));
    }
    if (c.prefix_bytes < 0) {
        bad("prefix_bytes must be >= 0, got " + str(c.prefix_bytes));
    }
    if (c.warm_disk_bytes < 0) {
        bad("warm_disk_bytes must be >= 0, got " + str(c.warm_disk_bytes));
    }
    if (!c.warm_dir.empty() && c.warm_disk_bytes == 0) {
        bad("a warm_dir needs warm_disk_bytes > 0 (the disk tier's bound)");
    }
    const auto & types = shard_kv_types();
    if (std::find(types.begin(), types.end(), c.kv_type) == types.end()) {
        std::string names;
        for (const std::string & t : types) {
            names += (names.empty() ? "" : ", ") + t;
        }
        bad("kv_type must be one of " + names + ", got '" + c.kv_type + "'");
    }
    if (!c.flash_attn && c.kv_type != "f16") {
        bad("kv_type " + c.kv_type + " needs flash_attn (llama.cpp's quantized V cache)");
    }
}

int32_t hot_kv_slot_cells(int32_t context_tokens, int32_t n_batch) {
    constexpr int64_t pad = 256;  // llama_context's stream padding
    const int64_t cells = std::max<int64_t>(std::max(context_tokens, n_batch), 1);
    return (int32_t) ((cells + pad - 1) / pad * pad);
}

shard_context_params hot_kv_context_params(const hot_kv_config & config) {
    shard_context_params cp;
    cp.n_ctx      = hot_kv_slot_cells(config.context_tokens, config.n_batch) * config.max_sessions;
    cp.n_seq_max  = config.max_sessions;
    cp.n_batch    = config.n_batch;
    cp.kv_unified = false;
    cp.n_threads  = config.n_threads;
    cp.kv_type    = config.kv_type;
    cp.flash_attn = config.flash_attn;
    return cp;
}

shard_memory hot_kv_plan_memory(const shard_model_params & model_params, const hot_kv_config & config) {
    hot_kv_check_config(config);
    return shard_plan_memory(model_params, hot_kv_context_params(config));
}

static void count_leaving(hot_kv_stats & c, shard_miss_reason reason) {
    switch (reason) {
        case SHARD_MISS_EVICTED_TTL:      c.evictions_ttl++; break;
        case SHARD_MISS_EVICTED_LRU:      c.evictions_lru++; break;
        case SHARD_MISS_RELEASED:         c.releases++;      break;
        case SHARD_MISS_SUPERSEDED_EPOCH: c.supersessions++; break;
        default: break;
    }
}

hot_kv_engine::hot_kv_engine(const shard_model & model, const hot_kv_config & config)
    : model_(model), config_(config),
      warm_((uint64_t) std::max<int64_t>(config.warm_bytes, 0), (uint64_t) std::max<int64_t>(config.warm_disk_bytes, 0),
            config.warm_ttl_seconds,
            // every session the tier drops is remembered (stale-epoch fencing) and, when a caller's
            // release or a new epoch dropped it, counted as that
            [this](const std::string & sid, int64_t epoch, shard_miss_reason reason) {
                remember_locked(sid, epoch, reason);
                if (reason == SHARD_MISS_RELEASED || reason == SHARD_MISS_SUPERSEDED_EPOCH) {
                    count_leaving(counters_, reason);
                }
            }),
      prefixes_((uint64_t) std::max<int64_t>(config.prefix_bytes, 0)) {
    hot_kv_check_config(config);
    if (!config.warm_dir.empty() && config.recipe_fingerprint.empty()) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "a warm_dir needs the recipe fingerprint (written into every file)");
    }
    // One KV stream per session (kv_unified = false): a session's cells stay in position order
    // whatever other sessions do, so its results are bit-identical to running alone (in a shared
    // pool, cells freed by another session get reused out of order and change attention's
    // summation order). Each stream holds context_tokens cells (llama.cpp pads to 256), and
    // admission keeps every session within context_tokens, so llama_decode always finds a slot.
    // KV memory is bounded by max_sessions x context_tokens; budget_tokens bounds what is held.
    ctx_ = std::make_unique<shard_context>(model, hot_kv_context_params(config));
    config_.n_batch = ctx_->n_batch();
    n_swa_ = llama_model_n_swa(model.raw());
    {
        // what llama.cpp writes for this context (src/llama-kv-cache.cpp state_write_data): every owned
        // attention layer's K and V rows of kv_type, each layer's own width; V transposed without flash attention
        const shard_model_info & info = model.info();
        const ggml_type type = kv_ggml_type(config.kv_type);
        const int32_t n_kv_layers = llama_model_kv_state_widths(model.raw(), nullptr, nullptr, 0);
        state_layout_.k_widths.resize((size_t) n_kv_layers);
        state_layout_.v_widths.resize((size_t) n_kv_layers);
        llama_model_kv_state_widths(model.raw(), state_layout_.k_widths.data(), state_layout_.v_widths.data(), n_kv_layers);
        state_layout_.n_layers  = (uint32_t) n_kv_layers;
        state_layout_.type      = (int32_t) type;
        state_layout_.v_trans   = !config.flash_attn;
        state_layout_.el_bytes  = (uint32_t) ggml_type_size(type);
        state_layout_.format.v_rows = info.kv_v_rows;
        state_layout_.format.cell_ext_bytes = ctx_->n_pos_per_embd() > 1 ? 12 : 0;  // llama_kv_cell_ext
        if (ctx_->recurrent()) {  // a hybrid: its attention layers with a cache, then its recurrent block
            state_layout_.n_layers = (uint32_t) llama_model_layers_with_state(model.raw(), false);
            state_layout_.format.recurrent_layers = llama_model_layers_with_state(model.raw(), true);
            state_layout_.recurrent_row_bytes = llama_model_recurrent_state_bytes(model.raw());
        }
        n_stream_ = ctx_->kv_unified() ? 1u : (uint32_t) ctx_->n_seq_max();
    }

    free_ids_.reserve((size_t) config.max_sessions);
    for (int32_t id = config.max_sessions - 1; id >= 0; --id) {
        free_ids_.push_back(id);  // pop_back hands out 0 first
    }
    counters_.max_sessions       = config.max_sessions;
    counters_.budget_tokens      = config.budget_tokens;
    counters_.context_tokens     = config.context_tokens;
    counters_.kv_bytes_per_token = ctx_->kv_bytes_per_token();
    counters_.warm_capacity      = (uint64_t) config.warm_bytes;
    counters_.disk_capacity      = (uint64_t) config.warm_disk_bytes;
    counters_.prefix_capacity    = (uint64_t) config.prefix_bytes;
    if (!config.warm_dir.empty()) {
        load_disk_tier();
    }
    publish_locked();
}

// a restarted worker: the valid files of its directory become disk-tier sessions, oldest first
// (the oldest go first when they exceed warm_disk_bytes); their idle time starts at the first call
void hot_kv_engine::load_disk_tier() {
    const shard_model_info & info = model_.info();
    const std::string digest = kv_file_store::model_digest(model_.path());
    if (digest.empty()) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "cannot read the model file " + model_.path() + " for the disk tier");
    }
    auto files = std::make_unique<kv_file_store>(config_.warm_dir,
        kv_file_identity{config_.recipe_fingerprint, digest, info.first, info.last, info.n_layer, config_.kv_type});
    // a session longer than this engine's context or budget could never come back hot
    const int32_t longest = (int32_t) std::min<int64_t>(config_.context_tokens, config_.budget_tokens);
    warm_.attach_disk(std::move(files), longest);
    publish_locked();
}

// ---------------------------------------------------------------------------------------------
// bookkeeping helpers (mutex_ held)
// ---------------------------------------------------------------------------------------------

void hot_kv_engine::validate_key(const std::string & sid, int64_t epoch) const {
    if (sid.empty() || sid.size() > HOT_KV_MAX_SESSION_ID_BYTES) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT, "session id must be 1 to " + str(HOT_KV_MAX_SESSION_ID_BYTES) + " bytes");
    }
    if (epoch < 0 || epoch > HOT_KV_MAX_EPOCH) {
        throw shard_error(SHARD_ERRC_INVALID_ARGUMENT,
                          "route epoch must be 0 to " + str(HOT_KV_MAX_EPOCH) + ", got " + str(epoch));
    }
}

void hot_kv_engine::remember_locked(const std::string & sid, int64_t epoch, shard_miss_reason reason) {
    if (config_.recent_capacity == 0) {
        return;
    }
    const uint64_t stamp = ++recent_stamp_;
    recent_[sid] = dropped{epoch, reason, stamp};
    recent_order_.emplace_back(sid, stamp);
    // forget the oldest keys; an order entry whose stamp no longer matches was superseded
    while (recent_.size() > (size_t) config_.recent_capacity || recent_order_.size() > 2 * (size_t) config_.recent_capacity) {
        auto [old_sid, old_stamp] = recent_order_.front();
        recent_order_.pop_front();
        auto it = recent_.find(old_sid);
        if (it != recent_.end() && it->second.stamp == old_stamp) {
            recent_.erase(it);
        }
    }
}

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

double hot_kv_engine::begin_locked(const std::string & sid, int64_t epoch, double now) {
    validate_key(sid, epoch);
    now = tick_locked(now);
    sweep_locked(now);
    return now;
}

double hot_kv_engine::tick_locked(double now) {
    clock_ = std::max(clock_, now);
    warm_.start_clock(clock_);  // files loaded at start-up: idle from the first call on
    return clock_;
}

int32_t hot_kv_engine::sweep_locked(double now) {
    int32_t n = 0;
    // lru_ is ordered by last use, so the expired sessions are a prefix of it
    while (config_.ttl_seconds > 0 && !lru_.empty()) {
        const std::string sid = lru_.front();
        if (now - live_.at(sid).last_used <= config_.ttl_seconds) {
            break;
        }
        leave_hot_locked(sid, SHARD_MISS_EVICTED_TTL);
        ++n;
    }
    return n + warm_.sweep(now);
}

void hot_kv_engine::touch_locked(session & s, double now) {
    s.last_used = now;  // engine time is monotone (tick_locked), so the list stays ordered by last_used
    lru_.splice(lru_.end(), lru_, s.lru_pos);
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

void hot_kv_engine::count_miss_locked(const hot_kv_result & res) {
    if (res.status == SHARD_STATUS_CACHE_MISS) {
        counters_.misses[res.miss]++;
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

hot_kv_engine::session * hot_kv_engine::identify_locked(const std::string & sid, int64_t epoch, hot_kv_result & res,
                                                        warm_entry ** warm, bool query) {
    res = hot_kv_result{};
    auto it = live_.find(sid);
    if (it != live_.end()) {
        session & s = it->second;
        if (epoch == s.epoch) {
            return &s;
        }
        if (epoch < s.epoch) {
            res = stale_result(epoch, s.epoch, "current");
            return nullptr;
        }
        if (query) {
            res = newer_than_cached_result(epoch, s.epoch);
            return nullptr;
        }
        // a newer epoch: the route moved; the older state is dropped, and the newer epoch is what
        // later requests are judged against (older ones are stale, this one re-prefills)
        drop_locked(sid, SHARD_MISS_SUPERSEDED_EPOCH, epoch);
        res = superseded_result(epoch);
        return nullptr;
    }
    if (warm_entry * wp = warm_.find(sid); wp != nullptr) {
        warm_entry & w = *wp;
        if (epoch == w.epoch) {
            res.tier    = w.on_disk ? HOT_KV_TIER_DISK : HOT_KV_TIER_WARM;
            res.seq_len = w.seq_len;
            if (warm != nullptr) {
                *warm = &w;
            }
            return nullptr;
        }
        if (epoch < w.epoch) {
            res = stale_result(epoch, w.epoch, "current");
            return nullptr;
        }
        if (query) {
            res = newer_than_cached_result(epoch, w.epoch);
            return nullptr;
        }
        warm_.drop(sid, SHARD_MISS_SUPERSEDED_EPOCH, epoch);  // as for a hot session
        res = superseded_result(epoch);
        return nullptr;
    }
    auto rit = recent_.find(sid);
    if (rit != recent_.end()) {
        if (epoch < rit->second.epoch) {
            res = stale_result(epoch, rit->second.epoch, "last");
            return nullptr;
        }
        if (epoch == rit->second.epoch) {
            res.status = SHARD_STATUS_CACHE_MISS;
            res.miss   = rit->second.reason;
            res.detail = std::string("the session's state was dropped: ") + shard_miss_reason_name(rit->second.reason);
            return nullptr;
        }
    }
    res.status = SHARD_STATUS_CACHE_MISS;
    res.miss   = SHARD_MISS_UNKNOWN_SESSION;
    res.detail = "no cached state for this session and epoch";
    return nullptr;
}

// ---------------------------------------------------------------------------------------------
// requests
// ---------------------------------------------------------------------------------------------

hot_kv_result hot_kv_engine::open(const std::string & sid, int64_t epoch, double now) {
    std::lock_guard<fair_mutex> lock(mutex_);
    const publisher publish_on_return(*this);  // stats() sees this call once it is done
    now = begin_locked(sid, epoch, now);
    hot_kv_result res;
    warm_entry * w = nullptr;
    session * s = identify_locked(sid, epoch, res, &w);
    if (res.status == SHARD_STATUS_STALE_EPOCH) {
        return res;
    }
    if (w != nullptr) {
        s = restore_alone_locked(sid, w->seq_len, now, res);
        count_miss_locked(res);  // a lost warm copy is a miss even though open answers with a new session
    }
    if (s == nullptr) {  // nothing cached (not a miss: open asks for a session, and gets one)
        id_placement lone;
        s = &create_locked(sid, epoch, now, lone);
    }
    touch_locked(*s, now);
    return hot_result(s->seq_len, s->seq_id);
}

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

hot_kv_result hot_kv_engine::release(const std::string & sid, int64_t epoch, double now) {
    std::lock_guard<fair_mutex> lock(mutex_);
    const publisher publish_on_return(*this);  // stats() sees this call once it is done
    now = begin_locked(sid, epoch, now);
    hot_kv_result res;
    auto it = live_.find(sid);
    const warm_entry * w = warm_.find(sid);
    if (it != live_.end() || w != nullptr) {  // cached, hot or warm: released the same way
        const bool hot = it != live_.end();
        const int64_t cached = hot ? it->second.epoch : w->epoch;
        if (epoch < cached) {
            return stale_result(epoch, cached, "current");  // a stale release must not erase the current epoch
        }
        auto drop = [&](shard_miss_reason reason, int64_t remembered) {
            hot ? drop_locked(sid, reason, remembered) : warm_.drop(sid, reason, remembered);
        };
        if (epoch == cached) {
            drop(SHARD_MISS_RELEASED, -1);
        } else {  // a newer epoch supersedes the cached one, which is released with it
            drop(SHARD_MISS_SUPERSEDED_EPOCH, epoch);
            remember_locked(sid, epoch, SHARD_MISS_RELEASED);
        }
        res.changed = true;
        return res;
    }
    auto rit = recent_.find(sid);
    if (rit != recent_.end()) {
        if (epoch < rit->second.epoch) {
            return stale_result(epoch, rit->second.epoch, "last");
        }
        if (epoch > rit->second.epoch) {  // the route moved on: older epochs are stale from now on
            remember_locked(sid, epoch, SHARD_MISS_RELEASED);
        }
    }
    return res;  // releasing what is not cached is a no-op
}

hot_kv_result hot_kv_engine::resolve(const std::string & sid, int64_t epoch, double now) {
    std::lock_guard<fair_mutex> lock(mutex_);
    const publisher publish_on_return(*this);  // stats() sees this call once it is done
    now = begin_locked(sid, epoch, now);
    hot_kv_result res;
    // a query: a warm session is reported where it is, a newer epoch supersedes nothing
    session * s = identify_locked(sid, epoch, res, nullptr, /*query*/ true);
    if (s == nullptr) {
        count_miss_locked(res);
        return res;
    }
    return hot_result(s->seq_len, s->seq_id);
}

int32_t hot_kv_engine::persist(double now) {
    std::lock_guard<fair_mutex> lock(mutex_);
    const publisher publish_on_return(*this);  // stats() sees this call once it is done
    tick_locked(now);
    if (!warm_.has_disk()) {  // nothing outlives the process: everything is released
        while (!lru_.empty()) {
            drop_locked(std::string(lru_.front()), SHARD_MISS_RELEASED);
        }
        warm_.release_host_all();
        return 0;
    }
    while (!lru_.empty()) {
        const std::string sid = lru_.front();
        if (!spill_locked(sid, SHARD_MISS_NONE)) {
            drop_locked(sid, SHARD_MISS_RELEASED);
        }
    }
    warm_.demote_host_all();
    return (int32_t) warm_.disk_sessions();
}

int32_t hot_kv_engine::sweep(double now) {
    std::lock_guard<fair_mutex> lock(mutex_);
    const publisher publish_on_return(*this);  // stats() sees this call once it is done
    return sweep_locked(tick_locked(now));
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

// ---------------------------------------------------------------------------------------------
// introspection
// ---------------------------------------------------------------------------------------------

void hot_kv_engine::publish_locked() const {
    hot_kv_stats st = counters_;
    st.live_sessions   = (int32_t) live_.size();
    st.reserved_tokens = reserved_;
    st.reserved_bytes  = (uint64_t) reserved_ * counters_.kv_bytes_per_token;
    st.recent_keys     = (int32_t) recent_.size();
    st.warm_sessions   = (int32_t) warm_.host_sessions();
    st.warm_bytes      = warm_.host_held();
    st.disk_sessions   = (int32_t) warm_.disk_sessions();
    st.disk_bytes      = warm_.disk_held();
    const warm_counters & wc = warm_.counters();
    st.warm_drops      = wc.warm_drops;
    st.disk_spills     = wc.disk_spills;
    st.disk_restores   = wc.disk_restores;
    st.disk_loaded     = wc.disk_loaded;
    st.disk_failures   = wc.disk_failures;
    st.prefix_entries  = (int32_t) prefixes_.size();
    st.prefix_bytes    = prefixes_.held();
    st.checkpoint_bytes = 0;
    for (const auto & [sid, s] : live_) {
        st.checkpoint_bytes += s.checkpoints.bytes();
    }
    const prefix_counters & pc = prefixes_.counters();
    st.prefix_stores       = pc.stores;
    st.prefix_hits         = pc.hits;
    st.prefix_tokens_saved = pc.tokens_saved;
    st.prefix_evictions    = pc.evictions;
    std::vector<hot_kv_session_info> hot;
    hot.reserve(live_.size());
    for (const std::string & sid : lru_) {
        const session & s = live_.at(sid);
        hot.push_back({sid, s.epoch, s.seq_id, s.seq_len, s.last_used, HOT_KV_TIER_HOT});
    }
    std::vector<hot_kv_session_info> warm;
    const bool warm_changed = !warm_.listed();
    if (warm_changed) {
        warm.reserve(warm_.size());
        warm_.for_each([&](const std::string & sid, const warm_entry & w) {
            warm.push_back({sid, w.epoch, -1, w.seq_len, w.last_used, w.on_disk ? HOT_KV_TIER_DISK : HOT_KV_TIER_WARM});
        });
        warm_.mark_listed();
    }
    std::lock_guard<std::mutex> lock(stats_mutex_);
    published_ = st;
    published_hot_.swap(hot);
    if (warm_changed) {
        published_warm_.swap(warm);
    }
}

hot_kv_stats hot_kv_engine::stats() const {
    std::lock_guard<std::mutex> lock(stats_mutex_);  // never the engine lock: a step in progress does not delay it
    return published_;
}

std::vector<hot_kv_session_info> hot_kv_engine::sessions() const {
    std::lock_guard<std::mutex> lock(stats_mutex_);  // never the engine lock, as stats()
    std::vector<hot_kv_session_info> out;
    out.reserve(published_hot_.size() + published_warm_.size());
    out.insert(out.end(), published_hot_.begin(), published_hot_.end());
    out.insert(out.end(), published_warm_.begin(), published_warm_.end());
    return out;
}

void hot_kv_engine::check_invariants() const {
    std::lock_guard<fair_mutex> lock(mutex_);
    auto fail = [](const std::string & what) { throw std::logic_error("hot_kv_engine invariant violated: " + what); };

    if ((int32_t) live_.size() > config_.max_sessions) fail("more live sessions than max_sessions");
    if (lru_.size() != live_.size()) fail("LRU list and session map disagree");
    if (live_.size() + free_ids_.size() != (size_t) config_.max_sessions) fail("seq ids leaked or duplicated");

    std::vector<bool> used((size_t) config_.max_sessions, false);
    int64_t sum = 0;
    int64_t held = 0;  // cells: a restored sliding-window session holds its window, from swa_floor
    for (const auto & [sid, s] : live_) {
        if (s.seq_id < 0 || s.seq_id >= config_.max_sessions) fail("seq id out of range");
        if (used[(size_t) s.seq_id]) fail("seq id used twice");
        used[(size_t) s.seq_id] = true;
        if (s.seq_len < 0 || s.seq_len > config_.context_tokens) fail("session length outside [0, context_tokens]");
        if (*s.lru_pos != sid) fail("LRU position does not point at its session");
        if (ctx_->seq_pos_max(s.seq_id) != s.seq_len - 1) {
            fail("session '" + sid + "' has length " + str(s.seq_len) + " but llama.cpp holds positions up to " +
                 str(ctx_->seq_pos_max(s.seq_id)));
        }
        if (s.seq_len > 0 && ctx_->seq_pos_min(s.seq_id) != s.swa_floor) {
            fail("session '" + sid + "' should hold positions from " + str(s.swa_floor) + " but llama.cpp holds them from " +
                 str(ctx_->seq_pos_min(s.seq_id)));
        }
        sum += s.seq_len;
        held += s.seq_len > 0 ? s.seq_len - s.swa_floor : 0;
    }
    if (!std::is_sorted(free_ids_.begin(), free_ids_.end(), std::greater<int32_t>())) fail("free seq ids are not in descending order");
    for (int32_t id : free_ids_) {
        if (id < 0 || id >= config_.max_sessions || used[(size_t) id]) fail("free seq id is in use or out of range");
        used[(size_t) id] = true;
        if (ctx_->seq_pos_max(id) != -1) fail("a free seq id still holds positions");
    }
    if (sum != reserved_) fail("reserved tokens != sum of session lengths");
    if (reserved_ > config_.budget_tokens) fail("reserved tokens exceed the budget");
    if (ctx_->n_cells_used() != held) {
        fail("llama.cpp holds " + str(ctx_->n_cells_used()) + " cells but the sessions hold " + str(held));
    }
    double prev = -1e300;
    for (const std::string & sid : lru_) {
        const double t = live_.at(sid).last_used;
        if (t < prev) fail("LRU order disagrees with last_used");
        prev = t;
    }
    if (recent_.size() > (size_t) config_.recent_capacity) fail("the table of dropped keys outgrew its capacity");
    for (const auto & [sid, d] : recent_) {
        (void) d;
        if (live_.count(sid)) fail("a live session is also in the dropped table");
        if (warm_.contains(sid)) fail("a warm session is also in the dropped table");
    }
    warm_.check(config_.context_tokens);
    warm_.for_each([&](const std::string & sid, const warm_entry &) {
        if (live_.count(sid)) fail("session '" + sid + "' is both hot and warm");
    });
    if (warm_.listed()) {  // what sessions() shows of the warm tier is what it holds
        std::lock_guard<std::mutex> lock(stats_mutex_);
        bool same = published_warm_.size() == warm_.size();
        size_t i = 0;
        warm_.for_each([&](const std::string & sid, const warm_entry & w) {
            same = same && i < published_warm_.size() && published_warm_[i].session_id == sid &&
                   published_warm_[i].epoch == w.epoch && published_warm_[i].seq_len == w.seq_len &&
                   published_warm_[i].last_used == w.last_used &&
                   published_warm_[i].tier == (w.on_disk ? HOT_KV_TIER_DISK : HOT_KV_TIER_WARM);
            ++i;
        });
        if (!same) fail("the published warm and disk list is stale");
    }
    prefixes_.check(config_.context_tokens);
    // across the rooms: every spill or loaded file is restored, dropped, or still warm
    if (counters_.spills + warm_.counters().disk_loaded != counters_.restores + warm_.counters().warm_drops + warm_.size()) {
        fail("spills + disk_loaded != restores + warm drops + warm and disk sessions");
    }
}

} // namespace llama_shard
