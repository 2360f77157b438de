"""Gemma 3 shards: sliding-window and global layers in one split, through the Hot KV engine.

The synthetic Gemma 3 has a 4-token window, so every test prompt reaches past it. A shard's
context keeps every cell of its sliding-window layers (llama.cpp's swa_full), so a truncation to
any held position, inside or beyond the window, continues exactly as a fresh run of the same tokens.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import pytest

from llama_shard import (
    CacheMiss,
    CacheMissReason,
    HotKvStateConfig,
    ShardModel,
    Tier,
)

from support.engine_route import PROMPT
from support.engine_route import Route as EngineRoute


class Route(EngineRoute):
    """A 2-shard split of the synthetic Gemma 3 (layers 0-4: sliding only; 5-7: the global layer 5)."""

    def __init__(self, path, config: HotKvStateConfig | None = None, configs: list | None = None):
        super().__init__(path, [(0, 4), (5, 7)], config, configs)


@pytest.fixture
def route(synthetic_gemma3):
    r = Route(synthetic_gemma3)
    yield r
    r.close()


def test_a_gemma3_split_gives_the_whole_models_tokens_and_logits(synthetic_gemma3, route):
    from llama_shard.engine.pipeline import LocalPipeline

    whole = LocalPipeline(synthetic_gemma3, None, n_ctx=128, n_seq_max=1, n_batch=32, n_threads=1)
    expected = list(whole.generate(PROMPT, 16))
    tokens, logits = route.greedy("s", PROMPT, 16)
    assert tokens == [t for t, _ in expected]
    assert logits == [row.tobytes() for _, row in expected]
    assert len(set(tokens)) >= 4, tokens  # the text varies


@pytest.mark.parametrize("length", [10, 6, 2], ids=["inside the window", "beyond it", "far beyond it"])
def test_a_truncation_anywhere_continues_as_a_fresh_run(route, length):
    tokens, _ = route.greedy("s", PROMPT, 12)  # 12 + 11 tokens held: the window is 4
    history = PROMPT + tokens[:-1]
    route.truncate("s", length)
    suffix = history[length : length + 5]
    got = route.prefill("s", suffix)  # continue from the truncated state
    fresh = route.prefill("fresh", history[: length + 5], start_pos=0)
    assert got.seq_len == fresh.seq_len == length + 5
    assert got.logits.tobytes() == fresh.logits.tobytes()
    a, b = route.decode("s", got.token_id), route.decode("fresh", fresh.token_id)
    assert a.logits.tobytes() == b.logits.tobytes()


def test_a_gemma3_session_through_the_warm_tier_comes_back_bit_exact(synthetic_gemma3):
    config = HotKvStateConfig(max_sessions=1, context_tokens=128, budget_tokens=128, ttl_seconds=0, warm_bytes=64 << 20)
    r, ref = Route(synthetic_gemma3, config), Route(synthetic_gemma3)
    try:
        tokens, _ = r.greedy("a", PROMPT, 6)
        r.greedy("b", [7, 7, 7], 2)  # one hot slot: "a" goes to the warm tier
        assert all(m.resolve("a", 0).tier == Tier.WARM for m in r.managers)
        out = r.decode("a", tokens[-1])  # restored, no miss
        ref_tokens, _ = ref.greedy("a", PROMPT, 6)
        expected = ref.decode("a", ref_tokens[-1])
        assert out.logits.tobytes() == expected.logits.tobytes()
        assert np.array_equal(out.logits, expected.logits)
    finally:
        r.close()
        ref.close()


@contextmanager
def spilled_session(path, tier: Tier, **route_kw):
    """(a route whose 23-token session "a" (12 greedy tokens after PROMPT) went to `tier`, the same
    session on a route that kept it hot, a's tokens); both routes closed afterwards."""
    r, ref = Route(path, **route_kw), Route(path)
    try:
        tokens, _ = r.greedy("a", PROMPT, 12)
        assert ref.greedy("a", PROMPT, 12)[0] == tokens  # the same steps, hot all along
        r.greedy("b", [7, 7, 7], 2)  # one hot slot: "a" leaves it
        assert all(m.resolve("a", 0).tier == tier for m in r.managers)
        yield r, ref, tokens
    finally:
        r.close()
        ref.close()


@pytest.mark.parametrize("cut", [23, 22, 21, 20, 10, 6, 2])
def test_a_gemma3_session_back_from_the_warm_tier_and_cut_back_continues_exactly(synthetic_gemma3, cut):
    """llama.cpp saves a sliding-window model's sequence without the cells its window has passed:
    the 23-token session comes back holding its sliding layers from position 19 (window 4). Cut to
    22 (or not cut) it still has what the next position attends to (19-22), and continues as the
    same session would have hot; cut to 21 or further back it is a miss (dropped, as an eviction:
    at 21 and 20 llama.cpp would still hold cells, and compute wrong logits), and the head's
    re-prefill gives the fresh run's logits. Before the check, such a cut left llama.cpp holding
    nothing while the engine counted the tokens (the next step failed, the invariants broke)."""
    config = HotKvStateConfig(max_sessions=1, context_tokens=128, budget_tokens=128, ttl_seconds=0, warm_bytes=64 << 20)
    with spilled_session(synthetic_gemma3, Tier.WARM, config=config) as (r, ref, tokens):
        history = PROMPT + tokens[:-1] + [5, 6, 7, 8, 9]  # 23 tokens held, then what the next turn says
        suffix = history[cut : cut + 5]
        head, tail = r.adapters
        out = head.prefill("a", 0, token_ids=suffix, start_pos=cut)  # what the head sends
        if not isinstance(out, CacheMiss):
            out = tail.prefill("a", 0, boundary=out, start_pos=cut)
        assert isinstance(out, CacheMiss) == (cut < 22), out
        if isinstance(out, CacheMiss):
            assert out.reason == CacheMissReason.EVICTED_LRU and "warm tier" in out.detail
            for m in r.managers:
                m.release("a", 0)  # the head starts the session over
            out = r.prefill("a", history[: cut + 5], start_pos=0)
            expected = ref.prefill("fresh", history[: cut + 5], start_pos=0)
        else:
            expected = ref.prefill("a", suffix, start_pos=cut)  # a hot cut is exact (above)
        assert out.seq_len == expected.seq_len == cut + 5
        assert out.logits.tobytes() == expected.logits.tobytes()
        for m in r.managers:
            m.check_invariants()


def test_a_gemma3_session_longer_than_its_window_comes_back_from_the_disk_tier(synthetic_gemma3, tmp_path):
    """The disk tier's size check counts a sliding-window layer's window, not the whole sequence
    (its state holds only that): a 23-token session (window 4) comes back from a file and continues
    as it would have hot. Before, the file was refused as too short and the session was a miss."""
    configs = [
        HotKvStateConfig(
            max_sessions=1,
            context_tokens=128,
            budget_tokens=128,
            ttl_seconds=0,
            warm_dir=str(tmp_path / f"shard{i}"),
            warm_disk_bytes=64 << 20,
        )
        for i in range(2)
    ]
    with spilled_session(synthetic_gemma3, Tier.DISK, configs=configs) as (r, ref, tokens):  # no host tier
        out, expected = r.decode("a", tokens[-1]), ref.decode("a", tokens[-1])
        assert not isinstance(out, CacheMiss), out
        assert out.logits.tobytes() == expected.logits.tobytes()
        for m in r.managers:
            m.check_invariants()


# --- the real Gemma 3 270M (Q4_K_M; 18 layers, a 512-token window, every 6th layer global) ---------

LONG_TEXT = (
    "The history of the city begins with a small settlement on the river, where traders met to "
    "exchange grain, salt and cloth. Over the centuries the settlement grew into a market town, "
    "then a walled city with its own charter, guilds and council. "
)


def _real_prompts(model) -> list[list[int]]:
    """Three prompts longer than the 512-token sliding window."""
    text = LONG_TEXT * 16
    ids = model.tokenize(text)
    assert len(ids) > 720, len(ids)
    return [ids[:560], ids[40:640] + model.tokenize(" In summary,"), model.tokenize("Question: ") + ids[100:700]]


@pytest.mark.model
@pytest.mark.parametrize("split", [[(0, 8), (9, 17)], [(0, 5), (6, 11), (12, 17)]], ids=["2-shard", "3-shard"])
@pytest.mark.slow
def test_real_gemma3_split_gives_the_whole_models_tokens_and_logits(gemma3_model, split):
    from llama_shard.engine.pipeline import LocalPipeline

    whole = LocalPipeline(gemma3_model, None, n_ctx=1024, n_seq_max=1, n_batch=256, n_threads=2)
    pipe = LocalPipeline(gemma3_model, split, n_ctx=1024, n_seq_max=1, n_batch=256, n_threads=2)
    for prompt in _real_prompts(whole.head):
        expected = list(whole.generate(prompt, 32))
        got = list(pipe.generate(prompt, 32))
        assert [t for t, _ in got] == [t for t, _ in expected]
        assert all(a.tobytes() == b.tobytes() for (_, a), (_, b) in zip(got, expected))


@pytest.mark.model
def test_real_gemma3_half_shard_holds_half_the_kv(gemma3_model):
    whole, half = ShardModel(str(gemma3_model), None, 1), ShardModel(str(gemma3_model), (0, 8), 1)
    assert whole.info.architecture == "gemma3" and whole.info.n_layer == 18
    assert half.info.kv_bytes_per_token * 2 == whole.info.kv_bytes_per_token


@pytest.mark.model
@pytest.mark.grpc
@pytest.mark.slow
def test_two_workers_serving_a_real_gemma3_split_give_the_whole_models_tokens(gemma3_model):
    from llama_shard.engine.pipeline import LocalPipeline
    from llama_shard.local_workers import start_worker, stop_worker, wait_serving
    from llama_shard.route import RemoteStage, RouteClient

    flags = ("--context-tokens", "1024", "--budget-tokens", "4096", "--max-sessions", "2")
    workers = [start_worker(gemma3_model, 0, 8, 1, extra=flags), start_worker(gemma3_model, 9, 17, 1, extra=flags)]
    try:
        for proc, addr in workers:
            wait_serving(proc, addr)
        client = RouteClient([RemoteStage(addr) for _, addr in workers])
        whole = LocalPipeline(gemma3_model, None, n_ctx=1024, n_seq_max=1, n_batch=256, n_threads=2)
        prompt = _real_prompts(whole.head)[0]
        tokens = client.generate_many([client.session("g")], [prompt], 16)[0]
        assert tokens == [t for t, _ in whole.generate(prompt, 16)]
        client.close()
    finally:
        for proc, _ in workers:
            stop_worker(proc)


def test_the_recipe_covers_the_sliding_window(synthetic_gemma3, synthetic_model, model_dir):
    from llama_shard.engine.recipe import kv_recipe_for
    from llama_shard.testing.synthetic import SyntheticSpec, write_synthetic_gguf

    other = write_synthetic_gguf(
        model_dir / "gemma3-8L-w8.gguf",
        SyntheticSpec(architecture="gemma3", n_layer=8, sliding_window=8, logit_softcap=30.0, seed=19),
    )
    a, b = (kv_recipe_for(ShardModel(str(p), (0, 4), 1)) for p in (synthetic_gemma3, other))
    assert a.sliding_window == 4 and b.sliding_window == 8
    assert a.fingerprint() != b.fingerprint()  # a cache made under one window is no use under another
    llama = kv_recipe_for(ShardModel(str(synthetic_model), (0, 2), 1))
    assert llama.sliding_window == 0 and "sliding_window" not in llama.canonical()  # fingerprints as before


def test_the_reference_gives_the_same_recipe_as_the_native_engine(synthetic_gemma3):
    """The numpy reference's shard describes the same sliding window, so a cache recipe (and its
    fingerprint) made by one is the other's."""
    from llama_shard.engine.recipe import kv_recipe_for
    from llama_shard.reference import ReferenceModel, ReferenceShard

    native = kv_recipe_for(ShardModel(str(synthetic_gemma3), (0, 2), 1))
    reference = kv_recipe_for(ReferenceShard(ReferenceModel.from_gguf(synthetic_gemma3), 0, 2))
    assert reference == native and reference.sliding_window == 4
    assert reference.fingerprint() == native.fingerprint()
