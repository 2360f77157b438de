"""The streams of one principal on one route: grouped, and stepped a group at a time (a thread per
group). It only groups and steps: what a reply means is output.py's, pipelining a lone stream is
pipelined.py's, and the loop that owns it (loops.py) keeps the streams, records and routes."""

from __future__ import annotations

import threading
import time
from typing import NamedTuple, Protocol

from ...proto import shard_pb2 as pb
from ...worker.admission import SessionCapRefused
from ..speculation import CARRIED_WEIGHT, AheadTiming, DraftControl, StepCost
from .host import HeadHost
from .output import Outcomes
from .pipelined import PipelinedStepper
from .stream import Stream

#: a group's thread waits this long for a new stream before it ends
IDLE_S = 2.0


class RouteMeasures(NamedTuple):
    """What a route's scheduler learns of its route as its streams step: kept by `GenerationLoops`
    after the scheduler ends (IDLE_S after its last stream), so that the principal's next request
    down the same route starts from them, not from the priors, however long after it comes."""

    cost: StepCost  # the route's step time by tokens per step (what a draft costs)
    ahead: AheadTiming  # what a verification window sent ahead gains and costs on it
    rates: DraftControl  # the acceptance rates the last stream ended with: the next starts there

    @classmethod
    def new(cls) -> RouteMeasures:
        return cls(StepCost(), AheadTiming(), DraftControl(0))


class SchedulerOwner(Protocol):
    """What a scheduler uses of the loop that owns it (`GenerationLoops`), under its lock `cond`."""

    cond: threading.Condition
    host: HeadHost
    outcomes: Outcomes
    busy: int  # group steps in progress (the owner waits for none at shutdown)

    def seq_ids(self) -> dict[str, int]: ...

    def loop_for(self, principal: str, route: list, wire_dtype: int) -> RouteScheduler: ...

    def drop_if_idle(self, loop: RouteScheduler) -> None: ...


class RouteScheduler:
    """Groups are contiguous runs of the head's seq ids (llama.cpp computes consecutive ids in one
    ubatch: one pass over the weights per group step, not one per session). The partition is
    recomputed when a stream joins, leaves or gets a new id; a stream moves to its new group once
    its step in flight is back (never in two steps at once). Its state is changed under the loop's
    lock (`owner.cond`)."""

    def __init__(
        self,
        owner: SchedulerOwner,
        principal: str,
        forward: tuple,
        wire_dtype: int,
        measures: RouteMeasures | None = None,
    ):
        self.owner, self.principal, self.wire_dtype = owner, principal, wire_dtype
        self.forward = [pb.Hop(address=a, recipe_fingerprint=f, fail_fast=ff) for a, f, ff in forward]
        self.n_groups = 1 + len(forward)
        self.cost, self.ahead, self.rates = measures or RouteMeasures.new()
        self.pipeline = PipelinedStepper(self.cost, self.ahead, len(forward), wire_dtype)
        self.streams: list[Stream] = []  # in arrival order
        self.threads: list[threading.Thread | None] = [None] * self.n_groups
        self._group: dict[Stream, int] = {}
        self._stepping: set[Stream] = set()  # in a group's step now
        self._dirty = True

    def add(self, stream: Stream) -> None:  # under the owner's lock
        if not stream.drafting.control.observed:  # a new stream (not one moved from another route after learning)
            stream.drafting.control.learn_rates_from(self.rates, CARRIED_WEIGHT)
        self.streams.append(stream)
        self._dirty = True
        for g, t in enumerate(self.threads):
            if t is None:
                self.threads[g] = threading.Thread(target=self._run, args=(g,), name=f"generate-{g}", daemon=True)
                self.threads[g].start()
        self.owner.cond.notify_all()

    def idle(self) -> bool:
        return all(t is None for t in self.threads)

    def _partition(self) -> None:  # under the owner's lock
        if not self._dirty:
            return
        ids = self.owner.seq_ids()
        order = sorted(
            range(len(self.streams)), key=lambda i: (ids.get(self.streams[i].key, 1 << 30), i)
        )  # new ones: after, in arrival order
        n, k = len(order), self.n_groups
        for g in range(k):
            for i in order[g * n // k : (g + 1) * n // k]:
                self._group[self.streams[i]] = g
        self._dirty = False

    def _take(self, g: int) -> list[Stream] | None:  # under the owner's lock
        """Group g's streams for its next step, marked as stepping (none: nothing to step now)."""
        self._partition()
        mine = [s for s in self.streams if self._group.get(s) == g and s not in self._stepping]
        self._stepping.update(mine)
        return mine

    def _run(self, g: int) -> None:
        owner = self.owner
        idle_since = None
        while True:
            with owner.cond:
                mine = self._take(g)
                if not mine:
                    now = time.monotonic()
                    idle_since = idle_since or now
                    if not self.streams and now - idle_since >= IDLE_S:
                        self.threads[g] = None
                        owner.drop_if_idle(self)
                        return
                    owner.cond.wait(IDLE_S)
                    continue
                idle_since = None
                owner.busy += 1
            opening = [s.pos.first_step for s in mine]
            try:
                self._step(mine)
            except Exception as e:  # noqa: BLE001 - a bug must end its streams, not leave them waiting
                for s in mine:
                    owner.outcomes.finish(s, "error", outcome=pb.OUTCOME_INTERNAL, detail=f"the head failed: {e!r}")
            finally:
                with owner.cond:
                    owner.busy -= 1
                    for s, was_opening in zip(mine, opening):
                        self._stepped(s, was_opening)
                    owner.cond.notify_all()

    def _stepped(self, s: Stream, was_opening: bool) -> None:  # under the owner's lock
        self._stepping.discard(s)
        if s.done:
            self._leave(s)
            if s.drafting.control.observed:  # (a stream without drafts, or in shared steps, saw none)
                self.rates.learn_rates_from(s.drafting.control)
        elif s.place.rerouted:  # a failover or a hand-over: its steps go down another route now
            self._leave(s)
            s.place.rerouted = False
            self.owner.loop_for(self.principal, s.place.route, self.wire_dtype).add(s)
        elif was_opening and not s.pos.first_step:  # it has a seq id now
            self._dirty = True

    def _leave(self, s: Stream) -> None:
        self.streams.remove(s)
        self._group.pop(s, None)
        self._dirty = True

    def _live(self, streams: list[Stream], now: float) -> list[Stream]:
        """The streams that go on to this step: those stopped, cancelled, past their deadline or
        over their principal's session cap (a new session is admitted on its own) end here."""
        host, finish = self.owner.host, self.owner.outcomes.finish
        live = []
        for s in streams:
            if host.stopping.is_set():
                finish(s, "shutdown", detail="the worker is shutting down")
            elif s.out.stop_reason is not None:
                finish(s, "cancelled", detail=s.out.stop_reason)
            elif s.deadline is not None and now >= s.deadline:
                finish(s, "cancelled", detail="the stream's deadline passed")
            elif s.pos.first_step and (refused := host.admit(self.principal, [s.key])) is not None:
                finish(s, "error", outcome=pb.OUTCOME_BUDGET_EXCEEDED, detail=refused.text)
            else:
                live.append(s)
        return live

    def _one_step(self, kind, req: pb.StepRequest, deadline: float) -> pb.StepReply:
        """A lone stream's step down the route (the pipelined stepper's step function)."""
        host = self.owner.host
        return host.run_steps(self.principal, [(kind, req)], self.forward, deadline)[0]

    def _step(self, streams: list[Stream]) -> None:
        owner = self.owner
        now = time.monotonic()  # the hop's deadline counts from here (admission and drafts included)
        live = self._live(streams, now)
        for s in live:
            if s.pos.first_step and not s.prefix.planned:
                s.prefix.make(owner.host.prefixes, self.principal, s.pos, s.req.keep_prefix)
        if not live:
            return
        if (
            len(live) == 1
            and self.forward
            and self.pipeline.run(
                live[0],
                self._one_step,
                owner.outcomes,
                lambda: len(self.streams) == 1,
                owner.host.stopping,
                owner.host.max_hop_s,
            )
        ):
            return
        # drafts only for a stream stepping alone: streams sharing a step already share its compute,
        # which a verification's extra rows would take from them
        cost = self.cost.relative() if len(live) == 1 else None
        t0 = time.perf_counter()  # a draft model's time counts in the step's cost
        items = [s.request(self.wire_dtype, cost) for s in live]
        generating = all(not s.pos.first_step and s.pos.sent.decodes for s in live)  # steps past the prompt: timed
        try:
            replies = owner.host.run_steps(self.principal, items, self.forward, now + owner.host.max_hop_s)
            if generating:  # timed by the largest stream's step (what the batch's size follows)
                self.cost.observe(max(s.pos.sent.n_tokens for s in live), time.perf_counter() - t0)
        except SessionCapRefused as e:
            for s in live:
                owner.outcomes.finish(s, "error", outcome=pb.OUTCOME_BUDGET_EXCEEDED, detail=str(e))
            return
        for s, reply in zip(live, replies):
            owner.outcomes.settle(s, reply)

    def close(self) -> None:
        """Its pipelined steps' threads end (called once it has no stream: every step is back)."""
        self.pipeline.close()
