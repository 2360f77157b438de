"""How good the head's planner is (issue 62): its route against the best one an exhaustive search finds
(every set of members, every order, every contiguous split), and the naive equal-layers split beside
it, on meshes of simulated members whose per-layer times are measured here.

    python benchmarks/planner_study.py [--model PATH] [--sessions 8] [--context-tokens 4096]

The per-layer decode time of one token is measured on this machine for 1 and 2 threads (the whole
model, one session, greedy steps), then members are drawn with either thread count and a memory cap,
on sites with a delay proxy's round trip between them (0, 10 or 50 ms; 0.2 ms within a site).
Printed per scenario: each plan's tokens per second for one stream, the planner's ratio to the
exhaustive search's (its target: at least 0.95), and how long each took to plan.
"""

from __future__ import annotations

import argparse
import random
import time

from llama_shard import HotKvStateConfig, HotKvStateManager, ShardModel
from llama_shard.engine.hot_kv import Step
from llama_shard.engine.models import embedded_model_path, gguf_shape
from llama_shard.errors import WhyNot
from llama_shard.head import planner as plans

MiB = 1 << 20


def layer_seconds(path: str, threads: int, steps: int = 24) -> float:
    """One decode token through one layer: the whole model's decode step, divided by its layers."""
    model = ShardModel(path, None, threads)
    manager = HotKvStateManager(model, HotKvStateConfig(max_sessions=1, context_tokens=256, budget_tokens=256))
    manager.step_batch([Step.prefill("s", 0, [1, 2, 3, 4], start_pos=0)])
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        manager.step_batch([Step.decode("s", 0, [5 + i % 50], expected_seq_len=4 + i)])
        times.append(time.perf_counter() - t0)
    manager.close()
    times.sort()
    return times[len(times) // 2] / model.info.n_layer


def scenario(
    name: str, n: int, sites: int, delay_s: float, caps_mib: list[int], per_layer: dict[int, float], seed: int
) -> tuple[str, list[plans.Member]]:
    rng = random.Random(seed)
    where = {f"m{i}": (0 if i == 0 else rng.randrange(sites)) for i in range(n)}
    members = []
    for name_ in where:
        threads = rng.choice(list(per_layer))
        rtt = {
            o: (0.0002 if where[o] == where[name_] else delay_s * abs(where[o] - where[name_]))
            for o in where
            if o != name_
        }
        members.append(
            plans.Member(
                name_,
                rng.choice(caps_mib) * MiB,
                per_layer[threads],
                rtt_s=rtt,
                backend=f"cpu, {threads} thread{'s' if threads > 1 else ''}",
            )
        )
    return name, members


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--context-tokens", type=int, default=4096)
    args = ap.parse_args()
    path = args.model or str(embedded_model_path())
    shape = gguf_shape(path)
    costs = plans.ModelCosts.of(shape, args.sessions, args.context_tokens)
    per_layer = {t: layer_seconds(path, t) for t in (1, 2)}
    whole = costs.stage_bytes(0, shape.n_layer - 1) / MiB
    print(
        f"model {path.rsplit('/', 1)[-1]}: {shape.n_layer} layers; a stage of all of them needs {whole:.0f} MiB "
        f"({args.sessions} sessions of {args.context_tokens} tokens, {plans.HEADROOM:.0%} headroom)"
    )
    print(
        "measured per-layer decode time: " + ", ".join(f"{t} thread(s) {s * 1e3:.3f} ms" for t, s in per_layer.items())
    )
    caps = [int(whole * f) for f in (0.3, 0.45, 0.6, 1.2)]
    cases = [
        scenario("one site, 0 ms", 6, 1, 0.0, caps, per_layer, 1),
        scenario("two sites, 10 ms", 6, 2, 0.010, caps, per_layer, 2),
        scenario("three sites, 50 ms", 6, 3, 0.050, caps, per_layer, 3),
        scenario("two sites, 50 ms, 7 members", 7, 2, 0.050, caps, per_layer, 4),
    ]
    print("\n| scenario | planner tok/s | exhaustive tok/s | ratio | equal layers tok/s | plan ms | exhaustive ms |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, members in cases:
        t0 = time.perf_counter()
        plan = plans.plan_route(costs, members, "m0")
        t1 = time.perf_counter()
        best = plans.exhaustive(costs, members, "m0")
        t2 = time.perf_counter()
        naive = plans.equal_layers(costs, members, "m0")
        if isinstance(plan, WhyNot) or best is None:
            print(f"| {name} | {plan} | none fits | | | | |")
            continue
        print(
            f"| {name} | {plan.tokens_per_s:.1f} | {best.tokens_per_s:.1f} | {plan.tokens_per_s / best.tokens_per_s:.3f} "
            f"| {naive.tokens_per_s if naive else 0:.1f}{'' if naive else ' (does not fit)'} "
            f"| {(t1 - t0) * 1e3:.0f} | {(t2 - t1) * 1e3:.0f} |"
        )
    big = scenario("64 members, three sites", plans.MAX_MEMBERS, 3, 0.010, caps, per_layer, 5)[1]
    t0 = time.perf_counter()
    plan = plans.plan_route(costs, big, "m0")
    print(
        f"\n64 members on three sites (10 ms apart): planned in {(time.perf_counter() - t0) * 1e3:.0f} ms "
        f"(bound {plans.PLAN_TIME_BOUND_S:g} s):\n{plan.describe() if not isinstance(plan, WhyNot) else plan}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
