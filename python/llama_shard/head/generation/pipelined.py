"""Pipelining: a stream stepping alone keeps several steps in flight (a long prompt's chunks, or
verification windows likely to be kept), each reply settled in order as if its step had been sent
alone (docs/design.md#pipelining-a-stream-stepping-alone). Takes a stream and a step function; it
knows nothing of the loop that runs it."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from ...proto import shard_pb2 as pb
from ...proto.requests import MAX_DRAFTS
from ...worker.admission import SessionCapRefused
from ...worker.session_order import ORDER_GAP_MAX
from ..speculation import AheadTiming, StepCost
from .output import Outcomes
from .positions import GENERATE_CHUNK, Window
from .stream import Stream

#: the most steps in flight at once
MAX_WINDOWS = 4
# a worker waits for a session's earlier step only within this many positions (steps.SessionOrder)
assert MAX_WINDOWS * max(GENERATE_CHUNK, MAX_DRAFTS + 1) <= ORDER_GAP_MAX


def _arrival_timed(call, *args):
    """call(*args) and when it returned (a pipelined step's reply: AheadTiming's measures)."""
    return call(*args), time.perf_counter()


class PipelinedStepper:
    """One route's pipelined steps: `cost` and `ahead` are the route's measures, `stages` its later
    stages (a chunk in flight per stage, and one more for the link)."""

    def __init__(self, cost: StepCost, ahead: AheadTiming, stages: int, wire_dtype: int):
        self.cost, self.ahead, self.stages, self.wire_dtype = cost, ahead, stages, wire_dtype
        self._executor: ThreadPoolExecutor | None = None
        self._executor_lock = threading.Lock()

    def run(
        self,
        s: Stream,
        step: Callable[[object, pb.StepRequest, float], pb.StepReply],
        outcomes: Outcomes,
        alone: Callable[[], bool],
        stopping: threading.Event,
        max_hop_s: float,
    ) -> bool:
        """Runs the stream's steps (`step(kind, request, deadline)`: its reply, the deadline `max_hop_s`
        from when it is sent; raises SessionCapRefused) with
        several in flight where that pays; False if the stream has no step for this (its first, which
        opens the session on the route). A reply that does not continue the stream (a draft rejected,
        a guess wrong, an error) drops the steps after it: the stream waits for their replies, so that
        none overtakes its next step, which then cuts what they computed. Kept replies are those the
        same steps sent one at a time get: the tokens are exact. `alone`: no other stream joined."""
        cost = self.cost.relative()
        t_first = time.perf_counter()  # a draft model's time counts in the step's cost
        first = self.next_window(s, [], cost)
        if first is None:
            return False
        flight = _Flight(self, s, step, max_hop_s)

        def ending() -> bool:
            return (
                s.done
                or s.place.rerouted
                or s.out.stop_reason is not None
                or stopping.is_set()
                or (s.deadline is not None and time.monotonic() >= s.deadline)
            )

        try:
            flight.send(*first, t0=t_first)
            while flight.inflight:
                while not ending() and alone():
                    nxt = self.next_window(s, flight.windows(), cost)
                    if nxt is None:
                        break
                    flight.send(*nxt)
                if not flight.settle_next(outcomes, ending):
                    return True
        finally:
            self.drain(s, flight.inflight)  # whatever ends the loop (an exception too), nothing stays in flight
        return True

    def next_window(self, s: Stream, ahead: list[Window], cost: list[float]) -> tuple | None:
        """(Window, kind, request) of the stream's next step, built as if the steps in flight (`ahead`)
        come back as hoped; None when none is worth sending now. With none in flight: the stream's
        own next step. After a prompt chunk that does not end the prompt: the next chunk (at most
        one in flight per stage, and one more for the link). After verification windows: one more,
        whose first token is the drafter's guess of the token the last one samples, where it pays
        (`_verification_window`)."""
        pos = s.pos
        if not ahead:
            if pos.first_step:
                return None
            kind, req = s.request(self.wire_dtype, cost)
            return (
                Window(
                    pos.computed,
                    pos.tokens[pos.computed],
                    pos.sent,
                    pos.computed + pos.sent.n_tokens,
                    stores=req.prefix.store_tokens > 0,
                ),
                kind,
                req,
            )
        last, end = ahead[-1], ahead[-1].end
        if last.stores:  # each worker stores the prefix after that step: a later one must not run first
            return None
        if not last.sent.samples:  # a prompt's chunk: the next one
            if len(ahead) >= min(MAX_WINDOWS, self.stages + 2):
                return None
            with pos.assuming([], end, s.params is not None):
                kind, req = s.request(self.wire_dtype)
                return (
                    Window(end, pos.tokens[end], pos.sent, end + pos.sent.n_tokens, stores=req.prefix.store_tokens > 0),
                    kind,
                    req,
                )
        if not s.drafting.on or len(ahead) >= MAX_WINDOWS or not all(w.sent.samples for w in ahead):
            return None
        return self._verification_window(s, ahead, cost)

    def _verification_window(self, s: Stream, ahead: list[Window], cost: list[float]) -> tuple | None:
        """One more verification window, sent while P times what a kept window saves is at least
        (1 - P) times what a dropped one costs, plus what it slows the steps before it, P the chance
        that every window before it is kept (its drafts accepted, its next token guessed: one run of
        accepted drafts, DraftControl.all_accepted). AheadTiming measures both on the route; before
        that, a kept window saves a one-token step and a dropped one costs its rows at the step cost
        of a second token. A slow link keeps more in flight; on loopback, where compute is the step, few."""
        pos, drafting, end = s.pos, s.drafting, ahead[-1].end
        in_flight = sum(len(w.sent.drafts) + 1 for w in ahead)
        room = s.max_tokens - len(pos.generated) - in_flight
        if room < 1:
            return None
        chance = drafting.control.all_accepted(in_flight, drafting.long_match)
        k = max(0, min(drafting.control.k(cost, drafting.long_match, probe=False), room - 1))
        # until a one-token step is timed, AheadTiming has measured nothing (measure_ahead, drop):
        # the priors, in units of such a step
        step_s = self.cost.seconds(1) or 1.0
        if not self.ahead.worth(chance, k + 1, step_s, max(cost[1] - 1.0, 0.01) * step_s):
            return None
        assumed = []  # after the stream's tokens: each window's drafts, then the next one's guess
        for i, w in enumerate(ahead):
            assumed += w.sent.drafts
            if i + 1 < len(ahead):
                assumed.append(ahead[i + 1].first_token)
        guess = drafting.guess(s.key, pos.tokens, pos.tokens + assumed, k + 1)
        if not guess:
            return None
        drafting.unsent = None  # the token the draft would have been checked against is this window's guess
        with pos.assuming(assumed + guess[:1], end, s.params is not None):
            kind, req = s.request(self.wire_dtype, drafts=guess[1:])
            sent = pos.sent._replace(in_run=True)
            return Window(end, guess[0], sent, end + sent.n_tokens, guess=True), kind, req

    def measure_ahead(
        self,
        window: Window,
        behind: Window | None,
        keep: bool,
        sent_at: float,
        arrived: float,
        arrived_before: float | None,
    ) -> None:
        """What a pipelined generation step's reply (OK) tells of windows ahead (AheadTiming): a
        verification window sent ahead and kept, how much sooner it came than sent after the reply
        before it; a step with one sent behind it, how much longer it took. Prompt chunks tell
        neither, and nothing counts before a one-token step is timed (the priors are in its units)."""
        alone = self.cost.seconds(window.sent.n_tokens)
        if not window.sent.decodes or alone is None or self.cost.seconds(1) is None:
            return
        if window.ahead and window.guess and keep and arrived_before is not None:
            # (sent once the reply before it was back but not yet read: its time from then)
            self.ahead.kept(alone, arrived - max(arrived_before, sent_at))
        elif not window.ahead and behind is not None and behind.guess:
            self.ahead.slowed(alone, arrived - sent_at)

    @staticmethod
    def drain(s: Stream, inflight: deque) -> tuple[int, float]:
        """Waits for the replies of the steps still in flight and drops them; the route may hold their
        positions (the next step is a prefill at `computed` that cuts them). Returns the tokens they
        carried and the seconds waited."""
        t0, rows = time.perf_counter(), 0
        while inflight:
            window, future, _ = inflight.popleft()
            rows += window.sent.n_tokens
            try:
                future.result()
            except Exception:  # noqa: BLE001 - a dropped step's failure is not the stream's
                pass
            s.pos.held = max(s.pos.held, window.end)
        return rows, time.perf_counter() - t0

    def pool(self) -> ThreadPoolExecutor:
        with self._executor_lock:  # groups of one route loop may each have a lone stream
            if self._executor is None:
                self._executor = ThreadPoolExecutor(MAX_WINDOWS, thread_name_prefix="pipelined-step")
            return self._executor

    def close(self) -> None:
        """Its threads end (called once the route has no stream: every step is back)."""
        with self._executor_lock:
            if self._executor is not None:
                self._executor.shutdown(wait=False)
                self._executor = None


class _Flight:
    """One run's steps in flight, in order: (window, future of (reply, arrived at), sent at)."""

    def __init__(self, stepper: PipelinedStepper, s: Stream, step, max_hop_s: float):
        self.stepper, self.s, self.step, self.max_hop_s = stepper, s, step, max_hop_s
        self.inflight: deque = deque()
        self.solo: list = []  # [window, sent at]: the one step in flight, while no other was sent with it
        self.arrived_before = None  # when the reply popped before this one came back

    def windows(self) -> list[Window]:
        return [w for w, _, _ in self.inflight]

    def send(self, window: Window, kind, req: pb.StepRequest, t0: float | None = None) -> None:
        if self.inflight:
            window = window._replace(ahead=True)
            req.follows = True  # a worker that has not queued the step before it waits for it
            self.s.drafting.windows_sent += 1
        sent_at = time.perf_counter()
        self.solo[:] = [window, t0 or sent_at] if not self.inflight else []
        deadline = time.monotonic() + self.max_hop_s
        self.inflight.append(
            (window, self.stepper.pool().submit(_arrival_timed, self.step, kind, req, deadline), sent_at)
        )

    def drop(self, record: bool) -> None:
        """The windows in flight, built on what did not happen."""
        rows, waited = self.stepper.drain(self.s, self.inflight)
        if record and self.stepper.cost.seconds(1) is not None:
            self.stepper.ahead.dropped(rows, waited)

    def settle_next(self, outcomes: Outcomes, ending) -> bool:
        """The first step's reply, settled in order; False when the stream ended on it."""
        s, stepper = self.s, self.stepper
        window, future, sent_at = self.inflight.popleft()
        try:
            reply, arrived = future.result()
        except SessionCapRefused as e:  # (a later stage's cap: only a step that opens a session there)
            outcomes.finish(s, "error", outcome=pb.OUTCOME_BUDGET_EXCEEDED, detail=str(e))
            return False
        if self.solo and self.solo[0] is window and window.sent.decodes:  # timed alone: the route's step cost
            stepper.cost.observe(window.sent.n_tokens, time.perf_counter() - self.solo[1])
        # a window sent ahead that missed is resent from where the stream is (it may have overtaken
        # the step before it for longer than a worker waits), not a re-prefill
        ok = reply.outcome == pb.OUTCOME_OK
        keep = window.continues(s.pos) and not s.done and not (window.ahead and reply.outcome == pb.OUTCOME_CACHE_MISS)
        if ok:
            stepper.measure_ahead(
                window, self.inflight[0][0] if self.inflight else None, keep, sent_at, arrived, self.arrived_before
            )
        self.arrived_before = arrived
        if not keep or not ok:
            s.pos.held = max(s.pos.held, window.end)
            self.drop(record=ok and not ending())  # nothing built on it counts, and none may overtake the next step
        if keep:
            if window.ahead and ok:
                s.drafting.windows_kept += 1
            s.pos.sent = window.sent
            outcomes.settle(s, reply)
        nxt = self.inflight[0][0] if self.inflight and not s.done and ok else None
        if nxt is not None and nxt.guess and s.pos.computed == nxt.start:
            # the next window's first token guessed the token this one sampled: a draft, checked now
            right = nxt.continues(s.pos)
            s.drafting.control.update(1, int(right), s.drafting.long_match, in_run=bool(window.sent.drafts))
            outcomes.metrics.count_drafts(1, int(right))
        if self.inflight and (ending() or not self.inflight[0][0].continues(s.pos)):
            # a draft rejected, or the next window's guess wrong: what was built on it is dropped
            # now, before anything more is built on it
            self.drop(record=not ending())
        return True
