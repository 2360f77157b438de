"""Continuous batching: a batched engine step answers every request on its own; batched and
one-at-a-time decoding agree; the native step loop coalesces concurrent callers of a plain
`KvBoundaryAdapter(model, manager)` into fewer engine steps than tokens generated (threads and
asyncio), chunks long prefills, and keeps a session's steps in order."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from llama_shard import (
    CacheMiss,
    HotKvStateConfig,
    HotKvStateManager,
    InvalidInputError,
    KvBoundaryAdapter,
    ManualClock,
    MissReason,
    ShardModel,
    Status,
    Step,
    TailOutput,
)
from llama_shard.reference import ReferenceModel, ReferenceShard

PROMPTS = [
    [5, 12, 3, 41],
    [200, 7, 7, 19, 88],
    [1, 2, 3],
    [310, 45, 99, 150, 6, 27],
    [17, 17, 4],
    [63, 8, 250, 1],
    [99],
    [12, 34, 56, 78, 90],
]


@pytest.fixture(params=["native", "reference"])
def manager(request, synthetic_model):
    if request.param == "native":
        shard = ShardModel(str(synthetic_model), None, 2)
    else:
        shard = ReferenceShard(ReferenceModel.from_gguf(synthetic_model))
    return HotKvStateManager(
        shard, HotKvStateConfig(max_sessions=8, context_tokens=64, budget_tokens=256), ManualClock(), n_batch=32
    )


def test_a_batched_step_answers_each_request_on_its_own(manager):
    ad = KvBoundaryAdapter(manager.model, manager)
    ad.prefill("live", 2, token_ids=[1, 2, 3])
    answers = manager.step_batch(
        [
            Step.prefill("fresh", 0, [4, 5, 6]),  # new session
            Step.decode("live", 2, [7], expected_seq_len=3),  # ok, expected length right
            Step.decode("ghost", 0, [1]),  # unknown: a miss
            Step.decode("live", 1, [1]),  # the same session again: runs after, stale
            Step.prefill("bad", 0, [10**6]),  # invalid token
            "not a step",
        ]
    )
    assert isinstance(answers[4], InvalidInputError) and isinstance(answers[5], InvalidInputError)
    statuses = [(r.status, r.miss) for r, _ in answers[:4]]
    assert statuses == [
        (Status.OK, MissReason.NONE),
        (Status.OK, MissReason.NONE),
        (Status.CACHE_MISS, MissReason.UNKNOWN_SESSION),
        (Status.STALE_EPOCH, MissReason.NONE),
    ]
    assert answers[0][1].shape == (320,) and answers[1][0].seq_len == 4
    assert answers[2][1] is None
    with pytest.raises(InvalidInputError):
        Step.decode("other", 0)  # no input
    with pytest.raises(InvalidInputError):
        Step.decode("other", 0, [1], expected_seq_len=-2)
    manager.check_invariants()
    # the batched results equal running the same steps one at a time
    solo = HotKvStateManager(manager.model, manager.config, ManualClock(), n_batch=32)
    sad = KvBoundaryAdapter(solo.model, solo)
    a = sad.prefill("fresh", 0, token_ids=[4, 5, 6])
    assert np.abs(a.logits - answers[0][1]).max() < 1e-3 and a.token_id == int(np.argmax(answers[0][1]))


def test_budget_counts_everything_admitted_in_the_step(manager):
    small = HotKvStateManager(
        manager.model, HotKvStateConfig(max_sessions=4, context_tokens=8, budget_tokens=10), ManualClock(), n_batch=32
    )
    answers = small.step_batch([Step.prefill("a", 0, [1] * 6), Step.prefill("b", 0, [2] * 6)])
    # a is admitted; b would need 12 > 10 and a takes part in the step, so it cannot be evicted
    assert [r.status for r, _ in answers] == [Status.OK, Status.BUDGET_EXCEEDED]
    assert small.reserved_tokens == 6 and small.session_keys() == [("a", 0)]
    small.check_invariants()


def test_a_prefill_longer_than_a_step_is_chunked_and_a_refused_one_changes_nothing(manager):
    """n_batch is 32: a 50-token prompt runs in two chunks and equals the one-piece result of a
    manager with a larger step; a prompt longer than context_tokens is refused before any chunk."""
    prompt = [int(t) for t in np.random.default_rng(5).integers(0, 320, 50)]
    ad = KvBoundaryAdapter(manager.model, manager)
    out = ad.prefill("long", 0, token_ids=prompt)
    assert out.seq_len == 50 and manager.loop_stats()["chunks"] == 2
    big = HotKvStateManager(manager.model, manager.config, ManualClock(), n_batch=64)
    one = KvBoundaryAdapter(big.model, big).prefill("long", 0, token_ids=prompt)
    assert one.token_id == out.token_id and np.abs(one.logits - out.logits).max() < 1e-3
    from llama_shard import KvBudgetExceededError

    with pytest.raises(KvBudgetExceededError):
        ad.prefill("long", 0, token_ids=prompt * 2)  # 100 > context_tokens 64
    assert manager.get("long", 0).seq_len == 50
    manager.check_invariants()


def _decode_all(adapter, n_steps, threads: bool):
    outs = {i: adapter.prefill(f"s{i}", 0, token_ids=p) for i, p in enumerate(PROMPTS)}
    tokens = {i: [o.token_id] for i, o in outs.items()}
    logits = {i: [o.logits] for i, o in outs.items()}

    # the threads start their decodes together (else, on a tiny model, each can finish before the
    # next one starts and there is nothing to batch)
    start = threading.Barrier(len(PROMPTS)) if threads else None

    def run(i):
        if start is not None:
            start.wait(60)
        for _ in range(n_steps - 1):
            o = adapter.decode(f"s{i}", 0, token_ids=[tokens[i][-1]])
            assert isinstance(o, TailOutput), o
            tokens[i].append(o.token_id)
            logits[i].append(o.logits)

    if threads:
        ts = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
        for t in ts:
            t.start()
        for t in ts:
            t.join(300)
    else:
        for i in range(len(PROMPTS)):
            run(i)
    return tokens, logits


def test_a_plain_adapter_batches_eight_threads(synthetic_model):
    """Batching by default: KvBoundaryAdapter(model, manager) with no other argument; the engine
    runs fewer steps (and llama_decode calls) than the tokens it generates, and the tokens equal
    one-at-a-time decoding."""
    model = ShardModel(str(synthetic_model), None, 2)
    cfg = HotKvStateConfig(max_sessions=8, context_tokens=64, budget_tokens=512)
    alone_mgr = HotKvStateManager(model, cfg, ManualClock(), n_batch=32)
    alone_tokens, _ = _decode_all(KvBoundaryAdapter(model, alone_mgr), 16, threads=False)

    mgr = HotKvStateManager(model, cfg, ManualClock(), n_batch=32)
    adapter = KvBoundaryAdapter(model, mgr)
    before, steps_before = mgr.n_decode_calls, mgr.loop_stats()["steps"]
    tokens, _ = _decode_all(adapter, 16, threads=True)
    decode_calls = mgr.n_decode_calls - before
    steps = mgr.loop_stats()["steps"] - steps_before
    generated = sum(len(t) for t in tokens.values())
    print(f"8 threads: {generated} tokens from {decode_calls} llama_decode calls in {steps} engine steps")
    assert tokens == alone_tokens
    assert decode_calls < generated and steps < generated
    mgr.check_invariants()


def test_asyncio_callers_are_batched_too(synthetic_model):
    model = ShardModel(str(synthetic_model), None, 2)
    mgr = HotKvStateManager(
        model, HotKvStateConfig(max_sessions=8, context_tokens=64, budget_tokens=512), ManualClock(), n_batch=32
    )
    adapter = KvBoundaryAdapter(model, mgr)

    async def session(i):
        out = await adapter.prefill_async(f"a{i}", 0, token_ids=PROMPTS[i])
        toks = [out.token_id]
        for _ in range(7):
            out = await adapter.decode_async(f"a{i}", 0, token_ids=[toks[-1]])
            toks.append(out.token_id)
        return toks

    async def main():
        return await asyncio.gather(*(session(i) for i in range(4)))

    threads_before = threading.active_count()
    got = asyncio.run(main())
    ref = ReferenceModel.from_gguf(synthetic_model)
    assert got == [ref.greedy(PROMPTS[i], 8) for i in range(4)]
    st = mgr.loop_stats()
    print(f"4 asyncio callers: {st['requests']} requests in {st['steps']} engine steps")
    # shared steps, not one per request; how many share depends on how fast the event loop wakes
    # its callers against the step loop's gather wait (on a loaded sanitizer build, 2 of 4 at a time)
    assert st["steps"] < st["requests"], st
    assert threading.active_count() == threads_before  # no Python thread per request (nor at all)


def test_chunked_prefill_matches_one_piece(synthetic_model):
    model = ShardModel(str(synthetic_model), (0, 2), 2)
    cfg = HotKvStateConfig(max_sessions=4, context_tokens=128, budget_tokens=256)
    plain = KvBoundaryAdapter(model, m1 := HotKvStateManager(model, cfg, ManualClock(), n_batch=64))
    mgr = HotKvStateManager(model, cfg, ManualClock(), n_batch=8)
    chunked = KvBoundaryAdapter(model, mgr)
    prompt = list(np.random.default_rng(3).integers(0, 320, 29))
    a = plain.prefill("p", 0, token_ids=prompt)
    b = chunked.prefill("p", 0, token_ids=prompt)
    assert mgr.loop_stats()["chunks"] == 4
    assert b.hidden.shape == a.hidden.shape == (29, 64) and b.start_pos == 0
    assert np.abs(a.hidden - b.hidden).max() < 1e-3
    assert m1.get("p", 0).seq_len == mgr.get("p", 0).seq_len == 29


def test_a_release_racing_a_queued_step_is_a_released_miss(synthetic_model):
    """Cancellation: a session's steps queued behind its own long prefill (500 chunks), then the
    session released: the rest of the prefill and the queued steps answer RELEASED (never computed
    into a freed sequence), and every seq id returns to the pool."""
    model = ShardModel(str(synthetic_model), None, 2)
    mgr = HotKvStateManager(
        model,
        HotKvStateConfig(max_sessions=4, context_tokens=4096, budget_tokens=8192),
        ManualClock(),
        n_batch=8,
        prefill_chunk=8,
    )
    ad = KvBoundaryAdapter(model, mgr)
    ad.prefill("victim", 0, token_ids=[1, 2, 3])
    long_prompt = [int(t) for t in np.random.default_rng(1).integers(0, 320, 4000)]
    # continuing at 3 (a prefill from 0 or from the end would open the session again if the release
    # came before its first chunk)
    tickets = mgr.submit([Step.prefill("victim", 0, long_prompt, start_pos=3)])  # 500 chunks of 8
    tickets += mgr.submit([Step.decode("victim", 0, [4]), Step.decode("victim", 0, [5])])
    assert mgr.release("victim", 0)
    for t in tickets:
        t.wait()
    assert [(t.result.status, t.result.miss) for t in tickets] == [(Status.CACHE_MISS, MissReason.RELEASED)] * 3
    assert mgr.session_count == 0 and mgr.reserved_tokens == 0
    mgr.check_invariants()


def test_closing_completes_what_was_queued_then_refuses(synthetic_model):
    model = ShardModel(str(synthetic_model), None, 2)
    mgr = HotKvStateManager(
        model, HotKvStateConfig(max_sessions=4, context_tokens=128, budget_tokens=512), ManualClock(), n_batch=8
    )
    tickets = mgr.submit([Step.prefill(f"c{i}", 0, PROMPTS[i] * 4) for i in range(4)])
    mgr.close()
    assert all(t.done() and t.result.status == Status.OK for t in tickets)
    from llama_shard import CapacityError

    with pytest.raises(CapacityError):
        mgr.submit([Step.prefill("late", 0, [1])])


@pytest.mark.model
def test_smollm2_batched_and_one_at_a_time_agree(embedded_model):
    """8 sessions x 32 steps on SmolLM2: identical greedy tokens; logits within 1e-3 (batch shape may
    change float summation order)."""
    model = ShardModel(str(embedded_model), None, 2)
    cfg = HotKvStateConfig(max_sessions=8, context_tokens=128, budget_tokens=1024)
    texts = [
        "The capital of France is",
        "Once upon a time",
        "def add(a, b):",
        "The three primary colors are",
        "Water boils at",
        "My favourite book is",
        "import numpy as np",
        "The quick brown fox",
    ]
    prompts = [model.tokenize(t) for t in texts]

    solo_mgr = HotKvStateManager(model, cfg, ManualClock(), n_batch=64)
    solo = KvBoundaryAdapter(model, solo_mgr)
    ref_tokens, ref_logits = {}, {}
    for i, p in enumerate(prompts):
        o = solo.prefill(f"s{i}", 0, token_ids=p)
        ref_tokens[i], ref_logits[i] = [o.token_id], [o.logits]
        for _ in range(31):
            o = solo.decode(f"s{i}", 0, token_ids=[ref_tokens[i][-1]])
            ref_tokens[i].append(o.token_id)
            ref_logits[i].append(o.logits)

    mgr = HotKvStateManager(model, cfg, ManualClock(), n_batch=64)
    answers = mgr.step_batch([Step.prefill(f"s{i}", 0, p) for i, p in enumerate(prompts)])
    tokens = {i: [int(np.argmax(out))] for i, (_, out) in enumerate(answers)}
    logits = {i: [out] for i, (_, out) in enumerate(answers)}
    calls_before = mgr.n_decode_calls
    for _ in range(31):
        answers = mgr.step_batch([Step.decode(f"s{i}", 0, [tokens[i][-1]]) for i in range(8)])
        for i, (r, out) in enumerate(answers):
            assert r.status == Status.OK
            tokens[i].append(int(np.argmax(out)))
            logits[i].append(out)
    assert mgr.n_decode_calls - calls_before == 31  # one llama_decode per step for all 8 sessions
    assert tokens == ref_tokens
    worst = max(float(np.abs(a - b).max()) for i in range(8) for a, b in zip(logits[i], ref_logits[i]))
    print(f"max |batched - one at a time| logit difference: {worst:.2e}")
    assert worst < 1e-3


def test_a_micro_batch_runs_as_one_step(synthetic_model, manager):
    """step_many: a client's micro-batch shares engine steps, each step answered on its own,
    prefills chunked while others wait, a repeated session refused."""
    small = HotKvStateManager(manager.model, manager.config, ManualClock(), n_batch=32, prefill_chunk=4)
    adapter = KvBoundaryAdapter(small.model, small)
    batch = [Step.prefill(f"m{i}", 0, PROMPTS[i]) for i in range(4)] + [
        Step.decode("m-unknown", 0, [1]),
        Step.prefill("m0", 0, [1]),
        "not a step",
    ]
    queued = []
    outs = adapter.step_many(batch, queued.extend)
    assert queued == batch[:5]  # told which were queued: not the repeated session's, not the non-step
    assert all(isinstance(o, TailOutput) for o in outs[:4])
    assert isinstance(outs[4], CacheMiss)
    assert isinstance(outs[5], InvalidInputError) and "more than one step" in str(outs[5])
    assert isinstance(outs[6], InvalidInputError)
    # chunks of 4: the first step has every first chunk and the miss, the second the rest of the
    # 5- and 6-token prompts
    st = small.loop_stats()
    assert (st["steps"], st["chunks"], st["requests"]) == (2, 7, 5), st
    ref = ReferenceModel.from_gguf(synthetic_model)
    tokens = {i: [o.token_id] for i, o in enumerate(outs[:4])}
    for _ in range(3):
        outs = adapter.step_many([Step.decode(f"m{i}", 0, [tokens[i][-1]]) for i in range(4)])
        for i, o in enumerate(outs):
            tokens[i].append(o.token_id)
    assert small.loop_stats()["steps"] == 5
    assert [tokens[i] for i in range(4)] == [ref.greedy(PROMPTS[i], 4) for i in range(4)]
    small.check_invariants()


_COUNT_THREADS = """
import os, sys
from llama_shard import HotKvStateConfig, HotKvStateManager, ManualClock, ShardModel, Step
threads = int(sys.argv[2])
model = ShardModel(sys.argv[1], None, threads)
manager = HotKvStateManager(model, HotKvStateConfig(max_sessions=2, context_tokens=64, budget_tokens=128),
                            ManualClock(), n_batch=32, n_threads=threads)
for step in ([Step.prefill("s", 0, [5, 12, 3], start_pos=0)], [Step.decode("s", 0, [7])]):
    manager.step_batch(step)
print(len(os.listdir("/proc/self/task")))
"""


def test_a_context_keeps_its_compute_threads_between_steps(synthetic_model):
    """ggml joins the threads of a graph's pool after it unless the context has a pool of its own;
    a context with 2 compute threads keeps its second one alive between steps (one thread more
    than a 1-thread context's process, every other thread alike), so no step starts a thread."""
    import subprocess
    import sys

    counts = {}
    for threads in (1, 2):
        out = subprocess.run(
            [sys.executable, "-c", _COUNT_THREADS, str(synthetic_model), str(threads)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        counts[threads] = int(out.stdout.strip().splitlines()[-1])
    assert counts[2] - counts[1] == 1, counts
