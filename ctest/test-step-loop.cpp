// The native step loop without Python: concurrent submitters share engine steps (fewer steps than
// requests, the same tokens as one at a time), a long prefill is chunked and equals one piece, a
// session's requests keep their order, a prefill that cannot fit is refused before any chunk, and
// close() completes what is pending, then refuses; oversubscribed with a warm tier, sessions take
// turns (BUSY requests go first in the next step) and none misses.

#include "llama_shard/step_loop.h"
#include "test-common.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <thread>
#include <vector>

using namespace llama_shard;

namespace {

std::shared_ptr<step_ticket> ticket(const std::string & sid, hot_kv_step_kind kind, std::vector<int32_t> tokens,
                                    int32_t position = -1) {
    auto t = std::make_shared<step_ticket>();
    t->session_id = sid;
    t->kind       = kind;
    t->position   = position;
    t->n_tokens   = (int64_t) tokens.size();
    t->tokens     = std::move(tokens);
    return t;
}

int32_t argmax(const std::vector<float> & v) {
    return (int32_t) (std::max_element(v.begin(), v.end()) - v.begin());
}

hot_kv_config config(int32_t n_batch) {
    hot_kv_config c;
    c.max_sessions   = 8;
    c.context_tokens = 128;
    c.budget_tokens  = 1024;
    c.n_batch        = n_batch;
    return c;
}

// greedy tokens of `steps` decodes after `prompt`, one request at a time
std::vector<int32_t> greedy_alone(const shard_model & model, const std::vector<int32_t> & prompt, int steps) {
    hot_kv_engine engine(model, config(64));
    step_loop loop(engine, {});
    auto t = ticket("alone", HOT_KV_STEP_PREFILL, prompt);
    loop.submit(t);
    t->wait();
    std::vector<int32_t> out{argmax(t->out)};
    for (int i = 0; i < steps; ++i) {
        auto d = ticket("alone", HOT_KV_STEP_DECODE, {out.back()});
        loop.submit(d);
        d->wait();
        out.push_back(argmax(d->out));
    }
    return out;
}


// 100 tokens: seven chunks of 16
std::vector<int32_t> long_prompt() {
    std::vector<int32_t> prompt;
    for (int i = 0; i < 100; ++i) {
        prompt.push_back((i * 37 + 11) % 300);
    }
    return prompt;
}

// eight submitting threads share engine steps, and get the tokens they get alone
void test_threads_share_engine_steps(const shard_model & model) {
    const int n_threads = 8, steps = 12;
    std::vector<std::vector<int32_t>> prompts;
    for (int i = 0; i < n_threads; ++i) {
        prompts.push_back({(int32_t) (5 + 17 * i) % 300, 7, (int32_t) (11 * i) % 300, 3});
    }
    hot_kv_engine engine(model, config(64));
    step_loop loop(engine, {});
    std::vector<std::vector<int32_t>> got(n_threads);
    std::vector<std::thread> threads;
    for (int i = 0; i < n_threads; ++i) {
        threads.emplace_back([&, i] {
            const std::string sid = "s" + std::to_string(i);
            auto t = ticket(sid, HOT_KV_STEP_PREFILL, prompts[i]);
            loop.submit(t);
            CHECK(t->wait().status == SHARD_STATUS_OK);
            got[i].push_back(argmax(t->out));
            for (int k = 0; k < steps; ++k) {
                auto d = ticket(sid, HOT_KV_STEP_DECODE, {got[i].back()}, (int32_t) (prompts[i].size() + k));
                loop.submit(d);
                CHECK(d->wait().status == SHARD_STATUS_OK);
                got[i].push_back(argmax(d->out));
            }
        });
    }
    for (auto & th : threads) {
        th.join();
    }
    const step_loop_stats st = loop.stats();
    std::printf("8 threads: %llu requests in %llu engine steps\n", (unsigned long long) st.requests,
                (unsigned long long) st.steps);
    CHECK(st.requests == (uint64_t) n_threads * (steps + 1));
    CHECK(st.steps < st.requests / 2);
    for (int i = 0; i < n_threads; ++i) {
        CHECK(got[i] == greedy_alone(model, prompts[i], steps));
    }
    engine.check_invariants();
}

// oversubscribed with a warm tier: BUSY requests go first in the next step, none misses
void test_oversubscribed_sessions_take_turns(const shard_model & model) {
    const int n_threads = 4, steps = 8;
    hot_kv_config c = config(64);
    c.max_sessions = 2;
    c.budget_tokens = 24;  // two sessions of up to 12 tokens at once
    c.warm_bytes = 1 << 20;
    hot_kv_engine engine(model, c);
    step_loop loop(engine, {});
    // all four prompts first (two of them go warm), then the four decode concurrently: the warm
    // ones must come back, whatever order the threads run in
    std::vector<std::vector<int32_t>> got(n_threads);
    std::vector<std::shared_ptr<step_ticket>> prefills;
    for (int i = 0; i < n_threads; ++i) {
        prefills.push_back(ticket("o" + std::to_string(i), HOT_KV_STEP_PREFILL, {(int32_t) (9 + 13 * i) % 300, 4}));
    }
    loop.submit_many(prefills);
    for (int i = 0; i < n_threads; ++i) {
        CHECK(prefills[i]->wait().status == SHARD_STATUS_OK);
        got[i].push_back(argmax(prefills[i]->out));
    }
    std::vector<std::thread> threads;
    for (int i = 0; i < n_threads; ++i) {
        threads.emplace_back([&, i] {
            const std::string sid = "o" + std::to_string(i);
            for (int k = 0; k < steps; ++k) {
                auto d = ticket(sid, HOT_KV_STEP_DECODE, {got[i].back()}, (int32_t) (2 + k));
                loop.submit(d);
                CHECK(d->wait().status == SHARD_STATUS_OK);
                got[i].push_back(argmax(d->out));
            }
        });
    }
    for (auto & th : threads) {
        th.join();
    }
    const hot_kv_stats st = engine.stats();
    std::printf("4 sessions over 2 slots: %llu spills, %llu restores, %llu misses\n", (unsigned long long) st.spills,
                (unsigned long long) st.restores, (unsigned long long) st.misses[SHARD_MISS_EVICTED_LRU]);
    CHECK(st.restores > 0 && st.misses[SHARD_MISS_EVICTED_LRU] == 0);
    for (int i = 0; i < n_threads; ++i) {
        CHECK(got[i] == greedy_alone(model, {(int32_t) (9 + 13 * i) % 300, 4}, steps));
    }
    engine.check_invariants();
}

// a long prefill is chunked, and equals one piece
void test_a_long_prefill_is_chunked(const shard_model & model) {
    const std::vector<int32_t> prompt = long_prompt();
    hot_kv_engine small(model, config(16));
    step_loop loop(small, {});
    auto t = ticket("long", HOT_KV_STEP_PREFILL, prompt);
    loop.submit(t);
    CHECK(t->wait().status == SHARD_STATUS_OK && t->result().seq_len == 100);
    CHECK(loop.stats().chunks == 7);  // 100 tokens in steps of 16
    hot_kv_engine big(model, config(128));
    step_loop one(big, {});
    auto u = ticket("long", HOT_KV_STEP_PREFILL, prompt);
    one.submit(u);
    u->wait();
    // chunks change the summation order of attention and of the matmuls: close, not bit-equal
    // (2e-3 of the largest logit measured here); a chunk at a wrong position would be far off
    float gap = 0, scale = 0;
    for (size_t i = 0; i < t->out.size(); ++i) {
        gap   = std::max(gap, std::fabs(t->out[i] - u->out[i]));
        scale = std::max(scale, std::fabs(u->out[i]));
    }
    std::printf("chunked vs one piece: max |logit gap| %.2e of max |logit| %.2e\n", gap, scale);
    CHECK(gap <= 1e-2f * std::max(scale, 1.0f));
    CHECK(argmax(t->out) == argmax(u->out));
    small.check_invariants();
}

// a session's requests run in order, and a decode is not pushed out of the step by a long prompt
void test_order_and_decodes_beside_long_prompts(const shard_model & model) {
    hot_kv_engine small(model, config(16));
    step_loop loop(small, {});
    // a decode queued behind its own prefill follows it
    auto p = ticket("order", HOT_KV_STEP_PREFILL, long_prompt());
    auto d = ticket("order", HOT_KV_STEP_DECODE, {1}, 100);
    loop.submit_many({p, d});
    CHECK(d->wait().status == SHARD_STATUS_OK && d->result().seq_len == 101);
    // a long prompt queued before a decode: the decode runs in the first step, beside the first chunk
    std::vector<int32_t> long_prompt(120, 7);
    auto a = ticket("prompt", HOT_KV_STEP_PREFILL, long_prompt);
    auto b = ticket("order", HOT_KV_STEP_DECODE, {2}, 101);
    loop.submit_many({a, b});
    CHECK(b->wait().status == SHARD_STATUS_OK);
    CHECK(!a->done());  // 15 chunks of 8
    CHECK(a->wait().status == SHARD_STATUS_OK);
    small.check_invariants();
}

// what cannot run is refused before anything runs: a prompt too long for a session (nothing
// changes), a malformed ticket (nothing queued)
void test_refusals_change_nothing(const shard_model & model) {
    hot_kv_engine small(model, config(16));
    step_loop loop(small, {});
    auto t = ticket("long", HOT_KV_STEP_PREFILL, long_prompt());
    loop.submit(t);
    CHECK(t->wait().status == SHARD_STATUS_OK);
    std::vector<int32_t> huge(200, 1);
    auto h = ticket("long", HOT_KV_STEP_PREFILL, huge, 0);
    loop.submit(h);
    CHECK(h->wait().status == SHARD_STATUS_BUDGET_EXCEEDED);
    CHECK(small.resolve("long", 0, 0.0).seq_len == 100);
    auto bad = ticket("bad", HOT_KV_STEP_DECODE, {});
    CHECK_THROWS(loop.submit(bad), SHARD_ERRC_INVALID_ARGUMENT);
    auto wide = ticket("bad", HOT_KV_STEP_DECODE, std::vector<int32_t>(17, 1));
    CHECK_THROWS(loop.submit(wide), SHARD_ERRC_INVALID_ARGUMENT);
    CHECK(loop.stats().pending == 0);  // the malformed ones never queued
    small.check_invariants();
}

// close(): what was queued completes, later submissions are refused
void test_close_completes_then_refuses(const shard_model & model) {
    hot_kv_engine small(model, config(16));
    step_loop loop(small, {});
    std::vector<std::shared_ptr<step_ticket>> queued;
    for (int i = 0; i < 4; ++i) {
        queued.push_back(ticket("c" + std::to_string(i), HOT_KV_STEP_PREFILL, long_prompt()));
    }
    loop.submit_many(queued);
    loop.close();
    for (auto & q : queued) {
        CHECK(q->done() && q->result().status == SHARD_STATUS_OK);
    }
    CHECK_THROWS(loop.submit(ticket("late", HOT_KV_STEP_PREFILL, {1})), SHARD_ERRC_CAPACITY);
    small.check_invariants();
}

} // namespace

int main(int argc, char ** argv) {
    if (argc < 2) {
        std::fprintf(stderr, "usage: %s llama-6L.gguf\n", argv[0]);
        return 2;
    }
    shard_model_params mp;
    mp.path      = argv[1];
    mp.n_threads = 2;
    const shard_model model(mp);
    test_threads_share_engine_steps(model);
    test_oversubscribed_sessions_take_turns(model);
    test_a_long_prefill_is_chunked(model);
    test_order_and_decodes_beside_long_prompts(model);
    test_refusals_change_nothing(model);
    test_close_completes_then_refuses(model);
    return finish("test-step-loop");
}
