"""Two installs of llama-shard side by side: this interpreter's (e.g. the source build, native to
this CPU) against another interpreter's (e.g. a venv with the portable wheel), same model, threads
and shapes, alternating rounds, each side's best kept.

    python benchmarks/compare_builds.py --other /path/to/venv/bin/python [--rounds 3] [--model PATH]
        [--other-benchmarks /path/to/other/checkout/benchmarks]

With --other-benchmarks the other side measures with its own checkout's benchmark code (an A/B
against an older commit whose package layout differs: build it in a worktree into a venv).

Rows: prefill of a 128-token prompt, decode of 1 session, aggregate decode of 8 sessions; the ratio
is the other install over this one. Each side's CPU kernels (cpu_backend()) are printed first.

With --rows adapter: the in-process path users run (the seed's API): 4 and 8 threads, each driving
its own session through `KvBoundaryAdapter(model, manager)` (bench.ours_adapter_callers), beside the
engine's own batched decode at 4 and 8 sessions (bench.ours_batched), both sides measuring with their
own checkout's benchmark functions (the A/B of issue 46's regression: build the older commit in a
worktree into a venv, `-C cmake.define.LLAMA_SHARD_PORTABLE=OFF` on both sides for like builds).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def measure(model: str, threads: int, quick: bool) -> dict:
    """This install's figures (run in the interpreter being measured)."""
    from bench import ours_batched, ours_prefill_and_tg

    from llama_shard import ShardModel, cpu_backend

    vocab = ShardModel(model, (0, 0), 1).info.n_vocab
    npp, ntg, reps = (16, 8, 1) if quick else (128, 64, 3)
    single = ours_prefill_and_tg(Path(model), threads, npp, ntg, reps, vocab)
    batched = ours_batched(Path(model), threads, npp, ntg, [8], vocab)
    backend = cpu_backend()
    return {
        "pp": single["pp"],
        "tg1": single["tg"],
        "tg8": batched[8]["tg"],
        "variant": backend["variant"],
        "features": backend["features"],
    }


#: the adapter rows, run with the measuring side's own bench.py (whose functions kept these signatures)
ADAPTER_MEASURE = """
import json, sys
from pathlib import Path
from bench import ours_adapter_callers, ours_batched
from llama_shard import ShardModel
model, threads, quick = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
vocab = ShardModel(model, (0, 0), 1).info.n_vocab
npp, ntg, npl = (16, 8, [4]) if quick else (128, 64, [4, 8])
callers = ours_adapter_callers(Path(model), threads, npp, ntg, npl, vocab)
engine = ours_batched(Path(model), threads, npp, ntg, npl, vocab)
print(json.dumps({**{f"adapter{n}": callers[n] for n in npl}, **{f"engine{n}": engine[n]["tg"] for n in npl}}))
"""
ADAPTER_ROWS = (
    ("4 threads through KvBoundaryAdapter", "adapter4"),
    ("8 threads through KvBoundaryAdapter", "adapter8"),
    ("engine batched decode, 4 sessions", "engine4"),
    ("engine batched decode, 8 sessions", "engine8"),
)


def run_side(python: str, model: str, threads: int, quick: bool, bench_dir: Path = HERE, rows: str = "build") -> dict:
    if rows == "adapter":
        out = subprocess.run(
            [python, "-c", ADAPTER_MEASURE, model, str(threads), "1" if quick else "0"],
            capture_output=True,
            text=True,
            check=True,
            cwd=bench_dir.parent,
            env=dict(os.environ, PYTHONPATH=str(bench_dir)),
        )
        return json.loads(out.stdout.strip().splitlines()[-1])
    cmd = [python, str(bench_dir / "compare_builds.py"), "--measure", "--model", model, "--threads", str(threads)]
    out = subprocess.run(
        cmd + (["--quick"] if quick else []),
        capture_output=True,
        text=True,
        check=True,
        cwd=bench_dir.parent,
        env=dict(os.environ, PYTHONPATH=str(bench_dir)),
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/compare_builds.py", description=__doc__.splitlines()[0])
    ap.add_argument("--other", help="the other install's python (e.g. a venv with the portable wheel)")
    ap.add_argument(
        "--other-benchmarks",
        type=Path,
        default=HERE,
        help="the benchmarks directory the other side measures with (default: this one)",
    )
    ap.add_argument("--model", help="GGUF file (default: the embedded SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="small shapes (for tests)")
    ap.add_argument(
        "--rows",
        choices=("build", "adapter"),
        default="build",
        help="build: prefill and decode (default); adapter: threads through KvBoundaryAdapter",
    )
    ap.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # one side, as JSON
    args = ap.parse_args(argv)
    if args.model is None:
        from llama_shard.engine.models import require_embedded_model

        args.model = str(require_embedded_model())
    if args.measure:
        print(json.dumps(measure(args.model, args.threads, args.quick)))
        return 0
    if not args.other:
        ap.error("--other PYTHON is required")
    from common import Row, format_table

    sides: dict[str, list[dict]] = {"this": [], "other": []}
    order = [("this", sys.executable, HERE), ("other", args.other, args.other_benchmarks.resolve())]
    for k in range(args.rounds):
        for name, python, bench_dir in order if k % 2 == 0 else order[::-1]:  # neither side always goes first
            sides[name].append(run_side(python, args.model, args.threads, args.quick, bench_dir, args.rows))
            print(f"round {k + 1} {name}: {json.dumps(sides[name][-1])}", file=sys.stderr, flush=True)
    if args.rows == "adapter":
        keys = [(label, key) for label, key in ADAPTER_ROWS if key in sides["this"][0]]
        rows = [
            Row(label, max(r[key] for r in sides["other"]), max(r[key] for r in sides["this"]), "tok/s", ">= 0.97")
            for label, key in keys
        ]
        print(
            format_table(
                rows,
                f"{Path(args.model).name}, {args.threads} threads, {args.rounds} alternating rounds, "
                f"best of each; llama-shard: {args.other}; peer: {sys.executable}",
            )
        )
        for _label, key in keys:
            print(
                f"{key}: this {' '.join(f'{r[key]:.1f}' for r in sides['this'])}; "
                f"other {' '.join(f'{r[key]:.1f}' for r in sides['other'])}"
            )
        return 0
    best = {
        name: {k: max(r[k] for r in runs) for k in ("pp", "tg1", "tg8")}
        | {"variant": runs[0]["variant"], "features": runs[0]["features"]}
        for name, runs in sides.items()
    }
    rows = [
        Row(label, best["other"][key], best["this"][key], "tok/s", ">= 0.97")
        for label, key in (
            ("prefill pp128" if not args.quick else "prefill pp16", "pp"),
            ("decode, 1 session", "tg1"),
            ("aggregate decode, 8 sessions", "tg8"),
        )
    ]
    header = (
        f"{Path(args.model).name}, {args.threads} threads, {args.rounds} alternating rounds, best of each; "
        f"llama-shard: {args.other} (CPU variant {best['other']['variant']}); peer: {sys.executable} "
        f"(CPU variant {best['this']['variant']})"
    )
    print(format_table(rows, header))
    for name in ("this", "other"):
        print(f"{name}: {best[name]['variant']}: {' '.join(best[name]['features'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
