"""The start-up self-check of the CPU kernels (native/include/llama_shard/cpu_backend.h).

Every fallback is driven on any CPU with LLAMA_SHARD_CPU_PROBE_FAIL (the probe child kills itself
with SIGILL, as a faulting instruction would), each case in a fresh interpreter: a probe that
crashes the worker instead of the child would fail the test, not pytest.

On a CPU with AMX (and a build that carries the AMX kernels) the models run through the AMX path and
through the fallback (AMX off, the same build's AVX-512 kernels), with prefills (the tile kernels),
decodes and batched steps, and the two agree: identical greedy tokens except where the two best
logits are nearer than the kernels differ. Measured on an Intel Xeon with AMX (amx_tile amx_int8
amx_bf16): see AMX_LOGIT_ATOL; the test prints its figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from llama_shard import cpu_backend

PROBE_LINE = "llama-shard: CPU self-check:"

# solo prefills and decodes, the same as one batched step per token, and split-vs-whole in one build
RUN = """
import json, sys
import numpy as np
import llama_shard as ls
from llama_shard import HotKvStateConfig, HotKvStateManager, KvBoundaryAdapter, ManualClock, ShardModel, Step
from llama_shard.engine.pipeline import LocalPipeline

path, out, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
forced = json.loads(sys.argv[4]) if len(sys.argv) > 4 else None  # teacher forcing: another run's tokens
model = ShardModel(path, None, 2)
texts = ["The capital of France is", "def add(a, b):", "Once upon a time,",
         "List the planets of the solar system in order from the sun, with one fact about each: " * 3]
prompts = [model.tokenize(t) for t in texts]
cfg = HotKvStateConfig(max_sessions=4, context_tokens=512, budget_tokens=2048)
solo = KvBoundaryAdapter(model, HotKvStateManager(model, cfg, ManualClock(), n_batch=64))
tokens, logits = [], []
for i, p in enumerate(prompts):
    o = solo.prefill(f"s{i}", 0, token_ids=p)
    t, l = [o.token_id], [o.logits]
    for k in range(steps - 1):
        o = solo.decode(f"s{i}", 0, token_ids=[forced[i][k] if forced else t[-1]])
        t.append(o.token_id)
        l.append(o.logits)
    tokens.append(t)
    logits.append(np.stack(l))
mgr = HotKvStateManager(model, cfg, ManualClock(), n_batch=64)
answers = mgr.step_batch([Step.prefill(f"s{i}", 0, p) for i, p in enumerate(prompts)])
batched = [[int(np.argmax(a))] for _, a in answers]
for _ in range(steps - 1):
    answers = mgr.step_batch([Step.decode(f"s{i}", 0, [batched[i][-1]]) for i in range(len(prompts))])
    for i, (r, a) in enumerate(answers):
        batched[i].append(int(np.argmax(a)))
n = model.info.n_layer
whole = LocalPipeline(path, None, n_ctx=256, n_seq_max=1, n_batch=64, n_threads=2)
split = LocalPipeline(path, [(0, n // 2 - 1), (n // 2, n - 1)], n_ctx=256, n_seq_max=1, n_batch=64, n_threads=2)
a, b = list(whole.generate(prompts[0], 8)), list(split.generate(prompts[0], 8))
split_exact = [t for t, _ in a] == [t for t, _ in b] and all(x.tobytes() == y.tobytes() for (_, x), (_, y) in zip(a, b))
np.savez(out, *logits)
print(json.dumps({"backend": ls.cpu_backend(), "tokens": tokens, "batched": batched, "split_exact": split_exact}))
"""


def _run(
    model, tmp_path, name: str, fail: str | None, steps: int = 16, forced: list[list[int]] | None = None
) -> tuple[dict, list[np.ndarray], str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LLAMA_SHARD_CPU_PROBE_FAIL", "LLAMA_SHARD_CPU_VARIANT")}
    if fail:
        env["LLAMA_SHARD_CPU_PROBE_FAIL"] = fail
    out = tmp_path / f"{name}.npz"
    forcing = [json.dumps(forced)] if forced else []
    res = subprocess.run(
        [sys.executable, "-c", RUN, str(model), str(out), str(steps), *forcing],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert res.returncode == 0, f"exit {res.returncode}: {res.stderr[-3000:]}"
    with np.load(out) as z:
        logits = [z[f"arr_{i}"] for i in range(len(z.files))]
    return json.loads(res.stdout.strip().splitlines()[-1]), logits, res.stderr


def _amx_compiled_in() -> bool:
    c = cpu_backend()
    return "AMX_INT8" in c["features"]


def test_the_self_check_is_reported():
    c = cpu_backend()
    assert c["self_check"].startswith(("passed", "fell back")), c
    assert c["amx"] == ("AMX_INT8" in c["features"] and not any("AMX" in f for f in c["fallbacks"])), c
    if (
        os.environ.get("LLAMA_SHARD_CPU_PROBE_FAIL") is None
        and "amx_tile" in Path("/proc/cpuinfo").read_text()
        and "AMX_INT8" in c["features"]
    ):
        assert c["amx"], f"this CPU has AMX and the kernels carry it, but the self-check turned it off: {c}"


@pytest.mark.model
def test_a_failing_builtin_probe_is_a_clear_error_not_a_crash(embedded_model):
    if cpu_backend()["available"]:
        pytest.skip("a portable build probes variants (test_a_failing_best_variant_picks_the_next)")
    env = dict(os.environ, LLAMA_SHARD_CPU_PROBE_FAIL="built-in")
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "llama_shard.cli",
            "generate",
            "--model",
            str(embedded_model),
            "--split",
            "whole",
            "--prompt",
            "Hello",
            "--max-tokens",
            "2",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert res.returncode == 2, res.stderr[-2000:]
    assert "the CPU kernels built into this module fail on this CPU (killed by SIGILL" in res.stderr
    assert "Fatal Python error" not in res.stderr


@pytest.mark.model
def test_a_failing_best_variant_picks_the_next(embedded_model, tmp_path):
    c = cpu_backend()
    if not c["available"]:
        pytest.skip("a source build has one set of kernels built in (the portable wheel ships variants)")
    # the variant a node picks unforced (this process's may be forced: LLAMA_SHARD_CPU_VARIANT)
    env = {k: v for k, v in os.environ.items() if k not in ("LLAMA_SHARD_CPU_PROBE_FAIL", "LLAMA_SHARD_CPU_VARIANT")}
    best = subprocess.run(
        [sys.executable, "-c", "import llama_shard as ls; print(ls.cpu_backend()['variant'])"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=True,
    ).stdout.strip()
    info, _, err = _run(embedded_model, tmp_path, "next", best, steps=2)
    assert info["backend"]["variant"] != best
    assert err.count(PROBE_LINE) == 1 and f"the {best} kernels failed a probe (killed by SIGILL" in err, err
    assert f"trying the {info['backend']['variant']} kernels" in err


@pytest.mark.model
def test_a_forced_variant_that_fails_its_probe_is_a_clear_error(embedded_model):
    c = cpu_backend()
    if not c["available"]:
        pytest.skip("a source build loads no CPU variant")
    env = dict(os.environ, LLAMA_SHARD_CPU_VARIANT="x64", LLAMA_SHARD_CPU_PROBE_FAIL="x64")
    res = subprocess.run(
        [sys.executable, "-c", "import llama_shard as ls; ls.cpu_backend()"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert res.returncode != 0 and "LLAMA_SHARD_CPU_VARIANT=x64: its kernels failed the self-check" in res.stderr


@pytest.mark.model
def test_a_failing_amx_probe_turns_amx_off_in_one_line(embedded_model, tmp_path):
    if not _amx_compiled_in():
        pytest.skip("these CPU kernels carry no AMX (the AMX probe runs only where they do)")
    info, _, err = _run(embedded_model, tmp_path, "noamx", "amx", steps=2)
    assert not info["backend"]["amx"]
    lines = [line for line in err.splitlines() if line.startswith(PROBE_LINE)]
    assert lines == [
        f"{PROBE_LINE} AMX tiles failed a probe (killed by SIGILL (Illegal instruction)); "
        "running the same kernels without AMX (AVX-512)"
    ], err
    assert info["backend"]["self_check"].startswith("fell back: AMX tiles failed")


# the worst |AMX - fallback| logit difference over the prompts' 64 teacher-forced steps, measured on
# an Intel Xeon with AMX: smollm2 1.678 and gemma3 1.697 (3 near-tie disagreements each); the bound
# leaves room for other CPUs. Different kernels round differently (x64 vs zen4 differ by up to 1.5).
AMX_LOGIT_ATOL = {"smollm2": 3.0, "gemma3": 3.0}


@pytest.mark.model
@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_amx_and_the_fallback_agree(which, embedded_model, gemma3_model, tmp_path):
    """Prefill, decode and batched steps through the AMX kernels, and the fallback fed the same
    tokens: the same greedy choice at every step but near ties (the two best logits nearer than
    the kernels differ), and rarely."""
    if not cpu_backend()["amx"]:
        pytest.skip("AMX is not in use here (no AMX on this CPU or in these kernels): nothing to compare")
    model = embedded_model if which == "smollm2" else gemma3_model
    amx, amx_logits, _ = _run(model, tmp_path, "amx", None)
    off, off_logits, _ = _run(model, tmp_path, "off", "amx", forced=amx["tokens"])
    assert amx["backend"]["amx"] and not off["backend"]["amx"]
    for run in (amx, off):
        assert run["split_exact"], f"split != whole within one build: {run['backend']['self_check']}"
    if which == "smollm2":  # Q4_1: batch shape does not change the greedy tokens (test_batching.py)
        assert amx["batched"] == amx["tokens"]
    worst = max(float(np.abs(a - o).max()) for a, o in zip(amx_logits, off_logits))
    steps = disagreements = 0
    for la, lo in zip(amx_logits, off_logits):
        for a, o in zip(la, lo):
            steps += 1
            if int(np.argmax(a)) != int(np.argmax(o)):
                disagreements += 1
                top2 = np.sort(a)[-2:]
                assert top2[1] - top2[0] < worst, "the choices part where the kernels' differences cannot explain it"
    print(
        f"{which}: worst |AMX - fallback| logit difference {worst:.4f} over {steps} teacher-forced steps; "
        f"{disagreements} greedy disagreements (near ties)"
    )
    assert worst < AMX_LOGIT_ATOL[which]
    assert disagreements <= steps // 10
