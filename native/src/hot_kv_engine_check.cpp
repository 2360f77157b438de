// The Hot KV engine's introspection (hot_kv_engine.h): the counters and session list published at
// the end of every call, and check_invariants, which the tests run after every step. A file of its
// own: what the engine reports and checks, read apart from what it does.

#include "llama_shard/hot_kv_engine.h"
#include "hot_kv_engine_internal.h"

#include <algorithm>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace llama_shard {

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
