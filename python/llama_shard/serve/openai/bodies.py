"""Request bodies on their way in: who may have how many arriving at once, and in how much memory.

A request's generation slot (`OpenAIEndpoint._slot`) is taken only once its body is whole. Before,
the slot was taken first, so 300 connections that sent their headers and then a byte a second held
every slot until the body deadline: one client with a few hundred sockets kept an open endpoint
answering 429 to everyone. Reading a body now holds a place here instead, bounded twice:

- **memory**: a body reserves its declared length (the endpoint's body cap when it declares none:
  chunked) against `body_memory_bytes`, which bounds what the bodies being read can hold together;
  past it a request gets 503 with Retry-After, whoever sends it;
- **per caller**: an anonymous caller (a worker without authentication) is its address, as nginx's
  `limit_conn` counts it, and has at most `max_bodies_per_address` bodies arriving at once; an authenticated
  caller has at most its per-principal request cap, wherever it connects from. Past it, 429, and
  the connection closes (its body is never read).

So a slow sender holds only its own places: another address, or a caller with its own credentials,
is served while it drips. The connection count stays the guard's (`guard.ConnectionGuard`), and
the time a body may take the endpoint's body timeout.

Invariants: `reserved` is the sum of the places held and never exceeds `body_memory_bytes`; a place is
given back on every way out of `reading` (answer, error, cancellation); a refusal changes nothing."""
from __future__ import annotations

import contextlib

from .errors import HttpError

#: the default memory for bodies being read at once (serve --http-body-memory)
BODY_MEMORY_BYTES = 64 * 2**20
#: the default bodies one anonymous address may have arriving at once (serve --http-max-bodies-per-address)
BODIES_PER_ADDRESS = 16


class BodyReaders:
    """The bodies being read now, counted in bytes and by caller."""

    def __init__(self, limits, max_body_bytes: int, per_principal: int, authenticated: bool):
        """`limits`: the port's `guard.HttpLimits` (body_memory_bytes, max_bodies_per_address)."""
        self.limits, self.max_body_bytes = limits, max_body_bytes
        self.per_principal, self.authenticated = per_principal, authenticated
        self.reserved = 0
        self.by_caller: dict[str, int] = {}
        self.refused = {"memory": 0, "caller": 0}

    def _caller(self, address: str | None, principal: str) -> tuple[str, int, str]:
        """(the key a caller's bodies are counted under, its cap, the flag that sets it)."""
        if self.authenticated:
            return "principal:" + principal, self.per_principal, "--http-max-requests-per-principal"
        return "address:" + (address or "?"), self.limits.max_bodies_per_address, "--http-max-bodies-per-address"

    def _reservation(self, content_length: int | None) -> int:
        return self.max_body_bytes if content_length is None else max(0, min(content_length, self.max_body_bytes))

    def refusal(self, address: str | None, principal: str, content_length: int | None) -> HttpError | None:
        """The error a body of this caller gets now, or None when it may be read."""
        key, cap, flag = self._caller(address, principal)
        mine = self.by_caller.get(key, 0)
        if mine >= cap:
            self.refused["caller"] += 1
            who = "this address" if not self.authenticated else "this caller"
            return HttpError(429, f"{who} has {mine} request bodies arriving here, its most (serve {flag})",
                             close=True)
        need = self._reservation(content_length)
        if self.reserved + need > self.limits.body_memory_bytes:
            self.refused["memory"] += 1
            return HttpError(503, "request bodies arriving fill this worker's "
                                  f"{self.limits.body_memory_bytes} bytes for them (serve --http-body-memory); "
                                  "try again shortly", close=True)
        return None

    @contextlib.contextmanager
    def reading(self, address: str | None, principal: str, content_length: int | None):
        """Holds a body's place while it is read; raises the refusal when it may not be."""
        refusal = self.refusal(address, principal, content_length)
        if refusal is not None:
            raise refusal
        key, _, _ = self._caller(address, principal)
        need = self._reservation(content_length)
        self.reserved += need
        self.by_caller[key] = self.by_caller.get(key, 0) + 1
        try:
            yield
        finally:
            self.reserved -= need
            left = self.by_caller[key] - 1
            if left:
                self.by_caller[key] = left
            else:
                del self.by_caller[key]
