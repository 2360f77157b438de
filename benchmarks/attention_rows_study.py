"""One step's time by its rows, with llama-shard's flash-attention kernel (patch 0010) and with
upstream's kernels (docs/benchmarks.md, "Flash attention: what nothing set gets"):

    python benchmarks/attention_rows_study.py [--depth 2048] [--rows 1,2,4,8,32,64] [--sessions 1,4,8,16]

The whole embedded model in one HotKvStateManager (`--threads`, 2 by default). A session holding
`--depth` tokens takes a step of r new rows at that depth (a prefill, the same position each time:
best of `--reps`); then N sessions holding `--session-depth` tokens each take one batched decode
step. Each setting runs in its own process, since the kernel switch is read once per process
(LLAMA_SHARD_FLASH_ATTN_TILED_ROWS: 1 llama-shard's kernel, 0 upstream's); "off" is
--flash-attn off.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

SETTINGS = {"llama-shard's kernel": ("1", True), "upstream's kernels": ("0", True), "flash attention off": ("1", False)}


def measure(args) -> dict:
    """In this process: {"rows": {r: ms}, "sessions": {n: ms}}."""
    import numpy as np

    from llama_shard import HotKvStateConfig, HotKvStateManager, ShardModel, Step
    from llama_shard.engine.models import require_embedded_model

    rows = [int(x) for x in args.rows.split(",")]
    sessions = [int(x) for x in args.sessions.split(",")]
    model = ShardModel(str(require_embedded_model()), None, args.threads)
    n_ctx = max(args.depth + max(rows), args.session_depth + 1)
    mgr = HotKvStateManager(
        model,
        HotKvStateConfig(
            max_sessions=max(sessions + [1]), context_tokens=n_ctx, ttl_seconds=0, flash_attn=args.flash_attn
        ),
        n_threads=args.threads,
    )
    rng = np.random.default_rng(1)
    out: dict = {"rows": {}, "sessions": {}}

    def fill(sid: str, n: int) -> None:
        tokens = rng.integers(100, 40000, n).tolist()
        for a in range(0, n, 256):
            mgr.step_batch([Step.prefill(sid, 0, tokens[a : a + 256], start_pos=a)])

    def best(steps) -> float:
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            mgr.step_batch(steps)
            times.append(time.perf_counter() - t0)
        return min(times) * 1e3

    try:
        fill("deep", args.depth)
        more = rng.integers(100, 40000, max(rows)).tolist()
        for r in rows:
            out["rows"][r] = best([Step.prefill("deep", 0, more[:r], start_pos=args.depth)])
        mgr.release("deep", 0)
        for s in range(max(sessions)):
            fill(f"s{s}", args.session_depth)
        for n in sessions:
            out["sessions"][n] = best(
                [Step.prefill(f"s{s}", 0, [1000], start_pos=args.session_depth) for s in range(n)]
            )
    finally:
        mgr.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depth", type=int, default=2048)
    ap.add_argument("--rows", default="1,2,4,8,32,64")
    ap.add_argument("--session-depth", type=int, default=512)
    ap.add_argument("--sessions", default="1,4,8,16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--child", choices=("on", "off"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        args.flash_attn = args.child == "on"
        print(json.dumps(measure(args)))
        return 0
    results = {}
    for name, (tiled_rows, flash_attn) in SETTINGS.items():  # one after another: 2 cores take one at a time
        env = dict(os.environ, LLAMA_SHARD_FLASH_ATTN_TILED_ROWS=tiled_rows)
        cmd = [sys.executable, __file__, *sys.argv[1:], "--child", "on" if flash_attn else "off"]
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
        results[name] = json.loads(res.stdout.strip().splitlines()[-1])
    print_table(
        f"one step of r new rows on a session holding {args.depth} tokens, ms (best of {args.reps})", "rows", results
    )
    print_table(
        f"\none batched decode step of N sessions holding {args.session_depth} tokens each, ms", "sessions", results
    )
    return 0


def print_table(title: str, measure: str, results: dict) -> None:
    """One markdown table: a row per setting, a column per key of results[setting][measure]."""
    keys = list(next(iter(results.values()))[measure])
    print(title + "\n")
    print(f"| {measure} | " + " | ".join(keys) + " |")
    print("| --- |" + " ---: |" * len(keys))
    for name, got in results.items():
        print(f"| {name} | " + " | ".join(f"{got[measure][k]:.1f}" for k in keys) + " |")


if __name__ == "__main__":
    raise SystemExit(main())
