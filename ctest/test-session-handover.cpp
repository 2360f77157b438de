// Session hand-over without Python: hot_kv_engine::export_session / import_session between two
// engines of the same shard. An imported session continues bit for bit as its source (a receiver
// with another max_sessions: the state is rewritten for its stream count); a warm session exports
// the bytes it was spilled with; refused bytes change nothing (stats and sessions equal before and
// after), and bytes that pass every check but that llama.cpp still refuses (a guard) leave no
// half-made session. Also what llama.cpp itself does at the pin with a state of another context
// (shard_context::seq_restore): it answers an error, never aborts, and leaves the sequence empty.

#include "llama_shard/hot_kv_engine.h"
#include "llama_shard/kv_state_check.h"
#include "test-common.h"

#include <cstring>
#include <string>
#include <vector>

using namespace llama_shard;

namespace {

shard_model_params model_params(const std::string & path, int32_t first = -1, int32_t last = -1) {
    shard_model_params mp;
    mp.path = path;
    mp.n_threads = 2;
    if (first >= 0) {
        mp.layers = std::make_pair(first, last);
    }
    return mp;
}

hot_kv_config config(int32_t sessions, int32_t context, int64_t budget) {
    hot_kv_config c;
    c.max_sessions = sessions;
    c.context_tokens = context;
    c.budget_tokens = budget;
    c.ttl_seconds = 0;
    c.n_batch = 64;
    c.recent_capacity = 8;
    return c;
}

std::vector<int32_t> prompt(int32_t n, int32_t seed) {
    std::vector<int32_t> t;
    for (int32_t i = 0; i < n; ++i) {
        t.push_back(1 + (i * 37 + seed * 11) % 300);
    }
    return t;
}

struct engine_harness {
    hot_kv_engine engine;
    std::vector<float> out;
    double now = 0.0;

    engine_harness(const shard_model & model, const hot_kv_config & cfg)
        : engine(model, cfg), out((size_t) engine.output_size(64)) {}

    hot_kv_result prefill(const std::string & sid, int64_t epoch, const std::vector<int32_t> & toks, int32_t start = 0) {
        hot_kv_result r;
        for (size_t at = 0; at < toks.size(); at += 64) {  // n_batch tokens a call
            shard_input in;
            in.tokens = toks.data() + at;
            in.n_tokens = (int64_t) std::min<size_t>(64, toks.size() - at);
            r = engine.prefill(sid, epoch, at == 0 ? start : -1, in, out.data(), now);
            if (r.status != SHARD_STATUS_OK) {
                break;
            }
        }
        engine.check_invariants();
        return r;
    }
    // n greedy-free decodes of fixed tokens: every output, in order
    std::vector<float> decode(const std::string & sid, int64_t epoch, int32_t n) {
        std::vector<float> all;
        for (int32_t i = 0; i < n; ++i) {
            int32_t tok = 5 + 7 * i;
            shard_input in;
            in.tokens = &tok;
            in.n_tokens = 1;
            const hot_kv_result r = engine.decode(sid, epoch, -1, in, out.data(), now);
            CHECK(r.status == SHARD_STATUS_OK);
            all.insert(all.end(), out.begin(), out.begin() + engine.output_size(1));
        }
        engine.check_invariants();
        return all;
    }
    std::vector<uint8_t> export_bytes(const std::string & sid, int64_t epoch, hot_kv_result * res = nullptr) {
        page_buffer state;
        const hot_kv_result r = engine.export_session(sid, epoch, now, state);
        if (res != nullptr) {
            *res = r;
        }
        return std::vector<uint8_t>(state.data(), state.data() + state.size());
    }
    hot_kv_result import_bytes(const std::string & sid, int64_t epoch, int32_t seq_len, const std::vector<uint8_t> & b) {
        const hot_kv_result r = engine.import_session(sid, epoch, seq_len, b.data(), b.size(), now);
        engine.check_invariants();
        return r;
    }
};

// what a refused import must leave as it was
struct snapshot {
    hot_kv_stats stats;
    std::vector<hot_kv_session_info> sessions;
    explicit snapshot(const hot_kv_engine & e) : stats(e.stats()), sessions(e.sessions()) {}
    bool operator==(const snapshot & o) const {
        const hot_kv_stats & a = stats;
        const hot_kv_stats & b = o.stats;
        if (a.live_sessions != b.live_sessions || a.reserved_tokens != b.reserved_tokens || a.evictions_ttl != b.evictions_ttl ||
            a.evictions_lru != b.evictions_lru || a.releases != b.releases || a.supersessions != b.supersessions ||
            a.steps != b.steps || a.recent_keys != b.recent_keys || a.misses != b.misses || a.spills != b.spills ||
            a.restores != b.restores || a.warm_drops != b.warm_drops || a.warm_sessions != b.warm_sessions ||
            sessions.size() != o.sessions.size()) {
            return false;
        }
        for (size_t i = 0; i < sessions.size(); ++i) {
            const hot_kv_session_info & x = sessions[i];
            const hot_kv_session_info & y = o.sessions[i];
            if (x.session_id != y.session_id || x.epoch != y.epoch || x.seq_id != y.seq_id || x.seq_len != y.seq_len ||
                x.last_used != y.last_used || x.tier != y.tier) {
                return false;
            }
        }
        return true;
    }
};

bool same(const std::vector<float> & a, const std::vector<float> & b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// export, import into a receiver with other limits, continue both: the same bytes out
void continues_bit_for_bit(const std::string & path, const std::string & kv_type, bool flash_attn) {
    shard_model model(model_params(path));
    hot_kv_config a = config(4, 96, 384), b = config(2, 96, 200);
    a.kv_type = b.kv_type = kv_type;
    a.flash_attn = b.flash_attn = flash_attn;
    engine_harness src(model, a), dst(model, b);
    CHECK(src.prefill("s", 0, prompt(40, 1)).seq_len == 40);
    CHECK(dst.prefill("other", 0, prompt(9, 2)).seq_len == 9);
    hot_kv_result r;
    const std::vector<uint8_t> state = src.export_bytes("s", 0, &r);
    CHECK(r.status == SHARD_STATUS_OK && r.seq_len == 40 && r.tier == HOT_KV_TIER_HOT && !state.empty());
    CHECK(kv_state_streams(state.data(), state.size()) == 4);
    r = dst.import_bytes("s", 0, 40, state);
    CHECK(r.status == SHARD_STATUS_OK && r.seq_len == 40 && r.tier == HOT_KV_TIER_HOT);
    CHECK(same(src.decode("s", 0, 6), dst.decode("s", 0, 6)));
    // the receiver's own export is its stream count's, and the same cells
    const std::vector<uint8_t> again = dst.export_bytes("s", 0);
    CHECK(kv_state_streams(again.data(), again.size()) == 2);
    src.engine.check_invariants();
}

// a warm session's export is the state it was spilled with; nothing moves
void warm_export(const std::string & path) {
    shard_model model(model_params(path));
    hot_kv_config c = config(1, 96, 384);
    c.warm_bytes = 16 << 20;
    engine_harness src(model, c), dst(model, config(2, 96, 384));
    CHECK(src.prefill("s", 3, prompt(40, 3)).seq_len == 40);
    const std::vector<uint8_t> hot = src.export_bytes("s", 3);
    CHECK(src.prefill("pusher", 0, prompt(3, 4)).seq_len == 3);  // one slot: s spills
    const snapshot before(src.engine);
    hot_kv_result r;
    const std::vector<uint8_t> warm = src.export_bytes("s", 3, &r);
    CHECK(r.status == SHARD_STATUS_OK && r.tier == HOT_KV_TIER_WARM && r.seq_len == 40 && r.seq_id == -1);
    CHECK(warm == hot);
    CHECK(snapshot(src.engine) == before);
    CHECK(dst.import_bytes("s", 3, 40, warm).status == SHARD_STATUS_OK);
    CHECK(same(src.decode("s", 3, 3), dst.decode("s", 3, 3)));
    // misses and stale epochs as resolve answers them
    CHECK(src.export_bytes("nobody", 0, &r).empty() && r.status == SHARD_STATUS_CACHE_MISS &&
          r.miss == SHARD_MISS_UNKNOWN_SESSION);
    CHECK(src.export_bytes("s", 2, &r).empty() && r.status == SHARD_STATUS_STALE_EPOCH && r.current_epoch == 3);
    CHECK(src.export_bytes("s", 4, &r).empty() && r.status == SHARD_STATUS_CACHE_MISS);
    CHECK(src.engine.resolve("s", 3, src.now).seq_len == 43);  // a newer epoch superseded nothing
}

// refused bytes change nothing; caller mistakes throw
void refusals(const std::string & path) {
    shard_model model(model_params(path));
    shard_model part(model_params(path, 0, 2));
    engine_harness src(model, config(4, 96, 384)), dst(model, config(4, 32, 64));
    engine_harness other(part, config(4, 96, 384));
    CHECK(src.prefill("s", 0, prompt(30, 5)).seq_len == 30);
    CHECK(other.prefill("s", 0, prompt(30, 5)).seq_len == 30);
    const std::vector<uint8_t> state = src.export_bytes("s", 0);
    CHECK(dst.prefill("s", 0, prompt(5, 6)).seq_len == 5);
    CHECK(dst.prefill("t", 7, prompt(5, 7)).seq_len == 5);
    const snapshot before(dst.engine);

    CHECK(dst.import_bytes("t", 6, 30, state).status == SHARD_STATUS_STALE_EPOCH);
    CHECK(dst.import_bytes("s", 0, 33, state).status == SHARD_STATUS_BUDGET_EXCEEDED);  // over context_tokens 32
    CHECK(dst.import_bytes("s", 0, 29, state).status == SHARD_STATUS_INVALID_INPUT);   // another length
    CHECK(dst.import_bytes("s", 0, 30, std::vector<uint8_t>(state.begin(), state.end() - 1)).status == SHARD_STATUS_INVALID_INPUT);
    CHECK(dst.import_bytes("s", 0, 30, other.export_bytes("s", 0)).status == SHARD_STATUS_INVALID_INPUT);  // 3 layers, not 6
    std::vector<uint8_t> moved = state;
    // the first cell's position: after magic, seq id, the stream count and stream 0's cell count
    // (s took seq id 0: stream 0 holds its cells; the other streams' counts follow its rows)
    const size_t cell0 = 16;
    moved[cell0 + 12 * 3] ^= 1;
    CHECK(dst.import_bytes("s", 0, 30, moved).status == SHARD_STATUS_INVALID_INPUT);
    std::vector<uint8_t> noise(state.size());
    for (size_t i = 0; i < noise.size(); ++i) {
        noise[i] = (uint8_t) (i * 2654435761u >> 13);
    }
    CHECK(dst.import_bytes("s", 0, 30, noise).status == SHARD_STATUS_INVALID_INPUT);
    CHECK(dst.import_bytes("s", 0, 30, {}).status == SHARD_STATUS_INVALID_INPUT);
    CHECK_THROWS(dst.engine.import_session("s", 0, 0, state.data(), state.size(), 0), SHARD_ERRC_INVALID_ARGUMENT);
    CHECK_THROWS(dst.engine.import_session("", 0, 30, state.data(), state.size(), 0), SHARD_ERRC_INVALID_ARGUMENT);
    CHECK_THROWS(dst.engine.import_session("s", -1, 30, state.data(), state.size(), 0), SHARD_ERRC_INVALID_ARGUMENT);
    CHECK(snapshot(dst.engine) == before);
    dst.engine.check_invariants();
}

// Bytes that pass every check of the engine and that llama.cpp still refuses (a guard): a state of
// two caches whose layers add up to the owned ones, on a model of one cache. The session is freed
// entirely, remembered as a miss; nothing is half-made.
void refused_by_llama_cpp(const std::string & path) {
    shard_model model(model_params(path));
    engine_harness src(model, config(1, 96, 384)), dst(model, config(1, 96, 384));
    const int32_t n = 12;
    CHECK(src.prefill("s", 0, prompt(n, 8)).seq_len == n);
    const std::vector<uint8_t> st = src.export_bytes("s", 0);
    // magic, seq id, n_stream 1, cells n, n cells of 12 bytes, v_trans, n_layer, then per layer K
    // (type, row size, rows), then per layer V
    auto u32 = [&](size_t at) { uint32_t v; std::memcpy(&v, st.data() + at, 4); return v; };
    const size_t meta = 16, rows = meta + 12 * (size_t) n;
    const uint32_t n_layer = u32(rows + 4);
    uint64_t row = 0;
    std::memcpy(&row, st.data() + rows + 8 + 4, 8);
    const size_t block = 4 + 8 + (size_t) n * row;
    CHECK(n_layer >= 2 && st.size() == rows + 8 + 2 * n_layer * block);
    std::vector<uint8_t> forged(st.begin(), st.begin() + 8);
    const uint32_t half = n_layer / 2;
    for (uint32_t part = 0; part < 2; ++part) {
        const uint32_t first = part == 0 ? 0 : half, count = part == 0 ? half : n_layer - half;
        forged.insert(forged.end(), st.begin() + 8, st.begin() + rows + 4);  // n_stream, cells, cell list, v_trans
        forged.insert(forged.end(), (const uint8_t *) &count, (const uint8_t *) &count + 4);
        for (uint32_t kv = 0; kv < 2; ++kv) {
            const size_t at = rows + 8 + ((size_t) kv * n_layer + first) * block;
            forged.insert(forged.end(), st.begin() + at, st.begin() + at + count * block);
        }
    }
    std::string why;
    CHECK(kv_state_positions_ok(forged.data(), forged.size(), n, why));
    CHECK(dst.prefill("s", 0, prompt(4, 9)).seq_len == 4);  // held before: replaced, then gone
    const hot_kv_result r = dst.import_bytes("s", 0, n, forged);
    CHECK(r.status == SHARD_STATUS_INVALID_INPUT);
    CHECK(dst.engine.stats().live_sessions == 0 && dst.engine.stats().reserved_tokens == 0);
    const hot_kv_result after = dst.engine.resolve("s", 0, dst.now);
    CHECK(after.status == SHARD_STATUS_CACHE_MISS && after.miss == SHARD_MISS_EVICTED_LRU);
    CHECK(dst.import_bytes("s", 0, n, st).status == SHARD_STATUS_OK);  // the genuine bytes still go in
    CHECK(same(src.decode("s", 0, 2), dst.decode("s", 0, 2)));
}

// llama.cpp at the pin, given a state of another context: an error (false), the sequence left
// empty, the process alive. These are the mismatches kv_state_restorable refuses first.
void llama_cpp_refuses_other_contexts(const std::string & path) {
    shard_model model(model_params(path));
    shard_model part(model_params(path, 0, 2));
    engine_harness src(model, config(2, 320, 640));
    CHECK(src.prefill("s", 0, prompt(300, 10)).seq_len == 300);
    const std::vector<uint8_t> st = src.export_bytes("s", 0);
    auto refused = [&](const shard_model & m, shard_context_params p, const std::vector<uint8_t> & bytes) {
        shard_context ctx(m, p);
        const bool ok = ctx.seq_restore(0, bytes.data(), bytes.size());
        return !ok && ctx.seq_pos_max(0) == -1 && ctx.n_cells_used() == 0;
    };
    shard_context_params p;
    p.n_ctx = 1024;
    p.n_seq_max = 2;
    p.n_batch = 64;
    p.kv_unified = false;
    {
        shard_context ctx(model, p);  // the same layout: restored
        CHECK(ctx.seq_restore(1, st.data(), st.size()) && ctx.seq_pos_max(1) == 299);
    }
    // another K type (this model's head size of 16 takes no quantized cache: the type field forged;
    // tests/test_session_handover_engine.py hands over a q8_0 cache)
    std::vector<uint8_t> q8 = st;
    const size_t k0 = 8 + 4 + 4 + 12 * 300 + 8;  // magic, seq id, n_stream, stream 0's count, its cells, v_trans, n_layer
    int32_t type = 0;
    std::memcpy(&type, q8.data() + k0, 4);
    CHECK(type == 1);  // GGML_TYPE_F16
    type = 8;          // GGML_TYPE_Q8_0
    std::memcpy(q8.data() + k0, &type, 4);
    CHECK(refused(model, p, q8));
    shard_context_params no_fa = p;
    no_fa.flash_attn = false;
    CHECK(refused(model, no_fa, st));                                // V transposed
    CHECK(refused(part, p, st));                                     // another layer count
    shard_context_params four = p;
    four.n_seq_max = 4;
    four.n_ctx = 2048;
    CHECK(refused(model, four, st));                                 // another stream count
    shard_context_params small = p;
    small.n_ctx = 512;                                               // 256 cells a stream: 300 do not fit
    CHECK(refused(model, small, st));
    CHECK(refused(model, p, std::vector<uint8_t>(st.begin(), st.end() - 5)));  // truncated
    // the stream count rewritten: restored
    page_buffer four_streams;
    CHECK(kv_state_restream(st.data(), st.size(), 300, 4, four_streams));
    {
        shard_context ctx(model, four);
        CHECK(ctx.seq_restore(3, four_streams.data(), four_streams.size()) && ctx.seq_pos_max(3) == 299);
    }
}

// a sliding-window model: two caches, the sliding one holding the window; the imported session's
// swa_floor is set as after a warm restore, and it continues bit for bit
void sliding_window(const std::string & path) {
    shard_model model(model_params(path));
    engine_harness src(model, config(4, 96, 384)), dst(model, config(2, 96, 384));
    CHECK(src.prefill("s", 0, prompt(40, 11)).seq_len == 40);
    const std::vector<uint8_t> st = src.export_bytes("s", 0);
    CHECK(dst.import_bytes("s", 0, 40, st).status == SHARD_STATUS_OK);
    CHECK(same(src.decode("s", 0, 5), dst.decode("s", 0, 5)));
    // a cut below the window it holds is a miss there (the source, computed here, holds every cell)
    const hot_kv_result cut = dst.engine.truncate("s", 0, 2, dst.now);
    CHECK(cut.status == SHARD_STATUS_CACHE_MISS && cut.miss == SHARD_MISS_EVICTED_LRU);
    CHECK(src.engine.truncate("s", 0, 2, src.now).status == SHARD_STATUS_OK);
    dst.engine.check_invariants();
}

} // namespace

int main(int argc, char ** argv) {
    if (argc < 3) {
        std::fprintf(stderr, "usage: %s LLAMA.gguf GEMMA3.gguf\n", argv[0]);
        return 2;
    }
    continues_bit_for_bit(argv[1], "f16", true);
    continues_bit_for_bit(argv[1], "f16", false);
    // (q8_0: tests/test_session_handover_engine.py, on a model whose head size it can quantize)
    warm_export(argv[1]);
    refusals(argv[1]);
    refused_by_llama_cpp(argv[1]);
    llama_cpp_refuses_other_contexts(argv[1]);
    sliding_window(argv[2]);
    return finish("test-session-handover");
}
