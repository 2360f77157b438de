"""Flash attention on and off for whole requests, and the chained route's ceiling measured.

1. One worker (the whole model) serves N Generate streams opened at once (the bench's
   `ours_generate_streams`), with `--flash-attn on` and `off`, for each prompt/generation shape;
   beside it stock llama-batched-bench from the same pin with `-fa on` and `-fa off` (decode and
   prefill tok/s at N sessions).
2. The ceiling of two chained 1-thread workers: two stock `llama-batched-bench -t 1 -npl N/2`
   processes run at the same time (what two workers that only compute could reach on this
   machine), beside twice one run alone (the bench's ceiling row).

Every measure runs `--rounds` times, taking turns (docs/benchmarks.md, "Generation in the route").

    python benchmarks/flash_attn_study.py [--shapes 128x64,512x256] [--streams 8] [--rounds 2]
"""
from __future__ import annotations

import argparse
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import find_stock_tools, log, stock_batched_bench
from llama_shard.engine.models import gguf_layer_count, require_embedded_model
from routes import ours_generate_streams

VOCAB = 49152  # ids drawn for the random prompts (below every certified test model's vocabulary)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF file (default: the embedded SmolLM2)")
    ap.add_argument("--shapes", default="128x64,512x256", help="prompt x generated tokens per stream")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    path = Path(args.model) if args.model else require_embedded_model()
    n_layer, n = gguf_layer_count(path), args.streams
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    tools = find_stock_tools()
    bench = tools["llama-batched-bench"] if tools else None

    print("| prompt + generated | streams | Generate, flash attention on | off | "
          "stock batched-bench decode -fa on | off | stock prefill -fa on | off |")
    print("| --- | ---: | --- | --- | --- | --- | --- | --- |")
    for npp, ntg in shapes:
        got: dict[str, list[float]] = {"on": [], "off": [], "stock on": [], "stock off": []}
        stock_pp: dict[str, list[float]] = {"on": [], "off": []}
        for _ in range(args.rounds):
            for fa in ("on", "off"):
                got[fa].append(ours_generate_streams(path, [(0, n_layer - 1)], args.threads, npp, ntg, n, VOCAB,
                                                     worker_flags=("--flash-attn", fa)))
                if bench:
                    context = ("-c", str(max(4096, n * (npp + ntg))))  # later flags win: room for every session
                    r = stock_batched_bench(bench, path, args.threads, npp, ntg, [n], extra=("-fa", fa, *context))[n]
                    got[f"stock {fa}"].append(r["tg"])
                    stock_pp[fa].append(r["pp"])
        cells = [" / ".join(f"{v:.1f}" for v in got[k]) or "n/a" for k in ("on", "off", "stock on", "stock off")]
        cells += [" / ".join(f"{v:.0f}" for v in stock_pp[k]) or "n/a" for k in ("on", "off")]
        print(f"| {npp} + {ntg} | {n} | " + " | ".join(cells) + " |", flush=True)

    if bench:
        def one() -> float:
            return stock_batched_bench(bench, path, 1, 128, 64, [n // 2])[n // 2]["tg"]

        print(f"\n| round | stock -t 1 -npl {n // 2} alone, x2 | two such processes at once, together |")
        print("| ---: | ---: | ---: |")
        for k in range(args.rounds):
            alone = one()
            with ThreadPoolExecutor(2) as pool:
                pair = sum(pool.map(lambda _: one(), range(2)))
            print(f"| {k + 1} | {2 * alone:.1f} | {pair:.1f} |", flush=True)
    else:
        log("stock tools not found: the stock columns and the ceiling are n/a")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
