"""What a worker admits before it computes: request bytes in flight (a gRPC interceptor) and each
principal's sessions (the per-principal cap). Both refuse before anything is parsed into the engine
or computed: RESOURCE_EXHAUSTED for the caller, nothing changed.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, NamedTuple

import grpc
from google.protobuf.message import DecodeError

from ..errors import Why, WhyNot

if TYPE_CHECKING:
    from ..engine.manager import HotKvStateManager
    from .security import ServerSecurity


class RequestBounds(NamedTuple):
    """The most bytes a worker takes in: one request (gRPC refuses a larger message before it is
    parsed), all requests in flight at once, one hand-over's state."""

    request: int
    in_flight: int
    handover: int

    @classmethod
    def of(cls, config, n_embd: int, kv_bytes_per_token: int, max_message_bytes: int) -> RequestBounds:
        # no valid request is larger than a full batch of full-context float32 rows
        # (max_message_bytes stays the ceiling)
        needed = config.max_sessions * (config.context_tokens * (n_embd * 4 + 8) + 4096) + (1 << 16)
        request = min(max_message_bytes, needed)
        # every session's rows at once fit in one such request; twice that may be parsed and handled
        # at once (a pipelined route has two micro-batches in flight), more is RESOURCE_EXHAUSTED.
        # A hand-over comes in chunks (each under that bound); their sum is at most a full session's
        # KV with its cells' metadata
        return cls(request, 2 * request, 2 * kv_bytes_per_token * config.context_tokens + (2 << 20))


class _Unparsable:
    """What a request that did not parse becomes, so the handler can refuse it cleanly."""

    def __init__(self, error: DecodeError):
        self.error = error


class _Overloaded:
    """What a request becomes when the bytes already in flight leave no room for it."""

    def __init__(self, size: int, in_flight: int, limit: int):
        self.size, self.in_flight, self.limit = size, in_flight, limit


class _InFlightBytes:
    """The request bytes this worker has admitted and not yet answered."""

    def __init__(self, limit: int):
        self.limit, self.held = limit, 0
        self._lock = threading.Lock()

    def take(self, n: int) -> bool:
        with self._lock:
            if self.held + n > self.limit:
                return False
            self.held += n
            return True

    def give_back(self, n: int) -> None:
        with self._lock:
            self.held -= n


class _Admitted:
    """A parsed request holding its share of the in-flight bytes. The share goes back when the
    handler returns, or when gRPC drops the call before the handler runs (a cancelled call: this
    object is freed, and with it the share)."""

    def __init__(self, message, size: int, budget: _InFlightBytes):
        self.message, self._size, self._budget = message, size, budget

    def release(self) -> None:
        size, self._size = self._size, 0
        if size:
            self._budget.give_back(size)

    def __del__(self):
        self.release()


class AdmitRequests(grpc.ServerInterceptor):
    """Every unary request passes here before its handler.
    - Bytes that do not parse get INVALID_ARGUMENT with the parser's reason. gRPC's own answer to a
      request its deserializer rejects is INTERNAL, which reads as a fault of the worker on a
      dashboard; the fault is the caller's.
    - The request bytes being parsed and handled at once are bounded: a request that would take the
      total past `max_in_flight_bytes` gets RESOURCE_EXHAUSTED before it is parsed. gRPC bounds
      each message (the receive limit) and the calls (max_concurrent_rpcs), not their sum; a parsed
      message takes up to 5x its bytes (one-byte token ids become 4-byte ints), and a handler keeps
      its request while it waits for the engine or the next hop, so every handler thread could hold
      a maximum-size request at once. (Parsing itself holds the GIL: parses do not overlap.)
    Each method's wrapped handler is made once (the handlers are registered before the server
    starts), not per call."""

    def __init__(self, max_in_flight_bytes: int):
        self._wrapped: dict[str, object] = {}
        self.in_flight = _InFlightBytes(max_in_flight_bytes)

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        wrapped = self._wrapped.get(method)
        if wrapped is None:
            wrapped = self._wrap(method, continuation(handler_call_details))
            if wrapped is not None:  # only registered methods: a caller's made-up names are not kept
                self._wrapped[method] = wrapped
        return wrapped

    def _wrap(self, method: str, handler):
        if handler is None or handler.unary_unary is None or handler.request_deserializer is None:
            return handler
        parse, behavior, budget = handler.request_deserializer, handler.unary_unary, self.in_flight

        def admit_and_parse(data: bytes):
            if not budget.take(len(data)):
                return _Overloaded(len(data), budget.held, budget.limit)
            admitted = _Admitted(None, len(data), budget)
            try:
                admitted.message = parse(data)
            except DecodeError as e:
                admitted.release()
                return _Unparsable(e)
            return admitted

        def handle(request, context):
            if isinstance(request, _Unparsable):
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"{method}: the request does not parse: {request.error}"
                )
            if isinstance(request, _Overloaded):
                context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{method}: {request.in_flight} request bytes are in flight, {request.size} more would pass "
                    f"this worker's bound of {request.limit}; retry shortly",
                )
            try:
                return behavior(request.message, context)
            finally:
                request.release()

        return handler._replace(request_deserializer=admit_and_parse, unary_unary=handle)


class SessionOwners:
    """Which engine keys each principal holds, for the per-principal session cap. A principal's
    count starts from the keys the engine already holds under its tag (sessions a restarted worker
    resumed from disk count too); a key is counted from the step that creates it; keys the engine
    has since dropped (evicted, expired) are pruned against its session list when a principal
    reaches the cap, so the count is never too low."""

    def __init__(self, manager: HotKvStateManager, cap: int | None, security: ServerSecurity):
        self.manager = manager
        self.cap = cap
        self.security = security
        self._held: dict[str, set[str]] = {}
        self._names: dict[str, str] = {}  # principal tag -> principal, for Info
        self._lock = threading.Lock()

    def _held_by(self, principal: str) -> set[str]:  # under self._lock
        held = self._held.get(principal)
        if held is None:  # what the engine holds for this principal already (a resumed worker's sessions)
            tag = self.security.tag(principal)
            held = self._held[principal] = {
                r.session_id
                for r in self.manager.sessions()
                if tag is not None and self.security.owner_of_key(r.session_id)[0] == tag
            }
        return held

    def _over_cap(self, held: set[str], more: int) -> bool:  # under self._lock
        """Whether `more` new keys would take `held` past the cap, after pruning the keys the
        engine has dropped (only then: it lists every session)."""
        if len(held) + more > self.cap:
            held &= {r.session_id for r in self.manager.sessions()}
        return len(held) + more > self.cap

    def full(self, principal: str) -> bool:
        """Whether the principal holds as many sessions as its cap allows (a new one would be refused)."""
        if self.cap is None:
            return False
        with self._lock:
            return self._over_cap(self._held_by(principal), 1)

    def admit(self, principal: str, keys: list[str]) -> WhyNot | None:
        """Counts the new keys among `keys` against the principal's cap; the refusal, or None."""
        if self.cap is None:
            return None
        with self._lock:
            held = self._held_by(principal)
            new = [k for k in dict.fromkeys(keys) if k not in held]
            if new and self._over_cap(held, len(new)):
                return WhyNot(
                    Why.CALLER_CAP,
                    f"this caller holds {len(held)} sessions here and asks for "
                    f"{len(new)} more; the cap is {self.cap} per caller (serve --max-sessions-per-principal)",
                )
            held.update(new)
        return None

    def forget(self, principal: str, key: str) -> None:
        with self._lock:
            self._held.get(principal, set()).discard(key)

    def name(self, principal: str, tag: str | None) -> None:
        if tag is not None and tag not in self._names:
            self._names[tag] = principal

    def principal_of(self, tag: str | None) -> str:
        return "" if tag is None else self._names.get(tag, "")


class SessionCapRefused(Exception):
    """The principal's session cap refused a new session (RESOURCE_EXHAUSTED, nothing computed)."""
