"""The Hot KV State contract, scenario by scenario, on both engines: the native engine (patched
llama.cpp) and the numpy reference engine, through one parametrised fixture on the synthetic model."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from llama_shard import (
    BoundaryBundle,
    CacheMiss,
    CacheMissReason,
    HotKvStateConfig,
    HotKvStateManager,
    IncompatibleCacheRecipeError,
    KvBoundaryAdapter,
    KvBudgetExceededError,
    KvCacheMissError,
    KvCacheRecipe,
    ManualClock,
    ShardModel,
    StaleRouteEpochError,
    Status,
    Step,
    TailOutput,
    UncertifiedArchitectureError,
    kv_recipe_for,
)
from llama_shard.reference import ReferenceModel, ReferenceShard


@pytest.fixture(scope="module")
def reference_model(synthetic_model) -> ReferenceModel:
    return ReferenceModel.from_gguf(synthetic_model)


@pytest.fixture(params=["native", "reference"])
def make_shard(request, synthetic_model, reference_model):
    """make_shard(first, last) -> a shard of the synthetic model on the parametrised engine."""

    def make(first=None, last=None):
        if request.param == "native":
            layers = None if first is None else (first, last)
            return ShardModel(str(synthetic_model), layers, 2)
        return ReferenceShard(reference_model, first, last)

    make.engine = request.param
    return make


def manager_for(shard, clock=None, **config):
    return HotKvStateManager(shard, HotKvStateConfig(**config) if config else None, clock or ManualClock())


def greedy(adapter, sid, epoch, prompt, n_new):
    out = adapter.prefill(sid, epoch, token_ids=prompt)
    assert isinstance(out, TailOutput)
    tokens = [out.token_id]
    for _ in range(n_new - 1):
        out = adapter.decode(sid, epoch, token_ids=[out.token_id])
        assert isinstance(out, TailOutput)
        tokens.append(out.token_id)
    return tokens


PROMPTS = [[5, 12, 3, 41], [200, 7, 7, 19, 88], [1, 2, 3], [310, 45, 99, 150, 6, 27]]

# --- recipe identity ---------------------------------------------------------------------------


def test_recipe_owned_layers_and_fingerprint_aliasing():
    base = dict(kv_dtype="f16", n_kv_heads=2, head_dim=16, total_layers=6)
    recipe = KvCacheRecipe(architecture_adapter="LlamaForCausalLM", start_layer=2, end_layer=3, **base)
    assert recipe.owned_layers == (2, 3)
    assert recipe.is_compatible(KvCacheRecipe(architecture_adapter="llama", start_layer=2, end_layer=3, **base))
    assert not recipe.is_compatible(KvCacheRecipe(architecture_adapter="llama", start_layer=0, end_layer=1, **base))
    assert not recipe.is_compatible(
        KvCacheRecipe(architecture_adapter="llama", start_layer=2, end_layer=3, **{**base, "kv_dtype": "q8_0"})
    )


def test_recipe_bytes_per_token_scales_with_owned_layers():
    base = dict(architecture_adapter="llama", kv_dtype="f16", n_kv_heads=2, head_dim=16, total_layers=6)
    one = KvCacheRecipe(**base, start_layer=0, end_layer=0)
    three = KvCacheRecipe(**base, start_layer=1, end_layer=3)
    assert one.bytes_per_token() == 2 * 2 * 16 * 2
    assert three.bytes_per_token() == 3 * one.bytes_per_token()


def test_native_and_reference_shards_have_the_same_recipe(synthetic_model, reference_model):
    native = kv_recipe_for(ShardModel(str(synthetic_model), (2, 3), 1))
    ref = kv_recipe_for(ReferenceShard(reference_model, 2, 3))
    assert native.fingerprint() == ref.fingerprint()
    assert native.bytes_per_token() == ShardModel(str(synthetic_model), (2, 3), 1).info.kv_bytes_per_token


def test_uncertified_architecture_recipe_fails_closed():
    with pytest.raises(UncertifiedArchitectureError):
        KvCacheRecipe(
            architecture_adapter="gpt2",
            kv_dtype="f16",
            n_kv_heads=2,
            head_dim=16,
            total_layers=6,
            start_layer=0,
            end_layer=5,
        )


# --- allocation and growth ------------------------------------------------------------------


def test_manager_allocates_kv_only_for_owned_layers(make_shard):
    shard = make_shard(2, 3)
    manager = manager_for(shard)
    session = manager.open("sess-mid", 0)
    assert session.owned_layers == (2, 3)
    assert session.bytes_per_token == 2 * 2 * 2 * 16 * 2  # two layers, K and V, 2 heads x 16, f16
    if make_shard.engine == "reference":
        assert set(manager.engine.session_kv("sess-mid").layers) == {2, 3}
        return

    # measured, not derived: the KV llama.cpp holds for a 200-token session, serialized by the warm
    # tier, on the 2-layer shard and on the whole 6-layer model
    def held(model) -> int:
        m = manager_for(model, max_sessions=1, context_tokens=256, warm_bytes=1 << 20)
        ad = KvBoundaryAdapter(model, m)
        rows = np.random.default_rng(0).standard_normal((200, model.info.n_embd)).astype(np.float32)
        feed = (lambda n: {"token_ids": [1] * n}) if model.info.is_head else (lambda n: {"boundary": rows[:n]})
        ad.prefill("a", 0, **feed(200))
        ad.prefill("b", 0, **feed(1))  # "a" spills: warm_bytes is its serialized KV
        return m.stats()["warm_bytes"]

    two, six = held(shard), held(make_shard())
    assert 0.30 < two / six < 0.37, (two, six)  # 2 of 6 layers, plus per-cell and page overhead


def test_prefill_then_decode_append_grows_owned_layers(make_shard):
    shard = make_shard()
    manager = manager_for(shard)
    adapter = KvBoundaryAdapter(shard, manager)
    out = adapter.prefill("s", 0, token_ids=np.asarray(PROMPTS[0]))
    assert isinstance(out, TailOutput) and out.logits.dtype == np.float32
    assert manager.get("s", 0).seq_len == 4
    step = adapter.decode("s", 0, token_ids=[out.token_id])
    assert isinstance(step, TailOutput)
    assert manager.get("s", 0).seq_len == 5
    assert manager.total_bytes == 5 * manager.recipe.bytes_per_token()
    manager.check_invariants()


def test_truncate_rolls_back_all_owned_layers(make_shard):
    shard = make_shard()
    manager = manager_for(shard)
    adapter = KvBoundaryAdapter(shard, manager)
    adapter.prefill("s", 0, token_ids=[1, 2, 3, 4, 5])
    assert manager.get("s", 0).seq_len == 5
    manager.truncate("s", 0, 2)
    assert manager.get("s", 0).seq_len == 2
    manager.check_invariants()
    # the truncated cache computes exactly what a fresh session with the same two positions does
    adapter.prefill("fresh", 0, token_ids=[1, 2])
    expected = adapter.prefill("fresh", 0, token_ids=[3, 4, 5])
    again = adapter.prefill("s", 0, token_ids=[3, 4, 5])
    assert again.logits.tobytes() == expected.logits.tobytes()


def test_prefill_at_an_earlier_position_truncates_first(make_shard):
    shard = make_shard()
    manager = manager_for(shard)
    adapter = KvBoundaryAdapter(shard, manager)
    a = adapter.prefill("s", 0, token_ids=[9, 8, 7, 6])
    adapter.decode("s", 0, token_ids=[a.token_id])
    b = adapter.prefill("s", 0, token_ids=[9, 8, 7, 6], start_pos=0)  # the head re-prefills
    assert b.logits.tobytes() == a.logits.tobytes()
    assert manager.get("s", 0).seq_len == 4
    manager.check_invariants()


# --- correctness of cached computation ----------------------------------------------------------


def test_cached_full_shard_decode_matches_stateless_whole_model(make_shard, reference_model):
    shard = make_shard()
    adapter = KvBoundaryAdapter(shard, manager_for(shard))
    assert greedy(adapter, "s", 0, PROMPTS[0], 8) == reference_model.greedy(PROMPTS[0], 8)


def test_cached_prefill_next_token_matches_whole_model_logits(make_shard, reference_model):
    shard = make_shard()
    adapter = KvBoundaryAdapter(shard, manager_for(shard))
    out = adapter.prefill("s", 0, token_ids=PROMPTS[1])
    expected = reference_model.forward(PROMPTS[1])[-1]
    assert out.token_id == int(np.argmax(expected))
    assert np.abs(out.logits - expected).max() < 2e-2


def test_multi_range_cached_decode_parity_across_a_seam(make_shard, reference_model):
    head, tail = make_shard(0, 2), make_shard(3, 5)
    head_ad = KvBoundaryAdapter(head, manager_for(head))
    tail_ad = KvBoundaryAdapter(tail, manager_for(tail))
    bundle = head_ad.prefill("s", 0, token_ids=PROMPTS[2])
    assert isinstance(bundle, BoundaryBundle) and bundle.hidden.shape == (3, 64) and bundle.start_pos == 0
    out = tail_ad.prefill("s", 0, boundary=bundle)
    tokens = [out.token_id]
    for _ in range(7):
        bundle = head_ad.decode("s", 0, token_ids=[out.token_id])
        assert bundle.start_pos == len(PROMPTS[2]) + len(tokens) - 1
        out = tail_ad.decode("s", 0, boundary=bundle)
        tokens.append(out.token_id)
    assert tokens == reference_model.greedy(PROMPTS[2], 8)


# --- isolation -------------------------------------------------------------------------------


def test_four_interleaved_sessions_have_no_kv_cross_talk(make_shard, reference_model):
    shard = make_shard()
    manager = manager_for(shard, max_sessions=4)
    adapter = KvBoundaryAdapter(shard, manager)
    refs = [reference_model.greedy(p, 6) for p in PROMPTS]
    assert len({tuple(r) for r in refs}) == 4, "the four references must be distinct"
    outs = [adapter.prefill(f"s{i}", 0, token_ids=p) for i, p in enumerate(PROMPTS)]
    got = [[o.token_id] for o in outs]
    for _ in range(5):
        for i in range(4):  # round-robin
            o = adapter.decode(f"s{i}", 0, token_ids=[got[i][-1]])
            got[i].append(o.token_id)
    assert got == refs
    manager.check_invariants()


def test_four_sessions_on_real_threads_stay_isolated(make_shard, reference_model):
    shard = make_shard()
    manager = manager_for(shard, max_sessions=8)
    adapter = KvBoundaryAdapter(shard, manager)
    refs = [reference_model.greedy(p, 6) for p in PROMPTS]
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def run(i):
        try:
            barrier.wait()
            results[i] = greedy(adapter, f"t{i}", 0, PROMPTS[i], 6)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert [results[i] for i in range(4)] == refs
    manager.check_invariants()


def test_release_one_session_leaves_others_intact_and_returns_memory(make_shard, reference_model):
    shard = make_shard()
    manager = manager_for(shard, max_sessions=4)
    adapter = KvBoundaryAdapter(shard, manager)
    outs = {i: adapter.prefill(f"s{i}", 0, token_ids=PROMPTS[i]) for i in range(3)}
    before = manager.total_bytes
    assert manager.release("s1", 0) is True
    assert manager.total_bytes == before - len(PROMPTS[1]) * manager.recipe.bytes_per_token()
    miss = manager.resolve("s1", 0)
    assert isinstance(miss, CacheMiss) and miss.reason is CacheMissReason.RELEASED
    for i in (0, 2):
        got = [outs[i].token_id]
        for _ in range(3):
            got.append(adapter.decode(f"s{i}", 0, token_ids=[got[-1]]).token_id)
        assert got == reference_model.greedy(PROMPTS[i], 4)
    assert manager.release("s1", 0) is False  # idempotent
    manager.check_invariants()


def test_freed_seq_ids_are_reused_lowest_first_and_batches_run_in_any_order(make_shard, reference_model):
    """Live sessions keep a compact run of seq ids (the lowest free id is handed out first), and a
    batched step gives every session its own tokens whatever order its requests come in (the native
    context runs them in ascending seq id order: one ubatch per run of consecutive ids)."""
    shard = make_shard()
    manager = manager_for(shard, max_sessions=4)
    adapter = KvBoundaryAdapter(shard, manager)
    seq = {
        f"s{i}": adapter.prefill(f"s{i}", 0, token_ids=PROMPTS[i]) and manager.get(f"s{i}", 0).seq_id for i in range(3)
    }
    assert seq == {"s0": 0, "s1": 1, "s2": 2}
    manager.release("s2", 0)
    manager.release("s0", 0)
    outs = manager.step_batch([Step.prefill(f"n{i}", 0, PROMPTS[i], start_pos=0) for i in (3, 2, 0)])
    assert [r.status for r, _ in outs] == [Status.OK] * 3
    assert [manager.get(f"n{i}", 0).seq_id for i in (3, 2, 0)] == [0, 2, 3]
    tokens = {i: [int(np.argmax(out))] for i, (_, out) in zip((3, 2, 0), outs)}
    for _ in range(3):
        order = (0, 3, 2)  # not the seq id order
        outs = manager.step_batch([Step.decode(f"n{i}", 0, [tokens[i][-1]]) for i in order])
        for i, (_, out) in zip(order, outs):
            tokens[i].append(int(np.argmax(out)))
    for i in (3, 2, 0):
        assert tokens[i] == reference_model.greedy(PROMPTS[i], 4)
    manager.check_invariants()


def test_sessions_opened_by_one_step_take_consecutive_seq_ids(make_shard):
    """After churn the free ids are {1, 5, 6, 7}: three sessions opened by one step take the run
    5-7 (one ubatch on the native engine), not 1, 5, 6; a lone new session takes the lowest id."""
    shard = make_shard()
    manager = manager_for(shard, max_sessions=8)
    manager.step_batch([Step.prefill(f"old{i}", 0, PROMPTS[i % 4], start_pos=0) for i in range(8)])
    assert [manager.get(f"old{i}", 0).seq_id for i in range(8)] == list(range(8))
    for i in (1, 5, 6, 7):
        manager.release(f"old{i}", 0)
    outs = manager.step_batch(
        [Step.decode("old0", 0, [3])] + [Step.prefill(f"new{i}", 0, PROMPTS[i], start_pos=0) for i in range(3)]
    )
    assert [r.status for r, _ in outs] == [Status.OK] * 4
    assert [manager.get(f"new{i}", 0).seq_id for i in range(3)] == [5, 6, 7]
    manager.step_batch([Step.prefill("lone", 0, PROMPTS[3], start_pos=0)])
    assert manager.get("lone", 0).seq_id == 1
    manager.check_invariants()


# --- identity ----------------------------------------------------------------------------------


def test_stale_route_epoch_is_rejected(make_shard):
    shard = make_shard()
    manager = manager_for(shard)
    adapter = KvBoundaryAdapter(shard, manager)
    adapter.prefill("s", 3, token_ids=[1, 2])
    for call in (
        lambda: manager.open("s", 2),
        lambda: adapter.decode("s", 2, token_ids=[1]),
        lambda: adapter.prefill("s", 1, token_ids=[1]),
        lambda: manager.truncate("s", 2, 0),
        lambda: manager.resolve("s", 0),
        lambda: manager.release("s", 2),
    ):
        with pytest.raises(StaleRouteEpochError) as e:
            call()
        assert e.value.current_epoch == 3
    assert manager.get("s", 3).seq_len == 2  # the stale release erased nothing
    manager.check_invariants()


def test_new_route_epoch_supersedes_and_frees_old_epoch(make_shard):
    shard = make_shard()
    manager = manager_for(shard)
    adapter = KvBoundaryAdapter(shard, manager)
    adapter.prefill("s", 0, token_ids=[1, 2, 3])
    miss = adapter.decode("s", 1, token_ids=[4])
    assert isinstance(miss, CacheMiss) and miss.reason is CacheMissReason.SUPERSEDED_EPOCH
    assert manager.session_count == 0 and manager.total_bytes == 0
    with pytest.raises(StaleRouteEpochError):
        manager.resolve("s", 0)
    out = adapter.prefill("s", 1, token_ids=[1, 2, 3])  # the head re-prefills under the new epoch
    assert isinstance(out, TailOutput) and manager.session_keys() == [("s", 1)]
    manager.check_invariants()


def test_incompatible_cache_recipe_is_rejected(make_shard):
    shard = make_shard(0, 2)
    manager = manager_for(shard)
    adapter = KvBoundaryAdapter(shard, manager)
    other = KvCacheRecipe(
        architecture_adapter="llama",
        kv_dtype="f16",
        n_kv_heads=2,
        head_dim=16,
        total_layers=6,
        start_layer=3,
        end_layer=5,
    )
    with pytest.raises(IncompatibleCacheRecipeError):
        manager.open("s", 0, recipe=other)
    with pytest.raises(IncompatibleCacheRecipeError):
        adapter.prefill("s", 0, token_ids=[1], recipe=other)
    assert manager.session_count == 0
    assert isinstance(adapter.prefill("s", 0, token_ids=[1], recipe=manager.recipe), BoundaryBundle)


def test_uncertified_architecture_fails_closed_at_load(model_dir):
    from llama_shard.testing.synthetic import SyntheticSpec, write_synthetic_gguf

    path = write_synthetic_gguf(model_dir / "gpt2-2L.gguf", SyntheticSpec(n_layer=2, architecture="gpt2"))
    with pytest.raises(UncertifiedArchitectureError):
        ShardModel(str(path), (0, 0))


# --- misses ------------------------------------------------------------------------------------


def test_unknown_session_is_an_explicit_cache_miss(make_shard):
    shard = make_shard()
    manager = manager_for(shard)
    adapter = KvBoundaryAdapter(shard, manager)
    miss = adapter.decode("nobody", 0, token_ids=[1])
    assert isinstance(miss, CacheMiss) and miss.reason is CacheMissReason.UNKNOWN_SESSION
    assert miss.to_dict()["reason"] == "unknown-session"
    with pytest.raises(KvCacheMissError) as e:
        manager.get("nobody", 0)
    assert e.value.miss.reason is CacheMissReason.UNKNOWN_SESSION
    assert isinstance(adapter.prefill("nobody", 0, token_ids=[1], start_pos=3), CacheMiss)


def test_seq_len_mismatch_is_an_explicit_cache_miss(make_shard):
    shard = make_shard()
    manager = manager_for(shard)
    adapter = KvBoundaryAdapter(shard, manager)
    adapter.prefill("s", 0, token_ids=[1, 2, 3])
    miss = adapter.decode("s", 0, token_ids=[4], expected_seq_len=5)
    assert isinstance(miss, CacheMiss) and miss.reason is CacheMissReason.SEQ_LEN_MISMATCH
    miss = adapter.prefill("s", 0, token_ids=[4], start_pos=7)
    assert isinstance(miss, CacheMiss) and miss.reason is CacheMissReason.SEQ_LEN_MISMATCH
    assert manager.get("s", 0).seq_len == 3
    assert isinstance(adapter.decode("s", 0, token_ids=[4], expected_seq_len=3), TailOutput)


def test_ttl_eviction_yields_an_explicit_cache_miss(make_shard):
    shard = make_shard()
    clock = ManualClock()
    manager = manager_for(shard, clock, ttl_seconds=10.0)
    adapter = KvBoundaryAdapter(shard, manager)
    adapter.prefill("old", 0, token_ids=[1, 2])
    clock.advance(6)
    adapter.prefill("young", 0, token_ids=[3, 4])
    clock.advance(6)  # old idle 12s, young 6s
    miss = adapter.decode("old", 0, token_ids=[5])
    assert isinstance(miss, CacheMiss) and miss.reason is CacheMissReason.EVICTED_TTL
    assert manager.session_keys() == [("young", 0)]
    clock.advance(11)
    assert manager.sweep() == 1 and manager.session_count == 0 and manager.total_bytes == 0
    assert manager.stats()["evictions_ttl"] == 2
    manager.check_invariants()


def test_lru_eviction_by_session_cap_reports_a_miss(make_shard):
    shard = make_shard()
    clock = ManualClock()
    manager = manager_for(shard, clock, max_sessions=2)
    adapter = KvBoundaryAdapter(shard, manager)
    adapter.prefill("a", 0, token_ids=[1])
    clock.advance(1)
    adapter.prefill("b", 0, token_ids=[2])
    clock.advance(1)
    adapter.decode("a", 0, token_ids=[3])  # a is now the most recent
    clock.advance(1)
    adapter.prefill("c", 0, token_ids=[4])  # evicts b, the least recently used
    miss = manager.resolve("b", 0)
    assert isinstance(miss, CacheMiss) and miss.reason is CacheMissReason.EVICTED_LRU
    assert sorted(k for k, _ in manager.session_keys()) == ["a", "c"]
    manager.check_invariants()


def test_budget_eviction_keeps_total_within_budget(make_shard):
    shard = make_shard()
    clock = ManualClock()
    manager = manager_for(shard, clock, max_sessions=8, budget_tokens=16, context_tokens=16)
    adapter = KvBoundaryAdapter(shard, manager)
    for i in range(3):
        adapter.prefill(f"s{i}", 0, token_ids=[1 + i] * 5)
        clock.advance(1)
    assert manager.reserved_tokens == 15
    adapter.prefill("big", 0, token_ids=[9] * 8)  # needs 8: evicts s0 and s1 (LRU), keeps s2
    assert manager.reserved_tokens <= 16
    assert [k for k, _ in manager.session_keys()] == ["s2", "big"]
    for i in (0, 1):
        miss = manager.resolve(f"s{i}", 0)
        assert isinstance(miss, CacheMiss) and miss.reason is CacheMissReason.EVICTED_LRU
    manager.check_invariants()


def test_single_session_exceeding_budget_raises(make_shard):
    shard = make_shard()
    manager = manager_for(shard, budget_tokens=8, context_tokens=8)
    adapter = KvBoundaryAdapter(shard, manager)
    adapter.prefill("keep", 0, token_ids=[1, 2, 3])
    with pytest.raises(KvBudgetExceededError):
        adapter.prefill("huge", 0, token_ids=[1] * 9)
    # nothing changed: no session was created or evicted
    assert manager.session_keys() == [("keep", 0)] and manager.reserved_tokens == 3
    adapter.decode("keep", 0, token_ids=[4] * 5)
    with pytest.raises(KvBudgetExceededError):
        adapter.decode("keep", 0, token_ids=[5])  # would make 9 > context_tokens
    assert manager.get("keep", 0).seq_len == 8
    manager.check_invariants()


def test_recently_dropped_keys_are_bounded(make_shard):
    shard = make_shard()
    manager = HotKvStateManager(shard, HotKvStateConfig(max_sessions=2), ManualClock(), recent_capacity=16)
    for i in range(200):
        manager.open(f"flood-{i}", 0)
    assert manager.stats()["recent_keys"] <= 16
    manager.check_invariants()


# --- contract edges, decided the same way by both engines --------------------------------------


def test_resolve_is_a_query_even_at_a_newer_epoch(make_shard):
    shard = make_shard()
    manager = manager_for(shard)
    KvBoundaryAdapter(shard, manager).prefill("s", 1, token_ids=[1, 2, 3])
    miss = manager.resolve("s", 2)
    assert isinstance(miss, CacheMiss) and miss.reason == CacheMissReason.UNKNOWN_SESSION
    assert manager.resolve("s", 1).seq_len == 3  # the cached epoch is untouched
    assert manager.stats()["supersessions"] == 0


def test_release_at_a_newer_epoch_supersedes_and_releases(make_shard):
    shard = make_shard()
    manager = manager_for(shard)
    adapter = KvBoundaryAdapter(shard, manager)
    adapter.prefill("s", 1, token_ids=[1, 2, 3])
    assert manager.release("s", 2) is True
    with pytest.raises(StaleRouteEpochError):
        manager.resolve("s", 1)
    assert manager.resolve("s", 2).reason == CacheMissReason.RELEASED
    assert manager.stats()["supersessions"] == 1 and manager.reserved_tokens == 0
    # a session only remembered: a newer release moves the fence
    adapter.prefill("t", 1, token_ids=[1])
    manager.release("t", 1)
    assert manager.release("t", 5) is False
    with pytest.raises(StaleRouteEpochError):
        manager.resolve("t", 4)
    manager.check_invariants()


@pytest.mark.parametrize("others, fenced", [(3, True), (5, False)])
def test_stale_epoch_fencing_lasts_for_recent_capacity_dropped_keys(make_shard, others, fenced):
    """The table of dropped keys is bounded (recent_capacity, 4 here): an old epoch of a session in
    no tier is refused as stale until that many later keys were dropped, then it is an
    UNKNOWN_SESSION miss (still a miss: the head re-prefills)."""
    shard = make_shard()
    manager = HotKvStateManager(shard, HotKvStateConfig(max_sessions=2), ManualClock(), recent_capacity=4)
    manager.open("a", 3)
    manager.release("a", 3)
    for i in range(others):
        manager.open(f"other-{i}", 0)
        manager.release(f"other-{i}", 0)
    if fenced:
        with pytest.raises(StaleRouteEpochError):
            manager.resolve("a", 1)
    else:
        assert manager.resolve("a", 1).reason == CacheMissReason.UNKNOWN_SESSION


def test_engines_serialise_calls_from_many_threads(make_shard):
    """Eight threads step, release, resolve, truncate and read stats on one manager at once (the
    reference engine takes its own lock, as the native one does): every call gets a contract answer
    and the invariants hold afterwards."""
    import threading

    shard = make_shard()
    manager = manager_for(shard, max_sessions=4, context_tokens=32, budget_tokens=64, warm_bytes=1 << 20)
    adapter = KvBoundaryAdapter(shard, manager)
    errors: list[BaseException] = []

    def work(t):
        rng = np.random.default_rng(t)
        try:
            for _ in range(40):
                sid = f"s{int(rng.integers(0, 6))}"
                op = int(rng.integers(0, 5))
                try:
                    if op == 0:
                        adapter.prefill(sid, 0, token_ids=[int(x) for x in rng.integers(0, 300, 3)])
                    elif op == 1:
                        adapter.decode(sid, 0, token_ids=[1])
                    elif op == 2:
                        manager.release(sid, 0)
                    elif op == 3:
                        manager.resolve(sid, 0)
                    else:
                        manager.stats()
                        manager.sessions()
                except KvBudgetExceededError:
                    pass  # a session at its context limit
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    manager.check_invariants()
