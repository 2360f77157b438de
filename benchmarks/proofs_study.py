"""Receipts and spot checks, studied (docs/benchmarks.md "Spot checks"): false alarms of an honest
route, and how fast each dishonest worker of tests/support/cheats.py is caught.

- honest: a head and two tail replicas (one thread each) at --spot-check-rate 1: streams of greedy
  and seeded requests, every one replayed on the other tail, until at least --steps replayed steps
  (then 4,000 more for each longer --tokens); prints the spot checks' outcomes (a false alarm is a
  mismatch here);
- each cheat served as the tail the head routes to, with two honest replicas: requests until its
  first mismatch at rate 1 (--runs runs with other prompts), and at --live-rate (runs of requests
  until caught, a new head each run);
- the head's draw of the requests it checks, counted over 100,000 draws at 1%, 5% and 100%, and the
  probability of catching a worker that cheats on every request within n requests, 1 - (1 - r)^n.

    python benchmarks/proofs_study.py [--steps 10000] [--runs 3] [--live-rate 0.05] [--tokens 128 448]
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the cheats are the tests' own: no install reaches them

from llama_shard.engine.models import require_embedded_model  # noqa: E402
from llama_shard.head.proofs import RouteProofs  # noqa: E402
from llama_shard.local_workers import start_worker, stop_worker, wait_serving  # noqa: E402
from llama_shard.proto import shard_pb2 as pb  # noqa: E402
from llama_shard.proto import shard_pb2_grpc as pb_grpc  # noqa: E402
from llama_shard.receipts.chain import ReceiptChains  # noqa: E402
from llama_shard.receipts.verify import stage_bodies  # noqa: E402

from support.cheats import CHEATS, cheating_worker  # noqa: E402

TAIL = (15, 29)
PROMPTS = [
    [1, 504, 3458, 282, 4649, 314],
    [1, 11442, 2020, 253, 655, 28],
    [1, 1073, 28709, 5012, 30, 198],
    [1, 378, 1341, 4093, 14032, 359],
]


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def start_head(model: Path, tails: list[str], rate: float):
    peers = [f for a in tails for f in ("--peer", a)]
    proc, address = start_worker(model, 0, TAIL[0] - 1, extra=(*peers, "--spot-check-rate", str(rate)))
    wait_serving(proc, address)
    return proc, address


def generate(stub, sid: str, prompt: list[int], n: int, seed: int | None) -> pb.GenerateFinal:
    req = pb.GenerateRequest(session_id=sid, prompt=prompt, max_tokens=n, receipt=True)
    if seed is not None:
        req.sampling.CopyFrom(pb.Sampling(temperature=0.8, top_k=40, seed=seed))
    final = list(stub.Generate(req, timeout=300))[-1].final
    if final.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"a request failed: {final}")
    return final


def receipt_of(final: pb.GenerateFinal) -> pb.RouteReceipt:
    r = pb.RouteReceipt()
    r.ParseFromString(final.receipt)
    return r


def honest(model: Path, tails: list[str], steps: int, n_streams: int = 8, n_tokens: int = 128) -> None:
    proc, address = start_head(model, tails, 1.0)
    outcomes: dict[str, int] = {}
    replayed = requests = 0
    lock = threading.Lock()
    t0 = time.perf_counter()
    try:
        with grpc.insecure_channel(address) as ch:
            stub = pb_grpc.ShardServiceStub(ch)
            round_ = 0
            while replayed < steps:

                def one(i: int, round_: int = round_) -> None:
                    nonlocal replayed, requests
                    seed = None if i % 2 == 0 else 1000 * round_ + i
                    r = receipt_of(generate(stub, f"h{round_}-{i}", PROMPTS[i % 4], n_tokens, seed))
                    n = stage_bodies(r)[0][1].steps
                    with lock:
                        requests += 1
                        for c in r.spot_checks:
                            outcomes[c.outcome] = outcomes.get(c.outcome, 0) + 1
                            replayed += n if c.outcome == "equal" else 0

                threads = [threading.Thread(target=one, args=(i,)) for i in range(n_streams)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                round_ += 1
                log(f"  honest: {requests} requests, {replayed} steps replayed, {outcomes}")
    finally:
        stop_worker(proc)
    mismatches = sum(v for k, v in outcomes.items() if k.startswith("mismatch"))
    print(
        f"honest route, rate 1: {requests} requests ({n_streams} streams at once, greedy and seeded, {n_tokens} "
        f"tokens), {replayed} steps replayed on the other tail in {time.perf_counter() - t0:.0f} s: "
        f"{outcomes}; false alarms: {mismatches}"
    )


def caught(model: Path, tails: list[str], honest_info, cheat: str, rate: float, seed0: int, cap: int) -> tuple:
    """(requests until the first mismatch or None past `cap`, that request's steps)."""
    with tempfile.TemporaryDirectory() as tmp:
        worker = cheating_worker(model, *TAIL, cheat, honest_info, Path(tmp))
        proc, address = start_head(model, [worker.address, *tails], rate)
        try:
            with grpc.insecure_channel(address) as ch:
                stub = pb_grpc.ShardServiceStub(ch)
                for k in range(1, cap + 1):
                    r = receipt_of(generate(stub, f"{cheat}-{seed0}-{k}", PROMPTS[(seed0 + k) % 4], 8, None))
                    if any(c.outcome.startswith("mismatch") for c in r.spot_checks):
                        return k, stage_bodies(r)[0][1].steps
            return None, 0
        finally:
            stop_worker(proc)
            worker.stop()


def step_costs(n: int = 20_000) -> None:
    """A step's receipt work on a worker, timed alone at SmolLM2's shapes (576-float rows, 49,152 logits)."""
    import numpy as np

    from llama_shard.proto.wire import encode_tensor
    from llama_shard.receipts.chain import CommittedStep, logits_digest, rows_digest, tokens_digest

    row = encode_tensor(np.random.rand(1, 576).astype(np.float32), pb.DTYPE_FLOAT32)
    logits = np.random.rand(1, 49152).astype(np.float32)
    chains = ReceiptChains(64, 10 * n)
    pos = iter(range(10 * n))

    def timed(f) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            f()
        return (time.perf_counter() - t0) / n * 1e6

    costs = {
        "a hidden row's SHA-256": timed(lambda: rows_digest(row)),
        "49,152 logits' XXH3-128": timed(lambda: logits_digest(logits)),
        "a token's SHA-256": timed(lambda: tokens_digest([5])),
        "a step committed": timed(
            lambda: chains.commit(CommittedStep(("k", 1, b"n" * 16), next(pos), 1, b"a" * 32, b"b" * 32), [7])
        ),
    }
    print("a step's receipt work, timed alone: " + ", ".join(f"{k} {v:.1f} us" for k, v in costs.items()))


def draws() -> None:
    for rate in (0.01, 0.05, 1.0):
        proofs = RouteProofs(lambda *a: None, ReceiptChains(4, 4), b"", None, None, rate)
        n = 100_000
        chosen = sum(proofs.open(pb.GenerateRequest()).spot_check for _ in range(n))
        proofs.close()
        measured = chosen / n
        within = {k: 1 - (1 - measured) ** k for k in (1, 10, 100, 500)}
        needed = math.ceil(math.log(0.01) / math.log(1 - measured)) if measured < 1 else 1
        print(
            f"rate {rate:g}: {chosen} of {n:,} requests drawn ({measured:.4f}); a worker that cheats on every "
            f"request is caught within 1/10/100/500 requests with probability "
            f"{' / '.join(f'{p:.3f}' for p in within.values())}; 99% within {needed} requests"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10_000, help="honest steps to replay (default 10,000)")
    ap.add_argument("--runs", type=int, default=3, help="runs per cheat at rate 1 (default 3)")
    ap.add_argument("--live-rate", type=float, default=0.05, help="the rate of the live runs (default 0.05)")
    ap.add_argument("--live-runs", type=int, default=5, help="runs of the noise cheat at --live-rate (default 5)")
    ap.add_argument(
        "--tokens",
        type=int,
        nargs="+",
        default=[128, 448],
        help="tokens per honest request: the first for --steps (8 streams), each other for 4,000 more steps "
        "(4 streams; longer sessions, past the first 256 cells) (default 128 448)",
    )
    args = ap.parse_args()
    model = require_embedded_model()
    step_costs()
    draws()
    tails = [start_worker(model, *TAIL) for _ in range(2)]
    try:
        for proc, address in tails:
            wait_serving(proc, address)
        addresses = [a for _, a in tails]
        with grpc.insecure_channel(addresses[0]) as ch:
            info = pb_grpc.ShardServiceStub(ch).Info(pb.InfoRequest(), timeout=10)
        for cheat in CHEATS:
            found = [caught(model, addresses, info, cheat, 1.0, run, 5) for run in range(args.runs)]
            print(
                f"cheat {cheat}, rate 1: caught at request {[k for k, _ in found]} (of that request's steps: {[s for _, s in found]})"
            )
        live = [
            caught(model, addresses, info, "noise", args.live_rate, 10 + run, 400)[0] for run in range(args.live_runs)
        ]
        print(
            f"cheat noise, rate {args.live_rate:g}: caught at request {live} (expected 1/rate = {1 / args.live_rate:.0f})"
        )
        honest(model, addresses, args.steps, n_tokens=args.tokens[0])
        for n in args.tokens[1:]:
            honest(model, addresses, 4000, n_streams=4, n_tokens=n)
    finally:
        for proc, _ in tails:
            stop_worker(proc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
