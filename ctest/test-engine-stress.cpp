// Many threads on one Hot KV engine, no Python: open, prefill, decode, batched steps, truncate,
// release, resolve, sweep and stats with random keys and epochs, on a small budget with a warm
// tier, so eviction, spills and restores race with everything else. Every call must return a
// status (the one throw allowed: truncating past what a session holds, a caller mistake that
// another thread's step can cause here); at the end the engine's invariants hold, and once
// every session is released nothing is reserved, every seq id is free and the tier counters add up.
// Run under ThreadSanitizer by scripts that build with -fsanitize=thread.

#include "llama_shard/hot_kv_engine.h"
#include "test-common.h"

#include <atomic>
#include <chrono>
#include <random>
#include <string>
#include <thread>
#include <vector>

using namespace llama_shard;

namespace {

constexpr int N_THREADS = 6;
constexpr int N_OPS     = 400;   // per thread
constexpr int N_KEYS    = 24;    // more sessions than hot slots: eviction and the warm tier race
std::atomic<int> g_unexpected{0};

double clock_now() {
    using namespace std::chrono;
    return duration<double>(steady_clock::now().time_since_epoch()).count();
}

void worker(hot_kv_engine & engine, int seed) {
    std::mt19937 rng((uint32_t) seed);
    std::vector<float> out((size_t) engine.output_size(8) * 4);
    auto pick = [&](int n) { return (int) (rng() % (uint32_t) n); };
    for (int i = 0; i < N_OPS; ++i) {
        const std::string sid = "s" + std::to_string(pick(N_KEYS));
        const int64_t epoch = pick(3);
        int32_t toks[8];
        for (int32_t & t : toks) {
            t = 1 + pick(300);
        }
        shard_input in;
        in.tokens = toks;
        in.n_tokens = 1 + pick(8);
        if (i % 100 == 99) {  // now and then a pause longer than the TTL
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
        const double now = clock_now();
        try {
            switch (pick(9)) {
                case 0: engine.open(sid, epoch, now); break;
                case 1: engine.prefill(sid, epoch, pick(2) ? -1 : 0, in, out.data(), now); break;
                case 2: in.n_tokens = 1; engine.decode(sid, epoch, -1, in, out.data(), now); break;
                case 3: {  // a batched step of distinct sessions
                    std::vector<hot_kv_request> reqs;
                    for (int k = 0; k < 3; ++k) {
                        hot_kv_request r;
                        r.session_id = "s" + std::to_string((pick(N_KEYS) + k * 7) % N_KEYS);
                        bool dup = false;
                        for (const auto & q : reqs) {
                            dup = dup || q.session_id == r.session_id;
                        }
                        if (dup) {
                            continue;
                        }
                        r.epoch = epoch;
                        r.kind = pick(2) ? HOT_KV_STEP_PREFILL : HOT_KV_STEP_DECODE;
                        r.input = in;
                        r.input.n_tokens = 1;
                        r.out = out.data() + (size_t) k * (size_t) engine.output_size(8);
                        reqs.push_back(r);
                    }
                    engine.step(reqs, now);
                    break;
                }
                case 4:
                    try {  // longer than the session holds is a caller mistake, which another thread's step can make it
                        engine.truncate(sid, epoch, pick(4), now);
                    } catch (const shard_error & e) {
                        if (e.code != SHARD_ERRC_INVALID_ARGUMENT) {
                            throw;
                        }
                    }
                    break;
                case 5: engine.release(sid, epoch, now); break;
                case 6: engine.resolve(sid, epoch, now); break;
                case 7: engine.sweep(now); break;
                default: (void) engine.stats(); (void) engine.sessions(); break;
            }
        } catch (const std::exception & e) {
            std::fprintf(stderr, "unexpected exception: %s\n", e.what());
            ++g_unexpected;
        }
    }
}

}  // namespace

int main(int argc, char ** argv) {
    if (argc < 2) {
        std::fprintf(stderr, "usage: %s MODEL.gguf\n", argv[0]);
        return 2;
    }
    shard_model_params mp;
    mp.path = argv[1];
    mp.n_threads = 1;
    const shard_model model(mp);
    hot_kv_config cfg;
    cfg.max_sessions = 6;
    cfg.context_tokens = 64;
    cfg.budget_tokens = 160;
    cfg.ttl_seconds = 0.005;  // short: TTL evictions race too
    cfg.warm_bytes = 4 << 20;
    cfg.n_batch = 32;
    cfg.recent_capacity = 64;
    hot_kv_engine engine(model, cfg);

    std::vector<std::thread> threads;
    for (int t = 0; t < N_THREADS; ++t) {
        threads.emplace_back(worker, std::ref(engine), 1000 + t);
    }
    for (auto & t : threads) {
        t.join();
    }
    CHECK(g_unexpected.load() == 0);
    engine.check_invariants();

    for (const hot_kv_session_info & s : engine.sessions()) {  // release everything left
        CHECK(engine.release(s.session_id, s.epoch, clock_now()).changed);
    }
    engine.check_invariants();
    const hot_kv_stats st = engine.stats();
    CHECK(st.live_sessions == 0);
    CHECK(st.reserved_tokens == 0);
    CHECK(st.warm_sessions == 0 && st.warm_bytes == 0);
    CHECK(st.spills + st.disk_loaded == st.restores + st.warm_drops + (uint64_t) st.warm_sessions +
                                            (uint64_t) st.disk_sessions);
    std::printf("%d threads x %d operations: %llu steps, %llu spills, %llu restores, %llu LRU and %llu TTL evictions\n",
                N_THREADS, N_OPS, (unsigned long long) st.steps, (unsigned long long) st.spills,
                (unsigned long long) st.restores, (unsigned long long) st.evictions_lru,
                (unsigned long long) st.evictions_ttl);
    return finish("test-engine-stress");
}
