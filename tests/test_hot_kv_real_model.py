"""SmolLM2 split in two shards, each with its own Hot KV manager: 8 sessions decoding concurrently
from 8 threads produce exactly the tokens each produces alone; releasing one session from another
thread mid-decode leaves the others' tokens unchanged and returns its reservation."""

from __future__ import annotations

import threading
import time

import pytest

from llama_shard import (
    CacheMiss,
    CacheMissReason,
    HotKvStateConfig,
    HotKvStateManager,
    KvBoundaryAdapter,
    ShardModel,
    Step,
    TailOutput,
)

pytestmark = pytest.mark.model

N_SESSIONS, N_STEPS = 8, 12
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def add(a, b):",
    "The three primary colors are",
    "Water boils at",
    "My favourite book is",
    "import numpy as np\n",
    "The quick brown fox",
]


class Route:
    """Head (0-14) and tail (15-29) shards, each with its own manager, driven like a mesh would."""

    def __init__(self, path):
        config = HotKvStateConfig(max_sessions=N_SESSIONS, context_tokens=256, budget_tokens=2048, ttl_seconds=600)
        self.head = ShardModel(str(path), (0, 14), 1)
        self.tail = ShardModel(str(path), (15, 29), 1)
        self.head_mgr = HotKvStateManager(self.head, config, n_batch=64)
        self.tail_mgr = HotKvStateManager(self.tail, config, n_batch=64)
        self.head_ad = KvBoundaryAdapter(self.head, self.head_mgr)
        self.tail_ad = KvBoundaryAdapter(self.tail, self.tail_mgr)

    def generate(self, sid, prompt, n_steps, on_step=None):
        ids = self.head.tokenize(prompt)
        out = self.tail_ad.prefill(sid, 0, boundary=self.head_ad.prefill(sid, 0, token_ids=ids))
        tokens = []
        for step in range(n_steps):
            if not isinstance(out, TailOutput):
                return tokens, out
            tokens.append(out.token_id)
            if on_step:
                on_step(step)
            bundle = self.head_ad.decode(sid, 0, token_ids=[out.token_id], expected_seq_len=len(ids) + step)
            if isinstance(bundle, CacheMiss):
                return tokens, bundle
            out = self.tail_ad.decode(sid, 0, boundary=bundle, expected_seq_len=len(ids) + step)
        return tokens, None

    def check(self):
        self.head_mgr.check_invariants()
        self.tail_mgr.check_invariants()


@pytest.fixture(scope="module")
def alone(embedded_model):
    """Each prompt's tokens generated alone, one session at a time, on a fresh route."""
    route = Route(embedded_model)
    out = {}
    for i, p in enumerate(PROMPTS):
        out[i], _ = route.generate(f"alone-{i}", p, N_STEPS)
        route.head_mgr.release(f"alone-{i}", 0)
        route.tail_mgr.release(f"alone-{i}", 0)
    return out


def run_threads(route, fn):
    errors, threads = [], []

    def wrap(i):
        try:
            fn(i)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    for i in range(N_SESSIONS):
        threads.append(threading.Thread(target=wrap, args=(i,)))
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return errors, time.perf_counter() - t0


@pytest.mark.real_model_threads
def test_eight_threads_get_the_tokens_they_get_alone(embedded_model, alone):
    route = Route(embedded_model)
    results = {}
    barrier = threading.Barrier(N_SESSIONS)

    def one(i):
        barrier.wait()
        results[i], miss = route.generate(f"sess-{i}", PROMPTS[i], N_STEPS)
        assert miss is None

    steps_before = route.head_mgr.loop_stats()
    errors, elapsed = run_threads(route, one)
    assert not errors, errors
    loop = route.head_mgr.loop_stats()
    steps, requests = loop["steps"] - steps_before["steps"], loop["requests"] - steps_before["requests"]
    print(
        f"8 threads x {N_STEPS} steps through 2 shards: {elapsed:.2f}s; head: {requests} requests in {steps} engine steps"
    )
    assert results == alone
    # plain KvBoundaryAdapter(model, manager): the threads' steps share engine steps by default
    assert steps < requests / 2, (steps, requests)
    assert len({tuple(v) for v in results.values()}) == N_SESSIONS
    route.check()
    lengths = {sid: n for sid, _, _, n, *_ in route.head_mgr.engine.sessions()}
    for i in range(N_SESSIONS):  # positions never leak between sessions
        assert lengths[f"sess-{i}"] == len(route.head.tokenize(PROMPTS[i])) + N_STEPS


@pytest.mark.real_model_threads
def test_release_from_another_thread_mid_decode(embedded_model, alone):
    route = Route(embedded_model)
    victim = 3
    results, misses = {}, {}
    reached, released = threading.Event(), threading.Event()

    def one(i):
        def on_step(step):
            if i == victim and step == 4:
                reached.set()
                released.wait(60)  # the victim is mid-decode while another thread releases it

        results[i], misses[i] = route.generate(f"sess-{i}", PROMPTS[i], N_STEPS, on_step)

    def releaser():
        reached.wait(120)
        assert route.head_mgr.release(f"sess-{victim}", 0)
        assert route.tail_mgr.release(f"sess-{victim}", 0)
        assert ("sess-%d" % victim, 0) not in route.head_mgr.session_keys()
        released.set()

    rel = threading.Thread(target=releaser)
    rel.start()
    errors, _ = run_threads(route, one)
    rel.join(120)
    assert not errors, errors
    assert isinstance(misses[victim], CacheMiss) and misses[victim].reason is CacheMissReason.RELEASED
    assert results[victim] == alone[victim][: len(results[victim])]
    for i in range(N_SESSIONS):
        if i != victim:
            assert misses[i] is None and results[i] == alone[i]
    route.check()
    assert f"sess-{victim}" not in [k for k, _ in route.head_mgr.session_keys()]
    # the victim's reservation went back: what is reserved is exactly what the survivors hold
    reserved = sum(n for _, _, _, n, *_ in route.head_mgr.engine.sessions())
    assert route.head_mgr.reserved_tokens == reserved
    assert route.head_mgr.stats()["releases"] == 1


@pytest.mark.slow
def test_stats_and_other_threads_run_while_a_long_step_computes(embedded_model):
    """A 2,048-token prefill is one engine step of seconds here. Meanwhile stats() (what a metrics
    scrape and Info read) answers from its snapshot at once, and other Python threads keep running
    (the step holds no GIL)."""
    model = ShardModel(str(embedded_model), None, 2)
    manager = HotKvStateManager(model, HotKvStateConfig(max_sessions=1, context_tokens=2048), n_batch=2048)
    (ticket,) = manager.submit([Step.prefill("long", 0, [1] * 2048)])
    time.sleep(0.3)  # the step has started
    ticks = []
    ticker = threading.Thread(target=lambda: [ticks.append(time.perf_counter()) or time.sleep(0.01) for _ in range(20)])
    ticker.start()
    t0 = time.perf_counter()
    st = manager.stats()
    waited = time.perf_counter() - t0
    ticker.join()
    assert not ticket.done(), "the step ended too soon to show anything; use a longer prompt"
    assert waited < 0.5, waited  # not the step's seconds (a loaded machine schedules the call late, not 1 s late)
    assert st["live_sessions"] <= 1 and len(ticks) == 20
    ticket.wait()
    assert ticket.result.seq_len == 2048 and manager.stats()["tokens_computed"] == 2048
