"""The head's planner (head/planner.py): memory a hard limit, the time per token of one stream
minimised, held to the exhaustive search over every set, order and split of small meshes; reports
out of their bounds refused; 64 members planned within the time bound."""

from __future__ import annotations

import itertools
import math
import random
import time

import pytest

from llama_shard.errors import Why, WhyNot
from llama_shard.head import planner as plans

MiB = 1 << 20
DELAYS = (0.0, 0.010, 0.050)  # the delay proxies between sites


def _costs(n_layer: int = 30, layer_mib: int = 10) -> plans.ModelCosts:
    return plans.ModelCosts(
        layer_bytes=(layer_mib * MiB,) * n_layer,
        stage_kv_bytes=(MiB,) * n_layer,
        input_bytes=20 * MiB,
        output_bytes=20 * MiB,
        compute_bytes=32 * MiB,
        tail_compute_bytes=40 * MiB,
    )


def _mesh(n: int, seed: int, delay: float | None = None) -> list[plans.Member]:
    """Members on three sites: heterogeneous memory and threads (their per-layer time), a round trip
    of 0.2 ms within a site and `delay` (or one of DELAYS by the sites' distance) between sites."""
    rng = random.Random(seed)
    names = [f"n{i}" for i in range(n)]
    site = {x: rng.randrange(3) for x in names}
    out = []
    for x in names:
        between = {
            y: 0.0002 if site[x] == site[y] else (delay if delay is not None else DELAYS[abs(site[x] - site[y])])
            for y in names
            if y != x
        }
        out.append(
            plans.Member(x, rng.choice([150, 250, 500]) * MiB, rng.choice([0.0005, 0.001, 0.002]), rtt_s=between)
        )
    return out


def test_the_best_split_is_the_best_of_every_split():
    costs = _costs(n_layer=9)
    members = _mesh(3, seed=5)
    ranges, compute = plans.best_split(costs, members)
    best = math.inf
    for a, b in itertools.combinations(range(1, 9), 2):
        split = [(0, a - 1), (a, b - 1), (b, 8)]
        if all(costs.stage_bytes(first, last) <= m.memory_bytes for (first, last), m in zip(split, members)):
            best = min(best, sum((last - first + 1) * m.layer_s for (first, last), m in zip(split, members)))
    assert compute == pytest.approx(best)
    assert all(costs.stage_bytes(first, last) <= m.memory_bytes for (first, last), m in zip(ranges, members))
    assert ranges[0][0] == 0 and ranges[-1][1] == 8 and all(a[1] + 1 == b[0] for a, b in zip(ranges, ranges[1:]))


@pytest.mark.parametrize("delay", [0.0, 0.010, 0.050, None])
def test_the_plan_is_within_five_percent_of_the_exhaustive_search(delay):
    """Random meshes of 3 to 6 members; the exhaustive search tries every set, order and split."""
    worse = []
    for seed in range(12):
        members = _mesh(3 + seed % 4, seed, delay)
        best = plans.exhaustive(_costs(), members, "n0")
        plan = plans.plan_route(_costs(), members, "n0")
        if best is None:
            assert isinstance(plan, WhyNot) and plan.kind is Why.NO_PLAN
            continue
        assert not isinstance(plan, WhyNot)
        assert plan.tokens_per_s >= 0.95 * best.tokens_per_s, (seed, plan.describe(), best.describe())
        worse.append(plan.tokens_per_s / best.tokens_per_s)
    assert worse


def test_memory_is_a_hard_limit_and_the_head_holds_the_first_layers():
    costs = _costs()
    for seed in range(8):
        plan = plans.plan_route(costs, _mesh(8, seed), "n0")
        assert not isinstance(plan, WhyNot)
        members = {m.name: m for m in _mesh(8, seed)}
        assert plan.stages[0].member == "n0" and plan.stages[0].first == 0 and plan.stages[-1].last == costs.n_layer - 1
        for s in plan.stages:
            assert costs.stage_bytes(s.first, s.last) <= members[s.member].memory_bytes
            for r in s.replicas:  # a replica can hold its stage's range
                assert costs.stage_bytes(s.first, s.last) <= members[r].memory_bytes
        placed = [s.member for s in plan.stages] + [r for s in plan.stages for r in s.replicas] + list(plan.spare)
        assert sorted(placed) == sorted(members)


def test_spare_members_stand_by_where_a_stage_has_fewest_replicas():
    costs = _costs(n_layer=10)
    near = {f"n{i}": 0.0002 for i in range(6)}
    members = [
        plans.Member(f"n{i}", 10_000 * MiB, 0.001, rtt_s={k: v for k, v in near.items() if k != f"n{i}"})
        for i in range(6)
    ]
    plan = plans.plan_route(costs, members, "n0")
    assert len(plan.stages) == 1  # one member holds it all: links only cost
    assert len(plan.stages[0].replicas) == 5
    tight = [
        plans.Member("n0", 200 * MiB, 0.001),
        plans.Member("n1", 200 * MiB, 0.001),
        plans.Member("n2", 10 * MiB, 0.001),
    ]
    plan = plans.plan_route(costs, tight, "n0")
    assert plan.spare == ("n2",)


def test_reports_out_of_bounds_are_refused():
    costs = _costs()
    ok = plans.Member("n1", 500 * MiB, 0.001)
    for bad in (
        plans.Member("n0", 10**18, 0.001),
        plans.Member("n0", 0, 0.001),
        plans.Member("n0", 500 * MiB, float("nan")),
        plans.Member("n0", 500 * MiB, -1.0),
        plans.Member("n0", 500 * MiB, 0.0),
        plans.Member("n0", 500 * MiB, 0.001, rtt_s={"n1": float("inf")}),
    ):
        why = plans.plan_route(costs, [bad, ok], "n0")
        assert isinstance(why, WhyNot) and why.kind is Why.BAD_REPORT and "n0" in why.text
    assert plans.plan_route(costs, [ok], "n0").kind is Why.BAD_REPORT  # the head reported nothing
    many = [plans.Member(f"n{i}", 500 * MiB, 0.001) for i in range(plans.MAX_MEMBERS + 1)]
    assert plans.plan_route(costs, many, "n0").kind is Why.BAD_REPORT
    small = [plans.Member("n0", 50 * MiB, 0.001), plans.Member("n1", 50 * MiB, 0.001)]
    why = plans.plan_route(costs, small, "n0")
    assert why.kind is Why.NO_PLAN and "no split fits" in why.text


def test_sixty_four_members_are_planned_within_the_time_bound():
    members = _mesh(plans.MAX_MEMBERS, seed=7)
    t0 = time.monotonic()
    plan = plans.plan_route(_costs(), members, "n0")
    took = time.monotonic() - t0
    assert not isinstance(plan, WhyNot)
    assert took < plans.PLAN_TIME_BOUND_S + 0.5
    print(f"\n  64 members: planned in {took * 1e3:.0f} ms, {len(plan.stages)} stages, {plan.tokens_per_s:.1f} tok/s")


def test_inspect_plans_members_described_in_a_file(tmp_path, embedded_model):
    """`llama-shard inspect --plan FILE`: the planner's dry run over members a file describes, beside
    the equal-layers split; a member out of its bounds is refused with its name (exit 2)."""
    import json
    import subprocess
    import sys

    members = [
        {"name": "head:1", "memory": "120MiB", "layer_ms": 1.0, "rtt_ms": {"b:2": 0.2, "c:3": 50}},
        {"name": "b:2", "memory": "200MiB", "layer_ms": 0.5, "rtt_ms": {"c:3": 50}},
        {"name": "c:3", "memory": 500 * MiB, "layer_ms": 2.0},
    ]
    spec = tmp_path / "members.json"
    spec.write_text(json.dumps(members))

    def inspect(*flags):
        cmd = [sys.executable, "-m", "llama_shard.cli", "inspect", str(embedded_model), "--plan", str(spec), *flags]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120)

    res = inspect("--sessions", "2", "--context-tokens", "1024")
    assert res.returncode == 0, res.stderr
    assert "stage 0: layers 0-" in res.stdout and "on head:1" in res.stdout and "tok/s" in res.stdout
    assert "equal layers over every member" in res.stdout
    members[1]["memory"] = 10**18
    spec.write_text(json.dumps(members))
    res = inspect()
    assert res.returncode == 2 and "b:2" in res.stderr and "memory" in res.stderr
    alone = subprocess.run(
        [sys.executable, "-m", "llama_shard.cli", "inspect", str(embedded_model), "--sessions", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert alone.returncode == 2 and "--plan" in alone.stderr  # not silently ignored
