"""Generation in the route against generation driven by the client, end to end, as a user calls it.

    python benchmarks/generate_study.py [--model PATH] [--tokens 64] [--prompt 32] [--streams 1,8]

Two chained 1-thread workers (split where per-token compute balances). For each number of
concurrent sessions: `RouteClient.generate_many` with the loop in the route (one `Generate` stream
per session; the head micro-batches them) and with the loop in this client (`route_loop=False`: a
chained StepBatch per token per micro-batch). Wall time covers the whole request: prefill of a
random prompt, then the tokens; each session is released after. Prints aggregate tokens/s and the
ratio; a study, not the table (benchmarks/bench.py is the table)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from delay_proxy import DelayProxy

from llama_shard.engine.models import compute_balanced_cut, gguf_layer_count, require_embedded_model
from llama_shard.local_workers import start_worker, stop_worker, wait_serving
from llama_shard.route import RemoteStage, RouteClient


def run(client: RouteClient, n: int, prompt_len: int, tokens: int, rng, tag: str) -> float:
    sessions = [client.session(f"{tag}-{n}-{i}-{time.monotonic_ns()}") for i in range(n)]
    prompts = [[int(t) for t in rng.integers(100, 20000, prompt_len)] for _ in range(n)]
    t0 = time.perf_counter()
    out = client.generate_many(sessions, prompts, tokens)
    wall = time.perf_counter() - t0
    assert all(len(o) == tokens for o in out), [len(o) for o in out]
    for s in sessions:
        s.release()
    return n * tokens / wall


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--streams", default="1,8")
    ap.add_argument("--repeat", type=int, default=2, help="keep each side's best of this many")
    ap.add_argument(
        "--delay-ms",
        default="",
        help="also measure one session with every link delayed by each of "
        "these (ms each way, a loopback proxy), e.g. 2,10",
    )
    args = ap.parse_args(argv)
    path = Path(args.model) if args.model else require_embedded_model()
    n_layer, cut = gguf_layer_count(path), compute_balanced_cut(path)
    tail, tail_addr = start_worker(path, cut, n_layer - 1, threads=1)
    head, head_addr = start_worker(path, 0, cut - 1, threads=1, extra=("--peer", tail_addr))
    try:
        wait_serving(tail, tail_addr)
        wait_serving(head, head_addr)
        stages = [RemoteStage(head_addr), RemoteStage(tail_addr)]
        in_route = RouteClient(stages)
        in_client = RouteClient(stages, route_loop=False)
        rng = np.random.default_rng(5)
        run(in_route, 2, args.prompt, 8, rng, "warm-up")
        print(
            f"two chained 1-thread workers (0-{cut - 1} | {cut}-{n_layer - 1}), {args.prompt}-token prompts, "
            f"{args.tokens} tokens each, whole requests timed"
        )
        print("| sessions | loop in the route (tok/s) | loop in the client (tok/s) | ratio |")
        print("| ---: | ---: | ---: | ---: |")
        for n in [int(x) for x in args.streams.split(",")]:
            route = max(run(in_route, n, args.prompt, args.tokens, rng, "route") for _ in range(args.repeat))
            client = max(run(in_client, n, args.prompt, args.tokens, rng, "client") for _ in range(args.repeat))
            print(f"| {n} | {route:.1f} | {client:.1f} | {route / client:.2f}x |", flush=True)
        for delay in [float(x) for x in args.delay_ms.split(",") if x]:
            # client -> proxy -> head -> proxy -> tail: the head forwards to the tail's proxy (its peer)
            with DelayProxy(tail_addr, delay / 1000) as to_tail, DelayProxy(head_addr, delay / 1000) as to_head:
                stop_worker(head)
                head, head_addr2 = start_worker(
                    path,
                    0,
                    cut - 1,
                    threads=1,
                    extra=("--peer", to_tail.address),
                    port=int(head_addr.rsplit(":", 1)[1]),
                )
                wait_serving(head, head_addr2)
                stages = [RemoteStage(to_head.address), RemoteStage(to_tail.address)]
                in_route, in_client = RouteClient(stages), RouteClient(stages, route_loop=False)
                route = max(run(in_route, 1, args.prompt, args.tokens, rng, "route-d") for _ in range(args.repeat))
                client = max(run(in_client, 1, args.prompt, args.tokens, rng, "client-d") for _ in range(args.repeat))
                print(
                    f"| 1, links +{delay:g} ms each way | {route:.1f} | {client:.1f} | {route / client:.2f}x |",
                    flush=True,
                )
    finally:
        stop_worker(head)
        stop_worker(tail)
    return 0


if __name__ == "__main__":
    sys.exit(main())
