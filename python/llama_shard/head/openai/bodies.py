"""Request bodies on their way in: who may have how many arriving at once, and in how much memory.

A request's generation slot (`HttpServer.slot`) is taken only once its body is whole. Before,
the slot was taken first, so 300 connections that sent their headers and then a byte a second held
every slot until the body deadline: one client with a few hundred sockets kept an open endpoint
answering 429 to everyone. Reading a body now holds a place here instead, bounded twice:

- **memory**: a body reserves its declared length (the endpoint's body cap when it declares none:
  chunked) against `body_memory_bytes`, which bounds what the bodies being read can hold together;
  past it a request gets 503, whoever sends it;
- **per caller**: an anonymous caller (a worker without authentication) is its address (an IPv6
  address's /64, what one host is usually given), as nginx's `limit_conn` counts it, and has at most
  `max_bodies_per_address` bodies arriving at once; an authenticated caller has at most its
  per-principal request cap, wherever it connects from. Either holds at most a quarter of the
  memory, so one caller's large bodies cannot take all of it. Past either, 429, and the connection
  closes (its body is never read).

So a slow sender holds only its own places: another address, or a caller with its own credentials,
is served while it drips. The connection count stays the guard's (`guard.ConnectionGuard`), and
the time a body may take the endpoint's body timeout.

Invariants: `reserved` is the sum of the places held and never exceeds `body_memory_bytes`, and a
caller's share never exceeds a quarter of it; a place is
given back on every way out of `reading` (answer, error, cancellation); a refusal changes nothing."""

from __future__ import annotations

import contextlib
import ipaddress

from .errors import HttpError

#: the largest request body whatever the context (a longer one gets 413 before it is read in full)
MAX_BODY_BYTES = 4 * 2**20
#: the default memory for bodies being read at once (serve --http-body-memory)
BODY_MEMORY_BYTES = 64 * 2**20
#: the default bodies one anonymous address may have arriving at once (serve --http-max-bodies-per-address)
BODIES_PER_ADDRESS = 16


def caller_address(address: str | None) -> str:
    """What counts as one anonymous caller: an IPv4 address, or an IPv6 address's /64 (a host is
    usually given a whole /64: counted per address, it could spread its bodies over 2^64 of them)."""
    try:
        ip = ipaddress.ip_address(address or "")
    except ValueError:
        return address or "?"
    mapped = getattr(ip, "ipv4_mapped", None)
    if ip.version == 6 and mapped is None:
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(mapped or ip)


class BodyReaders:
    """The bodies being read now, counted in bytes and by caller."""

    def __init__(self, limits, max_body_bytes: int, per_principal: int, authenticated: bool):
        """`limits`: the port's `guard.HttpLimits` (body_memory_bytes, max_bodies_per_address)."""
        self.limits, self.max_body_bytes = limits, max_body_bytes
        self.per_principal, self.authenticated = per_principal, authenticated
        self.reserved = 0
        self.by_caller: dict[str, int] = {}  # bodies arriving per caller
        self.bytes_by_caller: dict[str, int] = {}  # and the bytes they reserve

    def _caller(self, address: str | None, principal: str) -> tuple[str, int, str]:
        """(the key a caller's bodies are counted under, its cap, the flag that sets it)."""
        if self.authenticated:
            return "principal:" + principal, self.per_principal, "--http-max-requests-per-principal"
        return "address:" + caller_address(address), self.limits.max_bodies_per_address, "--http-max-bodies-per-address"

    def _reservation(self, content_length: int | None) -> int:
        return self.max_body_bytes if content_length is None else max(0, min(content_length, self.max_body_bytes))

    def refusal(self, address: str | None, principal: str, content_length: int | None) -> HttpError | None:
        """The error a body of this caller gets now, or None when it may be read."""
        key, cap, flag = self._caller(address, principal)
        mine = self.by_caller.get(key, 0)
        who = "this address" if not self.authenticated else "this caller"
        if mine >= cap:
            return HttpError(429, f"{who} has {mine} request bodies arriving here, its most (serve {flag})", close=True)
        need = self._reservation(content_length)
        share = self.limits.body_memory_bytes // 4
        if self.bytes_by_caller.get(key, 0) + need > share:
            return HttpError(
                429,
                f"{who} has {self.bytes_by_caller.get(key, 0)} bytes of request bodies arriving "
                f"here; a caller's most is {share} (a quarter of serve --http-body-memory)",
                close=True,
            )
        if self.reserved + need > self.limits.body_memory_bytes:
            return HttpError(
                503,
                "request bodies arriving fill this worker's "
                f"{self.limits.body_memory_bytes} bytes for them (serve --http-body-memory); "
                "try again shortly",
                close=True,
            )
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
        self.bytes_by_caller[key] = self.bytes_by_caller.get(key, 0) + need
        try:
            yield
        finally:
            self.reserved -= need
            left, left_bytes = self.by_caller[key] - 1, self.bytes_by_caller[key] - need
            if left:
                self.by_caller[key], self.bytes_by_caller[key] = left, left_bytes
            else:
                del self.by_caller[key], self.bytes_by_caller[key]
