"""The later stages of a head's route and their replicas, as the head sees them (serve --peer).

A head lists every later worker with `--peer`. Each one's `Info` says which layers it holds: peers
of the same range, model and numerics are replicas of one stage, and the stages in layer order
are the head's own route (a Generate request that names no `forward`, and every HTTP request). A
session is placed on one replica per stage when it opens (the least loaded that is up) and stays
there; when a step cannot reach a replica, the head marks it down and moves the session to another
replica of that stage (the loop re-prefills it there: generation/loops.py).

A replica's state (docs/design.md#replicas-and-failover draws it):

    up ──(a probe fails)──> suspect ──(a second one fails)──> down
    up, suspect ──(a step cannot reach it)──> down
    down ──(its backoff passed)──> probing ──(Info answers, checks pass)──> up
                                          └──(no answer)──> down (backoff doubled, at most BACKOFF_MAX_S)
    any ──(its bytes differed in a spot check: head/proofs.py)──> failed-check (for good)

New sessions go to up replicas (suspect ones only when a stage has no up one); a down or probing
replica gets none. Invariants: every peer is in exactly one state; a replica is in a stage only once
its Info answered and passed the checks (another model, other numerics than its stage, a range that
overlaps another stage's: refused, named); the head's health is SERVING only while every stage it
knows has a replica up or suspect, and no layer after the head is left unknown while a peer that
could hold it has not answered.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

from prometheus_client import Counter, Gauge

from .._native import is_cpu_device
from ..errors import InvalidInputError, Why, WhyNot
from ..proto import shard_pb2 as pb
from ..proto.requests import FEATURE_HANDED_FROM
from ..proto.wire import wire_dtype_name
from .replica import (
    BACKOFF_MAX_S,
    BACKOFF_MIN_S,
    DOWN_AFTER_PROBES,
    ON_DEMAND_PROBE_S,
    PROBE_S,
    PROBE_TIMEOUT_S,
    Refusal,
    Replica,
    ReplicaState,
    wire_reads,
)


def _log(message: str) -> None:
    print(f"llama-shard worker: {message}", file=sys.stderr, flush=True)


class Replicas:
    """The head's peers grouped into stages of replicas, probed in the background.

    `probe(address, timeout)` reads a peer's Info (raising on any failure); `on_health(ok, detail)`
    is told each time the route's health changes. Thread-safe: the generation loop's threads, the
    servicer's handlers and the probe thread all call in."""

    def __init__(
        self,
        info,
        numerics: str,
        model_digest: str,
        instance_id: str,
        addresses: tuple[str, ...],
        probe: Callable[[str, float], pb.InfoReply],
        registry=None,
        on_health: Callable[[bool, str], None] = lambda ok, detail: None,
        wire_dtype: int = pb.DTYPE_FLOAT32,
    ):
        self.own = info
        self.wire_dtype = wire_dtype  # the head's route's hidden rows: every replica must read them
        self.numerics, self.model_digest, self.instance_id = numerics, model_digest, instance_id
        self._probe = probe
        self._on_health = on_health
        self._lock = threading.Lock()
        self.replicas = [Replica(a, i) for i, a in enumerate(dict.fromkeys(addresses))]
        self._by_address = {r.address: r for r in self.replicas}
        # a mesh's head (head/role.py sets it): how long a failover may wait for a stage it restores
        self.restoring: Callable[[tuple[int, int]], float] = lambda stage: 0.0
        self._health: tuple[bool, str] | None = None
        self._publish_lock = threading.Lock()  # health computed and told in one order
        self._seen: set[tuple[int, int]] = set()  # every stage a replica ever held: each needs one
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.failovers_total = 0
        self.failovers = (
            Counter(
                "llama_shard_failovers",
                "Sessions the head moved to another replica after one failed",
                registry=registry,
            )
            if registry is not None
            else None
        )
        self.up_gauge = (
            Gauge(
                "llama_shard_replica_up",
                "1 while the head can use this replica of a stage",
                ["stage", "address"],
                registry=registry,
            )
            if registry is not None
            else None
        )

    # --- probing ---------------------------------------------------------------------------------

    def start(
        self, on_health: Callable[[bool, str], None] | None = None, wait_s: float = PROBE_TIMEOUT_S
    ) -> "Replicas":
        """Tells `on_health` of every change of the route's health from now on; probes every peer once (at once, waiting at most `wait_s`), refuses a mesh whose answers
        contradict each other (two replicas of one range with other numerics, overlapping ranges:
        InvalidInputError naming both), then keeps probing in the background."""
        if on_health is not None:
            self._on_health = on_health
        threads = [threading.Thread(target=self._probe_one, args=(r, wait_s), daemon=True) for r in self.replicas]
        for t in threads:
            t.start()
        for t in threads:
            t.join(wait_s + 1.0)
        with self._lock:
            conflicts = [r.refused for r in self.replicas if r.refusal == Refusal.CONFLICT]
        if conflicts:
            raise InvalidInputError(conflicts[0])
        self._publish()
        self._thread = threading.Thread(target=self._run, name="replica-probe", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def add(self, address: str) -> None:
        """A peer that came to serve after the start (a mesh's member): probed from now on."""
        with self._lock:
            if address in self._by_address:
                self._by_address[address].next_probe = 0.0  # asked at once (it may hold a new range)
                return
            r = Replica(address, len(self.replicas))
            self.replicas.append(r)
            self._by_address[address] = r

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            now = time.monotonic()
            with self._lock:
                due = [r for r in self.replicas if now >= r.next_probe and r.refusal != Refusal.NOT_LATER]
                for r in due:
                    if r.state == ReplicaState.DOWN:
                        r.state = ReplicaState.PROBING
                    r.next_probe = now + 3600  # set again when the probe ends
            for r in due:
                self._probe_one(r, PROBE_TIMEOUT_S)
            if due:
                self._publish()

    def _probe_one(self, r: Replica, timeout: float) -> None:
        try:
            info = self._probe(r.address, timeout)
        except Exception as e:  # noqa: BLE001 - any failure to answer is a failed probe
            why = getattr(e, "details", lambda: None)() or str(e) or type(e).__name__
            self._failed_probe(r, f"Info: {why}")
            return
        with self._lock:
            if r.state == ReplicaState.FAILED_CHECK:  # answering again proves nothing of its bytes
                r.info = info
                return
            was = r.info
            r.refusal, refusal = self._refusal_locked(r, info)
            r.info, r.refused = info, refusal
            r.failed_probes, r.backoff = 0, BACKOFF_MIN_S
            r.next_probe = time.monotonic() + PROBE_S
            if was is not None and was.instance_id and info.instance_id != was.instance_id:
                r.restarts += 1  # its sessions are gone: their next step is a miss, which the loop re-prefills
                r.last_error = "restarted (a new instance id): its sessions were lost"
            if refusal:
                r.state, r.last_error = ReplicaState.DOWN, refusal
            elif info.draining:
                r.state, r.last_error = ReplicaState.DOWN, "draining: handing its sessions over"
            else:
                if was is None:
                    r.last_error = ""
                if r.state != ReplicaState.UP and was is not None:
                    _log(f"replica {r.address} (layers {info.first}-{info.last}) is up again")
                r.state = ReplicaState.UP

    def _failed_probe(self, r: Replica, why: str) -> None:
        with self._lock:
            if r.state == ReplicaState.FAILED_CHECK:
                return
            r.failed_probes += 1
            r.last_error = why
            if r.state in (ReplicaState.UP, ReplicaState.SUSPECT) and r.failed_probes < DOWN_AFTER_PROBES:
                r.state = ReplicaState.SUSPECT
                r.next_probe = time.monotonic() + BACKOFF_MIN_S
                return
            if r.state in (ReplicaState.UP, ReplicaState.SUSPECT):
                _log(f"replica {r.address} is down: {why}")
            r.state = ReplicaState.DOWN
            r.next_probe = time.monotonic() + r.backoff
            r.backoff = min(BACKOFF_MAX_S, 2 * r.backoff)

    def _refusal_locked(self, r: Replica, info: pb.InfoReply) -> tuple[Refusal | None, str]:
        """Why this answer makes the peer no replica of a later stage: its kind and words (None, ''
        if none)."""
        own = self.own
        if info.instance_id and info.instance_id == self.instance_id:
            return Refusal.NOT_LATER, "not a later stage: it is this worker"
        if (info.n_layer, info.n_embd, info.architecture) != (own.n_layer, own.n_embd, own.architecture):
            return Refusal.CONFLICT, (
                f"peer {r.address} serves another model ({info.architecture}, "
                f"{info.n_layer} layers) than this head ({own.architecture}, {own.n_layer} layers)"
            )
        if info.first <= own.last:
            return Refusal.NOT_LATER, (
                f"not a later stage: it holds layers {info.first}-{info.last}, this head {own.first}-{own.last}"
            )
        reads = wire_reads(info)
        if self.wire_dtype not in reads:
            return Refusal.CONFLICT, (
                f"peer {r.address} reads hidden rows as {', '.join(map(wire_dtype_name, reads))}; "
                f"this head sends {wire_dtype_name(self.wire_dtype)} (serve --wire-dtype)"
            )
        for other in self.replicas:
            o = other.info
            if other is r or o is None or other.refused:
                continue
            if (o.first, o.last) == (info.first, info.last):
                if o.numerics != info.numerics or o.recipe_fingerprint != info.recipe_fingerprint:
                    return Refusal.CONFLICT, (
                        f"peers {other.address} and {r.address} both hold layers "
                        f"{info.first}-{info.last} but compute differently ({o.numerics or 'unknown'}; "
                        f"{info.numerics or 'unknown'}): replicas of a stage must give the same bits"
                    )
                if o.model_digest and info.model_digest and o.model_digest != info.model_digest:
                    return Refusal.CONFLICT, (
                        f"peers {other.address} and {r.address} both hold layers "
                        f"{info.first}-{info.last} of different model files"
                    )
            elif o.first <= info.last and info.first <= o.last:
                return Refusal.CONFLICT, (
                    f"peer {r.address} holds layers {info.first}-{info.last}, which overlap "
                    f"{other.address}'s {o.first}-{o.last}: stages must tile the model"
                )
        return None, ""

    # --- proofs (head/proofs.py) ----------------------------------------------------------------

    def receipt_key(self, address: str) -> bytes | None:
        """The receipt key the replica at `address` showed in its last Info (None: not known)."""
        with self._lock:
            r = self._by_address.get(address)
            return r.info.receipt_key if r is not None and r.info is not None and r.info.receipt_key else None

    def check_partner(self, address: str, avoid: tuple[str, ...] = (), exact: bool = True) -> pb.Hop | None:
        """A usable replica of the same layers and model file as `address`, to replay its steps on
        (none of `avoid`); None: there is none. `exact`: one that computes the same bytes (the same
        numerics, backend and kernels); else one of the same numerics on other kernels or another
        backend (compared within a tolerance: receipts/tolerance.py)."""
        with self._lock:
            r = self._by_address.get(address)
            if r is None or r.range is None or r.info is None:
                return None
            same = [
                o
                for o in self.replicas
                if o is not r
                and o.address not in avoid
                and o.usable
                and o.range == r.range
                and o.info is not None
                and (o.info.numerics, o.info.model_digest) == (r.info.numerics, r.info.model_digest)
                and ((o.info.backend, o.info.kernels) == (r.info.backend, r.info.kernels)) == exact
            ]
            if not same:
                return None
            return self._hop_locked(min(same, key=lambda o: (o.load(), o.order)))

    def same_kernels(self, a: str, b: str) -> bool:
        """Whether the replicas at `a` and `b` compute on the same backend and kernels."""
        with self._lock:
            ra, rb = self._by_address.get(a), self._by_address.get(b)
            if ra is None or rb is None or ra.info is None or rb.info is None:
                return False
            return (ra.info.backend, ra.info.kernels) == (rb.info.backend, rb.info.kernels)

    def on_cpu(self, address: str) -> bool:
        """Whether the replica at `address` computes its layers on the CPU."""
        with self._lock:
            r = self._by_address.get(address)
            return r is not None and r.info is not None and is_cpu_device(r.info.device)

    def fail_check(self, address: str, why: str) -> None:
        """The replica at `address` gave other bytes than a replica in a spot check: no new route
        takes it (its running sessions fail over at their next error), whatever it answers later."""
        with self._lock:
            r = self._by_address.get(address)
            if r is None:
                return
            r.state, r.last_error = ReplicaState.FAILED_CHECK, why
        self._publish()

    def unreadable(self, wire_dtype: int) -> WhyNot | None:
        """Why the head's own route cannot carry rows of this type (a replica that does not read
        them), or None."""
        with self._lock:
            for r in self.replicas:
                if r.info is not None and not r.refused and wire_dtype not in (reads := wire_reads(r.info)):
                    return WhyNot(
                        Why.WIRE_DTYPE,
                        f"wire_dtype {wire_dtype_name(wire_dtype)}: peer {r.address} "
                        f"reads hidden rows as {', '.join(map(wire_dtype_name, reads))}",
                    )
        return None

    # --- the route ----------------------------------------------------------------------------

    def _stages_locked(self) -> list[tuple[int, int]]:
        return sorted({r.range for r in self.replicas if r.range is not None})

    def stage_of(self, address: str) -> tuple[int, int] | None:
        """The layer range of the replica at `address` (None: not a known replica)."""
        with self._lock:
            r = self._by_address.get(address)
            return None if r is None else r.range

    def complete(self) -> bool:
        with self._lock:
            return self._gap_locked() is None

    def _gap_locked(self) -> tuple[int, int] | None:
        """The first layers after the head no known stage holds (None: the stages tile the model)."""
        nxt = self.own.last + 1
        for first, last in self._stages_locked():
            if first != nxt:
                return nxt, first - 1
            nxt = last + 1
        return None if nxt >= self.own.n_layer else (nxt, self.own.n_layer - 1)

    def _pick_locked(self, stage: tuple[int, int], avoid: frozenset = frozenset()) -> Replica | None:
        cands = [r for r in self.replicas if r.range == stage and r.address not in avoid]
        for wanted in (ReplicaState.UP, ReplicaState.SUSPECT):
            ok = [r for r in cands if r.state == wanted]
            if ok:
                return min(ok, key=lambda r: (r.load(), r.order))
        return None

    def _hop_locked(self, r: Replica) -> pb.Hop:
        others = sum(1 for o in self.replicas if o is not r and o.range == r.range)
        return pb.Hop(address=r.address, recipe_fingerprint=r.info.recipe_fingerprint, fail_fast=others > 0)

    def choose(self, prefer: tuple[str, ...] = ()) -> list[pb.Hop] | WhyNot:
        """The head's own route for a new session: one usable replica per stage (those of `prefer`,
        the session's last route, while they are up), or why there is none (its text names the stage)."""
        with self._lock:
            gap = self._gap_locked()
            if gap is not None:
                waiting = [r.address for r in self.replicas if r.info is None]
                why = (
                    f"{', '.join(waiting)} not reached yet: {self._by_address[waiting[0]].last_error}"
                    if waiting
                    else "no --peer worker holds them"
                )
                return WhyNot(
                    Why.NO_REPLICA,
                    f"stage {self._stage_number_locked(gap)} (layers {gap[0]}-{gap[1]}) has no replica: {why}",
                )
            hops = []
            for n, stage in enumerate(self._stages_locked(), start=1):
                kept = next(
                    (
                        self._by_address[a]
                        for a in prefer
                        if a in self._by_address
                        and self._by_address[a].range == stage
                        and self._by_address[a].state == ReplicaState.UP
                    ),
                    None,
                )
                r = kept or self._pick_locked(stage)
                if r is None:
                    errors = "; ".join(f"{x.address}: {x.last_error}" for x in self.replicas if x.range == stage)
                    return WhyNot(
                        Why.NO_REPLICA, f"stage {n} (layers {stage[0]}-{stage[1]}) has no healthy replica ({errors})"
                    )
                hops.append(self._hop_locked(r))
            return hops

    def _stage_number_locked(self, stage: tuple[int, int]) -> int:
        return 1 + sum(1 for s in self._stages_locked() if s[0] < stage[0])

    def hops(self, forward) -> list[pb.Hop]:
        """A caller's route with each hop's fail_fast set where the head has another replica of its
        stage (copies: the request is not changed)."""
        out = []
        with self._lock:
            for hop in forward:
                r = self._by_address.get(hop.address)
                h = pb.Hop(address=hop.address, recipe_fingerprint=hop.recipe_fingerprint)
                if r is not None and r.range is not None:
                    h.fail_fast = any(o is not r and o.range == r.range for o in self.replicas)
                out.append(h)
        return out

    def failover(self, address: str, why: str, avoid: tuple[str, ...] = ()) -> pb.Hop | WhyNot:
        """A step could not reach the replica at `address`: it is marked down and the hop to use
        instead is returned (another replica of its stage), or why there is none."""
        with self._lock:
            r = self._by_address.get(address)
            if r is None or r.range is None:
                return WhyNot(Why.NO_REPLICA, f"worker {address} is no replica the head knows of (serve --peer): {why}")
            if r.state in (ReplicaState.UP, ReplicaState.SUSPECT):
                _log(f"replica {address} is down: {why}")
                r.state, r.next_probe = ReplicaState.DOWN, time.monotonic() + r.backoff
            r.last_error = why
            r.failovers += 1
            self.failovers_total += 1
            stage = r.range
            other = self._pick_locked(stage, frozenset((address, *avoid)))
            resting = (
                [
                    x
                    for x in self.replicas
                    if x.range == stage and x.address != address and x.address not in avoid and not x.usable
                ]
                if other is None
                else []
            )
        # a replica marked down may be back already (restarted since its last probe): asked now
        for x in resting:
            self._probe_one(x, ON_DEMAND_PROBE_S)
        with self._lock:
            if other is None and resting:
                other = self._pick_locked(stage, frozenset((address, *avoid)))
            n = self._stage_number_locked(stage)
            hop = self._hop_locked(other) if other is not None else None
        if hop is None:  # (the failed replica itself may answer again: a brief fault, not a death)
            hop = self._await_restored(stage, frozenset(avoid))
        if self.failovers is not None:
            self.failovers.inc()
        self._publish()
        if hop is None:
            return WhyNot(
                Why.NO_REPLICA, f"stage {n} (layers {stage[0]}-{stage[1]}) has no other healthy replica: {why}"
            )
        return hop

    def _await_restored(self, stage: tuple[int, int], avoid: frozenset) -> pb.Hop | None:
        """A stage a mesh restores (another member loads its layers, or the one that failed answers
        again): the hop of the first replica of it that is up, waiting while `restoring` says the
        stage may still come (None: it did not)."""
        deadline = time.monotonic() + self.restoring(stage)
        while time.monotonic() < deadline and not self._stop.is_set():
            with self._lock:
                other = self._pick_locked(stage, avoid)
                if other is not None:
                    return self._hop_locked(other)
                resting = [x for x in self.replicas if x.address not in avoid and not x.usable]
            for x in resting:
                self._probe_one(x, ON_DEMAND_PROBE_S)
            time.sleep(0.25)
            deadline = min(deadline, time.monotonic() + self.restoring(stage))
        return None

    def moved(self, address: str, to: str) -> pb.Hop | None:
        """A draining replica handed a session to `to`: its hop, if `to` is a replica of the same
        stage that the head knows (None: the head cannot follow; the loop fails over instead)."""
        with self._lock:
            r, t = self._by_address.get(address), self._by_address.get(to)
            if r is None or t is None or r.range is None or t.range != r.range:
                return None
            if r.state != ReplicaState.FAILED_CHECK:  # out for good: a drain does not bring it back
                r.state, r.last_error = ReplicaState.DOWN, "draining: handing its sessions over"
            r.next_probe = time.monotonic() + r.backoff
            return self._hop_locked(t)

    def supports(self, route: tuple[str, ...], feature: str) -> bool:
        """Whether every worker of `route` lists `feature` in its last Info (InfoReply.features)."""
        with self._lock:
            return all(
                (r := self._by_address.get(a)) is not None and r.info is not None and feature in r.info.features
                for a in route
            )

    def handed_from(self, held: tuple[str, ...], route: tuple[str, ...]) -> list[str] | None:
        """For a session that `held` (its last route) holds and that goes down `route` now: per stage,
        the instance id of its replica in `held` where `route` has another ('' where the same), for
        StepRequest.handed_from: the new replica continues it only if that one handed it over. None
        where a stage's replica was never reached (no instance id), the stages differ, or a worker of
        `route` would not forward or check it (an older version)."""
        if len(held) != len(route) or not self.supports(route, FEATURE_HANDED_FROM):
            return None
        with self._lock:
            out = []
            for old, new in zip(held, route):
                if old == new:
                    out.append("")
                    continue
                r = self._by_address.get(old)
                if r is None or r.info is None or not r.info.instance_id:
                    return None
                out.append(r.info.instance_id)
            return out

    def place(self, key: str, route: tuple[str, ...]) -> None:
        """The head's session `key` now lives on these replicas (and on no other)."""
        with self._lock:
            for r in self.replicas:
                if r.address in route:
                    r.sessions.add(key)
                else:
                    r.sessions.discard(key)

    def unplace(self, key: str) -> None:
        with self._lock:
            for r in self.replicas:
                r.sessions.discard(key)

    # --- what it tells -------------------------------------------------------------------------

    def health(self) -> tuple[bool, str]:
        """(SERVING, '' or the stage that has no healthy replica)."""
        with self._lock:
            gap = self._gap_locked()
            waiting = [r for r in self.replicas if r.info is None]
            if gap is not None and waiting:
                return False, (
                    f"stage {self._stage_number_locked(gap)} (layers {gap[0]}-{gap[1]}): no replica "
                    f"answers ({waiting[0].address}: {waiting[0].last_error})"
                )
            self._seen.update(self._stages_locked())
            for stage in sorted(self._seen):  # a stage whose replicas were all refused since is still one
                mine = [
                    r
                    for r in self.replicas
                    if r.range == stage or (r.info is not None and r.refused and (r.info.first, r.info.last) == stage)
                ]
                if not any(r.usable for r in mine):
                    errors = "; ".join(f"{r.address}: {r.refused or r.last_error}" for r in mine)
                    return False, (
                        f"stage {self._stage_number_locked(stage)} (layers {stage[0]}-{stage[1]}) has no "
                        f"healthy replica ({errors})"
                    )
        return True, ""

    def route_health(self) -> tuple[bool, str]:
        """health(), and the head's own route complete (what its HTTP requests take): SERVING only
        when every layer after the head has a stage."""
        ok, detail = self.health()
        if ok:
            with self._lock:
                gap = self._gap_locked()
            if gap is not None:
                return False, f"no --peer worker holds layers {gap[0]}-{gap[1]}: the head has no route of its own"
        return ok, detail

    def _publish(self) -> None:
        with self._publish_lock:
            health = self.health()
            with self._lock:
                changed, self._health = health != self._health, health
                stages = self._stages_locked()
                rows = [
                    (str(stages.index(r.range) + 1) if r.range in stages else "0", r.address, float(r.usable))
                    for r in self.replicas
                ]
            if self.up_gauge is not None:
                for stage, address, up in rows:
                    self.up_gauge.labels(stage, address).set(up)
            if changed:
                self._on_health(*health)

    def info(self) -> list[pb.ReplicaInfo]:
        with self._lock:
            stages = self._stages_locked()
            out = []
            for r in sorted(self.replicas, key=lambda r: (r.range or (1 << 30, 0), r.order)):
                first, last = r.range if r.range is not None else ((r.info.first, r.info.last) if r.info else (0, 0))
                out.append(
                    pb.ReplicaInfo(
                        stage=stages.index(r.range) + 1 if r.range in stages else 0,
                        first=first,
                        last=last,
                        address=r.address,
                        state=r.state.value,
                        sessions=len(r.sessions),
                        last_error=r.refused or r.last_error,
                        failovers=r.failovers,
                    )
                )
            return out
