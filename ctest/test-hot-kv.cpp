// Hot KV engine conformance without Python: lifecycle, admission, LRU/TTL eviction, stale epochs,
// supersession, miss reasons, the bounded table of dropped keys, the warm tier, the prefix store, and
// check_invariants() after every step. Expected outcomes are values; caller mistakes throw and change nothing.

#include "llama_shard/hot_kv_engine.h"
#include "test-common.h"

#include <cstring>
#include <string>
#include <vector>

using namespace llama_shard;

namespace {

struct harness {
    shard_model   model;
    hot_kv_engine engine;
    std::vector<float> out;
    double now = 0.0;

    harness(const std::string & path, hot_kv_config cfg)
        : model([&] {
              shard_model_params mp;
              mp.path = path;
              mp.n_threads = 2;
              return mp;
          }()),
          engine(model, cfg), out(1 << 16) {}

    hot_kv_result prefill(const std::string & sid, int64_t epoch, std::vector<int32_t> toks, int32_t start = -1) {
        shard_input in;
        in.tokens = toks.data();
        in.n_tokens = (int64_t) toks.size();
        hot_kv_result r = engine.prefill(sid, epoch, start, in, out.data(), now);
        engine.check_invariants();
        return r;
    }
    hot_kv_result decode(const std::string & sid, int64_t epoch, int32_t tok, int32_t expected = -1) {
        shard_input in;
        in.tokens = &tok;
        in.n_tokens = 1;
        hot_kv_result r = engine.decode(sid, epoch, expected, in, out.data(), now);
        engine.check_invariants();
        return r;
    }
    bool is_miss(const hot_kv_result & r, shard_miss_reason why) {
        return r.status == SHARD_STATUS_CACHE_MISS && r.miss == why;
    }
};

hot_kv_config config(int32_t sessions, int32_t context, int64_t budget, double ttl) {
    hot_kv_config c;
    c.max_sessions = sessions;
    c.context_tokens = context;
    c.budget_tokens = budget;
    c.ttl_seconds = ttl;
    c.n_batch = 16;
    c.recent_capacity = 8;
    return c;
}

void lifecycle(const std::string & path) {
    harness h(path, config(4, 32, 64, 0));
    // reference for the truncation check below: [1, 2, 3] then [4] in a session of its own
    CHECK(h.prefill("ref", 0, {1, 2, 3}).status == SHARD_STATUS_OK);
    CHECK(h.prefill("ref", 0, {4}).status == SHARD_STATUS_OK);
    std::vector<float> first(h.out.begin(), h.out.begin() + 320);
    CHECK(h.engine.release("ref", 0, h.now).changed);
    CHECK(h.prefill("a", 0, {1, 2, 3, 4}).status == SHARD_STATUS_OK);
    CHECK(h.decode("a", 0, 5).seq_len == 5);
    CHECK(h.decode("a", 0, 6, /*expected*/ 5).seq_len == 6);
    CHECK(h.is_miss(h.decode("a", 0, 7, /*expected*/ 9), SHARD_MISS_SEQ_LEN_MISMATCH));
    CHECK(h.engine.truncate("a", 0, 3, h.now).seq_len == 3);
    CHECK(h.prefill("a", 0, {4}).seq_len == 4);  // the truncated cache computes what a fresh one does
    CHECK(std::memcmp(first.data(), h.out.data(), 320 * sizeof(float)) == 0);
    CHECK(h.prefill("a", 0, {1, 2}, /*start*/ 0).seq_len == 2);  // earlier start truncates first
    CHECK(h.is_miss(h.prefill("a", 0, {1}, /*start*/ 7), SHARD_MISS_SEQ_LEN_MISMATCH));
    CHECK(h.engine.resolve("a", 0, h.now).seq_len == 2);
    CHECK(h.engine.release("a", 0, h.now).changed);
    CHECK(h.is_miss(h.engine.resolve("a", 0, h.now), SHARD_MISS_RELEASED));
    CHECK(h.is_miss(h.decode("a", 0, 1), SHARD_MISS_RELEASED));
    CHECK(!h.engine.release("a", 0, h.now).changed);
    CHECK(h.is_miss(h.decode("nobody", 0, 1), SHARD_MISS_UNKNOWN_SESSION));
    CHECK(h.is_miss(h.prefill("nobody", 0, {1}, 3), SHARD_MISS_UNKNOWN_SESSION));
    CHECK(h.engine.stats().reserved_tokens == 0);
    h.engine.check_invariants();
}

void epochs(const std::string & path) {
    harness h(path, config(4, 32, 64, 0));
    CHECK(h.prefill("s", 3, {1, 2, 3}).status == SHARD_STATUS_OK);
    CHECK(h.decode("s", 2, 1).status == SHARD_STATUS_STALE_EPOCH);
    CHECK(h.decode("s", 2, 1).current_epoch == 3);
    CHECK(h.engine.release("s", 1, h.now).status == SHARD_STATUS_STALE_EPOCH);
    CHECK(h.engine.resolve("s", 3, h.now).seq_len == 3);  // the stale release erased nothing
    CHECK(h.is_miss(h.decode("s", 4, 1), SHARD_MISS_SUPERSEDED_EPOCH));
    CHECK(h.engine.stats().live_sessions == 0 && h.engine.stats().reserved_tokens == 0);
    CHECK(h.engine.resolve("s", 3, h.now).status == SHARD_STATUS_STALE_EPOCH);
    CHECK(h.is_miss(h.engine.resolve("s", 4, h.now), SHARD_MISS_SUPERSEDED_EPOCH));
    CHECK(h.prefill("s", 4, {1, 2}).status == SHARD_STATUS_OK);
    CHECK(h.engine.open("s", 5, h.now).seq_len == 0);  // open at a newer epoch supersedes and starts empty
    CHECK(h.engine.stats().supersessions == 2);
}

void admission_and_eviction(const std::string & path) {
    harness h(path, config(2, 16, 24, 10));
    h.prefill("a", 0, {1});
    h.now = 1;
    h.prefill("b", 0, {2});
    h.now = 2;
    h.decode("a", 0, 3);  // a is the most recent
    h.now = 3;
    CHECK(h.prefill("c", 0, {4}).status == SHARD_STATUS_OK);  // session cap: evicts b
    CHECK(h.is_miss(h.engine.resolve("b", 0, h.now), SHARD_MISS_EVICTED_LRU));
    // budget: a holds 2, c 1; a step of 16 for c needs 16 <= 24 - 2: fits without eviction
    std::vector<int32_t> sixteen(15, 7);
    CHECK(h.prefill("c", 0, sixteen).seq_len == 16);
    CHECK(h.engine.stats().live_sessions == 2);
    // a needs 2 + 8 = 10 more than 24 - 16 allows: c (least recent) is evicted, never the requester
    h.now = 4;
    std::vector<int32_t> eight(8, 9);
    CHECK(h.prefill("a", 0, eight).seq_len == 10);
    CHECK(h.is_miss(h.engine.resolve("c", 0, h.now), SHARD_MISS_EVICTED_LRU));
    std::vector<int32_t> big(16, 1);
    CHECK(h.prefill("d", 0, big).status == SHARD_STATUS_OK);  // 16 fits context 16 and budget (evicts a)
    CHECK(h.is_miss(h.engine.resolve("a", 0, h.now), SHARD_MISS_EVICTED_LRU));
    // alone too big: refused, and nothing changes
    const hot_kv_stats before = h.engine.stats();
    CHECK(h.decode("d", 0, 1).status == SHARD_STATUS_BUDGET_EXCEEDED);  // 17 > context_tokens
    const hot_kv_stats after = h.engine.stats();
    CHECK(after.reserved_tokens == before.reserved_tokens && after.live_sessions == before.live_sessions);
    CHECK(after.evictions_lru == before.evictions_lru && after.steps == before.steps);
    CHECK(h.engine.resolve("d", 0, h.now).seq_len == 16);
    // TTL
    h.now = 100;
    CHECK(h.is_miss(h.decode("d", 0, 1), SHARD_MISS_EVICTED_TTL));
    CHECK(h.engine.stats().evictions_ttl == 1 && h.engine.stats().reserved_tokens == 0);
    h.prefill("e", 0, {1});
    h.now = 200;
    CHECK(h.engine.sweep(h.now) == 1);
    CHECK(h.engine.stats().misses[SHARD_MISS_EVICTED_LRU] == 3);
    h.engine.check_invariants();
}

void bounded_and_invalid(const std::string & path) {
    harness h(path, config(2, 16, 24, 0));
    for (int i = 0; i < 100; ++i) {
        h.engine.open("flood-" + std::to_string(i), 0, h.now);
    }
    CHECK(h.engine.stats().recent_keys <= 8);
    h.engine.check_invariants();

    h.prefill("k", 0, {1, 2});
    const int64_t reserved = h.engine.stats().reserved_tokens;
    std::vector<int32_t> oov = {1, 100000};
    shard_input in;
    in.tokens = oov.data();
    in.n_tokens = 2;
    CHECK_THROWS(h.engine.prefill("k", 0, -1, in, h.out.data(), h.now), SHARD_ERRC_INVALID_ARGUMENT);
    CHECK_THROWS(h.engine.prefill("", 0, -1, in, h.out.data(), h.now), SHARD_ERRC_INVALID_ARGUMENT);
    CHECK_THROWS(h.engine.open("k", -1, h.now), SHARD_ERRC_INVALID_ARGUMENT);
    CHECK_THROWS(h.engine.truncate("k", 0, 3, h.now), SHARD_ERRC_INVALID_ARGUMENT);
    CHECK_THROWS(h.engine.truncate("k", 0, -1, h.now), SHARD_ERRC_INVALID_ARGUMENT);
    in.n_tokens = 0;
    CHECK_THROWS(h.engine.decode("k", 0, -1, in, h.out.data(), h.now), SHARD_ERRC_INVALID_ARGUMENT);
    CHECK(h.engine.stats().reserved_tokens == reserved);
    CHECK(h.engine.resolve("k", 0, h.now).seq_len == 2);
    h.engine.check_invariants();

    hot_kv_config bad = config(0, 16, 24, 0);
    CHECK_THROWS(hot_kv_engine(h.model, bad), SHARD_ERRC_INVALID_ARGUMENT);
}

hot_kv_result step_one(harness & h, std::vector<hot_kv_request> & reqs, std::vector<hot_kv_result> & res) {
    res = h.engine.step(reqs, h.now);
    h.engine.check_invariants();
    return res.front();
}

hot_kv_request decode_request(harness & h, const std::string & sid, const int32_t * tok, float * out) {
    hot_kv_request r;
    r.session_id = sid;
    r.kind = HOT_KV_STEP_DECODE;
    r.input.tokens = tok;
    r.input.n_tokens = 1;
    r.out = out;
    (void) h;
    return r;
}

// the warm tier: an evicted session spills its KV to host memory and comes back bit-exact; resolve
// reports it without moving it; release, a newer epoch and warm TTL drop it; a full tier drops its
// least recently used session; BUSY defers a request that fits alone but not beside its step
void warm_tier_lifecycle(const std::string & path) {
    hot_kv_config cfg = config(1, 32, 32, 10);
    cfg.warm_bytes = 1 << 20;
    cfg.warm_ttl_seconds = 100;
    harness h(path, cfg);
    harness ref(path, config(1, 32, 32, 0));  // the same session, never evicted

    CHECK(h.prefill("a", 0, {1, 2, 3}).status == SHARD_STATUS_OK);
    CHECK(ref.prefill("a", 0, {1, 2, 3}).status == SHARD_STATUS_OK);
    CHECK(h.prefill("b", 0, {4, 5}).status == SHARD_STATUS_OK);  // the only slot: "a" spills
    hot_kv_result r = h.engine.resolve("a", 0, h.now);
    CHECK(r.status == SHARD_STATUS_OK && r.tier == HOT_KV_TIER_WARM && r.seq_len == 3 && r.seq_id == -1);
    CHECK(h.engine.stats().spills == 1 && h.engine.stats().restores == 0);  // resolve moved nothing
    CHECK(h.engine.stats().warm_bytes > 3 * h.engine.stats().kv_bytes_per_token);

    r = h.decode("a", 0, 6, /*expected*/ 3);  // restored, then decoded: "b" spills
    CHECK(r.status == SHARD_STATUS_OK && r.tier == HOT_KV_TIER_HOT && r.seq_len == 4);
    CHECK(ref.decode("a", 0, 6, 3).seq_len == 4);
    CHECK(std::memcmp(h.out.data(), ref.out.data(), 320 * sizeof(float)) == 0);  // bit-exact
    CHECK(h.engine.stats().restores == 1 && h.engine.stats().spills == 2);
    CHECK(h.engine.stats().misses[SHARD_MISS_EVICTED_LRU] == 0);

    // truncate restores; a length past the warm length is refused before anything moves
    CHECK_THROWS(h.engine.truncate("b", 0, 3, h.now), SHARD_ERRC_INVALID_ARGUMENT);
    CHECK(h.engine.resolve("b", 0, h.now).tier == HOT_KV_TIER_WARM);
    CHECK(h.engine.truncate("b", 0, 1, h.now).seq_len == 1);
    CHECK(h.engine.resolve("a", 0, h.now).tier == HOT_KV_TIER_WARM);

    // release and a newer epoch drop the warm copy; an older epoch is stale
    CHECK(h.engine.release("a", 0, h.now).changed);
    CHECK(h.is_miss(h.engine.resolve("a", 0, h.now), SHARD_MISS_RELEASED));
    CHECK(h.prefill("c", 0, {7}).status == SHARD_STATUS_OK);  // "b" spills
    CHECK(h.decode("b", 1, 1).status == SHARD_STATUS_CACHE_MISS);
    CHECK(h.decode("b", 0, 1).status == SHARD_STATUS_STALE_EPOCH);

    // TTL: idle past ttl_seconds spills, past warm_ttl_seconds drops
    h.now = 20;
    CHECK(h.engine.sweep(h.now) == 1);
    CHECK(h.engine.resolve("c", 0, h.now).tier == HOT_KV_TIER_WARM);
    h.now = 150;
    h.engine.sweep(h.now);
    CHECK(h.is_miss(h.engine.resolve("c", 0, h.now), SHARD_MISS_EVICTED_TTL));
    const hot_kv_stats st = h.engine.stats();
    CHECK(st.spills == st.restores + st.warm_drops + (uint64_t) st.warm_sessions);
    CHECK(st.warm_sessions == 0 && st.warm_bytes == 0);

    // a full tier: room for one 3-token session only (what one costs, measured on a roomy tier)
    hot_kv_config roomy = config(1, 32, 32, 0);
    roomy.warm_bytes = 1 << 20;
    harness m(path, roomy);
    m.prefill("x", 0, {1, 2, 3});
    m.prefill("y", 0, {1});
    hot_kv_config tight = roomy;
    tight.warm_bytes = (int64_t) m.engine.stats().warm_bytes + 100;
    harness t(path, tight);
    t.prefill("x", 0, {1, 2, 3});
    t.prefill("y", 0, {1, 2, 3});  // "x" warm
    t.prefill("z", 0, {1});        // "y" warm: "x" dropped for it
    CHECK(t.is_miss(t.engine.resolve("x", 0, t.now), SHARD_MISS_EVICTED_LRU));
    CHECK(t.engine.resolve("y", 0, t.now).tier == HOT_KV_TIER_WARM);
    CHECK(t.engine.stats().warm_drops == 1);

    // BUSY: two slots, budget 8; a (4) and b (3) hot, c (4) warm, all three decode in one step
    hot_kv_config busy = config(2, 16, 8, 0);
    busy.warm_bytes = 1 << 20;
    harness b(path, busy);
    b.prefill("c", 0, {1, 2, 3, 4});
    b.prefill("a", 0, {1, 2, 3, 4});
    b.prefill("b", 0, {1, 2, 3});  // budget: "c" spills
    const int32_t tok = 5;
    std::vector<float> outs(3 * 320);
    std::vector<hot_kv_request> reqs = {decode_request(b, "a", &tok, &outs[0]), decode_request(b, "b", &tok, &outs[320]),
                                        decode_request(b, "c", &tok, &outs[640])};
    std::vector<hot_kv_result> res;
    step_one(b, reqs, res);
    CHECK(res[0].status == SHARD_STATUS_OK && res[1].status == SHARD_STATUS_BUSY && res[2].status == SHARD_STATUS_BUSY);
    std::vector<hot_kv_request> next = {reqs[2], reqs[1]};  // the loop runs deferred requests first
    step_one(b, next, res);
    CHECK(res[0].status == SHARD_STATUS_OK && res[0].seq_len == 5 && res[1].status == SHARD_STATUS_BUSY);
    CHECK(b.engine.stats().restores == 1 && b.engine.stats().misses[SHARD_MISS_EVICTED_LRU] == 0);
    // a step that evicts its own later sessions after the others: the warm list stays in last-use
    // order (check_invariants in step_one), and the first request of a step is never BUSY
    hot_kv_config three = config(3, 16, 48, 0);
    three.warm_bytes = 1 << 20;
    harness o(path, three);
    o.now = 1;
    o.prefill("p", 0, {1});
    o.now = 2;
    o.prefill("q", 0, {1});
    o.now = 3;
    o.prefill("r", 0, {1});
    o.now = 4;
    std::vector<float> outs4(4 * 320);
    std::vector<int32_t> one = {2};
    auto prefill_request = [&](const std::string & sid, float * out) {
        hot_kv_request r;
        r.session_id = sid;
        r.kind = HOT_KV_STEP_PREFILL;
        r.input.tokens = one.data();
        r.input.n_tokens = 1;
        r.out = out;
        return r;
    };
    std::vector<hot_kv_request> mixed = {prefill_request("x", &outs4[0]), prefill_request("y", &outs4[320]),
                                         prefill_request("z", &outs4[640]), decode_request(o, "p", &tok, &outs4[960])};
    step_one(o, mixed, res);
    CHECK(res[0].status == SHARD_STATUS_OK && res[1].status == SHARD_STATUS_OK && res[2].status == SHARD_STATUS_OK);
    CHECK(res[3].status == SHARD_STATUS_BUSY);
    std::vector<hot_kv_request> retry = {mixed[3]};
    step_one(o, retry, res);
    CHECK(res[0].status == SHARD_STATUS_OK && res[0].seq_len == 2);

    // without a warm tier the same step answers BUDGET_EXCEEDED: the step's sessions stay hot
    harness nb(path, config(2, 16, 8, 0));
    nb.prefill("a", 0, {1, 2, 3, 4});
    nb.prefill("b", 0, {1, 2, 3});
    std::vector<hot_kv_request> two = {decode_request(nb, "a", &tok, &outs[0]), decode_request(nb, "b", &tok, &outs[320])};
    step_one(nb, two, res);
    CHECK(res[0].status == SHARD_STATUS_OK && res[1].status == SHARD_STATUS_BUDGET_EXCEEDED);
}

// the prefix store: a copy of a session's state that new sessions open from, bounded by its bytes
void prefix_store_lifecycle(const std::string & path) {
    hot_kv_config c = config(3, 32, 64, 0);
    c.prefix_bytes = 64 << 10;
    harness h(path, c);
    CHECK(h.prefill("src", 0, {1, 2, 3, 4}).status == SHARD_STATUS_OK);
    CHECK_THROWS(h.engine.store_prefix("src", 0, 7, 3, h.now), SHARD_ERRC_INVALID_ARGUMENT);  // it holds 4
    CHECK_THROWS(h.engine.store_prefix("src", 0, 7, 0, h.now), SHARD_ERRC_INVALID_ARGUMENT);
    hot_kv_result r = h.engine.store_prefix("src", 0, 7, 4, h.now);
    CHECK(r.status == SHARD_STATUS_OK && r.changed);
    CHECK(!h.engine.store_prefix("src", 0, 7, 4, h.now).changed);  // held already
    CHECK(h.engine.prefix_length(7) == 4 && h.engine.prefix_length(8) == 0);
    CHECK(h.prefill("src", 0, {5}).status == SHARD_STATUS_OK);
    std::vector<float> want(h.out.begin(), h.out.begin() + 320);

    // a key not held: a miss, and the session it named is not created
    CHECK(h.is_miss(h.engine.open_prefix("dst", 0, 8, 4, h.now), SHARD_MISS_PREFIX_EVICTED));
    CHECK(h.is_miss(h.engine.open_prefix("dst", 0, 7, 3, h.now), SHARD_MISS_PREFIX_EVICTED));  // another length
    CHECK(h.is_miss(h.engine.resolve("dst", 0, h.now), SHARD_MISS_UNKNOWN_SESSION));
    // a live session of 6 tokens is replaced by the copy, then continues as the source did
    CHECK(h.prefill("dst", 0, {9, 9, 9, 9, 9, 9}).status == SHARD_STATUS_OK);
    r = h.engine.open_prefix("dst", 0, 7, 4, h.now);
    h.engine.check_invariants();
    CHECK(r.status == SHARD_STATUS_OK && r.seq_len == 4);
    CHECK(h.prefill("dst", 0, {5}).status == SHARD_STATUS_OK);
    CHECK(std::memcmp(want.data(), h.out.data(), 320 * sizeof(float)) == 0);
    // the source released: the copy stays
    CHECK(h.engine.release("src", 0, h.now).changed);
    CHECK(h.engine.open_prefix("new", 0, 7, 4, h.now).status == SHARD_STATUS_OK);
    h.engine.check_invariants();
    hot_kv_stats st = h.engine.stats();
    CHECK(st.prefix_stores == 1 && st.prefix_hits == 2 && st.prefix_tokens_saved == 8 && st.prefix_entries == 1);
    CHECK(st.misses[SHARD_MISS_PREFIX_EVICTED] == 2);

    // the bound: storing more evicts the least valuable (the unused before the opened one)
    for (int32_t k = 0; k < 40; ++k) {
        h.now += 1;
        CHECK(h.prefill("s" + std::to_string(k % 2), 0, {k + 1, 2, 3}, 0).status == SHARD_STATUS_OK);
        h.engine.store_prefix("s" + std::to_string(k % 2), 0, 100 + (uint64_t) k, 3, h.now);
        h.engine.check_invariants();
        st = h.engine.stats();
        CHECK(st.prefix_bytes <= st.prefix_capacity);
    }
    CHECK(st.prefix_evictions > 0 && h.engine.prefix_length(139) == 3 && h.engine.prefix_length(100) == 0);
}

} // namespace

int main(int argc, char ** argv) {
    if (argc < 2) {
        std::fprintf(stderr, "usage: %s MODEL.gguf\n", argv[0]);
        return 2;
    }
    lifecycle(argv[1]);
    epochs(argv[1]);
    admission_and_eviction(argv[1]);
    bounded_and_invalid(argv[1]);
    warm_tier_lifecycle(argv[1]);
    prefix_store_lifecycle(argv[1]);
    return finish("test-hot-kv");
}
