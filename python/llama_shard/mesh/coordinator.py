"""A mesh's head (serve --mesh-members N): members join with a report of what they have, the head
plans the layers (head/planner.py), and each member's next report is answered with its range. A
member that stops reporting is dead; a stage it held alone is given to another member, which loads
it (fetching its tensors); a member that joins a planned mesh becomes a replica where one is needed.

A member's states:

    reporting ──(the plan, or a placement)──> assigned ──(it serves its range)──> serving
    any ──(no report for DEAD_AFTER_S)──> dead ──(FORGET_DEAD_S)──> forgotten
    assigned, serving ──(its stage's last holder died: it takes that stage)──> assigned

Invariants: at most MAX_MEMBERS members are known (a join beyond is refused); every report is
bounded before it is kept (`planner.Member.check`), and a refused join changes nothing; a member's
range is only ever what the head assigned it (a join names none), and a fetch is answered only for
the member's probe layer or its assignment; a member id is its joining principal's only. `Mesh` is
thread-safe (the gRPC handlers, the head's start and its failover all call in).
"""

from __future__ import annotations

import dataclasses
import enum
import secrets
import threading
import time
from collections.abc import Callable, Iterator

from ..errors import Why, WhyNot
from ..head.planner import MAX_MEMBERS, Member, ModelCosts, Plan, plan_route
from ..proto import shard_pb2 as pb
from .manifest import RangeSource

#: how often a member reports, and how long without a report makes it dead
HEARTBEAT_S = 1.0
DEAD_AFTER_S = 6.0
#: how long a member that joined but never measured itself is kept (a join flood ages out)
UNMEASURED_S = 600.0
#: how long a dead member is kept (shown in Info) before it is forgotten: the table stays bounded
FORGET_DEAD_S = 60.0
#: the longest address or round-trip key a report may carry
MAX_ADDRESS_BYTES = 255
#: how long a stream waits for a stage the mesh is restoring (a member loading the layers)
RESTORE_S = 120.0
#: the planner's name for the head (members report their round trip to it under this name)
HEAD = "head"


def _host_port(address: str) -> bool:
    host, _, port = address.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536 and address.isprintable() and " " not in address


class MemberState(enum.Enum):
    REPORTING = "reporting"
    ASSIGNED = "assigned"
    SERVING = "serving"
    DEAD = "dead"


@dataclasses.dataclass
class Joined:
    member_id: str
    principal: str
    joined_at: float
    last_seen: float
    report: Member | None = None  # None until it measured itself
    address: str = ""
    state: MemberState = MemberState.REPORTING
    assignment: tuple[int, int] | None = None
    fetched_bytes: int = 0
    told: frozenset = frozenset()  # the peers its last reply listed (it forwards to those only)
    announced: bool = False  # the head's route knows it serves (once every serving member was told)

    @property
    def live(self) -> bool:
        return self.state != MemberState.DEAD


class Mesh:
    def __init__(
        self,
        source: RangeSource,
        model_digest: str,
        costs: ModelCosts,
        max_sessions: int,
        context_tokens: int,
        clock: Callable[[], float] = time.monotonic,
        dead_after_s: float = DEAD_AFTER_S,
    ):
        self.source, self.model_digest, self.costs = source, model_digest, costs
        self.max_sessions, self.context_tokens = max_sessions, context_tokens
        self.clock, self.dead_after_s = clock, dead_after_s
        self.n_layer = costs.n_layer
        self.probe_layer = self.n_layer // 2  # a middle layer: neither the embeddings nor the output
        self._lock = threading.Condition()
        self._members: dict[str, Joined] = {}
        self.head: Member | None = None
        self.plan: Plan | None = None
        self.head_range: tuple[int, int] | None = None
        self.on_serving: Callable[[str], None] = lambda address: None  # the head's route learns of it

    def attach(self, on_serving: Callable[[str], None]) -> None:
        """The head's route learns of each member that serves, from now on and those that do already."""
        with self._lock:
            self.on_serving = on_serving
            serving = [m.address for m in self._members.values() if m.announced]
        for address in serving:
            on_serving(address)

    def _announce_locked(self) -> list[str]:
        """Members that serve and that every other serving member forwards to by now: the head's
        route may use them (before, a step forwarded to one would be refused)."""
        serving = [m for m in self._members.values() if m.state == MemberState.SERVING]
        out = []
        for m in serving:
            if not m.announced and all(m.address in o.told for o in serving if o is not m):
                m.announced = True
                out.append(m.address)
        return out

    # --- a member's report ----------------------------------------------------------------------

    def join(self, principal: str, request: pb.JoinRequest) -> pb.JoinReply:
        with self._lock:
            self._expire_locked()
            refused = self._refusal_locked(principal, request)
            if refused is not None:
                m = self._members.get(request.member_id)
                gone = bool(request.member_id) and (m is None or (m.principal == principal and not m.live))
                return pb.JoinReply(admitted=False, refused=refused, rejoin=gone)
            now = self.clock()
            m = self._members.get(request.member_id)
            if m is None:
                m = Joined(secrets.token_hex(8), principal, now, now)
                self._members[m.member_id] = m
            report = self._report(m.member_id, request)
            m.last_seen = now
            if report is not None:
                m.report = report
            if request.address:
                m.address = request.address
            if self.plan is not None and m.assignment is None and m.report is not None:
                self._place_locked(m)
            if (
                request.serving
                and m.assignment == (request.serving_first, request.serving_last)
                and m.state != MemberState.SERVING
                and m.address
            ):
                m.state = MemberState.SERVING
            current = (request.serving_first, request.serving_last) if request.serving else m.assignment
            reply = self._reply_locked(m, current)
            m.told = frozenset(reply.peers)
            announced = self._announce_locked()
            self._lock.notify_all()
            manifest_of = m.assignment or (self.probe_layer, self.probe_layer)
        if request.want_manifest:  # (laid out once per range, outside the lock: it reads the file)
            reply.manifest.CopyFrom(self.source.manifest(*manifest_of))
        for address in announced:
            self.on_serving(address)
        return reply

    def _refusal_locked(self, principal: str, request: pb.JoinRequest) -> str | None:
        if request.model_digest and request.model_digest != self.model_digest:
            return (
                f"this mesh serves the model {self.model_digest}; the member asked for {request.model_digest}: "
                "a member joins the head's model only"
            )
        if request.member_id:
            m = self._members.get(request.member_id)
            if m is None or m.principal != principal:
                return f"no member {request.member_id!r} of this caller: join again without an id"
            if m.state == MemberState.DEAD:
                return f"member {m.member_id} was declared dead ({self.dead_after_s:g} s without a report): join again"
        elif sum(1 for m in self._members.values() if m.live) >= MAX_MEMBERS - 1:
            return f"the mesh is full: {MAX_MEMBERS} members with the head"
        report = request.report
        if len(request.address) > MAX_ADDRESS_BYTES or any(len(k) > MAX_ADDRESS_BYTES for k in report.rtt_s):
            return f"report refused: an address over {MAX_ADDRESS_BYTES} bytes"
        if request.address and not _host_port(request.address):
            return f"report refused: its address {request.address[:64]!r} is not HOST:PORT"
        probe = Member(
            request.member_id or "a new member",
            report.memory_bytes,
            1.0 if report.layer_s == 0 else report.layer_s,  # 0: not measured yet (its memory is checked)
            report.prefill_layer_s,
            dict(report.rtt_s),
            report.backend or "cpu",
        )
        why = probe.check()
        if why is None and (len(report.rtt_s) > MAX_MEMBERS or len(report.backend) > 64):
            why = WhyNot(Why.BAD_REPORT, "a report names more round trips than members, or a backend over 64 bytes")
        return None if why is None else f"report refused: {why.text}"

    def _report(self, member_id: str, request: pb.JoinRequest) -> Member | None:
        r = request.report
        if r.layer_s == 0:
            return None
        by_address = {m.address: m.member_id for m in self._members.values() if m.address}
        rtt = {by_address.get(a, a): s for a, s in r.rtt_s.items()}
        return Member(member_id, r.memory_bytes, r.layer_s, r.prefill_layer_s, rtt, r.backend or "cpu")

    def _reply_locked(self, m: Joined, current: tuple[int, int] | None) -> pb.JoinReply:
        """The answer to m's report; `current`: the range it serves now (its sessions' hand-over
        goes to the other members serving that one, when it moves)."""
        reply = pb.JoinReply(
            admitted=True,
            member_id=m.member_id,
            model_digest=self.model_digest,
            n_layer=self.n_layer,
            probe_layer=self.probe_layer,
            heartbeat_s=HEARTBEAT_S,
            max_sessions=self.max_sessions,
            context_tokens=self.context_tokens,
            plan=self.describe_locked(),
        )
        others = [o for o in self._members.values() if o is not m and o.live]
        reply.members.extend(sorted(o.address for o in others if o.address))
        reply.peers.extend(sorted(o.address for o in others if o.state == MemberState.SERVING))
        if m.assignment is not None:
            reply.assigned, (reply.first, reply.last) = True, m.assignment
        if current is not None:
            reply.replicas.extend(
                sorted(o.address for o in others if o.state == MemberState.SERVING and o.assignment == current)
            )
        return reply

    # --- tensors ---------------------------------------------------------------------------------

    def fetch(self, principal: str, request: pb.FetchRequest) -> Iterator[bytes] | WhyNot:
        """A tensor's bytes for a member, or why not (another caller's id, a range it was not given,
        a tensor its range does not hold)."""
        with self._lock:
            m = self._members.get(request.member_id)
            if m is None or m.principal != principal or not m.live:
                return WhyNot(Why.BAD_REPORT, f"no live member {request.member_id!r} of this caller")
            wanted = (request.first, request.last)
            allowed = {(self.probe_layer, self.probe_layer), m.assignment}
            if wanted not in allowed:
                return WhyNot(
                    Why.BAD_REPORT,
                    f"layers {wanted[0]}-{wanted[1]} are not this member's to fetch "
                    f"(its assignment: {'none' if m.assignment is None else '%d-%d' % m.assignment})",
                )
        chunks = self.source.chunks(request.first, request.last, request.tensor, request.offset)
        if chunks is None:
            return WhyNot(Why.BAD_REPORT, f"layers {wanted[0]}-{wanted[1]} hold no tensor {request.tensor!r}")

        def counted():
            for chunk in chunks:
                with self._lock:
                    m.fetched_bytes += len(chunk)
                yield chunk

        return counted()

    # --- the plan --------------------------------------------------------------------------------

    def wait_planned(self, head: Member, members: int, wait_s: float) -> Plan | WhyNot:
        """Waits until `members` members measured themselves (at most `wait_s`), then plans with the
        head as stage 0; the head's range is `head_range`."""
        deadline = time.monotonic() + wait_s
        with self._lock:
            self.head = head
            while len(self._measured_locked()) < members and time.monotonic() < deadline:
                self._lock.wait(0.25)
                self._expire_locked()
            plan = plan_route(self.costs, [head, *self._measured_locked()], HEAD)
            if isinstance(plan, WhyNot):
                return plan
            self.plan = plan
            self.head_range = (plan.stages[0].first, plan.stages[0].last)
            for stage in plan.stages[1:]:  # (a replica of the head's range would stand by: it is placed later)
                for name in (stage.member, *stage.replicas):
                    self._assign_locked(self._members[name], (stage.first, stage.last))
            self._lock.notify_all()
        # every stage's manifest made now, once, not inside a member's Join (it hashes the range)
        stages = [(s.first, s.last) for s in plan.stages[1:]]
        threading.Thread(
            target=lambda: [self.source.manifest(*s) for s in stages], name="mesh-manifests", daemon=True
        ).start()
        return plan

    def wait_serving(self, wait_s: float) -> list[str]:
        """Waits until every assigned member serves and every serving member was told of the others
        (at most `wait_s`); the addresses the head's route may use, in stage order."""
        deadline = time.monotonic() + wait_s
        with self._lock:
            while time.monotonic() < deadline and any(
                m.state == MemberState.ASSIGNED or (m.state == MemberState.SERVING and not m.announced)
                for m in self._members.values()
            ):
                self._lock.wait(0.25)
                self._expire_locked()
            serving = [m for m in self._members.values() if m.announced and m.live]
            return [m.address for m in sorted(serving, key=lambda m: m.assignment)]

    def _measured_locked(self) -> list[Member]:
        return [m.report for m in self._members.values() if m.live and m.report is not None]

    def _assign_locked(self, m: Joined, stage: tuple[int, int]) -> None:
        m.assignment, m.state = stage, MemberState.ASSIGNED

    def _holders_locked(self, stage: tuple[int, int]) -> list[Joined]:
        return [m for m in self._members.values() if m.live and m.assignment == stage]

    def _stages_locked(self) -> list[tuple[int, int]]:
        return [] if self.plan is None else [(s.first, s.last) for s in self.plan.stages[1:]]

    def _place_locked(self, m: Joined) -> None:
        """A member measured after the plan: the stage it can hold with the fewest live holders (an
        empty one first), the one of most layers among those; else it stands by."""
        fits = [s for s in self._stages_locked() if self.costs.stage_bytes(*s) <= m.report.memory_bytes]
        if not fits:
            return
        stage = min(fits, key=lambda s: (len(self._holders_locked(s)), -(s[1] - s[0] + 1)))
        self._assign_locked(m, stage)

    # --- deaths ----------------------------------------------------------------------------------

    def tick(self) -> None:
        """Marks members without a report for dead_after_s dead, and gives each stage left without a
        live holder to another member."""
        with self._lock:
            self._expire_locked()

    def _expire_locked(self) -> None:
        now = self.clock()
        for m in list(self._members.values()):
            if m.live and now - m.last_seen > self.dead_after_s:
                m.state = MemberState.DEAD
            elif m.live and m.report is None and now - m.joined_at > UNMEASURED_S:
                del self._members[m.member_id]  # joined, never measured: a flood ages out
            elif not m.live and now - m.last_seen > self.dead_after_s + FORGET_DEAD_S:
                del self._members[m.member_id]
        for stage in self._stages_locked():
            if not self._holders_locked(stage):
                self._restore_locked(stage)

    def _restore_locked(self, stage: tuple[int, int]) -> None:
        """A live member takes `stage`: one with no range first, else a serving replica of a stage that
        another member serves too, the fastest first; it must fit the stage's memory."""
        need = self.costs.stage_bytes(*stage)
        spare, replicas = [], []
        for m in self._members.values():
            if not m.live or m.report is None or m.report.memory_bytes < need:
                continue
            if m.assignment is None:
                spare.append(m)
            elif (
                m.state == MemberState.SERVING
                and sum(o.state == MemberState.SERVING for o in self._holders_locked(m.assignment)) > 1
            ):  # (a stage keeps a serving copy: one still loading counts for nothing yet)
                replicas.append(m)
        pick = min(spare or replicas, key=lambda m: m.report.layer_s, default=None)
        if pick is not None:
            self._assign_locked(pick, stage)

    def restoring(self, stage: tuple[int, int]) -> float:
        """How long a stream may wait for `stage`: RESTORE_S while a live member holds or loads it
        (one that just failed counts until it is declared dead, then whoever took its stage), 0 for
        a stage the mesh does not plan or cannot restore (asked again as the wait goes on)."""
        with self._lock:
            return RESTORE_S if stage in self._stages_locked() and self._holders_locked(stage) else 0.0

    # --- what people read ------------------------------------------------------------------------

    def describe_locked(self) -> str:
        if self.plan is None:
            return f"not planned yet: {len(self._measured_locked())} member(s) measured"
        lines = [f"  stage 0: layers {self.head_range[0]}-{self.head_range[1]} on the head"]
        for i, stage in enumerate(self._stages_locked(), start=1):
            holders = self._holders_locked(stage)
            lines.append(
                f"  stage {i}: layers {stage[0]}-{stage[1]} on "
                + (", ".join(f"{m.address or m.member_id} ({m.state.value})" for m in holders) or "nobody yet")
            )
        spare = [m.address or m.member_id for m in self._members.values() if m.live and m.assignment is None]
        if spare:
            lines.append(f"  standing by: {', '.join(spare)}")
        lines.append(f"  planned: {self.plan.time_per_token_s * 1e3:.2f} ms a token for one stream")
        return "\n".join(lines)

    def describe(self) -> str:
        with self._lock:
            return self.describe_locked()

    def members(self) -> list[pb.MeshMember]:
        with self._lock:
            return [
                pb.MeshMember(
                    member_id=m.member_id,
                    address=m.address,
                    state=m.state.value,
                    first=m.assignment[0] if m.assignment else -1,
                    last=m.assignment[1] if m.assignment else -1,
                    memory_bytes=m.report.memory_bytes if m.report else 0,
                    layer_s=m.report.layer_s if m.report else 0.0,
                    fetched_bytes=m.fetched_bytes,
                )
                for m in self._members.values()
            ]
