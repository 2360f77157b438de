"""Spot checks across kernels, studied (docs/benchmarks.md "Across kernels"): how far honest replicas
on other CPU kernels land from each other, the false alarms of the tolerance (receipts/tolerance.py),
and how far each dishonest worker of tests/support/cheats.py lands.

- honest: a head (layers 0-9) and two later stages (10-19, 20-29), each held by a worker on this
  CPU's kernels and one on --other-variant's (LLAMA_SHARD_CPU_VARIANT) or on --other-device (a
  GPU; lavapipe, a Vulkan driver on the CPU, where there is none), one thread each, at
  --spot-check-rate 1: every request is replayed stage by stage on both and each stage's largest
  relative row error printed (hidden rows at stage 1, logit rows at the tail), until at least
  --steps steps were compared; a false alarm is a mismatch here;
- row by row, outside a route: each measure's spread for other kernels, another quantization, one
  layer fewer, the previous position's row and noise of 1e-3 (the data behind the measure);
- each cheat served as stage 1 or 2 (on this CPU's kernels) with one honest replica on the other
  kernels beside it: --runs requests, each on a new head, with the spot check's outcome and largest
  error;

    python benchmarks/cross_kernels_study.py [--steps 5000] [--other-variant haswell] [--runs 3]
    python benchmarks/cross_kernels_study.py --other-device Vulkan0   # CPU against Vulkan
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the cheats are the tests' own: no install reaches them

from proofs_study import PROMPTS, log  # noqa: E402  (the same prompts as the exact checks' study)

from llama_shard.engine.models import require_embedded_model  # noqa: E402
from llama_shard.local_workers import start_worker, stop_worker, wait_serving  # noqa: E402
from llama_shard.proto import shard_pb2 as pb  # noqa: E402
from llama_shard.proto import shard_pb2_grpc as pb_grpc  # noqa: E402
from llama_shard.receipts.tolerance import HIDDEN_TOLERANCE, LOGITS_TOLERANCE  # noqa: E402
from llama_shard.receipts.verify import stage_bodies  # noqa: E402

from support.cheats import CHEATS, cheating_worker  # noqa: E402

STAGES = ((0, 9), (10, 19), (20, 29))


@dataclasses.dataclass(frozen=True)
class Other:
    """Where the other replicas compute: another CPU variant's kernels, or a device."""

    label: str
    env: dict
    extra: tuple = ()

    @staticmethod
    def of(variant: str, device: str | None) -> Other:
        if device is None:
            return Other(variant, {"LLAMA_SHARD_CPU_VARIANT": variant})
        # lavapipe is listed only where GGML_VK_VISIBLE_DEVICES names it (tests/test_devices.py)
        visible = {"GGML_VK_VISIBLE_DEVICES": os.environ.get("GGML_VK_VISIBLE_DEVICES", "0")}
        return Other(f"device {device}", visible, ("--device", device))

    def start(self, model, first: int, last: int, extra: tuple = ()):
        return start_worker(model, first, last, extra=(*extra, *self.extra), env=self.env)


def start_head(model: Path, peers: list[str], rate: float = 1.0):
    flags = [f for a in peers for f in ("--peer", a)]
    proc, address = start_worker(model, *STAGES[0], extra=(*flags, "--spot-check-rate", str(rate)))
    wait_serving(proc, address)
    with grpc.insecure_channel(address) as ch:  # every replica probed and up: checks need their partners
        stub, deadline = pb_grpc.ShardServiceStub(ch), time.monotonic() + 60
        while any(r.state != "up" for r in stub.Info(pb.InfoRequest(), timeout=10).replicas):
            if time.monotonic() > deadline:
                raise RuntimeError("the head's replicas did not come up")
            time.sleep(0.1)
    return proc, address


def generate(stub, sid: str, prompt: list[int], n: int, kind: int) -> pb.RouteReceipt:
    """kind 0: greedy; 1: seeded; 2: greedy with drafts."""
    req = pb.GenerateRequest(session_id=sid, prompt=prompt, max_tokens=n, receipt=True)
    if kind == 1:
        req.sampling.CopyFrom(pb.Sampling(temperature=0.8, top_k=40, seed=hash(sid) & 0xFFFF))
    if kind == 2:
        req.max_drafts = 4
    final = list(stub.Generate(req, timeout=600))[-1].final
    if final.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"a request failed: {final}")
    r = pb.RouteReceipt()
    r.ParseFromString(final.receipt)
    return r


def _label(outcome: str) -> str:
    """An outcome without its figures, but saying whether a miss was struck or only counted."""
    label = outcome.split(" (")[0]
    if "(off the CPU" in outcome:
        return label + " (off the CPU: counted)"
    return label + (" (struck)" if "(strike" in outcome else "")


def _summary(errors: list[float]) -> str:
    if not errors:
        return "none"
    q = statistics.quantiles(errors, n=100, method="inclusive") if len(errors) > 1 else errors * 99
    return f"{len(errors)} requests: median {statistics.median(errors):.4f}, p99 {q[98]:.4f}, max {max(errors):.4f}"


def honest(
    model: Path, other: Other, steps: int, n_streams: int = 4, n_tokens: int = 96, rounds: int = 0, flags: tuple = ()
) -> None:
    """`flags`: the later stages' workers' own serve flags (a smaller --budget-tokens, say)."""
    workers = [start_worker(model, *STAGES[2], extra=flags), other.start(model, *STAGES[2], flags)]
    tails = tuple(f for _, a in workers for f in ("--peer", a))  # the middle stage forwards to either
    workers += [
        start_worker(model, *STAGES[1], extra=(*flags, *tails)),
        other.start(model, *STAGES[1], (*flags, *tails)),
    ]
    head = None
    try:
        for proc, address in workers:
            wait_serving(proc, address)
        head = start_head(model, [a for _, a in workers])
        errors: dict[int, list[float]] = {1: [], 2: []}
        outcomes: dict[str, int] = {}
        compared = requests = parted = 0
        lock = threading.Lock()
        t0 = time.perf_counter()
        with grpc.insecure_channel(head[1]) as ch:
            stub = pb_grpc.ShardServiceStub(ch)
            round_ = 0
            while (round_ < rounds) if rounds else (compared < steps):

                def one(i: int, round_: int = round_) -> None:
                    nonlocal compared, requests, parted
                    r = generate(stub, f"x{round_}-{i}", PROMPTS[i % 4], n_tokens, (round_ + i) % 3)
                    with lock:
                        requests += 1
                        for c in r.spot_checks:
                            label = f"stage {c.stage}: {_label(c.outcome)}"
                            outcomes[label] = outcomes.get(label, 0) + 1
                            parted += "parted" in c.outcome
                            if c.outcome.startswith(("close", "mismatch")) and c.tolerance:
                                errors[c.stage].append(c.max_error)
                        if all(c.outcome.startswith("close") for c in r.spot_checks):
                            compared += stage_bodies(r)[0][1].steps

                threads = [threading.Thread(target=one, args=(i,)) for i in range(n_streams)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                round_ += 1
                if requests < round_ * n_streams:
                    raise RuntimeError("a request failed (above)")
                log(f"  honest across kernels: {requests} requests, {compared} steps compared, {outcomes}")
        mismatches = sum(v for k, v in outcomes.items() if "mismatch" in k)
        print(
            f"honest route across kernels ({other.label} against this CPU's), rate 1: {requests} requests ({n_streams} at "
            f"once; greedy, seeded, drafts; {n_tokens} tokens), {compared} steps compared on both stages in "
            f"{time.perf_counter() - t0:.0f} s: {outcomes}; false alarms: {mismatches}; tails' tokens parted "
            f"at a near tie in {parted} checks"
        )
        print(f"  stage 1 (layers 10-19, hidden rows; tolerance {HIDDEN_TOLERANCE}): {_summary(errors[1])}")
        print(f"  stage 2 (layers 20-29, logit rows; tolerance {LOGITS_TOLERANCE}): {_summary(errors[2])}")
        evicted = []  # how hard the later workers' KV budgets were pressed (replays evict, and are evicted)
        for _, address in workers:
            with grpc.insecure_channel(address) as ch:
                evicted.append(pb_grpc.ShardServiceStub(ch).Info(pb.InfoRequest(), timeout=10).evictions_lru)
        print(f"  the later stages' workers' LRU evictions: {evicted}")
    finally:
        if head is not None:
            said = stop_worker(head[0])[1].splitlines()
            for line in [x for x in said if "spot check" in x][:10]:
                print(f"  the head said: {line}")
        for proc, _ in workers:
            stop_worker(proc)


def _cheat_route(model: Path, other: Other, cheat: str, stage: int, honest_info, tmp: Path) -> tuple:
    """(head, the cheat, the processes to stop): the cheat on `stage` (1: layers 10-19, 2: 20-29),
    an honest worker on --other-variant's kernels beside it, one honest worker of this CPU's kernels
    on the other stage."""
    if stage == 2:
        worker = cheating_worker(model, *STAGES[2], cheat, honest_info, tmp)
        partner = other.start(model, *STAGES[2])
        other_stage = start_worker(model, *STAGES[1], extra=("--peer", worker.address, "--peer", partner[1]))
    else:
        other_stage = start_worker(model, *STAGES[2])
        worker = cheating_worker(model, *STAGES[1], cheat, honest_info, tmp, peers=(other_stage[1],))
        partner = other.start(model, *STAGES[1], ("--peer", other_stage[1]))
    for proc, address in (partner, other_stage):
        wait_serving(proc, address)
    head = start_head(model, [other_stage[1], worker.address, partner[1]])
    return head, worker, [head[0], partner[0], other_stage[0]]


def cheats(model: Path, other: Other, runs: int) -> None:
    for stage in (1, 2):
        honest = start_worker(model, *STAGES[stage])  # what the cheats claim to be (not in the routes)
        try:
            wait_serving(*honest)
            with grpc.insecure_channel(honest[1]) as ch:
                info = pb_grpc.ShardServiceStub(ch).Info(pb.InfoRequest(), timeout=10)
        finally:
            stop_worker(honest[0])
        for cheat in CHEATS:
            seen = []
            for run in range(runs):
                with tempfile.TemporaryDirectory() as tmp:
                    head, worker, procs = _cheat_route(model, other, cheat, stage, info, Path(tmp))
                    try:
                        with grpc.insecure_channel(head[1]) as ch:
                            stub = pb_grpc.ShardServiceStub(ch)
                            for k in range(6):  # until a request's route runs through the cheat
                                r = generate(stub, f"{cheat}-{run}-{k}", PROMPTS[(run + k) % 4], 16, 0)
                                mine = [c for c in r.spot_checks if c.stage == stage]
                                if mine and mine[0].worker == worker.address:
                                    seen.append((mine[0].outcome.split(" (")[0], round(mine[0].max_error, 4)))
                                    break
                    finally:
                        for proc in procs:
                            stop_worker(proc)
                        worker.stop()
            rows = "logit" if stage == 2 else "hidden"
            print(f"cheat {cheat} at stage {stage}, against {other.label}: (outcome, largest {rows}-row error) {seen}")


def row_distances(model: Path, other: Other, n_steps: int = 48) -> None:
    """Row by row, outside any route: the rows of layers 10-19 and the logit rows of 20-29 on this
    CPU's kernels against --other-variant's, another quantization, one layer fewer, the previous
    position's row and N(0, 1e-3) noise; each measure's spread over 4 prompts x n_steps positions
    (greedy, teacher-forced by this CPU's tokens). The data behind the tolerance's measure."""
    import numpy as np

    from llama_shard.proto.wire import decode_tensor
    from llama_shard.receipts.tolerance import row_errors

    from support.cheats import requantized_copy

    tmp = Path(tempfile.mkdtemp())
    quant = requantized_copy(model, 10, 29, tmp / "other-quant.gguf")
    specs = {
        "source": (model, 0, 9, False),
        "mid": (model, 10, 19, False),
        "mid other kernels": (model, 10, 19, True),
        "mid other quantization": (quant, 10, 19, False),
        "mid one layer fewer": (model, 11, 19, False),
        "tail": (model, 20, 29, False),
        "tail other kernels": (model, 20, 29, True),
        "tail other quantization": (quant, 20, 29, False),
        "tail one layer fewer": (model, 21, 29, False),
    }
    workers = {
        k: other.start(m, f, last) if theirs else start_worker(m, f, last) for k, (m, f, last, theirs) in specs.items()
    }
    try:
        for proc, address in workers.values():
            wait_serving(proc, address)
        channels = {k: grpc.insecure_channel(a) for k, (_, a) in workers.items()}
        stubs = {k: pb_grpc.ShardServiceStub(ch) for k, ch in channels.items()}

        def rows(name: str, sid: str, pos: int, **kw):
            reply = stubs[name].Prefill(pb.StepRequest(session_id=sid, route_epoch=1, position=pos, **kw), timeout=60)
            assert reply.outcome == pb.OUTCOME_OK, (name, reply.detail)
            t = reply.hidden if reply.HasField("hidden") else reply.logits
            return reply, decode_tensor(t, t.shape[1], t.shape[0])[-1:]

        measures: dict[tuple[str, str], list[float]] = {}

        def add(what: str, a, b, logits: bool) -> None:
            measures.setdefault((what, "relative"), []).extend(row_errors(a, b).tolist())
            if logits:
                measures.setdefault((what, "centred"), []).extend(row_errors(a, b, centered=True).tolist())

        rng = np.random.default_rng(1)
        for i, prompt in enumerate(PROMPTS):
            pos, feed, before = 0, prompt, None
            for _ in range(n_steps):
                source, _ = rows("source", f"p{i}", pos, token_ids=feed)
                mid, mid_rows = rows("mid", f"p{i}", pos, hidden=source.hidden)
                _, tail_rows = rows("tail", f"p{i}", pos, hidden=mid.hidden, return_logits=True)
                mid_rows = mid_rows[-1:]  # a position's row: the last of its step's
                for kind in ("other kernels", "other quantization", "one layer fewer"):
                    theirs = rows(f"mid {kind}", f"p{i}", pos, hidden=source.hidden)[1]
                    add(f"hidden rows, {kind}", mid_rows, theirs[-1:], False)
                    theirs = rows(f"tail {kind}", f"p{i}", pos, hidden=mid.hidden, return_logits=True)[1]
                    add(f"logit rows, {kind}", tail_rows, theirs, True)
                add("hidden rows, noise 1e-3", mid_rows, mid_rows + rng.normal(0, 1e-3, mid_rows.shape), False)
                add("logit rows, noise 1e-3", tail_rows, tail_rows + rng.normal(0, 1e-3, tail_rows.shape), True)
                if before is not None:
                    add("hidden rows, the previous position's", mid_rows, before[0], False)
                    add("logit rows, the previous position's", tail_rows, before[1], True)
                before = (mid_rows, tail_rows)
                pos, feed = pos + len(feed), [int(np.argmax(tail_rows[-1]))]
        for ch in channels.values():
            ch.close()
    finally:
        for proc, _ in workers.values():
            stop_worker(proc)
    print(f"row errors against this CPU's kernels ({4 * n_steps} positions; {other.label} as the other kernels):")
    for (what, measure), errors in sorted(measures.items()):
        e = sorted(errors)
        print(f"  {what:42s} {measure:8s} min {e[0]:.4g}  median {e[len(e) // 2]:.4g}  max {e[-1]:.4g}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5000, help="honest steps to compare (default 5,000)")
    ap.add_argument("--other-variant", default="haswell", help="the other replicas' CPU kernels (default haswell)")
    ap.add_argument("--other-device", help="the other replicas on this device instead (Vulkan0, say)")
    ap.add_argument("--runs", type=int, default=3, help="requests per cheat, each on a new head (default 3)")
    ap.add_argument(
        "--tokens",
        type=int,
        nargs="+",
        default=[96, 448],
        help="tokens per request: the first for --steps, each other for 8 requests (default 96 448)",
    )
    ap.add_argument("--streams", type=int, default=4, help="requests at once on the honest route (default 4)")
    ap.add_argument("--budget-tokens", type=int, help="the honest route's later workers' KV budget (default 2,048)")
    ap.add_argument("--skip-cheats", action="store_true")
    ap.add_argument("--skip-rows", action="store_true", help="skip the row-by-row measures")
    args = ap.parse_args()
    model = require_embedded_model()
    other = Other.of(args.other_variant, args.other_device)
    if not args.skip_rows:
        row_distances(model, other)
    if not args.skip_cheats:
        cheats(model, other, args.runs)
    flags = ("--budget-tokens", str(args.budget_tokens)) if args.budget_tokens else ()
    honest(model, other, args.steps, n_streams=args.streams, n_tokens=args.tokens[0], flags=flags)
    for n in args.tokens[1:]:  # longer sessions: the errors grow with the positions behind a row
        honest(model, other, 1, n_streams=2, n_tokens=n, rounds=4, flags=flags)
    return 0


if __name__ == "__main__":
    sys.exit(main())
