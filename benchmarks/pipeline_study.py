"""The pipelining study: the 8-session ratio of two 1-thread stages against llama.cpp's RPC split,
over alternating rounds, in four topologies, with its compute bound and its pipelining ceiling.

    python benchmarks/pipeline_study.py [ROUNDS] [--micro-batches 2] [--model PATH]

docs/benchmarks.md says what the bounds mean and shows the latest output.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
from common import bench_manager, find_stock_tools, model_and_vocab, stock_batched_bench, stock_rpc_split
from routes import TOPOLOGIES, ours_two_stages

from llama_shard import ShardModel, Step
from llama_shard.engine.models import compute_balanced_cut, require_embedded_model


def _stage_step_ms(path: str, layers: tuple[int, int], seconds: float, start=None, out=None) -> float:
    """ms per decode step of 4 sessions (128 cached tokens, kept near that) on one shard, 1 thread.
    With `start` (an Event) the timing begins when it is set; the result also goes to `out`."""
    model = ShardModel(path, layers, 1)
    mgr = bench_manager(model, 4, 512, 1)
    rng = np.random.default_rng(0)
    head = model.info.is_head

    def inputs(n):
        if head:
            return rng.integers(0, model.info.n_vocab, n).tolist(), None
        return None, rng.standard_normal((n, model.info.n_embd)).astype(np.float32)

    mgr.step_batch([Step.prefill(f"s{j}", 0, *inputs(128), start_pos=0) for j in range(4)])
    if start is not None:
        start.wait()
    steps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(8):
            mgr.step_batch([Step.decode(f"s{j}", 0, *inputs(1)) for j in range(4)])
            steps += 1
        for j in range(4):
            mgr.truncate(f"s{j}", 0, 128)
    ms = (time.perf_counter() - t0) / steps * 1e3
    if out is not None:
        out.put((layers, ms))
    return ms


def stage_costs(path: Path, ranges: list[tuple[int, int]], seconds: float) -> dict[str, list[float]]:
    """Each stage's 4-session step time alone, then with both stages computing at once (two
    processes), which is what a pipeline does."""
    import multiprocessing as mp

    alone = [_stage_step_ms(str(path), r, seconds) for r in ranges]
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_stage_step_ms, args=(str(path), r, seconds, start, out)) for r in ranges]
    for pr in procs:
        pr.start()
    time.sleep(5.0)  # both load and prefill before the timing starts (a few hundred ms here)
    start.set()
    together = dict(out.get(timeout=300) for _ in procs)
    for pr in procs:
        pr.join()
    return {"alone": alone, "together": [together[r] for r in ranges]}


def pipeline_study(path: Path, rounds: int, rpc_tools: dict | None, micro_batches: int = 2, quick: bool = False) -> str:
    """The 8-session pipelining ratio over `rounds` alternating rounds, for each topology (two
    worker processes; the head in this process + one worker; both stages in this process, no
    gRPC) against llama.cpp's RPC split, with two bounds: the compute bound from our own stage
    times, and the pipelining ceiling from stock llama.cpp in the same round (a perfect two-stage
    pipeline of 4-session micro-batches runs each half of the model on its own core, so it makes
    twice the whole model's 4-session decode rate)."""
    import statistics

    n_layer, vocab = model_and_vocab(path)
    cut = compute_balanced_cut(path)
    ranges = [(0, cut - 1), (cut, n_layer - 1)]
    lines = [
        f"{path.name}: pipelining at 8 sessions, 1 thread per worker, cut {cut}, "
        f"{micro_batches} micro-batches, {rounds} alternating rounds",
        "",
    ]
    npp, ntg, seconds = (16, 8, 0.3) if quick else (128, 64, 4.0)
    costs = stage_costs(path, ranges, seconds)
    for name, ms in costs.items():
        lines.append(
            f"4-session step, {name}: " + ", ".join(f"layers {a}-{b} {m:.1f} ms" for (a, b), m in zip(ranges, ms))
        )
    # two micro-batches of 4 keep each stage on one 4-session step at a time: 8 tokens per 2 steps
    bound = 8 / (2 * max(costs["together"]) / 1e3) if micro_batches == 2 else None
    if bound:
        lines.append(
            f"compute bound with free transport: 8 tokens per 2 x {max(costs['together']):.1f} ms = {bound:.1f} tok/s"
        )
    ratios: dict[str, list[float]] = {name: [] for name in [*TOPOLOGIES, "ceiling"]}
    peers: list[float] = []
    for k in range(rounds):
        ours = {
            name: ours_two_stages(path, n_layer, npp, ntg, [8], vocab, micro_batches, topology=name)[8]
            for name in TOPOLOGIES
        }
        line = f"round {k + 1}: " + ", ".join(f"{name} {v:.1f}" for name, v in ours.items())
        if rpc_tools:
            peer = stock_rpc_split(rpc_tools, path, n_layer, npp, ntg, [8])[8]["tg"]
            whole = stock_batched_bench(rpc_tools["llama-batched-bench"], path, 1, npp, ntg, [4, 8])
            whole4 = whole[4]["tg"]
            peers.append(peer)
            for name, v in ours.items():
                ratios[name].append(v / peer)
            ratios["ceiling"].append(2 * whole4 / peer)
            line += (
                f"; RPC split {peer:.1f}, stock whole model at 4 sessions {whole4:.1f} (8: {whole[8]['tg']:.1f}) tok/s; ratios "
                + ", ".join(f"{r[-1]:.3f}" for r in ratios.values())
            )
        else:
            line += "; RPC split n/a"
        lines.append(line)
    for name, r in ratios.items():
        if r:
            label = "ceiling (2 x stock whole model at 4 sessions)" if name == "ceiling" else name
            lines.append(
                f"{label} / RPC split: min {min(r):.3f}, median {statistics.median(r):.3f}, max {max(r):.3f}, "
                f"{sum(x >= 1.6 for x in r)} of {len(r)} rounds >= 1.6"
            )
    for name in TOPOLOGIES:
        if ratios["ceiling"]:
            of = [a / c for a, c in zip(ratios[name], ratios["ceiling"])]
            lines.append(
                f"{name} / ceiling (same round): min {min(of):.3f}, median {statistics.median(of):.3f}, "
                f"max {max(of):.3f}, {sum(x >= 0.88 for x in of)} of {len(of)} rounds >= 0.88"
            )
    if peers and bound:
        lines.append(f"compute bound / best RPC split: {bound:.1f} / {max(peers):.1f} = {bound / max(peers):.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/pipeline_study.py", description=__doc__.splitlines()[0])
    ap.add_argument("rounds", type=int, nargs="?", default=5)
    ap.add_argument("--model", help="GGUF file (default: the embedded SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--no-stock", action="store_true", help="skip stock llama.cpp (ratios n/a)")
    ap.add_argument("--no-build", action="store_true", help="use stock tools only if already built")
    ap.add_argument("--quick", action="store_true", help="small shapes (for tests)")
    args = ap.parse_args(argv)
    path = Path(args.model) if args.model else require_embedded_model()
    rpc_tools = None if args.no_stock else find_stock_tools(build=not args.no_build, rpc=True)
    print(pipeline_study(path, args.rounds, rpc_tools, args.micro_batches, args.quick))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
