"""A session's next turn on top of a long context: what the route costs, and what llama.cpp costs.

One worker (the whole model) holds a session of D random tokens; a Generate stream then sends the
same tokens plus a few new ones, so the head computes only the new ones: its time to first token
is printed for each depth D. Beside it, stock llama-bench from the same pin prefills the same
number of tokens at the same depths with flash attention on (llama.cpp's default on a CPU) and off,
and decodes at the deepest one (docs/benchmarks.md, "A long chat's next turn").

    python benchmarks/continuation_study.py [--depths 100,400,900,1800] [--new 34] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import grpc
import numpy as np
from common import find_stock_tools, log

from llama_shard.engine.models import gguf_layer_count, require_embedded_model
from llama_shard.local_workers import start_worker, stop_worker, wait_serving
from llama_shard.proto import shard_pb2 as pb
from llama_shard.proto import shard_pb2_grpc as pb_grpc


def ours(path: Path, threads: int, depths: list[int], new: int) -> dict[int, float]:
    """Time to first token (s) of a Generate stream adding `new` tokens to a session holding d."""
    proc, addr = start_worker(
        path,
        0,
        gguf_layer_count(path) - 1,
        threads,
        extra=("--context-tokens", str(max(depths) + 2 * new + 8), "--max-sessions", "2"),
    )
    rng = np.random.default_rng(1)
    out = {}
    try:
        wait_serving(proc, addr)
        with grpc.insecure_channel(addr) as ch:
            stub = pb_grpc.ShardServiceStub(ch)
            for d in depths:
                held = rng.integers(100, 10000, d).tolist()
                first = list(
                    stub.Generate(pb.GenerateRequest(session_id=f"d{d}", prompt=held, max_tokens=1), timeout=600)
                )
                prompt = held + [first[0].token.token_id] + rng.integers(100, 10000, new - 1).tolist()
                final = list(
                    stub.Generate(pb.GenerateRequest(session_id=f"d{d}", prompt=prompt, max_tokens=1), timeout=600)
                )[-1].final
                assert final.cached_tokens == d, final  # the sampled token was not computed yet
                out[d] = final.time_to_first_token_s
    finally:
        stop_worker(proc)
    return out


def stock(tool: Path, path: Path, threads: int, depths: list[int], new: int) -> dict[tuple, float]:
    """llama-bench tok/s: ('pp', fa, d) for a prefill of `new` at depth d, ('tg', fa, d) for 16 decoded there."""
    out = {}
    for fa in (1, 0):
        res = subprocess.run(
            [
                str(tool),
                "-m",
                str(path),
                "-t",
                str(threads),
                "-p",
                str(new),
                "-n",
                "16",
                "-r",
                "2",
                "-fa",
                str(fa),
                "-d",
                ",".join(map(str, depths)),
                "-o",
                "json",
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        for r in json.loads(res.stdout):
            out[("pp" if r["n_prompt"] else "tg", fa, r["n_depth"])] = r["avg_ts"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF file (default: the embedded SmolLM2)")
    ap.add_argument("--depths", default="100,400,900,1800")
    ap.add_argument("--new", type=int, default=34, help="tokens added on top (default 34)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    path = Path(args.model) if args.model else require_embedded_model()
    depths = [int(x) for x in args.depths.split(",")]
    log(f"Generate continuation of {args.new} tokens on one worker, {args.threads} threads")
    got = ours(path, args.threads, depths, args.new)
    tools = find_stock_tools()
    peer = stock(tools["llama-bench"], path, args.threads, depths, args.new) if tools else {}
    print(
        f"| held tokens | Generate: first token after {args.new} new | stock pp{args.new}, flash attention on | "
        f"off | stock tg16 there, on | off |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for d in depths:
        cells = [
            f"{peer[(k, fa, d)]:.1f} tok/s" if (k, fa, d) in peer else "n/a"
            for k, fa in (("pp", 1), ("pp", 0), ("tg", 1), ("tg", 0))
        ]
        print(f"| {d} | {got[d] * 1e3:.0f} ms | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
