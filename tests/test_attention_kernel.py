"""The CPU flash-attention kernel llama-shard computes with (patch 0010): a row's bytes do not
depend on how many rows share its step, how a prompt is cut into steps, or the thread count.

With upstream's kernels (`LLAMA_SHARD_FLASH_ATTN_TILED_ROWS=0`, run in a subprocess: the switch is
read once per process) a one-row step of 512 or more cells is split among the threads, steps under
64 rows take the one-row kernel and larger ones the tiled one, and the three round differently.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from llama_shard import HotKvStateConfig, HotKvStateManager, ShardModel, Step
from llama_shard._native import cpu_backend
from llama_shard.engine.hot_kv import route_numerics

# one step of 6 rows against 6 one-token steps, at depths under and over 512 cells, 2 threads
_ROWS_AGAINST_ONE_TOKEN_STEPS = """
import json, sys
import numpy as np
from llama_shard import HotKvStateConfig, HotKvStateManager, KvBoundaryAdapter, ShardModel
from llama_shard.engine.hot_kv import route_numerics

model = ShardModel(sys.argv[1], None, 2)
mgr = HotKvStateManager(model, HotKvStateConfig(max_sessions=2, context_tokens=1024, budget_tokens=2048), n_threads=2)
ad = KvBoundaryAdapter(model, mgr)
text = np.random.default_rng(5).integers(100, 40000, 700).tolist()
equal = {}
for depth in (40, 600):
    prompt, more = text[:depth], text[depth:depth + 6]
    ad.prefill("one", 0, prompt, start_pos=0)
    ad.prefill("rows", 0, prompt, start_pos=0)
    singles = [ad.decode("one", 0, [t]).logits.tobytes() for t in more]
    out = ad.prefill("rows", 0, more, start_pos=depth, logit_rows=6)
    equal[depth] = [out.rows[i].tobytes() == singles[i] for i in range(6)]
    mgr.release("one", 0)
    mgr.release("rows", 0)
mgr.close()
print(json.dumps({"equal": equal, "numerics": route_numerics("f16", True)}))
"""


def _rows_against_one_token_steps(model_path, tiled_rows: str | None, **env_extra: str) -> dict:
    env = dict(os.environ, **env_extra)
    env.pop("LLAMA_SHARD_FLASH_ATTN_TILED_ROWS", None)
    if tiled_rows is not None:
        env["LLAMA_SHARD_FLASH_ATTN_TILED_ROWS"] = tiled_rows
    res = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_ROWS_AGAINST_ONE_TOKEN_STEPS), str(model_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.model
@pytest.mark.slow
def test_a_steps_rows_are_one_token_steps_to_the_byte_and_upstreams_kernels_are_not(embedded_model):
    ours = _rows_against_one_token_steps(embedded_model, None)
    assert ours["numerics"] == "K/V f16, flash attention on (llama-shard's kernel)"
    assert ours["equal"] == {"40": [True] * 6, "600": [True] * 6}
    # the control: upstream's kernels split a one-row step of 600 cells among the 2 threads
    upstream = _rows_against_one_token_steps(embedded_model, "0")
    assert upstream["numerics"] == "K/V f16, flash attention on (upstream's kernels)"
    assert upstream["equal"]["40"] == [True] * 6 and not any(upstream["equal"]["600"])


@pytest.mark.model
@pytest.mark.parametrize("variant", ["haswell", "sse42"])
@pytest.mark.slow
def test_other_kernel_families_keep_a_steps_rows_alike(embedded_model, variant):
    """The kernel's AVX2 path (inline f16 loads) and its generic horizontal sum (SSE) on any CPU
    that runs them: the portable build's variants, forced. (sandybridge, AVX without F16C, is not
    here: its Q4_1 matrix kernels round a 6-row step unlike one-token steps with either attention
    kernel, so the logits cannot show the attention's bytes.)"""
    c = cpu_backend()
    if variant not in c["available"]:
        pytest.skip(f"the {variant} kernels are not in this build (a source build has one variant)")
    got = _rows_against_one_token_steps(embedded_model, None, LLAMA_SHARD_CPU_VARIANT=variant)
    assert got["equal"] == {"40": [True] * 6, "600": [True] * 6}


@pytest.mark.model
@pytest.mark.slow
def test_any_cut_of_a_prompt_gives_the_same_logits(embedded_model):
    """Upstream's kernels round a step of under 64 rows (the one-row kernel) unlike a larger one
    (the tiled kernel): the same prompt cut differently gave other logits (benchmarks/chunking_study.py)."""
    model = ShardModel(str(embedded_model), None, 2)
    mgr = HotKvStateManager(model, HotKvStateConfig(max_sessions=2, context_tokens=1024, ttl_seconds=0), n_threads=2)
    tokens = np.random.default_rng(1).integers(100, 40000, 544).tolist()
    logits = {}
    try:
        for cuts in ([], [512], [448], [500], [3], [543], [100, 101, 300]):
            bounds = [0, *cuts, len(tokens)]
            for a, b in zip(bounds, bounds[1:]):
                ((result, out),) = mgr.step_batch([Step.prefill("cut", 0, tokens[a:b], start_pos=a)])
            logits[tuple(cuts)] = np.asarray(out).tobytes()
            mgr.release("cut", 0)
    finally:
        mgr.close()
    assert len(set(logits.values())) == 1, [c for c, v in logits.items() if v != logits[()]]


def test_the_kernel_is_part_of_a_routes_numerics():
    assert cpu_backend()["flash_attn_tiled_rows"] == 1
    assert route_numerics("f16", True) == "K/V f16, flash attention on (llama-shard's kernel)"
    assert route_numerics("q8_0", True) == "K/V q8_0, flash attention on"  # a quantized cache: upstream's kernel
    assert route_numerics("f16", False) == "K/V f16, flash attention off"


@pytest.mark.parametrize("value", ["x", "-1", "4097", "2.5"])
def test_a_bad_override_is_refused_with_its_name(value):
    env = dict(os.environ, LLAMA_SHARD_FLASH_ATTN_TILED_ROWS=value)
    res = subprocess.run(
        [sys.executable, "-c", "from llama_shard._native import cpu_backend; cpu_backend()"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert res.returncode == 1 and "LLAMA_SHARD_FLASH_ATTN_TILED_ROWS=" + value in res.stderr, res.stderr[-2000:]
