"""The head's generation loop: its streams, their routes' schedulers, and the record of what each
session holds (the package's docstring says how it works). `open` gives a `Stream` or a typed
`Refusal`; a stream's steps are its route's scheduler's, what replies mean is `Outcomes`'."""

from __future__ import annotations

import enum
import threading
import time
from collections import OrderedDict
from typing import NamedTuple

from ...errors import InvalidInputError, WhyNot
from ...proto import shard_pb2 as pb
from ..failover import addresses, tail_keeps_grammar
from .checks import check_request
from .host import HeadHost
from .metrics import GenerationMetrics
from .output import Outcomes
from .positions import common_prefix
from .records import RouteHolds, SessionRecords
from .scheduler import RouteMeasures, RouteScheduler
from .stream import Stream

#: routes whose measures (RouteMeasures) the head keeps after their scheduler ends, the most recent
MEASURES_KEPT = 256


class RefusalReason(enum.Enum):
    """Why a stream was refused before anything was computed (what a caller may act on)."""

    INVALID = "invalid"  # the request is wrong (Refusal.param names what, where it can)
    SESSION_BUSY = "session_busy"  # the session already has a stream running
    CALLER_STREAMS = "caller_streams"  # the principal runs as many streams as its cap allows
    WORKER_STREAMS = "worker_streams"  # the worker runs as many streams as it can
    NO_ROUTE = "no_route"  # a later stage of the head's own route has no healthy replica


class Refusal(NamedTuple):
    """A stream refused before anything was computed: its reason, and its final event for the caller."""

    reason: RefusalReason
    final: pb.GenerateFinal
    param: str | None = None  # the wire's name of the parameter refused (INVALID)


class GenerationLoops:
    """Every Generate stream of a head worker, and the record of what each session holds.

    Its interface, for the gRPC servicer and the HTTP endpoint alike: `open` (a running `Stream`, or
    a `Refusal`), the stream's `events` and `cancel`; `session_to_continue` (which of a caller's
    sessions a new conversation's prompt continues); `stop_stream` and `forget` (a session changed
    from outside a stream). It reaches its worker only through `HeadHost`."""

    def __init__(
        self,
        host: HeadHost,
        registry,
        draft_source: str = "ngram",
        max_drafts: int = 0,
        draft_model=None,
        row_by_row: bool = True,
    ):
        self.host = host
        self.row_by_row = row_by_row  # verifications computed row by row on every shard (serve --verify exact)
        self.draft_model = draft_model  # draft_model.DraftModel (serve --draft-model), or None
        self.draft_source = (
            f"model {draft_model.path.name}" if draft_model is not None else draft_source
        )  # speculative decoding: where drafts come from ("off": none)
        self.max_drafts = max_drafts if draft_source != "off" else 0  # a request's default
        self.cond = threading.Condition()
        self.loops: dict[tuple, RouteScheduler] = {}
        self._measures: OrderedDict[tuple, RouteMeasures] = OrderedDict()  # by loop key, MEASURES_KEPT at most
        self.streams: dict[str, Stream] = {}  # engine key -> its running stream
        self.busy = 0  # group steps in progress
        self.records = SessionRecords(2 * host.max_sessions, host.security, host.sessions, self.cond)
        self.max_streams = host.max_streams
        self.metrics = GenerationMetrics(registry, lambda: len(self.streams))
        self.outcomes = Outcomes(host, self.metrics, self._closed)

    @property
    def stopping(self) -> bool:
        return self.host.stopping.is_set()

    @property
    def context_tokens(self) -> int:
        return self.host.context_tokens

    # --- opening ---------------------------------------------------------------------------------

    def open(
        self, principal: str, req: pb.GenerateRequest, time_remaining: float | None, events=None
    ) -> Stream | Refusal:
        """A running stream, or the refusal of one refused before anything was computed. Its events
        go to `events.put` (default: a SimpleQueue the gRPC handler reads)."""

        def refused(reason: RefusalReason, outcome: int, detail: str, param: str | None = None) -> Refusal:
            return Refusal(
                reason,
                pb.GenerateFinal(finish_reason="error", outcome=outcome, detail=detail, prompt_tokens=len(req.prompt)),
                param,
            )

        try:
            checked = check_request(self.host, req, self.max_drafts, self.draft_source != "off")
            key = self.host.security.engine_key(principal, req.session_id)
        except InvalidInputError as e:
            return refused(RefusalReason.INVALID, pb.OUTCOME_INVALID_ARGUMENT, str(e), e.param)
        deadline = None if time_remaining is None else time.monotonic() + time_remaining
        with self.cond:
            why = self._full(principal, req, key)
            if why is not None:
                return refused(*why)
            record = self.records.get(key)
            route = self._route(req, record)
            if isinstance(route, WhyNot):
                return refused(RefusalReason.NO_ROUTE, pb.OUTCOME_UNAVAILABLE, route.text)
            cached, handed_from = self._reuse(req, record, addresses(route))
            stream = Stream(
                principal,
                key,
                req,
                checked.params,
                checked.max_tokens,
                cached,
                deadline,
                self.host.detokenize,
                events,
                checked.max_drafts,
                self.draft_model,
                self.row_by_row,
                route,
                handed_from,
                self.host.proofs.open(req) if self.host.proofs is not None else None,
            )
            stream.grammar.by_digest = tail_keeps_grammar(self.host.replicas, route)
            if self.host.replicas is not None:
                self.host.replicas.place(key, addresses(route))
            self.streams[key] = stream
            self.loop_for(principal, route, checked.wire_dtype).add(stream)
        return stream

    def _full(self, principal: str, req: pb.GenerateRequest, key: str) -> tuple | None:  # under self.cond
        """Why no stream may start for this session now (a refusal's reason, outcome and detail)."""
        if key in self.streams:
            return (
                RefusalReason.SESSION_BUSY,
                pb.OUTCOME_INVALID_ARGUMENT,
                f"session {req.session_id!r} already has a Generate stream running",
            )
        cap = self.host.session_cap
        mine = sum(1 for s in self.streams.values() if s.principal == principal)
        if cap is not None and mine >= cap:
            return (
                RefusalReason.CALLER_STREAMS,
                pb.OUTCOME_BUDGET_EXCEEDED,
                f"this caller has {mine} streams running; the cap is {cap} per caller "
                f"(serve --max-sessions-per-principal)",
            )
        limit = self.max_streams
        if len(self.streams) >= limit:
            warm = ", twice over with its warm tier" if limit > 1 and self.host.warm_bytes else ""
            return (
                RefusalReason.WORKER_STREAMS,
                pb.OUTCOME_BUDGET_EXCEEDED,
                f"this worker runs at most {limit} Generate streams at once (its hot sessions{warm})",
            )
        return None

    def _reuse(
        self, req: pb.GenerateRequest, record: RouteHolds | None, route: tuple[str, ...]
    ) -> tuple[int, list[str] | None]:
        """(prompt tokens the route holds, the hand-overs its first step must check). What the session
        holds is reused on the replicas that hold it, and on those a drained one handed it to (each
        continues it only if it did: StepRequest.handed_from); else a re-prefill."""
        if record is None or record.epoch != req.route_epoch:
            return 0, None
        handed_from = None
        if record.route != route and self.host.replicas is not None:
            handed_from = self.host.replicas.handed_from(record.route, route)
        if record.route == route or handed_from is not None:
            return min(common_prefix(record.tokens, list(req.prompt)), len(req.prompt) - 1), handed_from
        return 0, handed_from

    def _route(self, req: pb.GenerateRequest, record: RouteHolds | None) -> list[pb.Hop] | WhyNot:
        """The hops a new stream's steps go down: the request's own `forward`, else the head's own
        route (one replica per stage, the session's last ones while they are up), else none (a head
        that holds the whole model); or why there is no route."""
        replicas = self.host.replicas
        if req.forward:
            return (
                replicas.hops(req.forward)
                if replicas is not None
                else [pb.Hop(address=h.address, recipe_fingerprint=h.recipe_fingerprint) for h in req.forward]
            )
        if replicas is None:
            return []
        return replicas.choose(prefer=record.route if record is not None else ())

    def loop_for(self, principal: str, route: list[pb.Hop], wire_dtype: int) -> RouteScheduler:  # under self.cond
        """The scheduler that runs a principal's streams down `route` (made when there is none)."""
        hops = tuple((h.address, h.recipe_fingerprint, h.fail_fast) for h in route)
        loop_key = (principal, hops, wire_dtype)
        loop = self.loops.get(loop_key)
        if loop is None:
            measures = self._measures.pop(loop_key, None) or RouteMeasures.new()
            self._measures[loop_key] = measures  # the most recent last
            while len(self._measures) > MEASURES_KEPT:
                self._measures.popitem(last=False)
            loop = self.loops[loop_key] = RouteScheduler(self, principal, hops, wire_dtype, measures)
        return loop

    # --- a stream's end --------------------------------------------------------------------------

    def _closed(self, s: Stream, failed: bool) -> None:
        """A finished stream leaves; what the route holds of its session is kept for the next one
        (failed: the route's state is unknown, and the next stream starts over)."""
        replicas = self.host.replicas
        with self.cond:
            if self.streams.get(s.key) is s:
                del self.streams[s.key]
            if failed:
                self.records.drop(s.key)
                if replicas is not None:
                    replicas.unplace(s.key)
            else:  # (drafts past `computed`: cut by the next prefill)
                pushed_out = self.records.keep(
                    s.key, RouteHolds(s.req.route_epoch, s.pos.tokens[: s.pos.computed], s.place.addresses())
                )
                for old in pushed_out if replicas is not None else ():
                    replicas.unplace(old)
            self.cond.notify_all()  # a Release waiting for this stream to end (stop_stream)

    # --- bookkeeping -----------------------------------------------------------------------------

    def session_to_continue(self, principal: str, tokens: list[int], new_prefix: str) -> tuple[str, int] | None:
        """(session id, epoch) of the principal's session a new request with this prompt continues:
        the one sharing the longest prefix (`SessionRecords.longest_prefix`), else, for a principal at
        its session cap, its least recently finished one whose id begins with `new_prefix` (the route
        truncates it to what the prompts share), so new conversations do not wait for a TTL; None: a
        new session."""
        found = self.records.longest_prefix(principal, tokens, self.streams)
        if found is None and self.host.caller_full(principal):
            found = self.records.least_recent(principal, new_prefix, self.streams)
        return found

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
        return bool(self.records)

    def forget(self, key: str) -> None:
        """The session was stepped, truncated or released from outside a stream: its record is stale."""
        self.records.drop(key)

    def seq_ids(self) -> dict[str, int]:
        """Engine key -> seq id of the head's hot sessions ({} when the engine cannot say: closing)."""
        try:
            return {r.session_id: r.seq_id for r in self.host.sessions() if r.seq_id >= 0}
        except Exception:  # noqa: BLE001 - the partition falls back to arrival order
            return {}

    def drop_if_idle(self, loop: RouteScheduler) -> None:  # under self.cond
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
