"""A verification's rows (`row_by_row`: serve --draft-verify exact) are the bytes of one-token steps,
and are computed in one llama_decode call where that is proven: the first verification of each row
count is computed in one call and row by row, and compared (shard_context's whole_rows_verdicts).
Only patch 0010's attention kernel on the CPU makes the comparison hold at every depth, so nothing
is tried elsewhere; a CPU whose matrix kernels round by a call's shape (sandybridge's, with Q4_1)
keeps row by row.

Each case runs in a subprocess: the CPU variant and the attention kernel are chosen once per process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from llama_shard._native import cpu_backend

ONE_CALL = "one call"
SLOWER = "row by row: one call was slower"
DIFFER = "row by row: one call rounded differently"

# for each row count: one-token steps on one session, then the same rows as a verification on
# another, twice (the first is compared, the second follows the verdict), cut back after each
_VERIFY_ROWS = """
import json, sys
import numpy as np
from llama_shard import HotKvStateConfig, HotKvStateManager, KvBoundaryAdapter, ShardModel

layers = json.loads(sys.argv[2])
model = ShardModel(sys.argv[1], tuple(layers) if layers else None, 1)
config = HotKvStateConfig(max_sessions=2, context_tokens=256, flash_attn=sys.argv[3] == "on")
mgr = HotKvStateManager(model, config, n_threads=1)
ad = KvBoundaryAdapter(model, mgr)
info = model.info
rng = np.random.default_rng(7)

def rows(n):
    if info.is_head:
        return {"token_ids": rng.integers(100, 40000, n).tolist()}
    return {"boundary": rng.standard_normal((n, info.n_embd)).astype(np.float32)}

def one_row(out):  # a one-token step's output
    return (out.logits if info.is_tail else out.hidden).tobytes()

depth = 40
prompt = rows(depth)
ad.prefill("one", 0, **prompt, start_pos=0)
ad.prefill("rows", 0, **prompt, start_pos=0)
report = {"equal": {}, "calls": {}}
for m in (2, 6, 9):
    more = rows(m)
    singles = []
    for j in range(m):
        one = {k: (v[j:j + 1]) for k, v in more.items()}
        singles.append(one_row(ad.prefill("one", 0, **one, start_pos=depth + j)))
    kw = {"logit_rows": m} if info.is_tail else {}
    for attempt in range(2):
        before = mgr.n_decode_calls
        out = ad.prefill("rows", 0, **more, start_pos=depth, row_by_row=True, **kw)
        report["calls"].setdefault(str(m), []).append(mgr.n_decode_calls - before)
        if info.is_tail:
            got = [out.rows[i].tobytes() for i in range(m)]
        else:
            got = [out.hidden[i].tobytes() for i in range(m)]
        report["equal"].setdefault(str(m), []).append(got == singles)
    mgr.truncate("one", 0, depth)
    mgr.truncate("rows", 0, depth)
report["verdicts"] = {str(k): v for k, v in mgr.engine.whole_rows_verdicts.items()}
from prometheus_client import CollectorRegistry, generate_latest
from llama_shard.worker.metrics import EngineCollector
registry = CollectorRegistry()
registry.register(EngineCollector(mgr, {"shard": "s"}))
report["metrics"] = sorted(line for line in generate_latest(registry).decode().splitlines()
                           if line.startswith("llama_shard_verification_rows{"))
mgr.close()
print(json.dumps(report))
"""


def _verify_rows(model_path, layers=None, flash_attn: str = "on", **env_extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_SHARD_FLASH_ATTN_TILED_ROWS"}
    env.update(env_extra)
    res = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_VERIFY_ROWS), str(model_path), json.dumps(layers), flash_attn],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.model
def test_a_verifications_rows_are_one_call_where_proven_and_one_token_steps_always(embedded_model):
    taken = []
    for layers in (None, [0, 14], [15, 29]):  # the whole model, a head (token ids), a tail (hidden rows)
        got = _verify_rows(embedded_model, layers)
        assert got["equal"] == {m: [True, True] for m in ("2", "6", "9")}, layers
        assert set(got["verdicts"]) == {"2", "6", "9"}, layers
        for m, verdict in got["verdicts"].items():
            n = int(m)
            assert verdict in (ONE_CALL, SLOWER), (layers, m, verdict)  # this build's kernels: no rounding by shape
            # the first: one call, then each row alone (compared); the second as the verdict says
            assert got["calls"][m] == [n + 1, 1 if verdict == ONE_CALL else n], (layers, m, got["calls"])
            taken.append(verdict == ONE_CALL)
        # the same verdicts on the worker's metrics page
        assert got["metrics"] == sorted(
            f'llama_shard_verification_rows{{shard="s",tokens="{m}",verdict="{v}"}} 1.0'
            for m, v in got["verdicts"].items()
        ), layers
    # nine rows in one call read the weights once instead of nine times: faster on any CPU measured
    assert any(taken)


@pytest.mark.model
def test_nothing_is_tried_where_attention_rounds_by_depth(embedded_model):
    """Flash attention off, or upstream's kernels: a comparison at one depth would prove nothing for
    another (upstream splits a one-row step of 512 cells or more among threads), so rows stay alone."""
    for got in (
        _verify_rows(embedded_model, flash_attn="off"),
        _verify_rows(embedded_model, LLAMA_SHARD_FLASH_ATTN_TILED_ROWS="0"),
    ):
        assert got["verdicts"] == {} and got["metrics"] == []
        assert got["equal"] == {m: [True, True] for m in ("2", "6", "9")}
        assert got["calls"] == {m: [int(m), int(m)] for m in ("2", "6", "9")}


@pytest.mark.model
def test_kernels_that_round_by_a_calls_shape_keep_rows_alone(embedded_model):
    """sandybridge (AVX without F16C): its matrix kernels round a many-row call of the tail's layers
    unlike one-token calls, which the first comparison finds; every row stays a one-token step's."""
    if "sandybridge" not in cpu_backend()["available"]:
        pytest.skip("the sandybridge kernels are not in this build (a source build has one variant)")
    got = _verify_rows(embedded_model, LLAMA_SHARD_CPU_VARIANT="sandybridge")
    assert got["verdicts"]["6"] == DIFFER and got["verdicts"]["9"] == DIFFER
    assert got["equal"] == {m: [True, True] for m in ("2", "6", "9")}
    assert got["calls"]["9"] == [10, 9]


@pytest.mark.model
def test_the_avx2_kernels_keep_a_verifications_rows_exact(embedded_model):
    """The portable build's AVX2 variant forced (no AMX tiles): whatever each size's verdict, every
    row is a one-token step's."""
    if "haswell" not in cpu_backend()["available"]:
        pytest.skip("the haswell kernels are not in this build (a source build has one variant)")
    got = _verify_rows(embedded_model, LLAMA_SHARD_CPU_VARIANT="haswell")
    assert got["equal"] == {m: [True, True] for m in ("2", "6", "9")}
    assert set(got["verdicts"]) == {"2", "6", "9"}
    for m, verdict in got["verdicts"].items():
        assert got["calls"][m][1] == (1 if verdict == ONE_CALL else int(m)), (m, verdict, got["calls"])


@pytest.mark.model
@pytest.mark.grpc
def test_a_worker_decides_its_verification_sizes_before_it_serves(embedded_model):
    """Each size's one-time comparison runs on a scratch session at start-up (verification_sizes), so
    no request pays it: the metrics page has a verdict for every size before the first request, the
    log says which, and the scratch session is gone."""
    import re
    import urllib.request

    from llama_shard._native import MAX_LOGIT_ROWS

    from support.worker import Worker

    w = Worker(embedded_model, "15-29")
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{w.metrics_port}/metrics", timeout=10).read().decode()
    finally:
        _, log = w.stop()
    verdicts = dict(re.findall(r'llama_shard_verification_rows\{[^}]*tokens="(\d+)",verdict="([^"]+)"\} 1\.0', text))
    assert set(map(int, verdicts)) == set(range(2, MAX_LOGIT_ROWS + 1)), text[-2000:]
    assert set(verdicts.values()) <= {ONE_CALL, SLOWER}  # this build's kernels: no rounding by shape
    assert re.search(r'llama_shard_live_sessions\{layers="15-29"\} 0\.0', text)
    assert re.search(r"verifications of .* tokens in one call, .* row by row \(decided in [0-9.]+ s\)", log), log
