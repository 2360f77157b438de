"""Flash attention on and off for whole requests, and the chained route's ceiling measured.

1. One worker (the whole model) serves N Generate streams opened at once (the bench's
   `ours_generate_streams`), with `--flash-attn on` and `off`, for each prompt/generation shape;
   beside it stock llama-batched-bench from the same pin with `-fa on` and `-fa off` (decode and
   prefill tok/s at N sessions).
2. What a user who sets nothing gets against the better setting, on one worker of the whole model
   (`--threads` threads), end to end through Generate: the decode rows above, the time to first token
   of a fresh 512-token prompt (prefill), and of a chat's next turn (32 new tokens on a session
   holding 2,048: upstream's CPU flash attention computes a step of under 64 rows one query row at
   a time). Beside them, flash attention on with upstream's kernels
   (`LLAMA_SHARD_FLASH_ATTN_TILED_ROWS=0` in the workers' environment): what patch 0010's kernel
   changes.
3. The ceiling of two chained 1-thread workers: two stock `llama-batched-bench -t 1 -npl N/2`
   processes run at the same time (what two workers that only compute could reach on this
   machine), beside twice one run alone (the bench's ceiling row).

Every measure runs `--rounds` times, taking turns (docs/benchmarks.md, "Generation in the route").

    python benchmarks/flash_attn_study.py [--shapes 128x64,512x64,512x256] [--streams 8] [--rounds 2]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from common import find_stock_tools, log, stock_batched_bench
from routes import _first_token_seconds, ours_generate_streams

from llama_shard.engine.models import gguf_layer_count, require_embedded_model
from llama_shard.local_workers import start_worker, stop_worker, wait_serving
from llama_shard.proto import shard_pb2 as pb
from llama_shard.proto import shard_pb2_grpc as pb_grpc

VOCAB = 49152  # ids drawn for the random prompts (below every certified test model's vocabulary)


@contextlib.contextmanager
def worker_kernels(setting: str):
    """Workers started inside see LLAMA_SHARD_FLASH_ATTN_TILED_ROWS=0 for the setting "upstream"."""
    name, before = "LLAMA_SHARD_FLASH_ATTN_TILED_ROWS", os.environ.get("LLAMA_SHARD_FLASH_ATTN_TILED_ROWS")
    if setting == "upstream":
        os.environ[name] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


#: the settings each measure takes turns at: --flash-attn on (nothing set), off, and on with upstream's kernels
SETTINGS = ("on", "off", "upstream")


def ours_prefill_and_turn(path: Path, n_layer: int, threads: int, fa: str) -> dict[str, float]:
    """Seconds to the first token on one worker with `--flash-attn fa`: a fresh
    512-token prompt ("prefill"), and a session holding 2,048 tokens sent 32 more ("turn": the
    same session_id, its prompt the cached one plus the token it got plus 31 new ones)."""
    import grpc

    rng = np.random.default_rng(47)
    new = lambda n: rng.integers(100, VOCAB, n).tolist()  # noqa: E731
    proc, addr = start_worker(
        path,
        0,
        n_layer - 1,
        threads,
        extra=("--flash-attn", fa, "--max-sessions", "2", "--context-tokens", "2304", "--budget-tokens", "4608"),
    )
    out = {}
    try:
        wait_serving(proc, addr)
        with grpc.insecure_channel(addr) as ch:
            stub = pb_grpc.ShardServiceStub(ch)
            _first_token_seconds(stub, new(64), "warm-up")
            out["prefill"] = _first_token_seconds(stub, new(512), "prefill")
            sid, prompt = f"turn-{rng.integers(1 << 30)}", new(2048)
            events = list(stub.Generate(pb.GenerateRequest(session_id=sid, prompt=prompt, max_tokens=1, max_drafts=0)))
            if not events[0].HasField("token"):
                raise RuntimeError(f"the turn's first request failed: {events[-1].final}")
            prompt += [events[0].token.token_id] + new(31)
            t0 = time.perf_counter()
            events = list(stub.Generate(pb.GenerateRequest(session_id=sid, prompt=prompt, max_tokens=1, max_drafts=0)))
            seconds = time.perf_counter() - t0
            final = events[-1].final
            if final.finish_reason not in ("length", "stop") or final.cached_tokens < 2048:
                raise RuntimeError(f"the turn was not served from the session's cache: {final}")
            out["turn"] = seconds
            stub.Release(pb.SessionRequest(session_id=sid), timeout=10)
    finally:
        stop_worker(proc)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF file (default: the embedded SmolLM2)")
    ap.add_argument("--shapes", default="128x64,512x64,512x256", help="prompt x generated tokens per stream")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    path = Path(args.model) if args.model else require_embedded_model()
    n_layer, n = gguf_layer_count(path), args.streams
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    tools = find_stock_tools()
    bench = tools["llama-batched-bench"] if tools else None

    print(
        "| prompt + generated | streams | Generate, flash attention on | off | on, upstream's kernels | "
        "nothing set / the better | stock batched-bench decode -fa on | off | stock prefill -fa on | off |"
    )
    print("| --- | ---: | --- | --- | --- | ---: | --- | --- | --- | --- |")
    for npp, ntg in shapes:
        got: dict[str, list[float]] = {"on": [], "off": [], "upstream": [], "stock on": [], "stock off": []}
        stock_pp: dict[str, list[float]] = {"on": [], "off": []}
        for _ in range(args.rounds):
            for setting in SETTINGS:
                fa = "off" if setting == "off" else "on"
                with worker_kernels(setting):
                    got[setting].append(
                        ours_generate_streams(
                            path,
                            [(0, n_layer - 1)],
                            args.threads,
                            npp,
                            ntg,
                            n,
                            VOCAB,
                            worker_flags=("--flash-attn", fa),
                        )
                    )
                if bench and setting != "upstream":
                    context = ("-c", str(max(4096, n * (npp + ntg))))  # later flags win: room for every session
                    r = stock_batched_bench(bench, path, args.threads, npp, ntg, [n], extra=("-fa", fa, *context))[n]
                    got[f"stock {fa}"].append(r["tg"])
                    stock_pp[fa].append(r["pp"])
        cells = [" / ".join(f"{v:.1f}" for v in got[k]) or "n/a" for k in ("on", "off", "upstream")]
        cells.append(f"{max(got['on']) / max(max(got['on']), max(got['off'])):.3f}")  # best of each
        cells += [" / ".join(f"{v:.1f}" for v in got[k]) or "n/a" for k in ("stock on", "stock off")]
        cells += [" / ".join(f"{v:.0f}" for v in stock_pp[k]) or "n/a" for k in ("on", "off")]
        print(f"| {npp} + {ntg} | {n} | " + " | ".join(cells) + " |", flush=True)

    print(
        "\n| one worker, the whole model | flash attention on (nothing set) | --flash-attn off | "
        "on, upstream's kernels | nothing set / the better |"
    )
    print("| --- | ---: | ---: | ---: | ---: |")
    timed: dict[str, list[dict[str, float]]] = {s: [] for s in SETTINGS}
    for _ in range(args.rounds):  # taking turns, one worker per round and setting
        for setting in SETTINGS:
            with worker_kernels(setting):
                timed[setting].append(
                    ours_prefill_and_turn(path, n_layer, args.threads, "off" if setting == "off" else "on")
                )
    for key, label in (
        ("prefill", "time to first token, a fresh 512-token prompt"),
        ("turn", "time to first token, 32 new tokens on 2,048 cached"),
    ):
        on, off, upstream = (min(r[key] for r in timed[s]) for s in SETTINGS)
        print(
            f"| {label} | {on * 1e3:.0f} ms | {off * 1e3:.0f} ms | {upstream * 1e3:.0f} ms | {min(on, off) / on:.3f} |",
            flush=True,
        )

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
