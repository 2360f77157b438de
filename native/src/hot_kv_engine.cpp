// The Hot KV engine (hot_kv_engine.h), its construction and identity: the statuses' names, the
// configuration's one check, the constructor and the disk tier at start-up, a key's identity
// (identify_locked: live, warm, stale, superseded or a miss) and the requests that only ask it or
// drop it (open, release, resolve, persist, sweep). The step and every cut are in
// hot_kv_engine_step.cpp, moves between tiers in hot_kv_engine_tiers.cpp, the invariants and the
// published counters in hot_kv_engine_check.cpp: one file would be too long to read.

#include "llama_shard/hot_kv_engine.h"
#include "hot_kv_engine_internal.h"

#include "llama.h"
#include "llama_shard/kv_type.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>

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
// identity and bookkeeping (mutex_ held)
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

void hot_kv_engine::count_miss_locked(const hot_kv_result & res) {
    if (res.status == SHARD_STATUS_CACHE_MISS) {
        counters_.misses[res.miss]++;
    }
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
// requests that ask for a key or drop it (the step: hot_kv_engine_step.cpp)
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

} // namespace llama_shard
