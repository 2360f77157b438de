"""The head's generation loop: its streams grouped per route, one thread per group, and their outcomes
(the package's docstring says how it works)."""
from __future__ import annotations

import enum
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

from prometheus_client import Counter, Gauge, Histogram

from ...engine.hot_kv import CacheMissReason, check_key
from ...errors import InvalidInputError
from ...proto import shard_pb2 as pb
from ...proto.requests import (
    FEATURE_GRAMMAR_DIGEST,
    MAX_DRAFTS,
    MAX_REPREFILLS,
    MAX_STOP_CHARS,
    SAMPLER_STATE_MISS,
    check_grammar,
    check_max_drafts,
    check_stops,
    check_top_logprobs,
    sampling_from_wire,
)
from ...proto.wire import wire_dtype_name, wire_dtypes_for
from ...worker.admission import SessionCapRefused
from ...worker.steps import ORDER_GAP_MAX
from ..speculation import CARRIED_WEIGHT, AheadTiming, DraftControl, StepCost
from .host import HeadHost
from .stream import GENERATE_CHUNK, Stream, Window, common_prefix

#: a group's thread waits this long for a new stream before it ends
IDLE_S = 2.0
#: route changes (a failover, a hand-over followed) one step may cause before its stream ends with
#: an error: a route whose replicas all fail in turn is not retried forever
MAX_ROUTE_CHANGES = 4
#: pipelining (a stream stepping alone): the most steps in flight at once
MAX_WINDOWS = 4
#: route loops whose measures (RouteMeasures) the head keeps after the loop ends, the most recent
MEASURES_KEPT = 256
# a worker waits for a session's earlier step only within this many positions (steps.SessionOrder)
assert MAX_WINDOWS * max(GENERATE_CHUNK, MAX_DRAFTS + 1) <= ORDER_GAP_MAX


def _arrival_timed(call, *args):
    """call(*args) and when it returned (a pipelined step's reply: AheadTiming's measures)."""
    return call(*args), time.perf_counter()


class RouteMeasures(NamedTuple):
    """What a route loop learns of its route as its streams step: kept by `GenerationLoops` after
    the loop ends (IDLE_S after its last stream), so that the principal's next request down the same
    route starts from them, not from the priors, however long after it comes."""
    cost: StepCost          # the route's step time by tokens per step (what a draft costs)
    ahead: AheadTiming      # what a verification window sent ahead gains and costs on it
    rates: DraftControl     # the acceptance rates the last stream ended with: the next starts there

    @classmethod
    def new(cls) -> "RouteMeasures":
        return cls(StepCost(), AheadTiming(), DraftControl(0))


class _RouteLoop:
    """The streams of one principal on one route: a group per stage, a thread per group.

    Groups are contiguous runs of the head's seq ids (llama.cpp computes consecutive ids in one
    ubatch: one pass over the weights per group step, not one per session). The partition is
    recomputed when a stream joins, leaves or gets a new id; a stream moves to its new group once
    its step in flight is back (`in_flight`: never in two steps at once)."""

    def __init__(self, owner: "GenerationLoops", principal: str, forward: tuple, wire_dtype: int,
                 measures: RouteMeasures | None = None):
        self.owner, self.principal, self.wire_dtype = owner, principal, wire_dtype
        self.forward = [pb.Hop(address=a, recipe_fingerprint=f, fail_fast=ff) for a, f, ff in forward]
        self.n_groups = 1 + len(forward)
        self.cost, self.ahead, self.rates = measures or RouteMeasures.new()
        self.streams: list[Stream] = []  # in arrival order
        self.threads: list[threading.Thread | None] = [None] * self.n_groups
        self._dirty = True
        self._executor: ThreadPoolExecutor | None = None  # a lone stream's steps in flight (_pipeline)
        self._executor_lock = threading.Lock()

    def add(self, stream: Stream) -> None:  # under the owner's lock
        if not stream.control.observed:  # a new stream (not one moved from another route after learning)
            stream.control.learn_rates_from(self.rates, CARRIED_WEIGHT)
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
        order = sorted(range(len(self.streams)),
                       key=lambda i: (ids.get(self.streams[i].key, 1 << 30), i))  # new ones: after, in arrival order
        n, k = len(order), self.n_groups
        for g in range(k):
            for i in order[g * n // k:(g + 1) * n // k]:
                self.streams[i].group = g
        self._dirty = False

    def _run(self, g: int) -> None:
        owner = self.owner
        idle_since = None
        while True:
            with owner.cond:
                self._partition()
                mine = [s for s in self.streams if s.group == g and not s.in_flight]
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
                for s in mine:
                    s.in_flight = True
                owner.busy += 1
            opening = [s.first_step for s in mine]
            try:
                self._step(mine)
            except Exception as e:  # noqa: BLE001 - a bug must end its streams, not leave them waiting
                for s in mine:
                    owner.finish(s, "error", outcome=pb.OUTCOME_INTERNAL, detail=f"the head failed: {e!r}")
            finally:
                with owner.cond:
                    owner.busy -= 1
                    for s, was_opening in zip(mine, opening):
                        s.in_flight = False
                        if s.done:
                            self.streams.remove(s)
                            if s.control.observed:  # (a stream without drafts, or in shared steps, saw none)
                                self.rates.learn_rates_from(s.control)
                            self._dirty = True
                        elif s.rerouted:  # a failover or a hand-over: its steps go down another route now
                            self.streams.remove(s)
                            self._dirty = True
                            s.rerouted = False
                            owner.loop_for(self.principal, s.route, self.wire_dtype).add(s)
                        elif was_opening and not s.first_step:  # it has a seq id now
                            self._dirty = True
                    owner.cond.notify_all()

    def _step(self, streams: list[Stream]) -> None:
        owner = self.owner
        now = time.monotonic()
        live = []
        for s in streams:
            if owner.host.stopping.is_set():
                owner.finish(s, "shutdown", detail="the worker is shutting down")
            elif s.stop_reason is not None:
                owner.finish(s, "cancelled", detail=s.stop_reason)
            elif s.deadline is not None and now >= s.deadline:
                owner.finish(s, "cancelled", detail="the stream's deadline passed")
            else:
                live.append(s)
        if not live:
            return
        # a new session is admitted on its own: one over the principal's cap ends its stream only
        admitted = []
        for s in live:
            refused = owner.host.admit(self.principal, [s.key]) if s.first_step else None
            if refused is None:
                admitted.append(s)
            else:
                owner.finish(s, "error", outcome=pb.OUTCOME_BUDGET_EXCEEDED, detail=refused)
        live = admitted
        if not live:
            return
        for s in live:
            if s.first_step and not s.planned:
                s.plan_prefix(owner.host.prefixes)
        if len(live) == 1 and self.forward and self._pipeline(live[0]):
            return
        # drafts only for a stream stepping alone: streams sharing a step already share its compute,
        # which a verification's extra rows would take from them
        cost = self.cost.relative() if len(live) == 1 else None
        t0 = time.perf_counter()  # a draft model's time counts in the step's cost
        items = [s.request(self.wire_dtype, cost) for s in live]
        generating = all(not s.first_step and s.sent.decodes for s in live)  # steps past the prompt: timed
        try:
            replies = owner.host.run_steps(self.principal, items, self.forward, now + owner.host.max_hop_s)
            if generating:  # timed by the largest stream's step (what the batch's size follows)
                self.cost.observe(max(s.sent.n_tokens for s in live), time.perf_counter() - t0)
        except SessionCapRefused as e:
            for s in live:
                owner.finish(s, "error", outcome=pb.OUTCOME_BUDGET_EXCEEDED, detail=str(e))
            return
        for s, reply in zip(live, replies):
            owner.settle(s, reply)


    # --- pipelining: a stream stepping alone keeps several steps in flight --------------------------

    def _next_window(self, s: Stream, ahead: list[Window], cost: list[float]) -> tuple | None:
        """(Window, kind, request) of the stream's next step, built as if the steps in flight (`ahead`)
        come back as hoped; None when none is worth sending now. With none in flight: the stream's
        own next step (a prompt chunk after its first, or a token with the drafts DraftControl
        chooses). After a prompt chunk that does not end the prompt: the next chunk (at most one in
        flight per stage, and one more for the link). After verification windows: one more, whose
        first token is the drafter's guess of the token the last one samples, where it pays: with P
        the chance that every window before it is kept (its drafts accepted, its next token guessed:
        one run of accepted drafts, DraftControl.all_accepted), sent while P times what a kept window
        saves is at least (1 - P) times what a dropped one costs, plus what it slows the steps
        before it (AheadTiming: measured on the route; before that, a kept window saves a one-token
        step and a dropped one costs its rows at the step cost of a second token). A slow link
        keeps more in flight; on loopback, where compute is the step, few."""
        if not ahead:
            if s.first_step:
                return None
            kind, req = s.request(self.wire_dtype, cost)
            return Window(s.computed, s.tokens[s.computed], s.sent, s.computed + s.sent.n_tokens,
                          stores=req.prefix.store_tokens > 0), kind, req
        last, end = ahead[-1], ahead[-1].end
        if last.stores:  # each worker stores the prefix after that step: a later one must not run first
            return None
        if not last.sent.samples:  # a prompt's chunk: the next one
            if len(ahead) >= min(MAX_WINDOWS, len(self.forward) + 2):
                return None
            with s.assuming([], end):
                kind, req = s.request(self.wire_dtype)
                return Window(end, s.tokens[end], s.sent, end + s.sent.n_tokens,
                              stores=req.prefix.store_tokens > 0), kind, req
        if ((s.drafter is None and s.draft_model is None) or len(ahead) >= MAX_WINDOWS
                or not all(w.sent.samples for w in ahead)):
            return None
        room = s.max_tokens - len(s.generated) - sum(len(w.sent.drafts) + 1 for w in ahead)
        if room < 1:
            return None
        # every window in flight kept: its drafts accepted and the next one's first token guessed,
        # one run of drafts from the first window's first
        chance = s.control.all_accepted(sum(len(w.sent.drafts) + 1 for w in ahead), s.long_match)
        k = max(0, min(s.control.k(cost, s.long_match, probe=False), room - 1))
        # until a one-token step is timed, AheadTiming has measured nothing (_measure_ahead, drop):
        # the priors, in units of such a step
        step_s = self.cost.seconds(1) or 1.0
        if not self.ahead.worth(chance, k + 1, step_s, max(cost[1] - 1.0, 0.01) * step_s):
            return None
        assumed = []  # after the stream's tokens: each window's drafts, then the next one's guess
        for i, w in enumerate(ahead):
            assumed += w.sent.drafts
            if i + 1 < len(ahead):
                assumed.append(ahead[i + 1].first_token)
        full = s.tokens + assumed
        if s.draft_model is not None:
            guess = s.draft_model.propose(s.key, full, k + 1)
        else:
            s.drafter.propose(s.tokens, 0)  # the stream's own tokens indexed; the assumed ones only read
            guess, _ = s.drafter.propose(full, k + 1, index=False)
        if not guess:
            return None
        s.unsent = None  # the token the draft would have been checked against is this window's guess
        with s.assuming(assumed + guess[:1], end):
            kind, req = s.request(self.wire_dtype, drafts=guess[1:])
            sent = s.sent._replace(in_run=True)
            return Window(end, guess[0], sent, end + sent.n_tokens, guess=True), kind, req

    def _pipeline(self, s: Stream) -> bool:
        """Runs a lone stream's steps with several in flight where that pays (a prompt's chunks, or
        verification windows likely to be kept), each reply settled in order as if its step had been
        sent alone; False if the stream has no step for this (its first, which opens the session on
        the route). A reply that does not continue the stream (a draft rejected, a guess wrong, an
        error) drops the steps after it: the stream waits for their replies, so that none overtakes
        its next step, which then cuts what they computed. Kept replies are those the same steps sent
        one at a time get: the tokens are exact."""
        owner = self.owner
        cost = self.cost.relative()
        t_first = time.perf_counter()  # a draft model's time counts in the step's cost
        first = self._next_window(s, [], cost)
        if first is None:
            return False
        pool = self._pool()
        inflight: deque = deque()  # (window, future of (replies, arrived at), sent at)
        solo: list = []            # [window, sent at]: the one step in flight, while no other was sent with it
        arrived_before = None      # when the reply popped before this one came back

        def send(window: Window, kind, req, t0: float | None = None) -> None:
            if inflight:
                window = window._replace(ahead=True)
                req.follows = True  # a worker that has not queued the step before it waits for it
                s.pipelined_windows += 1
            sent_at = time.perf_counter()
            solo[:] = [window, t0 or sent_at] if not inflight else []
            deadline = time.monotonic() + owner.host.max_hop_s
            inflight.append((window, pool.submit(_arrival_timed, owner.host.run_steps, self.principal, [(kind, req)],
                                                 self.forward, deadline), sent_at))

        def drop(record: bool) -> None:  # the windows in flight, built on what did not happen
            rows, waited = self._drain(s, inflight)
            if record and self.cost.seconds(1) is not None:
                self.ahead.dropped(rows, waited)

        def ending() -> bool:
            return (s.done or s.rerouted or s.stop_reason is not None or owner.host.stopping.is_set()
                    or (s.deadline is not None and time.monotonic() >= s.deadline))

        try:
            send(*first, t0=t_first)
            while inflight:
                while not ending() and len(self.streams) == 1:
                    nxt = self._next_window(s, [w for w, _, _ in inflight], cost)
                    if nxt is None:
                        break
                    send(*nxt)
                window, future, sent_at = inflight.popleft()
                try:
                    (reply,), arrived = future.result()
                except SessionCapRefused as e:  # (a later stage's cap: only a step that opens a session there)
                    owner.finish(s, "error", outcome=pb.OUTCOME_BUDGET_EXCEEDED, detail=str(e))
                    return True
                if solo and solo[0] is window and window.sent.decodes:  # timed alone: the route's step cost
                    self.cost.observe(window.sent.n_tokens, time.perf_counter() - solo[1])
                # a window sent ahead that missed is resent from where the stream is (it may have
                # overtaken the step before it for longer than a worker waits), not a re-prefill
                keep = (window.continues(s) and not s.done
                        and not (window.ahead and reply.outcome == pb.OUTCOME_CACHE_MISS))
                if reply.outcome == pb.OUTCOME_OK:
                    self._measure_ahead(window, inflight[0][0] if inflight else None, keep, sent_at, arrived,
                                        arrived_before)
                arrived_before = arrived
                if not keep or reply.outcome != pb.OUTCOME_OK:
                    s.held = max(s.held, window.end)
                    # nothing built on it counts, and none may overtake the next step
                    drop(record=reply.outcome == pb.OUTCOME_OK and not ending())
                if keep:
                    if window.ahead and reply.outcome == pb.OUTCOME_OK:
                        s.pipelined_kept += 1
                    s.sent = window.sent
                    owner.settle(s, reply)
                nxt = inflight[0][0] if inflight and not s.done and reply.outcome == pb.OUTCOME_OK else None
                if nxt is not None and nxt.guess and s.computed == nxt.start:
                    # the next window's first token guessed the token this one sampled: a draft, checked now
                    right = nxt.continues(s)
                    s.control.update(1, int(right), s.long_match, in_run=bool(window.sent.drafts))
                    owner.count_drafts(1, int(right))
                if inflight and (ending() or not inflight[0][0].continues(s)):
                    # a draft rejected, or the next window's guess wrong: what was built on it is
                    # dropped now, before anything more is built on it
                    drop(record=not ending())
        finally:
            self._drain(s, inflight)  # whatever ends the loop (an exception too), nothing stays in flight
        return True

    def _measure_ahead(self, window: Window, behind: Window | None, keep: bool, sent_at: float, arrived: float,
                       arrived_before: float | None) -> None:
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
    def _drain(s: Stream, inflight: deque) -> tuple[int, float]:
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
            s.held = max(s.held, window.end)
        return rows, time.perf_counter() - t0

    def _pool(self) -> ThreadPoolExecutor:
        with self._executor_lock:  # groups of one route loop may each have a lone stream
            if self._executor is None:
                self._executor = ThreadPoolExecutor(MAX_WINDOWS, thread_name_prefix="pipelined-step")
            return self._executor

    def close(self) -> None:
        """Its pipelined steps' threads end (called once it has no stream: every step is back)."""
        with self._executor_lock:
            if self._executor is not None:
                self._executor.shutdown(wait=False)
                self._executor = None


class RouteHolds(NamedTuple):
    """What the route holds of a session after its last stream: what its next stream may reuse."""
    epoch: int
    tokens: list[int]
    route: tuple[str, ...] = ()   # the replicas that hold it (the addresses of its last route)


class RefusalReason(enum.Enum):
    """Why a stream was refused before anything was computed (what a caller may act on)."""
    INVALID = "invalid"                # the request is wrong (Refusal.param names what, where it can)
    SESSION_BUSY = "session_busy"      # the session already has a stream running
    CALLER_STREAMS = "caller_streams"  # the principal runs as many streams as its cap allows
    WORKER_STREAMS = "worker_streams"  # the worker runs as many streams as it can
    NO_ROUTE = "no_route"              # a later stage of the head's own route has no healthy replica


class Refusal(NamedTuple):
    """A stream refused before anything was computed: its reason, and its final event for the caller."""
    reason: RefusalReason
    final: pb.GenerateFinal
    param: str | None = None          # the wire's name of the parameter refused (INVALID)


class GenerationLoops:
    """Every Generate stream of a head worker, and the record of what each session holds.

    Its interface, for the gRPC servicer and the HTTP endpoint alike: `open` (a running `Stream`, or
    a `Refusal`), the stream's `events` and `cancel`; `session_to_continue` (which of a caller's
    sessions a new conversation's prompt continues); `stop_stream` and `forget` (a session changed
    from outside a stream). It reaches its worker only through `HeadHost`."""

    def __init__(self, host: HeadHost, registry, draft_source: str = "ngram", max_drafts: int = 0, draft_model=None,
                 row_by_row: bool = True):
        self.host = host
        self.row_by_row = row_by_row       # verifications computed row by row on every shard (serve --verify exact)
        self.draft_model = draft_model     # draft_model.DraftModel (serve --draft-model), or None
        self.draft_source = (f"model {draft_model.path.name}" if draft_model is not None
                             else draft_source)  # speculative decoding: where drafts come from ("off": none)
        self.max_drafts = max_drafts if draft_source != "off" else 0  # a request's default
        self.cond = threading.Condition()
        self.loops: dict[tuple, _RouteLoop] = {}
        self._measures: OrderedDict[tuple, RouteMeasures] = OrderedDict()  # by loop key, MEASURES_KEPT at most
        self.streams: dict[str, Stream] = {}           # engine key -> its running stream
        self.busy = 0                                   # group steps in progress
        # engine key -> (epoch, tokens the route holds): what the next stream of the session may reuse
        self._records: OrderedDict[str, RouteHolds] = OrderedDict()
        self._records_cap = 2 * host.max_sessions
        self.max_streams = host.max_streams
        self.active = Gauge("llama_shard_generate_streams", "Generate streams running on this head", registry=registry)
        self.active.set_function(lambda: len(self.streams))
        self.ttft = Histogram("llama_shard_generate_time_to_first_token_seconds",
                              "Time from a Generate call to its first token", registry=registry,
                              buckets=(.01, .02, .05, .1, .2, .5, 1, 2, 5, 10, 30))
        self.drafted = Counter("llama_shard_draft_tokens", "Drafts Generate streams sent to be verified",
                               registry=registry)
        self.accepted = Counter("llama_shard_draft_accepted_tokens", "Drafts the tail accepted", registry=registry)
        self.drafted_total = self.accepted_total = 0
        self.itl = Histogram("llama_shard_generate_inter_token_seconds", "Time between a stream's tokens",
                             registry=registry, buckets=(.002, .005, .01, .02, .05, .1, .2, .5, 1, 2))

    @property
    def stopping(self) -> bool:
        return self.host.stopping.is_set()

    @property
    def context_tokens(self) -> int:
        return self.host.context_tokens

    # --- opening ---------------------------------------------------------------------------------

    def open(self, principal: str, req: pb.GenerateRequest, time_remaining: float | None,
             events=None) -> Stream | Refusal:
        """A running stream, or the refusal of one refused before anything was computed. Its events
        go to `events.put` (default: a SimpleQueue the gRPC handler reads)."""
        def refused(reason: RefusalReason, outcome: int, detail: str, param: str | None = None) -> Refusal:
            return Refusal(reason, pb.GenerateFinal(finish_reason="error", outcome=outcome, detail=detail,
                                                    prompt_tokens=len(req.prompt)), param)
        try:
            params, max_tokens, max_drafts, wire_dtype = self._check(req)
            key = self.host.security.engine_key(principal, req.session_id)
        except InvalidInputError as e:
            return refused(RefusalReason.INVALID, pb.OUTCOME_INVALID_ARGUMENT, str(e), e.param)
        cap = self.host.session_cap
        deadline = None if time_remaining is None else time.monotonic() + time_remaining
        with self.cond:
            if key in self.streams:
                return refused(RefusalReason.SESSION_BUSY, pb.OUTCOME_INVALID_ARGUMENT,
                               f"session {req.session_id!r} already has a Generate stream running")
            mine = sum(1 for s in self.streams.values() if s.principal == principal)
            limit = self.max_streams
            if cap is not None and mine >= cap:
                return refused(RefusalReason.CALLER_STREAMS, pb.OUTCOME_BUDGET_EXCEEDED,
                               f"this caller has {mine} streams running; the cap is {cap} per caller "
                               f"(serve --max-sessions-per-principal)")
            if len(self.streams) >= limit:
                warm = ", twice over with its warm tier" if limit > 1 and self.host.warm_bytes else ""
                return refused(RefusalReason.WORKER_STREAMS, pb.OUTCOME_BUDGET_EXCEEDED,
                               f"this worker runs at most {limit} Generate streams at once (its hot sessions{warm})")
            record = self._records.get(key)
            route = self._route(req, record)
            if isinstance(route, str):
                return refused(RefusalReason.NO_ROUTE, pb.OUTCOME_UNAVAILABLE, route)
            addresses = tuple(h.address for h in route)
            cached, handed_from = 0, None
            # what the session holds is reused on the replicas that hold it, and on those a drained one
            # handed it to (each continues it only if it did: StepRequest.handed_from); else a re-prefill
            if record is not None and record.epoch == req.route_epoch:
                if record.route != addresses and self.host.replicas is not None:
                    handed_from = self.host.replicas.handed_from(record.route, addresses)
                if record.route == addresses or handed_from is not None:
                    cached = min(common_prefix(record.tokens, list(req.prompt)), len(req.prompt) - 1)
            stream = Stream(principal, key, req, params, max_tokens, cached, deadline, self.host.detokenize,
                            events, max_drafts, self.draft_model, self.row_by_row)
            stream.route = route
            stream.handed_from = handed_from or []
            stream.grammar.by_digest = self._tail_keeps_grammar(route)
            if self.host.replicas is not None:
                self.host.replicas.place(key, addresses)
            self.streams[key] = stream
            self.loop_for(principal, route, wire_dtype).add(stream)
        return stream

    def _tail_keeps_grammar(self, route: list[pb.Hop]) -> bool:
        """Whether a stream down `route` may name its grammar's state by digest: the head is the tail,
        or every worker of the route lists the feature (an older tail refuses a step without tokens)."""
        if not route:
            return True
        replicas = self.host.replicas
        addresses = tuple(h.address for h in route)
        return replicas is not None and replicas.supports(addresses, FEATURE_GRAMMAR_DIGEST)

    def _route(self, req: pb.GenerateRequest, record: "RouteHolds | None") -> list[pb.Hop] | str:
        """The hops a new stream's steps go down: the request's own `forward`, else the head's own
        route (one replica per stage, the session's last ones while they are up), else none (a head
        that holds the whole model); or why there is no route."""
        replicas = self.host.replicas
        if req.forward:
            return (replicas.hops(req.forward) if replicas is not None else
                    [pb.Hop(address=h.address, recipe_fingerprint=h.recipe_fingerprint) for h in req.forward])
        if replicas is None:
            return []
        return replicas.choose(prefer=record.route if record is not None else ())

    def loop_for(self, principal: str, route: list[pb.Hop], wire_dtype: int) -> _RouteLoop:  # under self.cond
        """The loop that runs a principal's streams down `route` (made when there is none)."""
        hops = tuple((h.address, h.recipe_fingerprint, h.fail_fast) for h in route)
        loop_key = (principal, hops, wire_dtype)
        loop = self.loops.get(loop_key)
        if loop is None:
            measures = self._measures.pop(loop_key, None) or RouteMeasures.new()
            self._measures[loop_key] = measures  # the most recent last
            while len(self._measures) > MEASURES_KEPT:
                self._measures.popitem(last=False)
            loop = self.loops[loop_key] = _RouteLoop(self, principal, hops, wire_dtype, measures)
        return loop

    def _check(self, req: pb.GenerateRequest):
        """(sampling params or None, max_tokens, max drafts per step, wire dtype): every check of a Generate
        request, once, before anything is computed; InvalidInputError says what is wrong (its
        `param`, the request field)."""
        host = self.host
        info, context = host.info, host.context_tokens
        check_key(req.session_id, req.route_epoch)
        if req.recipe_fingerprint and req.recipe_fingerprint != host.fingerprint:
            raise InvalidInputError("the request's KV recipe fingerprint does not match this worker's")
        if info.first != 0:
            raise InvalidInputError(f"Generate runs on the head of a route; this worker holds layers "
                                    f"{info.first}-{info.last}")
        if not req.forward and not info.is_tail and host.replicas is None:
            raise InvalidInputError(f"this worker holds layers {info.first}-{info.last} of {info.n_layer}: name the "
                                    f"rest of the route in forward")
        refusal = host.forward_refusal(req.forward)
        if refusal is not None:
            raise InvalidInputError(refusal)
        wire_dtype = req.wire_dtype if req.HasField("wire_dtype") else host.wire_dtype
        if wire_dtype not in wire_dtypes_for(info.n_embd):
            raise InvalidInputError(f"wire_dtype {wire_dtype_name(wire_dtype)}: this model's rows travel as "
                                    f"{', '.join(map(wire_dtype_name, wire_dtypes_for(info.n_embd)))}")
        if not req.forward and host.replicas is not None and (why := host.replicas.unreadable(wire_dtype)):
            raise InvalidInputError(why)
        n = len(req.prompt)
        if n == 0:
            raise InvalidInputError("the prompt is empty", param="prompt")
        if n >= context:
            raise InvalidInputError(f"the prompt has {n} tokens; a session holds at most {context} (context_tokens), "
                                    f"the prompt and at least one generated token", param="prompt")
        if any(not 0 <= t < info.n_vocab for t in req.prompt):
            raise InvalidInputError(f"a prompt token is outside the vocabulary (0..{info.n_vocab - 1})", param="prompt")
        room = context - n
        if req.max_tokens < 0 or req.max_tokens > room:
            raise InvalidInputError(f"max_tokens is {req.max_tokens}; with a {n}-token prompt the context "
                                    f"({context} tokens) leaves room for 1..{room} (0: all of it)", param="max_tokens")
        check_stops(list(req.stop), list(req.stop_token_ids), info.n_vocab)
        if not 0 <= req.keep_prefix <= n:
            raise InvalidInputError(f"keep_prefix is {req.keep_prefix}; it counts prompt tokens (0..{n})",
                                    param="keep_prefix")
        check_top_logprobs(req.top_logprobs)
        if req.HasField("max_drafts"):
            check_max_drafts(req.max_drafts)
        params = sampling_from_wire(req.sampling, info.n_vocab, context) if req.HasField("sampling") else None
        if params is not None and host.vocab_model is not None:
            check_grammar(params, host.vocab_model)  # llama.cpp's parser, here rather than at the tail's first step
        max_drafts = req.max_drafts if req.HasField("max_drafts") else self.max_drafts
        if self.draft_source == "off" or req.logprobs or req.top_logprobs:  # a verification returns no logprobs
            max_drafts = 0
        return params, req.max_tokens or room, max_drafts, wire_dtype

    # --- the loop's outcomes -------------------------------------------------------------------

    def settle(self, s: Stream, reply: pb.StepReply) -> None:
        """What one step's reply means for its stream (called by the stream's group thread)."""
        n_sent, final, drafts = s.sent.n_tokens, s.sent.samples, s.sent.drafts
        # a hand-over is claimed by the first step (a miss re-prefills without it; a route change of
        # that step keeps what the other stages must still check: _reroute)
        handed, s.handed_from = s.handed_from, []
        if reply.outcome == pb.OUTCOME_CACHE_MISS and reply.miss_reason == SAMPLER_STATE_MISS:
            # the tail keeps no grammar state this step named: the same step again with the tokens
            # (the stages before it applied it: a prefill at the same position cuts there)
            s.misses_in_row += 1
            if s.misses_in_row > MAX_REPREFILLS:
                self.finish(s, "error", outcome=reply.outcome, stage=reply.stage, miss_reason=reply.miss_reason,
                            detail=f"the tail refused the grammar's state {MAX_REPREFILLS} times: {reply.detail}")
                return
            s.grammar.lost()
            s.held = max(s.held, s.computed + n_sent)
            return
        if reply.outcome == pb.OUTCOME_CACHE_MISS:
            s.reprefills += 1
            s.misses_in_row += 1
            if s.misses_in_row > MAX_REPREFILLS:
                self.finish(s, "error", outcome=reply.outcome, stage=reply.stage, miss_reason=reply.miss_reason,
                            detail=f"still a cache miss after {MAX_REPREFILLS} re-prefills: {reply.detail}")
            else:
                if reply.miss_reason == CacheMissReason.PREFIX_EVICTED.name:  # a shard lacks the prefix: computed this time
                    s.may_open = False
                self._start_over(s)
            return
        if (reply.outcome == pb.OUTCOME_UNAVAILABLE and self.host.replicas is not None
                and 1 <= reply.stage <= len(s.route)):
            self._reroute(s, reply, handed)
            return
        if reply.outcome != pb.OUTCOME_OK:
            self.finish(s, "error", outcome=reply.outcome, stage=reply.stage, detail=reply.detail)
            return
        if s.first_step and s.prefix is not None and s.prefix.open_tokens:
            s.prefix_tokens = s.prefix.open_tokens
        s.first_step = False
        s.misses_in_row = 0
        s.changes_in_row = 0
        if not final:
            s.computed += n_sent
            s.held = s.computed
            return
        s.grammar.sampled()
        tokens = list(reply.tokens) if drafts else [reply.token_id]
        n_vocab = self.host.info.n_vocab
        # a tail must not make the head crash: its answer is checked against what was asked
        if not 1 <= len(tokens) <= len(drafts) + 1 or tokens[:-1] != drafts[:len(tokens) - 1]:
            self.finish(s, "error", outcome=pb.OUTCOME_INTERNAL, stage=reply.stage,
                        detail=f"the tail answered {len(tokens)} tokens that do not verify the {len(drafts)} drafts sent")
            return
        if not 0 <= tokens[-1] < n_vocab:
            self.finish(s, "error", outcome=pb.OUTCOME_INTERNAL, stage=reply.stage,
                        detail=f"the tail answered token {tokens[-1]}, outside the vocabulary")
            return
        accepted = len(tokens) - 1
        s.held = s.computed + n_sent            # the rejected drafts' positions too, until the next step cuts them
        s.computed += n_sent - len(drafts) + accepted
        if s.unsent is not None:
            s.control.unsent(tokens[0] == s.unsent, s.long_match)
            s.unsent = None
        s.control.update(len(drafts), accepted, s.long_match, in_run=s.sent.in_run)
        for i, token in enumerate(tokens):
            s.unsent_accepted = max(0, accepted - i - 1)  # accepted drafts behind this token: a stop here drops them
            if not self._emit(s, token, reply):
                break
        if drafts:  # counted as the client got them (accepted never exceeds the completion's tokens)
            self.count_drafts(len(drafts), accepted - s.unsent_accepted)

    def count_drafts(self, drafted: int, accepted: int) -> None:
        self.drafted.inc(drafted)
        self.accepted.inc(accepted)
        with self.cond:  # streams of several route loops count here (Info reads these)
            self.drafted_total += drafted
            self.accepted_total += accepted

    @staticmethod
    def _start_over(s: Stream) -> None:
        """The route lost the session (a miss, a failover): its next step re-prefills it from token
        zero, with the same tokens and draw count, so it samples what it would have anyway."""
        s.reprefilled_tokens += s.computed
        s.grammar.lost()
        s.computed, s.held, s.first_step, s.cached = 0, 0, True, 0
        s.planned, s.prefix, s.prefix_tokens = False, None, 0

    def _reroute(self, s: Stream, reply: pb.StepReply, handed: list[str]) -> None:
        """A later stage's replica did not take the step (reply.stage names which): follow its
        hand-over when it names the replica that holds the session now (the same step goes there,
        nothing is computed again), else mark it down and move the session to another replica of
        that stage, re-prefilled there. A stage with no other replica ends the stream."""
        replicas = self.host.replicas
        k = reply.stage - 1
        failed = s.route[k].address
        s.changes_in_row += 1
        if s.changes_in_row > MAX_ROUTE_CHANGES:
            self.finish(s, "error", outcome=reply.outcome, stage=reply.stage,
                        detail=f"the route changed {MAX_ROUTE_CHANGES} times in one step; last: {reply.detail}")
            return
        hop = replicas.moved(failed, reply.moved_to) if reply.moved_to else None
        s.grammar.lost()  # another replica's tail keeps no grammar state of this session
        if hop is not None:
            s.moves += 1
            # the stages before it applied the step: the same step again is a prefill that cuts there
            s.held = max(s.held, s.computed + s.sent.n_tokens)
            # what the other stages must still check (this one was followed: the session is there now)
            s.handed_from = [h if i != k else "" for i, h in enumerate(handed)]
            route = [*s.route[:k], hop, *s.route[k + 1:]]
        else:
            hop = replicas.failover(failed, reply.detail)
            if isinstance(hop, str):
                self.finish(s, "error", outcome=pb.OUTCOME_UNAVAILABLE, stage=reply.stage, detail=hop)
                return
            s.failovers += 1
            route = [*s.route[:k], hop, *s.route[k + 1:]]
            # a stream's first step on a session the route held: the failed replica may have drained,
            # handing it to this one (an idle session's head learns it only now); this one says. The
            # other stages keep the checks the step already named (`handed`)
            named = (replicas.handed_from(tuple(h.address for h in s.route), tuple(h.address for h in route))
                     if s.first_step and s.cached else None)
            if named:
                s.handed_from = [named[i] or (handed[i] if i < len(handed) else "") for i in range(len(route))]
                s.held = max(s.held, s.computed + s.sent.n_tokens)
            else:
                s.reprefills += 1
                self._start_over(s)
        s.route = route
        s.rerouted = True
        s.grammar.by_digest = self._tail_keeps_grammar(s.route)
        replicas.place(s.key, tuple(h.address for h in s.route))

    def _emit(self, s: Stream, token: int, reply: pb.StepReply) -> bool:
        """One sampled token to the stream's client; False once the stream has finished."""
        if s.params is not None:
            s.draws += 1
        now = time.monotonic()
        if s.t_first is None:
            s.t_first = now
            self.ttft.observe(now - s.t_start)
        else:
            self.itl.observe(now - s.t_last)
        s.t_last = now
        s.generated.append(token)
        s.tokens.append(token)
        text = s.detokenize(s.generated).rstrip("\ufffd")  # an incomplete character comes with a later token
        piece = text[len(s.text):] if text.startswith(s.text) else ""
        start = max(0, len(s.text) - MAX_STOP_CHARS)
        s.text = text
        event = pb.GeneratedToken(token_id=token, piece=piece)
        if s.req.logprobs or s.req.top_logprobs:
            event.logprob = reply.logprob
            n_vocab = self.host.info.n_vocab  # no more than asked, and only tokens, whatever the tail sent
            event.top_logprobs.extend(a for a in reply.top_logprobs[:s.req.top_logprobs] if 0 <= a.token_id < n_vocab)
        s.events.put(pb.GenerateEvent(token=event))
        if token in s.req.stop_token_ids:
            self.finish(s, "stop", stop=f"token {token}")
            return False
        hit = next((x for x in s.req.stop if x in text[start:]), None)
        if hit is not None:
            self.finish(s, "stop", stop=hit)
        elif len(s.generated) >= s.max_tokens:
            self.finish(s, "length")
        return not s.done

    def finish(self, s: Stream, reason: str, *, outcome: int = pb.OUTCOME_OK, stage: int = 0, detail: str = "",
               miss_reason: str = "", stop: str = "") -> None:
        if s.done:
            return
        s.done = True
        n = len(s.generated)
        rate = (n - 1) / (s.t_last - s.t_first) if n > 1 and s.t_last > s.t_first else 0.0
        host = self.host
        # a prefix shared among principals (--share-prefixes all) is someone else's start: how much of
        # a prompt it covered is reported to admins only (it says what other callers sent)
        told = s.prefix_tokens if host.prefixes.share != "all" or s.principal in host.security.admins else 0
        final = pb.GenerateFinal(
            finish_reason=reason, outcome=outcome, stage=stage, detail=detail, miss_reason=miss_reason,
            prompt_tokens=len(s.req.prompt), cached_tokens=s.cached, completion_tokens=n, reprefills=s.reprefills,
            time_to_first_token_s=(s.t_first - s.t_start) if s.t_first is not None else 0.0, tokens_per_s=rate,
            seq_len=min(s.computed, len(s.tokens)), stop=stop, prefix_tokens=told,
            drafted_tokens=s.control.drafted, accepted_tokens=s.control.accepted - s.unsent_accepted,
            failovers=s.failovers, reprefilled_tokens=s.reprefilled_tokens, moves=s.moves,
            pipelined_windows=s.pipelined_windows, pipelined_kept=s.pipelined_kept)
        replicas = host.replicas
        with self.cond:
            if self.streams.get(s.key) is s:
                del self.streams[s.key]
            if reason == "error":
                self._records.pop(s.key, None)  # the route's state is unknown: the next stream starts over
                if replicas is not None:
                    replicas.unplace(s.key)
            else:
                # (drafts past `computed`: cut by the next prefill)
                self._records[s.key] = RouteHolds(s.req.route_epoch, s.tokens[:s.computed],
                                                  tuple(h.address for h in s.route))
                self._records.move_to_end(s.key)
                while len(self._records) > self._records_cap:
                    old, _ = self._records.popitem(last=False)
                    if replicas is not None:
                        replicas.unplace(old)
            self.cond.notify_all()  # a Release waiting for this stream to end (stop_stream)
        s.events.put(pb.GenerateEvent(final=final))

    # --- bookkeeping -----------------------------------------------------------------------------

    def session_to_continue(self, principal: str, tokens: list[int], new_prefix: str) -> tuple[str, int] | None:
        """(session id, epoch) of the principal's session a new request with this prompt continues:
        the one sharing the longest prefix (`longest_prefix`), else, for a principal at its session
        cap, its least recently finished one whose id begins with `new_prefix` (the route truncates it
        to what the prompts share), so new conversations do not wait for a TTL; None: a new session."""
        found = self.longest_prefix(principal, tokens)
        if found is None and self.host.caller_full(principal):
            found = self.least_recent(principal, new_prefix)
        return found

    def longest_prefix(self, principal: str, tokens: list[int]) -> tuple[str, int] | None:
        """(session id, epoch) of the principal's session, with no stream running, whose record
        shares the longest common prefix with `tokens`; None if none does. A session is continued
        only where the prefix covers at least half of what it holds: a new chat that shares only a
        system prompt with another does not cut that one's tail (it gets a session of its own)."""
        security = self.host.security
        tag = security.tag(principal)
        with self.cond:  # the candidates only: the group threads need this lock at every step
            mine = [(key, record.epoch, record.tokens) for key, record in self._records.items()
                    if key not in self.streams and security.owner_of_key(key)[0] == tag]
        best, best_n = None, 0
        for key, epoch, held in mine:  # a record's list is replaced, never changed: safe to read here
            n = common_prefix(held, tokens)
            if n > best_n and 2 * n >= len(held):
                best, best_n = (security.owner_of_key(key)[1], epoch), n
        return best

    def least_recent(self, principal: str, prefix: str) -> tuple[str, int] | None:
        """(session id, epoch) of the principal's least recently finished session that the engine
        still holds, with no stream running, whose id begins with `prefix`; None if there is none
        (a record outlives a session the engine evicted: continuing that one would be a new session)."""
        security = self.host.security
        tag = security.tag(principal)
        held = {r.session_id for r in self.host.sessions()}
        with self.cond:
            for key, record in self._records.items():  # oldest first
                epoch = record.epoch
                owner, sid = security.owner_of_key(key)
                if key in held and key not in self.streams and owner == tag and sid.startswith(prefix):
                    return sid, epoch
        return None

    def stop_stream(self, key: str, reason: str, timeout: float) -> bool:
        """Ends the stream running on engine key `key`, if any, and waits (at most `timeout`
        seconds) until it has ended: a step already built for it must not run after a Release,
        or it would bring the session back. False if it had not ended in time."""
        end = time.monotonic() + timeout
        with self.cond:
            s = self.streams.get(key)
            if s is None:
                return True
            s.cancel(reason)
            self.cond.notify_all()  # an idle group thread picks it up at once
            while self.streams.get(key) is s:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(left)
        return True

    def has_records(self) -> bool:
        return bool(self._records)

    def forget(self, key: str) -> None:
        """The session was stepped, truncated or released from outside a stream: its record is stale."""
        if key in self._records:
            with self.cond:
                self._records.pop(key, None)

    def seq_ids(self) -> dict[str, int]:
        """Engine key -> seq id of the head's hot sessions ({} when the engine cannot say: closing)."""
        try:
            return {r.session_id: r.seq_id for r in self.host.sessions() if r.seq_id >= 0}
        except Exception:  # noqa: BLE001 - the partition falls back to arrival order
            return {}

    def drop_if_idle(self, loop: _RouteLoop) -> None:  # under self.cond
        if loop.idle() and not loop.streams:
            for k, v in list(self.loops.items()):
                if v is loop:
                    del self.loops[k]
                    if k in self._measures:  # the most recently used last (a long-lived loop is not the oldest)
                        self._measures.move_to_end(k)
            loop.close()

    def wait_idle(self, timeout: float) -> bool:
        """Waits until no stream is left and no group step is running (shutdown)."""
        end = time.monotonic() + timeout
        with self.cond:
            while self.streams or self.busy:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(left)
        return True
