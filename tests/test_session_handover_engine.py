"""Session hand-over between engines of the same shard (HotKvStateManager.export_session /
import_session over the native export_session / import_session): a session exported from one
manager and imported into another of the same model and range continues there bit for bit as it
would have at the source, whatever the receiver's limits (another max_sessions: another stream
count) and wherever the session was at the source (hot, warm, on disk). Bytes the receiver must not
restore are refused before anything changes (its sessions() and stats() are the same after); the
forged ones run in a subprocess, so an abort in llama.cpp would fail the test instead of pytest."""

from __future__ import annotations

import numpy as np
import pytest

from llama_shard import HotKvStateConfig, HotKvStateManager, KvBoundaryAdapter, ShardModel
from llama_shard.engine.hot_kv import CacheMiss, CacheMissReason, ManualClock, Tier
from llama_shard.errors import (
    IncompatibleCacheRecipeError,
    InvalidInputError,
    KvBudgetExceededError,
    StaleRouteEpochError,
)

from conftest import run_isolated

SPLIT = [(0, 14), (15, 29)]  # SmolLM2-135M: 30 layers
PROMPT = [int(t) for t in np.random.default_rng(5).integers(1, 40000, 40)]


def _config(**kw) -> HotKvStateConfig:
    base = dict(max_sessions=4, context_tokens=96, budget_tokens=384, ttl_seconds=0)
    base.update(kw)
    return HotKvStateConfig(**base)


class Route:
    """A head and a tail manager over the given shard models (the models are shared, immutable)."""

    def __init__(self, models, config: HotKvStateConfig | list[HotKvStateConfig]):
        configs = config if isinstance(config, list) else [config] * len(models)
        self.models = models
        self.managers = [HotKvStateManager(m, c, ManualClock(), n_batch=64) for m, c in zip(models, configs)]
        self.adapters = [KvBoundaryAdapter(m, mgr) for m, mgr in zip(models, self.managers)]

    def prefill(self, sid, tokens, epoch=0):
        head, tail = self.adapters
        rows = head.prefill(sid, epoch, token_ids=tokens, start_pos=0)
        return tail.prefill(sid, epoch, boundary=rows, start_pos=0)

    def decode(self, sid, tokens, n, epoch=0):
        """n greedy decodes after `tokens`' last: every head row and tail logits row, as bytes."""
        head, tail = self.adapters
        out, tok = [], tokens[-1]
        for _ in range(n):
            rows = head.decode(sid, epoch, token_ids=[tok])
            t = tail.decode(sid, epoch, boundary=rows)
            out.append((rows.hidden.tobytes(), t.logits.tobytes()))
            tok = t.token_id
        return out

    def check(self):
        for m in self.managers:
            m.check_invariants()

    def close(self):
        for m in self.managers:
            m.close()


@pytest.fixture(scope="module")
def models(embedded_model):
    return [ShardModel(str(embedded_model), layers, 1) for layers in SPLIT]


def _hand_over(src: Route, dst: Route, sid: str, epoch: int = 0, dst_epoch: int | None = None):
    for a, b in zip(src.managers, dst.managers):
        out = a.export_session(sid, epoch)
        assert not isinstance(out, CacheMiss), out
        info, blob = out
        got = b.import_session(sid, epoch if dst_epoch is None else dst_epoch, info.seq_len, blob)
        assert (got.seq_len, got.tier) == (info.seq_len, Tier.HOT)


@pytest.mark.parametrize(
    "numerics", [dict(), dict(flash_attn=False), dict(kv_type="q8_0")], ids=["f16", "f16-no-flash-attn", "q8_0"]
)
def test_an_imported_session_continues_bit_for_bit_as_its_source(models, numerics):
    # the receiver has other limits (2 sessions: another stream count) and holds other sessions
    src, dst = Route(models, _config(**numerics)), Route(models, _config(max_sessions=2, **numerics))
    try:
        src.prefill("s", PROMPT)
        dst.prefill("other", PROMPT[:7])
        _hand_over(src, dst, "s")
        src.check(), dst.check()
        assert src.decode("s", PROMPT, 6) == dst.decode("s", PROMPT, 6)
        src.check(), dst.check()
        # the source still holds it, unmoved; the receiver holds both
        assert [m.resolve("s", 0).seq_len for m in src.managers] == [46, 46]
        assert sorted(k for k, _ in dst.managers[0].session_keys()) == ["other", "s"]
    finally:
        src.close(), dst.close()


@pytest.mark.parametrize("tier", ["warm", "disk"])
def test_a_warm_or_disk_session_is_exported_where_it_is(models, tier, tmp_path):
    def warm(i):  # a directory per shard: a disk tier's directory belongs to one worker
        return (
            dict(warm_bytes=64 << 20)
            if tier == "warm"
            else dict(warm_dir=str(tmp_path / f"warm{i}"), warm_disk_bytes=64 << 20)
        )

    src = Route(models, [_config(max_sessions=1, **warm(i)) for i in range(len(models))])
    dst = Route(models, _config())
    try:
        src.prefill("s", PROMPT)
        src.prefill("pusher", PROMPT[:3])  # one slot: s leaves the hot set
        want = Tier.WARM if tier == "warm" else Tier.DISK
        before = [(m.sessions(), m.stats()) for m in src.managers]
        assert all(m.resolve("s", 0).tier == want for m in src.managers)
        _hand_over(src, dst, "s")
        # nothing moved at the source (export is a copy, not a restore)
        assert [(m.sessions(), m.stats()) for m in src.managers] == before
        assert dst.decode("s", PROMPT, 4) == src.decode("s", PROMPT, 4)  # the source restores it to continue
        src.check(), dst.check()
    finally:
        src.close(), dst.close()


def test_import_replaces_the_same_epoch_and_supersedes_an_older_one(models):
    src, dst = Route(models, _config()), Route(models, _config())
    try:
        src.prefill("s", PROMPT, epoch=3)
        dst.prefill("s", PROMPT[:10], epoch=3)  # replaced
        _hand_over(src, dst, "s", epoch=3)
        assert dst.decode("s", PROMPT, 3, epoch=3) == src.decode("s", PROMPT, 3, epoch=3)
        dst.prefill("t", PROMPT[:5], epoch=1)
        _hand_over(src, dst, "s", epoch=3, dst_epoch=4)  # the same state under a newer epoch
        for m in dst.managers:
            assert m.resolve("s", 4).seq_len == 43
            with pytest.raises(StaleRouteEpochError):
                m.resolve("s", 3)
        # an older epoch held elsewhere is superseded by an import
        info, blob = src.managers[0].export_session("s", 3)
        head = dst.managers[0]
        sup = head.stats()["supersessions"]
        head.import_session("t", 2, info.seq_len, blob)
        assert head.stats()["supersessions"] == sup + 1
        with pytest.raises(StaleRouteEpochError):
            head.resolve("t", 1)
        dst.check()
    finally:
        src.close(), dst.close()


def test_export_answers_as_resolve_for_what_it_does_not_hold(models):
    r = Route(models, _config())
    try:
        head = r.managers[0]
        miss = head.export_session("nobody", 0)
        assert isinstance(miss, CacheMiss) and miss.reason is CacheMissReason.UNKNOWN_SESSION
        assert head.stats()["misses"]["UNKNOWN_SESSION"] == 1
        r.prefill("s", PROMPT, epoch=2)
        with pytest.raises(StaleRouteEpochError):
            head.export_session("s", 1)
        miss = head.export_session("s", 3)  # a newer epoch supersedes nothing
        assert isinstance(miss, CacheMiss) and miss.reason is CacheMissReason.UNKNOWN_SESSION
        assert head.resolve("s", 2).seq_len == 40
        head.open("empty", 0)
        info, blob = head.export_session("empty", 0)
        assert info.seq_len == 0
        with pytest.raises(InvalidInputError):  # nothing to import: the receiver opens it instead
            head.import_session("empty2", 0, 0, blob)
        r.check()
    finally:
        r.close()


def _snapshot(route):
    return [(m.sessions(), m.stats()) for m in route.managers]


def test_refusals_that_need_no_forged_bytes_change_nothing(models):
    src, dst = Route(models, _config()), Route(models, _config(context_tokens=32, budget_tokens=64))
    try:
        src.prefill("s", PROMPT)
        dst.prefill("s", PROMPT[:5], epoch=7)
        dst.prefill("b", PROMPT[:9])
        info, blob = src.managers[0].export_session("s", 0)
        head = dst.managers[0]
        before = _snapshot(dst)
        with pytest.raises(StaleRouteEpochError):  # a newer epoch is held
            head.import_session("s", 6, info.seq_len, blob)
        with pytest.raises(KvBudgetExceededError):  # 40 tokens: over context_tokens 32
            head.import_session("c", 0, info.seq_len, blob)
        with pytest.raises(InvalidInputError):  # a length the bytes do not hold
            head.import_session("c", 0, info.seq_len - 1, blob)
        with pytest.raises(IncompatibleCacheRecipeError):  # another shard's export (the tail's range)
            head.import_session("c", 0, info.seq_len, src.managers[1].export_session("s", 0)[1])
        with pytest.raises(InvalidInputError):
            head.import_session("c", 0, info.seq_len, "not bytes")
        with pytest.raises(InvalidInputError):
            head.import_session("c", 0, 10, b"\0" * (head._handover_limit() + 4096))
        assert _snapshot(dst) == before
        dst.check()
    finally:
        src.close(), dst.close()


# the forged bytes: a subprocess per case, so that an abort fails the test and not pytest
FORGED = """
import struct, numpy as np
from llama_shard import HotKvStateConfig, HotKvStateManager, KvBoundaryAdapter, ShardModel
from llama_shard.engine.hot_kv import ManualClock
from llama_shard.errors import IncompatibleCacheRecipeError, InvalidInputError
path = {path!r}
cfg = HotKvStateConfig(max_sessions=4, context_tokens=96, budget_tokens=384, ttl_seconds=0)
def manager(layers):
    m = ShardModel(path, layers, 1)
    return m, HotKvStateManager(m, cfg, ManualClock(), n_batch=64)
head, src = manager((0, 14))
_, dst = manager((0, 14))
prompt = {prompt!r}
KvBoundaryAdapter(src.model, src).prefill("s", 0, token_ids=prompt, start_pos=0)
KvBoundaryAdapter(dst.model, dst).prefill("b", 0, token_ids=prompt[:9], start_pos=0)
info, blob = src.export_session("s", 0)
_, state = src.engine.export_session("s", 0, 0.0)   # the bare llama.cpp state inside the hand-over
assert blob.endswith(state)
def reseal(new_state):  # the hand-over's header around other state bytes (its size field rewritten)
    head = blob[:len(blob) - len(state)]
    return head[:-8] + struct.pack("<Q", len(new_state)) + new_state
def first_cell(st):  # the offset of the first cell's position in a state (magic, seq id, n_stream, counts)
    (n_stream,) = struct.unpack_from("<I", st, 8)
    at = 12
    for _ in range(n_stream):
        (cells,) = struct.unpack_from("<I", st, at)
        at += 4
        if cells:
            return at
    raise AssertionError("no cells")
n = info.seq_len
before = (dst.sessions(), dst.stats())
case = {case!r}
refusals = []
if case == "truncated":
    forged = [blob[:-1], reseal(state[:-1]), reseal(state[:len(state) // 2]), reseal(state[:13])]
elif case == "position":
    at = first_cell(state) + 12 * 5
    forged = []
    for delta in (1, -1, 1 << 20):
        bad = bytearray(state)
        struct.pack_into("<i", bad, at, struct.unpack_from("<i", bad, at)[0] + delta)
        forged.append(reseal(bytes(bad)))
    bad = bytearray(state); bad[at + 3] ^= 0x80  # one byte: a negative position
    forged.append(reseal(bytes(bad)))
elif case == "random":
    rng = np.random.default_rng(1)
    forged = [rng.bytes(len(blob)), reseal(rng.bytes(len(state))), reseal(state[:8] + rng.bytes(len(state) - 8)),
              reseal(state[:12] + rng.bytes(len(state) - 12))]
elif case == "other-range":
    # the same layer count (the envelope must catch it: the state carries no layer ids), and another count
    _, other = manager((15, 29))
    _, third = manager((0, 9))
    hid = np.full((n, head.info.n_embd), 0.01, np.float32)
    KvBoundaryAdapter(other.model, other).prefill("s", 0, boundary=hid, start_pos=0)
    KvBoundaryAdapter(third.model, third).prefill("s", 0, token_ids=prompt, start_pos=0)
    forged = [other.export_session("s", 0)[1], third.export_session("s", 0)[1]]
    # a bare state into the engine: another layer count is the layout check's (the same count of
    # another range passes every structural check: only the envelope tells)
    _, third_state = third.engine.export_session("s", 0, 0.0)
    r = dst.engine.import_session("c", 0, n, third_state, 0.0)
    assert r.status.name == "INVALID_INPUT" and "layers" in r.detail, (r.status, r.detail)
elif case == "non-finite":
    # values the sender's digest cannot vouch for: NaN and Inf in K and in V (f16), and in a
    # quantized cache's block scale (q8_0, q4_0: their quants are integers), each refused
    from llama_shard.testing.kv_state import F16_INF, F16_NAN, F16_NEG_INF, state_rows, with_f16
    rows = state_rows(state)
    k0, v_last = rows[0], [r for r in rows if r.kind == "V"][-1]
    assert k0.ggml_type == 1 and v_last.ggml_type == 1, rows
    forged = [reseal(with_f16(state, k0.offset, F16_NAN)), reseal(with_f16(state, k0.offset + 14, F16_INF)),
              reseal(with_f16(state, v_last.offset + v_last.size - 2, F16_NEG_INF))]
    for kv_type in ("q8_0", "q4_0"):
        qcfg = HotKvStateConfig(max_sessions=4, context_tokens=96, budget_tokens=384, ttl_seconds=0, kv_type=kv_type)
        q_src = HotKvStateManager(head, qcfg, ManualClock(), n_batch=64)
        q_dst = HotKvStateManager(ShardModel(path, (0, 14), 1), qcfg, ManualClock(), n_batch=64)
        KvBoundaryAdapter(head, q_src).prefill("s", 0, token_ids=prompt, start_pos=0)
        _, q_state = q_src.engine.export_session("s", 0, 0.0)
        q_rows = state_rows(q_state)
        assert q_rows[0].ggml_type in (8, 2), q_rows[0]
        q_before = (q_dst.sessions(), q_dst.stats())
        for at in (q_rows[0].offset, q_rows[-1].offset + q_rows[-1].size - (34 if kv_type == "q8_0" else 18)):
            r = q_dst.engine.import_session("c", 0, n, with_f16(q_state, at, F16_NAN), 0.0)
            assert r.status.name == "INVALID_INPUT" and "not finite" in r.detail, (kv_type, r.status, r.detail)
        assert (q_dst.sessions(), q_dst.stats()) == q_before
        assert q_dst.engine.import_session("c", 0, n, q_state, 0.0).status.name == "OK"  # the genuine bytes
        refusals.append(kv_type)
elif case == "seq-len":
    forged = []
    for m in (n - 1, n + 1, 1):
        try:
            dst.import_session("c", 0, m, blob)
        except InvalidInputError as e:
            refusals.append(type(e).__name__)
        r = dst.engine.import_session("c", 0, m, state, 0.0)   # the bare state: the positions check
        assert r.status.name == "INVALID_INPUT", (m, r.status, r.detail)
for bad in forged:
    try:
        dst.import_session("c", 0, n, bad)
    except (InvalidInputError, IncompatibleCacheRecipeError) as e:
        refusals.append(type(e).__name__)
    else:
        raise AssertionError("accepted forged bytes")
assert (dst.sessions(), dst.stats()) == before, "a refusal changed the receiver"
dst.check_invariants()
# the receiver still works, and still takes the genuine bytes
assert dst.import_session("c", 0, n, blob).seq_len == n
dst.check_invariants()
print("REFUSED", len(refusals), sorted(set(refusals)))
"""


@pytest.mark.parametrize("case", ["truncated", "position", "random", "other-range", "seq-len", "non-finite"])
def test_forged_bytes_are_refused_and_change_nothing(embedded_model, case):
    res = run_isolated(FORGED.format(path=str(embedded_model), prompt=PROMPT, case=case), timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "REFUSED" in res.stdout


def test_the_reference_engine_hands_over_the_same_way(synthetic_model):
    """The numpy reference's own bytes, with the same outcomes; a native state is refused by it."""
    from llama_shard.reference import ReferenceModel, ReferenceShard

    ref = ReferenceModel.from_gguf(synthetic_model)
    shard = ReferenceShard(ref)
    cfg = _config()
    a, b = (HotKvStateManager(shard, cfg, ManualClock(), n_batch=64) for _ in range(2))
    native = HotKvStateManager(ShardModel(str(synthetic_model), None, 1), cfg, ManualClock(), n_batch=64)
    try:
        tokens = [int(t) for t in np.random.default_rng(2).integers(1, 300, 12)]
        ad, bd = KvBoundaryAdapter(shard, a), KvBoundaryAdapter(shard, b)
        ad.prefill("s", 0, token_ids=tokens, start_pos=0)
        info, blob = a.export_session("s", 0)
        assert b.import_session("s", 0, info.seq_len, blob).seq_len == 12
        x, y = ad.decode("s", 0, token_ids=[7]), bd.decode("s", 0, token_ids=[7])
        assert x.logits.tobytes() == y.logits.tobytes()
        KvBoundaryAdapter(native.model, native).prefill("n", 0, token_ids=tokens, start_pos=0)
        native_blob = native.export_session("n", 0)[1]
        _, state = a.engine.export_session("s", 0, 0.0)
        b.import_session("t", 5, info.seq_len, blob)
        before = (b.sessions(), b.stats())
        with pytest.raises(IncompatibleCacheRecipeError):  # a native state: another engine's bytes
            b.import_session("n", 0, 12, native_blob)
        with pytest.raises(StaleRouteEpochError):
            b.import_session("t", 4, info.seq_len, blob)
        # bare reference states: the budget, sizes and lengths checked as the native engine checks them
        assert b.engine.import_session("t", 5, 97, state, 0.0).status.name == "BUDGET_EXCEEDED"
        assert b.engine.import_session("c", 0, 12, state[:-1], 0.0).status.name == "INVALID_INPUT"
        assert b.engine.import_session("c", 0, 11, state, 0.0).status.name == "INVALID_INPUT"
        assert (b.sessions(), b.stats()) == before
        a.check_invariants(), b.check_invariants()
    finally:
        for m in (a, b, native):
            m.close()
