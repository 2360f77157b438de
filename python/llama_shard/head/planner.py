"""The head's planner: which members hold which contiguous layers, in what order, and which stand by
as replicas, from what each member reports (its memory, its measured time per layer, its round trips
to the others). Pure: no I/O, no clock but its own time bound.

- **Memory is a hard limit.** A stage holds its layers' weights (the head its token embeddings, the
  tail its output layer), the KV of the sessions it should hold (`sessions` slots of
  `context_tokens`, recurrent state included), its compute buffers, and `headroom` on all of it.
- **Within that, the time per token of one stream** (`Plan.time_per_token_s`): each stage's layers
  times its member's measured per-layer decode time, plus the round trip of every link between
  consecutive stages (a step goes down the chain and its reply comes back along it).
- **The search.** The head is stage 0. For a set of members, the order is the shortest path over
  their round trips from the head (exact, Held-Karp, up to `EXACT_ORDER_MAX` members; nearest
  neighbour and 2-opt above), and the split the exact best for that order (`best_split`, a dynamic
  programme over layers). The set grows from the head by the member that lowers the time most, then
  improves by swapping one member in or out while that pays; every candidate is evaluated whole.
  `exhaustive` (every set and order, for tests and the benchmark) is the reference it is held to.
- **Replicas.** Members left over stand by for the stage whose range they can hold that has the
  fewest replicas, the slowest stage first.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import time
from collections.abc import Mapping, Sequence

from .._native import MAX_LOGIT_ROWS
from ..engine.hot_kv import HotKvConfig
from ..errors import Why, WhyNot

#: a plan's memory margin on everything a stage holds (stage servers of patched llama.cpp use 20%)
HEADROOM = 0.2
#: members ordered exactly (Held-Karp, 2^n n^2); more are ordered by nearest neighbour and 2-opt
EXACT_ORDER_MAX = 10
#: members after the head whose every order is tried (5! = 120 splits)
ALL_ORDERS_MAX = 5
#: the most members a plan considers (a join beyond them is refused), and its time bound
MAX_MEMBERS = 64
#: members tried at each step of the search, the most promising first (all of them in smaller meshes)
SEARCH_POOL = 16
PLAN_TIME_BOUND_S = 2.0
#: what a member may report, at most: 1 PiB of memory, an hour per layer, a minute of round trip
MAX_MEMORY_BYTES = 1 << 50
MAX_LAYER_S = 3600.0
MAX_RTT_S = 60.0


@dataclasses.dataclass(frozen=True)
class Member:
    """What a member reports of itself (bounded: `check`)."""

    name: str  # its address (host:port)
    memory_bytes: int  # memory it may use for this model: weights, KV, buffers
    layer_s: float  # one decode token through one of this model's layers, measured there
    prefill_layer_s: float = 0.0  # one prompt token through one layer (reported, not planned by)
    rtt_s: Mapping[str, float] = dataclasses.field(default_factory=dict)  # round trips to other members
    backend: str = "cpu"

    def check(self) -> WhyNot | None:
        if not 0 < self.memory_bytes <= MAX_MEMORY_BYTES:
            return WhyNot(Why.BAD_REPORT, f"{self.name}: memory {self.memory_bytes} bytes is not 1..{MAX_MEMORY_BYTES}")
        for what, v, top in (
            ("layer time", self.layer_s, MAX_LAYER_S),
            ("prefill time", self.prefill_layer_s, MAX_LAYER_S),
        ):
            if not (math.isfinite(v) and 0 <= v <= top) or (what == "layer time" and v == 0):
                return WhyNot(Why.BAD_REPORT, f"{self.name}: {what} {v!r} s is not within (0, {top:g}]")
        for other, v in self.rtt_s.items():
            if not (math.isfinite(v) and 0 <= v <= MAX_RTT_S):
                return WhyNot(
                    Why.BAD_REPORT, f"{self.name}: round trip to {other} {v!r} s is not within [0, {MAX_RTT_S:g}]"
                )
        return None


@dataclasses.dataclass(frozen=True)
class ModelCosts:
    """What a model's stages cost in memory, from its GGUF header (`of`)."""

    layer_bytes: tuple[int, ...]  # weights per layer
    stage_kv_bytes: tuple[int, ...]  # KV and recurrent state per layer for all the sessions a stage holds
    input_bytes: int  # token embeddings (the head's)
    output_bytes: int  # output norm and head (the tail's)
    compute_bytes: int  # a stage's compute buffers (an estimate: llama.cpp sizes them at load)
    tail_compute_bytes: int  # the tail's, with its logits
    headroom: float = HEADROOM

    @classmethod
    def of(cls, shape, sessions: int = 8, context_tokens: int = 4096, n_batch: int = 512) -> ModelCosts:
        cells = HotKvConfig(context_tokens=context_tokens, n_batch=n_batch).slot_cells
        recurrent = set(shape.recurrent_layers)
        kv = tuple(
            sessions * (cells * shape.kv_layer_bytes[il] + (shape.recurrent_layer_bytes if il in recurrent else 0))
            for il in range(shape.n_layer)
        )
        n_vocab = shape.lm_head_elements // max(shape.n_embd, 1)
        # a step's activations (a few rows of n_embd floats per token of a batch) and ggml's fixed
        # share; the tail's logits are computed for the rows asked for only (at most MAX_LOGIT_ROWS)
        compute = 4 * n_batch * 8 * shape.n_embd + (32 << 20)
        tail = compute + 4 * MAX_LOGIT_ROWS * n_vocab
        return cls(shape.layer_bytes, kv, shape.input_bytes, shape.output_bytes, compute, tail)

    @property
    def n_layer(self) -> int:
        return len(self.layer_bytes)

    @functools.cached_property
    def _prefix(self) -> list[int]:
        out = [0]
        for w, kv in zip(self.layer_bytes, self.stage_kv_bytes):
            out.append(out[-1] + w + kv)
        return out

    def stage_bytes(self, first: int, last: int) -> int:
        """What a stage of layers first..last needs, headroom included."""
        tail = last == self.n_layer - 1
        held = self._prefix[last + 1] - self._prefix[first]
        held += (self.input_bytes if first == 0 else 0) + (self.output_bytes if tail else 0)
        held += self.tail_compute_bytes if tail else self.compute_bytes
        return int(held * (1 + self.headroom))


@dataclasses.dataclass(frozen=True)
class Stage:
    first: int
    last: int
    member: str
    replicas: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Plan:
    stages: tuple[Stage, ...]
    time_per_token_s: float  # one stream's token through the route (compute and links)
    spare: tuple[str, ...] = ()  # members that hold nothing (no stage's range fits them)

    @property
    def tokens_per_s(self) -> float:
        return 1.0 / self.time_per_token_s if self.time_per_token_s > 0 else math.inf

    def describe(self) -> str:
        lines = [
            f"  stage {i}: layers {s.first}-{s.last} on {s.member}"
            + (f"; replicas {', '.join(s.replicas)}" if s.replicas else "")
            for i, s in enumerate(self.stages)
        ]
        lines.append(f"  one stream: {self.time_per_token_s * 1e3:.2f} ms a token ({self.tokens_per_s:.1f} tok/s)")
        if self.spare:
            lines.append(f"  spare: {', '.join(self.spare)}")
        return "\n".join(lines)


def rtt(members: Mapping[str, Member], a: str, b: str) -> float:
    """The round trip between two members: what either measured (the larger, if both did; 0 unknown)."""
    return max(members[a].rtt_s.get(b, 0.0), members[b].rtt_s.get(a, 0.0))


def best_split(costs: ModelCosts, order: Sequence[Member]) -> tuple[list[tuple[int, int]], float] | None:
    """The split of the layers over `order` (each member one contiguous range, in order, none empty)
    with the least compute time whose every stage fits its member's memory; (ranges, seconds), or
    None when none fits. A dynamic programme over (members placed, layers covered)."""
    n, k = costs.n_layer, len(order)
    if k == 0 or k > n:
        return None
    best = [[math.inf] * (n + 1) for _ in range(k + 1)]
    cut = [[-1] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for i, m in enumerate(order):
        last_stage = i == k - 1
        for start in range(i, n - (k - i) + 1):
            if best[i][start] == math.inf:
                continue
            ends = [n] if last_stage else range(start + 1, n - (k - i - 1) + 1)
            for end in ends:
                if costs.stage_bytes(start, end - 1) > m.memory_bytes:
                    break  # longer ranges only hold more (weights, KV)
                t = best[i][start] + (end - start) * m.layer_s
                if t < best[i + 1][end]:
                    best[i + 1][end], cut[i + 1][end] = t, start
    if best[k][n] == math.inf:
        return None
    ranges, end = [], n
    for i in range(k, 0, -1):
        start = cut[i][end]
        ranges.append((start, end - 1))
        end = start
    return ranges[::-1], best[k][n]


def _path_time(members: Mapping[str, Member], order: Sequence[str]) -> float:
    return sum(rtt(members, a, b) for a, b in zip(order, order[1:]))


def _order(members: Mapping[str, Member], head: str, others: Sequence[str]) -> list[str]:
    """The shortest path over round trips from the head through `others` (exact up to EXACT_ORDER_MAX)."""
    if len(others) <= 1:
        return [head, *others]
    if len(others) <= EXACT_ORDER_MAX:
        idx = list(others)
        n = len(idx)
        dist = {(mask, j): (rtt(members, head, idx[j]), [j]) for j in range(n) for mask in [1 << j]}
        for size in range(2, n + 1):
            for subset in itertools.combinations(range(n), size):
                mask = sum(1 << j for j in subset)
                for j in subset:
                    prev = mask & ~(1 << j)
                    options = [
                        (dist[(prev, i)][0] + rtt(members, idx[i], idx[j]), dist[(prev, i)][1])
                        for i in subset
                        if i != j and (prev, i) in dist
                    ]
                    if options:
                        d, path = min(options, key=lambda o: o[0])
                        dist[(mask, j)] = (d, path + [j])
        full = (1 << n) - 1
        _, path = min((dist[(full, j)] for j in range(n)), key=lambda o: o[0])
        return [head, *(idx[j] for j in path)]
    order, left = [head], set(others)
    while left:  # nearest neighbour, then 2-opt on the tail of the path
        nxt = min(left, key=lambda x: (rtt(members, order[-1], x), x))
        order.append(nxt)
        left.remove(nxt)
    improved = True
    while improved:
        improved = False
        for i in range(1, len(order) - 1):
            for j in range(i + 1, len(order)):
                candidate = order[:i] + order[i : j + 1][::-1] + order[j + 1 :]
                if _path_time(members, candidate) < _path_time(members, order) - 1e-12:
                    order, improved = candidate, True
    return order


def evaluate(costs: ModelCosts, members: Mapping[str, Member], order: Sequence[str]) -> Plan | None:
    """The plan of `order` (the head first) with its best split; None when it does not fit."""
    split = best_split(costs, [members[name] for name in order])
    if split is None:
        return None
    ranges, compute = split
    stages = tuple(Stage(a, b, name) for (a, b), name in zip(ranges, order))
    return Plan(stages, compute + _path_time(members, order))


def _for_set(costs: ModelCosts, members: Mapping[str, Member], head: str, chosen: frozenset[str]) -> Plan | None:
    """The best plan of these members (after the head): every order of a few (ALL_ORDERS_MAX);
    for more, the shortest path over round trips, improved by swapping two stages while that pays
    (the split, and so which member holds the tail's output layer, depends on the order too)."""
    if len(chosen) <= ALL_ORDERS_MAX:
        plans = (evaluate(costs, members, [head, *order]) for order in itertools.permutations(sorted(chosen)))
        return min((q for q in plans if q is not None), key=lambda q: q.time_per_token_s, default=None)
    order = _order(members, head, sorted(chosen))
    best = evaluate(costs, members, order)
    improved = True
    while improved:
        improved = False
        for i, j in itertools.combinations(range(1, len(order)), 2):
            candidate = list(order)
            candidate[i], candidate[j] = candidate[j], candidate[i]
            q = evaluate(costs, members, candidate)
            if q is not None and (best is None or q.time_per_token_s < best.time_per_token_s - 1e-12):
                order, best, improved = candidate, q, True
                break
    return best


def plan_route(
    costs: ModelCosts, reports: Sequence[Member], head: str, time_bound_s: float = PLAN_TIME_BOUND_S
) -> Plan | WhyNot:
    """The route and its replicas for these members (`head` serves stage 0), or why there is none."""
    members = {m.name: m for m in reports}
    if head not in members:
        return WhyNot(Why.BAD_REPORT, f"the head {head} reported nothing")
    if len(members) > MAX_MEMBERS:
        return WhyNot(Why.BAD_REPORT, f"{len(members)} members: a plan takes at most {MAX_MEMBERS}")
    for m in reports:
        if (why := m.check()) is not None:
            return why
    deadline = time.monotonic() + time_bound_s
    others = sorted(set(members) - {head})
    best = None
    # several starts (the head alone, then each promising member beside it): a greedy growth can
    # settle where no single swap helps
    for start in [frozenset(), *(frozenset({c}) for c in _pool(costs, members, head, frozenset(), others))]:
        if best is not None and time.monotonic() > deadline:
            break
        found = _search(costs, members, head, others, start, deadline)
        if found is not None and (best is None or found.time_per_token_s < best.time_per_token_s):
            best = found
    if best is None:
        need = costs.stage_bytes(0, costs.n_layer - 1)
        have = sum(m.memory_bytes for m in reports)
        return WhyNot(
            Why.NO_PLAN,
            f"no split fits the members' memory (the whole model needs about {need} bytes "
            f"with its KV and headroom; they offer {have})",
        )
    return with_replicas(costs, members, best)


def _search(
    costs: ModelCosts,
    members: Mapping[str, Member],
    head: str,
    others: list[str],
    chosen: frozenset[str],
    deadline: float,
) -> Plan | None:
    """From `chosen`: grow by the member that lowers the time most (the most memory first while
    nothing fits), then swap one member in or out while that pays."""
    current = _for_set(costs, members, head, chosen)
    while time.monotonic() < deadline:
        left = [c for c in others if c not in chosen]
        pool = _pool(costs, members, head, chosen, left)
        options = [(p, c) for c in pool if (p := _for_set(costs, members, head, chosen | {c})) is not None]
        better = [(p, c) for p, c in options if current is None or p.time_per_token_s < current.time_per_token_s]
        if better:
            current, add = min(better, key=lambda o: o[0].time_per_token_s)
        elif current is None and left:
            add = max(left, key=lambda c: (members[c].memory_bytes, -members[c].layer_s, c))
        else:
            break
        chosen = chosen | {add}
    if current is None:
        return None
    improved = True
    while improved and time.monotonic() < deadline:
        improved = False
        pool = _pool(costs, members, head, chosen, [c for c in others if c not in chosen])
        moves = [chosen - {c} for c in chosen] + [chosen | {c} for c in pool]
        moves += [(chosen - {a}) | {b} for a in chosen for b in pool]
        for candidate in moves:
            if time.monotonic() > deadline:
                break
            p = _for_set(costs, members, head, frozenset(candidate))
            if p is not None and p.time_per_token_s < current.time_per_token_s - 1e-12:
                current, chosen, improved = p, frozenset(candidate), True
                break
    return current


def _pool(
    costs: ModelCosts, members: Mapping[str, Member], head: str, chosen: frozenset[str], candidates: list[str]
) -> list[str]:
    """The SEARCH_POOL candidates likeliest to help: a share of the layers at their speed, plus their
    nearest round trip to the route so far, the most memory first on a tie."""
    share = costs.n_layer / (len(chosen) + 2)
    placed = [head, *chosen]

    def score(c: str) -> tuple:
        return (members[c].layer_s * share + min(rtt(members, c, x) for x in placed), -members[c].memory_bytes, c)

    return sorted(candidates, key=score)[:SEARCH_POOL]


def with_replicas(costs: ModelCosts, members: Mapping[str, Member], plan: Plan) -> Plan:
    """The members the route does not use stand by for a stage: the one they can hold with the
    fewest replicas, the slowest first (its layers times its member's time)."""
    used = {s.member for s in plan.stages}
    replicas: dict[int, list[str]] = {i: [] for i in range(len(plan.stages))}
    spare = []
    for name in sorted(set(members) - used, key=lambda x: (-members[x].memory_bytes, x)):
        fits = [
            i for i, s in enumerate(plan.stages) if costs.stage_bytes(s.first, s.last) <= members[name].memory_bytes
        ]
        if not fits:
            spare.append(name)
            continue
        slowest = {
            i: (plan.stages[i].last - plan.stages[i].first + 1) * members[plan.stages[i].member].layer_s for i in fits
        }
        i = min(fits, key=lambda i: (len(replicas[i]), -slowest[i]))
        replicas[i].append(name)
    stages = tuple(dataclasses.replace(s, replicas=tuple(replicas[i])) for i, s in enumerate(plan.stages))
    return Plan(stages, plan.time_per_token_s, tuple(spare))


def exhaustive(costs: ModelCosts, reports: Sequence[Member], head: str) -> Plan | None:
    """The best route over every set of members and every order, each with its best split (the
    reference the planner is held to; factorial: small meshes only)."""
    members = {m.name: m for m in reports}
    others = sorted(set(members) - {head})
    best = None
    for k in range(len(others) + 1):
        for subset in itertools.permutations(others, k):
            p = evaluate(costs, members, [head, *subset])
            if p is not None and (best is None or p.time_per_token_s < best.time_per_token_s):
                best = p
    return best


def equal_layers(costs: ModelCosts, reports: Sequence[Member], head: str) -> Plan | None:
    """The naive plan: every member, in the order given, an equal share of the layers (None: it
    does not fit, or there are more members than layers)."""
    order = [head, *[m.name for m in reports if m.name != head]]
    members = {m.name: m for m in reports}
    n, k = costs.n_layer, len(order)
    if k > n:
        return None
    bounds = [round(i * n / k) for i in range(k + 1)]
    stages = tuple(Stage(bounds[i], bounds[i + 1] - 1, order[i]) for i in range(k))
    if any(costs.stage_bytes(s.first, s.last) > members[s.member].memory_bytes for s in stages):
        return None
    compute = sum((s.last - s.first + 1) * members[s.member].layer_s for s in stages)
    return Plan(stages, compute + _path_time(members, order))


def members_from_json(data) -> list[Member] | WhyNot:
    """Members described by hand (a dry run: `llama-shard inspect --plan FILE`): a JSON list of
    {"name", "memory" (bytes, or "8GiB"), "layer_ms", "prefill_layer_ms"?, "rtt_ms": {name: ms}?,
    "backend"?}; the first is the head unless one says "head": true."""
    from ..engine.hot_kv import parse_size

    if not isinstance(data, list) or not data or len(data) > MAX_MEMBERS:
        return WhyNot(Why.BAD_REPORT, f"a plan's members are a JSON list of 1 to {MAX_MEMBERS} objects")
    out = []
    try:
        for item in data:
            rtt = {str(k): float(v) / 1e3 for k, v in (item.get("rtt_ms") or {}).items()}
            memory = item["memory"]
            out.append(
                Member(
                    str(item["name"]),
                    parse_size(memory) if isinstance(memory, str) else int(memory),
                    float(item["layer_ms"]) / 1e3,
                    float(item.get("prefill_layer_ms", 0.0)) / 1e3,
                    rtt,
                    str(item.get("backend", "cpu")),
                )
            )
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        return WhyNot(Why.BAD_REPORT, f"a member is {{name, memory, layer_ms, rtt_ms?}}: {e!r}")
    heads = [i for i, item in enumerate(data) if item.get("head")]
    if len(heads) > 1:
        return WhyNot(Why.BAD_REPORT, "one member at most says it is the head")
    if heads:
        out.insert(0, out.pop(heads[0]))
    if len({m.name for m in out}) != len(out):
        return WhyNot(Why.BAD_REPORT, "two members have one name")
    return out
