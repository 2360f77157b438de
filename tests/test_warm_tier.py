"""The warm tier and the memory plan: evicted sessions come back bit-exact without a re-prefill,
resolve reports a warm session without moving it, KV types and sizes agree between Python and the
native engine, and a plan in bytes sizes the hot set."""

from __future__ import annotations

import numpy as np
import pytest

from llama_shard import (
    CacheMiss,
    CacheMissReason,
    HotKvStateConfig,
    HotKvStateManager,
    KvBoundaryAdapter,
    ManualClock,
    ShardModel,
    TailOutput,
    Tier,
)
from llama_shard.engine.hot_kv import parse_size
from llama_shard.engine.memory import memory_plan
from llama_shard.engine.recipe import kv_bytes_per_token
from llama_shard.errors import InvalidInputError
from llama_shard.testing.synthetic import SyntheticSpec, write_synthetic_gguf

PROMPTS = [
    "The capital of France is",
    "Once upon a time,",
    "def add(a, b):",
    "The three primary colors are",
    "Water boils at",
    "My favourite book is",
    "import numpy as np",
    "The quick brown fox",
]


class Route:
    """SmolLM2 split 0-14 / 15-29, one manager per shard with the same config."""

    def __init__(self, path, config: HotKvStateConfig, tail_config: HotKvStateConfig | None = None):
        self.head = ShardModel(str(path), (0, 14), 1)
        self.tail = ShardModel(str(path), (15, 29), 1)
        self.managers = [
            HotKvStateManager(self.head, config, n_batch=64),
            HotKvStateManager(self.tail, tail_config or config, n_batch=64),
        ]
        self.head_ad = KvBoundaryAdapter(self.head, self.managers[0])
        self.tail_ad = KvBoundaryAdapter(self.tail, self.managers[1])

    def prefill(self, sid, prompt) -> TailOutput:
        ids = self.head.tokenize(prompt)
        return self.tail_ad.prefill(sid, 0, boundary=self.head_ad.prefill(sid, 0, token_ids=ids))

    def decode(self, sid, token, past) -> TailOutput | CacheMiss:
        bundle = self.head_ad.decode(sid, 0, token_ids=[token], expected_seq_len=past)
        if isinstance(bundle, CacheMiss):
            return bundle
        return self.tail_ad.decode(sid, 0, boundary=bundle, expected_seq_len=past)

    def round_robin(self, n_rounds):
        """Every session prefills, then decodes one token per round in turn: (tokens, logits bytes) per session."""
        outs = {sid: self.prefill(sid, p) for sid, p in zip(map(str, range(len(PROMPTS))), PROMPTS)}
        past = {sid: len(self.head.tokenize(p)) for sid, p in zip(map(str, range(len(PROMPTS))), PROMPTS)}
        history = {sid: [(o.token_id, o.logits.tobytes())] for sid, o in outs.items()}
        for _ in range(n_rounds):
            for sid in outs:
                out = self.decode(sid, outs[sid].token_id, past[sid])
                assert isinstance(out, TailOutput), out
                outs[sid], past[sid] = out, past[sid] + 1
                history[sid].append((out.token_id, out.logits.tobytes()))
        return history


@pytest.mark.model
def test_evicted_sessions_resume_bit_exact_from_the_warm_tier(embedded_model):
    roomy = Route(embedded_model, HotKvStateConfig(max_sessions=8, context_tokens=256))
    expected = roomy.round_robin(6)
    for m in roomy.managers:
        assert m.stats()["evictions_lru"] == 0

    # 2 hot slots for 8 sessions: every step evicts another session to the warm tier
    tight = Route(embedded_model, HotKvStateConfig(max_sessions=2, context_tokens=256, warm_bytes=64 << 20))
    got = tight.round_robin(6)
    assert got == expected  # the same tokens and the same logits, byte for byte
    for m in tight.managers:
        st = m.stats()
        m.check_invariants()
        assert st["restores"] >= 8 * 6 - 2, st  # almost every decode came back from the warm tier
        assert st["spills"] == st["restores"] + st["warm_drops"] + st["warm_sessions"]
        assert st["warm_drops"] == 0 and sum(st["misses"].values()) == 0, st  # nothing re-prefilled
        assert st["tokens_computed"] == roomy.managers[0].stats()["tokens_computed"]


@pytest.mark.model
def test_without_a_warm_tier_the_same_route_misses(embedded_model):
    route = Route(embedded_model, HotKvStateConfig(max_sessions=2, context_tokens=256))
    out = route.prefill("a", PROMPTS[0])
    route.prefill("b", PROMPTS[1])
    route.prefill("c", PROMPTS[2])  # evicts "a"
    miss = route.decode("a", out.token_id, len(route.head.tokenize(PROMPTS[0])))
    assert isinstance(miss, CacheMiss) and miss.reason == CacheMissReason.EVICTED_LRU


def _manager(path, **config):
    model = ShardModel(str(path), None, 1)
    clock = ManualClock()
    manager = HotKvStateManager(model, HotKvStateConfig(**config), clock, n_batch=8)
    return model, manager, KvBoundaryAdapter(model, manager), clock


def test_resolve_reports_a_warm_session_without_moving_it(synthetic_model):
    _, m, ad, _ = _manager(synthetic_model, max_sessions=1, context_tokens=16, warm_bytes=1 << 20)
    ad.prefill("a", 0, token_ids=[1, 2, 3])
    ad.prefill("b", 0, token_ids=[4, 5])  # "a" goes warm
    info = m.resolve("a", 0)
    assert (info.tier, info.seq_len, info.seq_id) == (Tier.WARM, 3, -1)
    assert m.resolve("b", 0).tier == Tier.HOT
    assert [(s.session_id, s.tier) for s in m.sessions()] == [("b", Tier.HOT), ("a", Tier.WARM)]
    assert m.stats()["restores"] == 0
    # truncate brings it back; a length past the warm length is refused before anything moves
    with pytest.raises(InvalidInputError):
        m.truncate("a", 0, 4)
    assert m.resolve("a", 0).tier == Tier.WARM
    assert m.truncate("a", 0, 2).seq_len == 2 and m.resolve("a", 0).tier == Tier.HOT
    assert m.resolve("b", 0).tier == Tier.WARM
    m.check_invariants()


def test_release_and_a_new_epoch_drop_the_warm_copy(synthetic_model):
    _, m, ad, _ = _manager(synthetic_model, max_sessions=1, context_tokens=16, warm_bytes=1 << 20)
    ad.prefill("a", 0, token_ids=[1, 2, 3])
    ad.prefill("b", 0, token_ids=[4])  # "a" warm
    assert m.release("a", 0) is True
    assert m.resolve("a", 0).reason == CacheMissReason.RELEASED
    ad.prefill("a", 0, token_ids=[1, 2, 3])  # "b" warm now
    out = ad.decode("b", 1, token_ids=[1])
    assert isinstance(out, CacheMiss) and out.reason == CacheMissReason.SUPERSEDED_EPOCH
    st = m.stats()
    assert st["warm_sessions"] == 0 and st["warm_bytes"] == 0
    assert st["spills"] == st["restores"] + st["warm_drops"]
    m.check_invariants()


def test_warm_sessions_expire_after_warm_ttl(synthetic_model):
    _, m, ad, clock = _manager(
        synthetic_model, max_sessions=2, context_tokens=16, ttl_seconds=10, warm_bytes=1 << 20, warm_ttl_seconds=100
    )
    ad.prefill("a", 0, token_ids=[1, 2, 3])
    clock.advance(11)
    m.sweep()
    assert m.resolve("a", 0).tier == Tier.WARM  # idle past ttl: spilled, not lost
    clock.advance(90)
    assert isinstance(m.resolve("a", 0), CacheMiss) and m.resolve("a", 0).reason == CacheMissReason.EVICTED_TTL


def test_a_full_warm_tier_drops_its_least_recently_used_session(synthetic_model):
    _, probe, ad, _ = _manager(synthetic_model, max_sessions=1, context_tokens=16, warm_bytes=1 << 20)
    ad.prefill("a", 0, token_ids=[1, 2, 3])
    ad.prefill("b", 0, token_ids=[4, 5, 6])
    one_session = probe.stats()["warm_bytes"]  # what "a" (3 tokens) costs in the tier

    _, m, ad, _ = _manager(synthetic_model, max_sessions=1, context_tokens=16, warm_bytes=one_session + 10)
    ad.prefill("a", 0, token_ids=[1, 2, 3])
    ad.prefill("b", 0, token_ids=[4, 5, 6])  # "a" warm
    ad.prefill("c", 0, token_ids=[7, 8, 9])  # "b" warm: "a" is dropped to make room
    assert m.resolve("a", 0).reason == CacheMissReason.EVICTED_LRU
    assert m.resolve("b", 0).tier == Tier.WARM
    st = m.stats()
    assert (st["spills"], st["warm_drops"], st["warm_sessions"]) == (2, 1, 1) and st["warm_bytes"] <= one_session + 10

    _, m, ad, _ = _manager(synthetic_model, max_sessions=1, context_tokens=16, warm_bytes=1)
    ad.prefill("a", 0, token_ids=[1, 2, 3])
    assert isinstance(ad.prefill("b", 0, token_ids=[4]), TailOutput)  # "a" fits no tier: dropped, the step goes on
    assert m.resolve("a", 0).reason == CacheMissReason.EVICTED_LRU
    assert m.stats()["spills"] == 0


@pytest.fixture(scope="module")
def head_dim_32_model(model_dir):
    """Quantized KV types need heads of a multiple of 32 values."""
    return write_synthetic_gguf(
        model_dir / "llama-head32.gguf", SyntheticSpec(n_layer=3, n_embd=64, n_head=2, n_head_kv=1)
    )


@pytest.mark.parametrize("kv_type, ratio", [("f16", 1.0), ("q8_0", 34 / 64), ("q4_0", 18 / 64)])
def test_kv_types_cost_what_python_and_the_native_engine_say(head_dim_32_model, synthetic_model, kv_type, ratio):
    model = ShardModel(str(head_dim_32_model), None, 1)
    info = model.info
    f16 = kv_bytes_per_token(info.n_head_kv, info.head_dim, info.n_layer, "f16")
    assert f16 == info.kv_bytes_per_token
    m = HotKvStateManager(model, HotKvStateConfig(max_sessions=2, context_tokens=64, kv_type=kv_type), n_batch=8)
    assert m.stats()["kv_bytes_per_token"] == kv_bytes_per_token(info.n_head_kv, info.head_dim, info.n_layer, kv_type)
    assert m.stats()["kv_bytes_per_token"] == int(f16 * ratio)
    assert m.recipe.kv_dtype == kv_type
    out = KvBoundaryAdapter(model, m).prefill("a", 0, token_ids=[1, 2, 3])
    assert isinstance(out, TailOutput) and np.isfinite(out.logits).all()
    if kv_type == "f16":
        with pytest.raises(InvalidInputError, match="head size"):  # 16-value heads cannot be quantized
            HotKvStateManager(ShardModel(str(synthetic_model), None, 1), HotKvStateConfig(kv_type="q8_0"))
    else:
        other = HotKvStateManager(model, HotKvStateConfig(max_sessions=1, context_tokens=64), n_batch=8)
        assert not other.recipe.is_compatible(m.recipe)  # shards of one route must agree on the KV type


def head_dim_32_model_info():
    import types

    return types.SimpleNamespace(n_head_kv=2, head_dim=64, first=0, last=14)


def test_sizes_and_the_memory_plan(synthetic_model):
    assert parse_size("512MiB") == 512 << 20 and parse_size("2GiB") == 2 << 30 and parse_size("1.5G") == 1_500_000_000
    assert parse_size("4096") == 4096
    for bad in ("", "12 parsecs", "-1", "MiB"):
        with pytest.raises(ValueError):
            parse_size(bad)
    model = ShardModel(str(synthetic_model), None, 1)
    bpt = model.info.kv_bytes_per_token
    plan = memory_plan(model.info, kv_memory=10 * 256 * bpt + 5, context_tokens=256, n_batch=64)
    assert plan.hot_slots == 10 and plan.slot_cells == 256 and plan.hot_bytes == 10 * 256 * bpt
    assert plan.config().max_sessions == 10 and plan.config().budget_tokens == 10 * 256
    # a context that is not a multiple of 256 cells still costs the padded stream
    assert memory_plan(model.info, kv_memory=10 * 256 * bpt, context_tokens=200, n_batch=64).hot_slots == 10
    with pytest.raises(InvalidInputError, match="does not fit"):
        memory_plan(model.info, kv_memory=256 * bpt - 1, context_tokens=256, n_batch=64)
    q8 = memory_plan(head_dim_32_model_info(), kv_memory=1 << 30, context_tokens=256, n_batch=64, kv_type="q8_0")
    f16 = memory_plan(head_dim_32_model_info(), kv_memory=1 << 30, context_tokens=256, n_batch=64)
    assert q8.kv_bytes_per_token * 64 == f16.kv_bytes_per_token * 34
    assert "hot" in plan.describe() and "warm" in plan.describe()


def test_warm_config_from_env():
    env = {"LLAMA_SHARD_WARM_BYTES": "256MiB", "LLAMA_SHARD_KV_TYPE": "Q8_0", "LLAMA_SHARD_WARM_TTL_SECONDS": "60"}
    cfg = HotKvStateConfig.from_env(env)
    assert (cfg.warm_bytes, cfg.kv_type, cfg.warm_ttl_seconds) == (256 << 20, "q8_0", 60.0)
    with pytest.raises(InvalidInputError):
        HotKvStateConfig.from_env({"LLAMA_SHARD_KV_TYPE": "f8"})
    with pytest.raises(InvalidInputError):
        HotKvStateConfig.from_env({"LLAMA_SHARD_WARM_BYTES": "lots"})


# --- the disk tier -----------------------------------------------------------------------------


@pytest.mark.model
def test_a_restarted_route_resumes_its_sessions_from_disk_bit_exact(embedded_model, tmp_path):
    roomy = Route(embedded_model, HotKvStateConfig(max_sessions=8, context_tokens=256))
    expected = roomy.round_robin(6)

    def config(shard):  # 2 hot slots, a host tier of about one session, the rest on disk
        return HotKvStateConfig(
            max_sessions=2,
            context_tokens=256,
            warm_bytes=300_000,
            warm_dir=str(tmp_path / shard),
            warm_disk_bytes=64 << 20,
        )

    first = Route(embedded_model, config("head"), config("tail"))  # one directory per worker
    history = first.round_robin(3)
    past = {sid: len(first.head.tokenize(p)) + 3 for sid, p in zip(map(str, range(len(PROMPTS))), PROMPTS)}
    assert [m.persist() for m in first.managers] == [8, 8]  # a worker's SIGTERM drain with a disk tier
    del first

    second = Route(embedded_model, config("head"), config("tail"))  # a new process would see the same files
    assert all(m.stats()["disk_loaded"] == 8 for m in second.managers)
    assert all(s.tier == Tier.DISK for s in second.managers[0].sessions())
    for _ in range(3):
        for sid in history:
            out = second.decode(sid, history[sid][-1][0], past[sid])
            assert isinstance(out, TailOutput), out
            past[sid] += 1
            history[sid].append((out.token_id, out.logits.tobytes()))
    assert history == expected
    for m in second.managers:
        st = m.stats()
        m.check_invariants()
        assert st["disk_restores"] >= 8 and sum(st["misses"].values()) == 0 and st["disk_failures"] == 0, st


def _disk_manager(path, warm_dir, kv_type="f16"):
    model = ShardModel(str(path), None, 1)
    config = HotKvStateConfig(
        max_sessions=1, context_tokens=16, warm_dir=str(warm_dir), warm_disk_bytes=1 << 20, kv_type=kv_type
    )
    manager = HotKvStateManager(model, config, ManualClock(), n_batch=8)
    return manager, KvBoundaryAdapter(model, manager)


def _one_file_on_disk(path, warm_dir):
    m, ad = _disk_manager(path, warm_dir)
    ad.prefill("a", 0, token_ids=[1, 2, 3])
    ad.prefill("b", 0, token_ids=[4])  # "a" goes to disk (no host tier)
    assert m.resolve("a", 0).tier == Tier.DISK
    files = list(warm_dir.glob("*.kv"))
    assert len(files) == 1
    return m, ad, files[0]


def test_a_corrupt_file_is_refused_deleted_and_logged(synthetic_model, tmp_path, capfd):
    m, ad, f = _one_file_on_disk(synthetic_model, tmp_path / "w")
    data = bytearray(f.read_bytes())
    data[-5] ^= 0xFF  # one payload byte
    f.write_bytes(bytes(data))
    out = ad.decode("a", 0, token_ids=[5])
    assert isinstance(out, CacheMiss) and out.reason == CacheMissReason.EVICTED_LRU
    assert not f.exists() and "payload digest mismatch" in capfd.readouterr().err
    assert m.stats()["disk_failures"] == 1
    m.check_invariants()


class KvFile:
    """A warm file taken apart (kv_file_store.cpp's layout, version 2): the signed header fields,
    the payload's SHA-256, the HMAC and the payload. `signed(key)` puts it back together the way a
    holder of the directory's key would."""

    def __init__(self, data: bytes):
        import struct

        self.fields, at = [], 4
        assert data[:4] == b"LSKV"

        def take(fmt):
            nonlocal at
            value = struct.unpack_from(fmt, data, at)
            at += struct.calcsize(fmt)
            return value[0]

        def take_str():
            nonlocal at
            n = take("<I")
            at += n
            return data[at - n : at]

        self.version = take("<I")
        self.fingerprint, self.model = take_str(), take_str()
        self.first, self.last, self.n_layer = take("<i"), take("<i"), take("<i")
        self.kv_type, self.sid = take_str(), take_str()
        self.epoch, self.seq_len, payload_bytes = take("<q"), take("<i"), take("<Q")
        self.payload_sha, self.mac = data[at : at + 32], data[at + 32 : at + 64]
        self.payload = bytearray(data[at + 64 :])
        assert len(self.payload) == payload_bytes

    def signed(self, key: bytes) -> bytes:
        import hashlib
        import hmac
        import struct

        def s(b):
            return struct.pack("<I", len(b)) + b

        head = (
            b"LSKV"
            + struct.pack("<I", self.version)
            + s(self.fingerprint)
            + s(self.model)
            + struct.pack("<iii", self.first, self.last, self.n_layer)
            + s(self.kv_type)
            + s(self.sid)
            + struct.pack("<qiQ", self.epoch, self.seq_len, len(self.payload))
            + hashlib.sha256(self.payload).digest()
        )
        return head + hmac.new(key, head, hashlib.sha256).digest() + bytes(self.payload)


def test_a_file_not_signed_with_the_directorys_key_is_refused(synthetic_model, tmp_path, capfd):
    """Anyone who could write the directory could mint a file for any session (the checksum was
    unkeyed): now a file must carry an HMAC under the directory's key. A header edited to move a
    session to another epoch, a file signed with a guessed key, and another worker's file copied
    in are each deleted with a log line, and the session is a miss."""
    warm_dir = tmp_path / "w"
    m, ad, f = _one_file_on_disk(synthetic_model, warm_dir)
    key = (warm_dir / "llama-shard.key").read_bytes()
    assert len(key) == 32 and (warm_dir / "llama-shard.key").stat().st_mode & 0o777 == 0o600
    original = f.read_bytes()
    del m, ad

    kv = KvFile(original)
    kv.epoch = 7  # the same payload under another epoch, re-hashed
    f.write_bytes(kv.signed(b"\0" * 32))  # ... signed with a key the attacker guessed
    m, ad = _disk_manager(synthetic_model, warm_dir)
    assert m.stats()["disk_loaded"] == 0 and not f.exists()
    assert "not signed with this directory's key" in capfd.readouterr().err

    other_dir = tmp_path / "other"  # another worker's directory, same model and shard
    m2, ad2, f2 = _one_file_on_disk(synthetic_model, other_dir)
    del m2, ad2
    f.write_bytes(f2.read_bytes())  # its file, transplanted
    m, ad = _disk_manager(synthetic_model, warm_dir)
    assert m.stats()["disk_loaded"] == 0 and not f.exists()
    assert "not signed with this directory's key" in capfd.readouterr().err

    f.write_bytes(original)  # this directory's own file comes back
    m, ad = _disk_manager(synthetic_model, warm_dir)
    assert m.stats()["disk_loaded"] == 1
    assert isinstance(ad.decode("a", 0, token_ids=[5]), TailOutput)
    m.check_invariants()


CROSS_READ = """
import sys
import llama_shard as ls
from llama_shard._native import warm_sha256
model = ls.ShardModel(sys.argv[2], None, 1)
config = ls.HotKvStateConfig(max_sessions=1, context_tokens=16, warm_dir=sys.argv[1], warm_disk_bytes=1 << 20)
m = ls.HotKvStateManager(model, config, ls.ManualClock(), n_batch=8)
ad = ls.KvBoundaryAdapter(model, m)
if sys.argv[3] == "write":
    ad.prefill("a", 0, token_ids=[1, 2, 3])
    print(warm_sha256(), m.persist())
else:
    out = ad.decode("a", 0, token_ids=[5])
    print(warm_sha256(), m.stats()["disk_loaded"], type(out).__name__, out.logits.tobytes().hex() if hasattr(out, "logits") else "")
"""


def test_files_written_with_one_sha256_are_read_with_the_other(synthetic_model, tmp_path):
    """The MAC's SHA-256 is OpenSSL's where the build found it and the vendored C otherwise (or with
    LLAMA_SHARD_SHA256=vendored): a file written by either is read by either, and the session
    decodes the same logits."""
    import os
    import subprocess
    import sys

    def run(warm_dir, mode, sha):
        env = dict(os.environ)
        env.pop("LLAMA_SHARD_SHA256", None)
        if sha == "vendored":
            env["LLAMA_SHARD_SHA256"] = "vendored"
        res = subprocess.run(
            [sys.executable, "-c", CROSS_READ, str(warm_dir), str(synthetic_model), mode],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert res.returncode == 0, res.stderr
        return res.stdout.split()

    reads = []
    for writer, reader in (("default", "vendored"), ("vendored", "default")):
        warm_dir = tmp_path / f"{writer}-{reader}"
        assert run(warm_dir, "write", writer)[1] == "1"
        reads.append(run(warm_dir, "read", reader))
    assert [r[1:3] for r in reads] == [["1", "TailOutput"]] * 2
    assert reads[0][3] == reads[1][3]
    assert reads[0][0] == "vendored"


@pytest.mark.parametrize("trap", ["group_readable", "wrong_size", "symlink", "fifo"])
def test_a_bad_key_file_is_refused(synthetic_model, tmp_path, trap):
    """The key must be this user's, private, 32 bytes and a regular file: anything else refuses to
    start (InvalidInputError; `serve` exits 2 with the reason), never opens a link or blocks."""
    import os
    import subprocess
    import sys

    warm_dir = tmp_path / "w"
    warm_dir.mkdir(mode=0o700)
    key = warm_dir / "llama-shard.key"
    if trap == "group_readable":
        key.write_bytes(os.urandom(32))
        key.chmod(0o640)
    elif trap == "wrong_size":
        key.write_bytes(b"short")
        key.chmod(0o600)
    elif trap == "symlink":
        (tmp_path / "elsewhere").write_bytes(os.urandom(32))
        key.symlink_to(tmp_path / "elsewhere")
    else:
        os.mkfifo(key)
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "llama_shard.cli",
            "serve",
            "--model",
            str(synthetic_model),
            "--port",
            "0",
            "--warm-dir",
            str(warm_dir),
            "--warm-disk",
            "1MiB",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2 and "the warm tier's key" in res.stderr, res.stderr
    with pytest.raises(InvalidInputError, match="the warm tier's key"):
        _disk_manager(synthetic_model, warm_dir)


def test_a_signed_state_with_wrong_positions_is_refused(synthetic_model, tmp_path, capfd):
    """llama.cpp restores whatever positions a state lists: a cell at position -1 loaded and the
    session decoded wrong logits. The restore now reads the cell list first (kv_state_check.h):
    even a file signed with the right key is refused unless its positions are exactly 0..n-1."""
    from llama_shard._native import kv_state_problem

    warm_dir = tmp_path / "w"
    m, ad, f = _one_file_on_disk(synthetic_model, warm_dir)
    key = (warm_dir / "llama-shard.key").read_bytes()
    kv = KvFile(f.read_bytes())
    assert kv_state_problem(bytes(kv.payload), 3) == ""
    assert "holds 3 cells for 4 tokens" in kv_state_problem(bytes(kv.payload), 4)
    cells = _cell_offsets(kv.payload, 3)
    kv.payload[cells[0] : cells[0] + 4] = (-1).to_bytes(4, "little", signed=True)
    assert "cell 0 at position -1, expected 0" in kv_state_problem(bytes(kv.payload), 3)
    f.write_bytes(kv.signed(key))
    out = ad.decode("a", 0, token_ids=[5])
    assert isinstance(out, CacheMiss) and out.reason == CacheMissReason.EVICTED_LRU
    assert "refused a state of 3 tokens: cache 0 cell 0 at position -1" in capfd.readouterr().err
    assert m.stats()["disk_failures"] == 1 and not f.exists()
    m.check_invariants()


@pytest.mark.parametrize("where", ["K", "V"])
def test_a_signed_state_with_a_value_that_is_not_finite_is_refused(synthetic_model, tmp_path, capfd, where):
    """A NaN or Inf row restores without an error and every later token is garbage: a file read back
    is checked to its values (kv_state_check.h), even one signed with the directory's key; the
    session it held is a miss (re-prefilled by the head), the others are untouched."""
    from llama_shard._native import kv_state_problem
    from llama_shard.testing.kv_state import F16_INF, F16_NAN, state_rows, with_f16

    warm_dir = tmp_path / "w"
    m, ad, f = _one_file_on_disk(synthetic_model, warm_dir)
    key = (warm_dir / "llama-shard.key").read_bytes()
    kv = KvFile(f.read_bytes())
    state = bytes(kv.payload)
    assert kv_state_problem(state, 3, values=True) == ""
    rows = [r for r in state_rows(state) if r.kind == where]
    for bits in (F16_NAN, F16_INF):
        bad = with_f16(state, rows[-1].offset + rows[-1].size - 2, bits)
        assert kv_state_problem(bad, 3) == ""  # its positions are fine: only the values are not
        assert "not finite" in kv_state_problem(bad, 3, values=True)
    kv.payload[:] = with_f16(state, rows[0].offset, F16_NAN)
    f.write_bytes(kv.signed(key))
    out = ad.decode("a", 0, token_ids=[5])
    assert isinstance(out, CacheMiss) and out.reason == CacheMissReason.EVICTED_LRU
    refused = f"refused a state of 3 tokens: {where} rows of layer 0 hold a value that is not finite"
    assert refused in capfd.readouterr().err
    assert m.stats()["disk_failures"] == 1 and not f.exists()
    assert m.resolve("b", 0).seq_len == 1  # the other session is held still (the restore made room first)
    m.check_invariants()


def _cell_offsets(state: bytes, seq_len: int) -> list[int]:
    """Where each cell's position lies in a one-cache state (magic, seq id, stream count, the cell
    count of each stream: the sequence's stream is the one whose count is seq_len)."""
    import struct

    n_stream = struct.unpack_from("<I", state, 8)[0]
    at = 12
    for _ in range(n_stream):
        (count,) = struct.unpack_from("<I", state, at)
        at += 4
        if count == seq_len:
            return [at + 12 * i for i in range(seq_len)]
    raise AssertionError("no stream holds the sequence")


def test_the_state_check_survives_any_damage(synthetic_model, tmp_path):
    """Every truncation and every single-byte change of a real state either passes (a byte of K/V
    rows) or is named; none crashes the reader."""
    from llama_shard._native import kv_state_problem

    m, ad, f = _one_file_on_disk(synthetic_model, tmp_path / "w")
    state = bytes(KvFile(f.read_bytes()).payload)
    for n in range(len(state)):
        assert kv_state_problem(state[:n], 3) != ""
    rows = 0
    for i in range(len(state)):
        for flip in (0x01, 0x80, 0xFF):
            damaged = bytearray(state)
            damaged[i] ^= flip
            rows += kv_state_problem(bytes(damaged), 3) == ""
    assert 0 < rows < 3 * len(state)
    for seq_len in (-1, 0, 2, 4, 1 << 30):
        assert kv_state_problem(state, seq_len) != ""
    # the value check too: any damage passes or is named
    for n in range(0, len(state), 7):
        assert kv_state_problem(state[:n], 3, values=True) != ""
    for i in range(len(state)):
        damaged = bytearray(state)
        damaged[i] ^= 0x7C
        kv_state_problem(bytes(damaged), 3, values=True)


@pytest.mark.parametrize("damage", ["truncated", "foreign_recipe", "foreign_range", "foreign_model", "flash_attn_off"])
def test_bad_files_are_deleted_at_start_up(synthetic_model, tmp_path, capfd, damage):
    warm_dir = tmp_path / "w"
    m, _, f = _one_file_on_disk(synthetic_model, warm_dir)
    del m
    if damage == "truncated":
        f.write_bytes(f.read_bytes()[:-10])
    if damage == "foreign_range":
        model = ShardModel(str(synthetic_model), (0, 2), 1)
        m = HotKvStateManager(
            model,
            HotKvStateConfig(max_sessions=1, context_tokens=16, warm_dir=str(warm_dir), warm_disk_bytes=1 << 20),
            n_batch=8,
        )
    elif damage == "foreign_recipe":  # another shard's file: the same range under another recipe
        from llama_shard._native import HotKvConfig, HotKvEngine

        engine = HotKvEngine(
            ShardModel(str(synthetic_model), None, 1),
            HotKvConfig(
                max_sessions=1,
                context_tokens=16,
                budget_tokens=16,
                ttl_seconds=0.0,
                n_batch=8,
                recent_capacity=16,
                warm_dir=str(warm_dir),
                warm_disk_bytes=1 << 20,
                recipe_fingerprint="another-recipe",
            ),
        )
        m = None
        assert engine.stats()["disk_loaded"] == 0
    elif damage == "flash_attn_off":  # the same shard restarted with --flash-attn off: V is laid out transposed
        model = ShardModel(str(synthetic_model), None, 1)
        m = HotKvStateManager(
            model,
            HotKvStateConfig(
                max_sessions=1, context_tokens=16, warm_dir=str(warm_dir), warm_disk_bytes=1 << 20, flash_attn=False
            ),
            n_batch=8,
        )
    elif damage == "foreign_model":  # the same shape and recipe, other weights (a fine-tune, say)
        other = write_synthetic_gguf(tmp_path / "other.gguf", SyntheticSpec(seed=99))
        m, _ = _disk_manager(other, warm_dir)
    else:
        m, _ = _disk_manager(synthetic_model, warm_dir)
    if m is not None:
        assert m.stats()["disk_loaded"] == 0
    assert not f.exists()
    assert "llama-shard warm tier: deleted" in capfd.readouterr().err


def test_a_model_changed_only_in_its_middle_is_another_model(embedded_model, tmp_path, capfd):
    """The digest sampled the file's size and its first and last MiB: a model re-quantised or
    fine-tuned in place with the same size kept the same digest, and its old KV files loaded. Now
    the digest reads every byte (XXH3-128, about 30 ms for this 98 MB file)."""
    import shutil

    from llama_shard._native import model_digest

    copy = tmp_path / "copy.gguf"
    shutil.copyfile(embedded_model, copy)
    warm_dir = tmp_path / "w"
    m, ad, f = _one_file_on_disk(copy, warm_dir)
    del m, ad
    before = model_digest(str(copy))
    data = bytearray(copy.read_bytes())
    middle = len(data) // 2  # inside the tensor data, far from either end
    data[middle] ^= 0x01
    copy.write_bytes(bytes(data))
    assert len(data) > 4 << 20 and model_digest(str(copy)) != before
    assert model_digest(str(copy)).split("-")[0] == before.split("-")[0] == str(len(data))
    m, _ = _disk_manager(copy, warm_dir)
    assert m.stats()["disk_loaded"] == 0 and not f.exists()
    assert "written for another model file" in capfd.readouterr().err


def test_a_file_that_is_not_ours_is_left_alone_at_start_up(synthetic_model, tmp_path, capfd):
    """An operator's file named *.kv (not this format) is logged and kept, not deleted."""
    warm_dir = tmp_path / "w"
    m, _, f = _one_file_on_disk(synthetic_model, warm_dir)
    del m
    f.write_bytes(b"an operator's notes, not a KV file\n")
    m, _ = _disk_manager(synthetic_model, warm_dir)
    assert m.stats()["disk_loaded"] == 0
    assert f.read_bytes() == b"an operator's notes, not a KV file\n"
    assert "left alone" in capfd.readouterr().err


@pytest.mark.parametrize(
    "mode,why", [(0o777, "writable by others"), (0o770, "writable by others"), (0o722, "writable by others")]
)
def test_a_warm_directory_others_can_write_is_refused(synthetic_model, tmp_path, mode, why):
    """Whoever can write the directory can plant files the worker loads: the engine refuses it, and
    `serve` exits 2 with the reason."""
    import subprocess
    import sys

    warm_dir = tmp_path / "w"
    warm_dir.mkdir()
    warm_dir.chmod(mode)
    with pytest.raises(InvalidInputError, match=why):
        _disk_manager(synthetic_model, warm_dir)
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "llama_shard.cli",
            "serve",
            "--model",
            str(synthetic_model),
            "--port",
            "0",
            "--warm-dir",
            str(warm_dir),
            "--warm-disk",
            "1MiB",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2 and why in res.stderr, res.stderr
    warm_dir.chmod(0o700)
    m, _ = _disk_manager(synthetic_model, warm_dir)  # this user's, not writable by others: fine
    m.check_invariants()


DIRECTORY_TRAPS = """
import os, sys
import llama_shard as ls
warm_dir, victim = sys.argv[1], sys.argv[2]
os.mkfifo(os.path.join(warm_dir, "0123456789abcdef0123456789abcdef.kv"))      # a FIFO: opening it blocks
os.symlink(victim, os.path.join(warm_dir, "fedcba9876543210fedcba9876543210.kv"))  # a link to someone's file
model = ls.ShardModel(sys.argv[3], None, 1)
config = ls.HotKvStateConfig(max_sessions=1, context_tokens=16, warm_dir=warm_dir, warm_disk_bytes=1 << 20)
m = ls.HotKvStateManager(model, config, ls.ManualClock(), n_batch=8)        # the start-up scan
ad = ls.KvBoundaryAdapter(model, m)
ad.prefill("a", 0, token_ids=[1, 2, 3])
ad.prefill("b", 0, token_ids=[4])                                         # "a" goes to disk
name = [f for f in os.listdir(warm_dir) if f.endswith(".kv") and os.path.isfile(os.path.join(warm_dir, f))
        and not os.path.islink(os.path.join(warm_dir, f))][0]
os.symlink(victim, os.path.join(warm_dir, name[:-3] + ".kv.tmp"))          # a link at the next temporary name
ad.decode("a", 0, token_ids=[5])                                          # "a" back, "b" to disk ...
ad.decode("b", 0, token_ids=[6])                                          # ... and "a" written again, via the name
m.check_invariants()
print("OK", m.stats()["disk_failures"])
"""


def test_the_warm_directory_does_not_follow_links_or_block_on_fifos(synthetic_model, tmp_path):
    """A FIFO named *.kv kept the worker from ever serving; a symlink at the temporary name was
    followed and its target overwritten. Now: the scan never blocks or follows (both are left
    alone, logged), and a write never goes through a planted link (it is removed, not its target)."""
    import subprocess
    import sys

    warm_dir, victim = tmp_path / "w", tmp_path / "victim.txt"
    warm_dir.mkdir(mode=0o700)
    victim.write_text("precious\n")
    res = subprocess.run(
        [sys.executable, "-c", DIRECTORY_TRAPS, str(warm_dir), str(victim), str(synthetic_model)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0 and "OK 0" in res.stdout, res.stderr
    assert victim.read_text() == "precious\n"
    assert "left alone" in res.stderr
    assert (warm_dir / "0123456789abcdef0123456789abcdef.kv").exists()  # not ours: kept
    assert (warm_dir / "fedcba9876543210fedcba9876543210.kv").is_symlink()


def test_an_unwritable_directory_degrades_to_a_miss(synthetic_model, tmp_path, capfd):
    warm_dir = tmp_path / "w"
    m, ad = _disk_manager(synthetic_model, warm_dir)
    import shutil

    shutil.rmtree(warm_dir)
    warm_dir.write_text("a file where the directory was")
    ad.prefill("a", 0, token_ids=[1, 2, 3])
    assert isinstance(ad.prefill("b", 0, token_ids=[4]), TailOutput)  # the step that evicted "a" goes on
    assert m.resolve("a", 0).reason == CacheMissReason.EVICTED_LRU
    assert "cannot write" in capfd.readouterr().err
    assert m.stats()["disk_failures"] == 1
    m.check_invariants()


def test_release_and_a_new_epoch_delete_the_file(synthetic_model, tmp_path):
    m, ad, f = _one_file_on_disk(synthetic_model, tmp_path / "w")
    assert m.release("a", 0) and not f.exists()
    m, ad, f = _one_file_on_disk(synthetic_model, tmp_path / "v")
    assert isinstance(ad.decode("a", 3, token_ids=[1]), CacheMiss) and not f.exists()
    assert m.stats()["disk_sessions"] == 0 and m.stats()["disk_bytes"] == 0
