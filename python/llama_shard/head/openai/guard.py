"""The HTTP port's connection limits, as a production server sets them: a bound on open connections
and a deadline for every way a client can hold one without making progress.

aiohttp gives the HTTP/1.1 parser and the handlers; it has no header or write timeout, and its
keep-alive timer stops at the first byte a client sends, so a client sending its headers one byte
a second holds a connection (and a file descriptor) forever. `ConnectionGuard` sits between the
listening socket and aiohttp's protocol and owns each connection from accept, before any TLS
handshake, to close:

- **headers**: a new connection must complete its TLS handshake and its first request's headers
  within `header_timeout_s`; a kept-alive one may wait `idle_timeout_s` for its next request, whose
  headers must then arrive within `header_timeout_s` of its first byte.
- **body**: a handler reads its body within `body_timeout_s` (`HttpServer.read_json`), holding a
  place bounded in memory and per caller (`bodies.BodyReaders`), not a generation slot.
- **writes**: a connection whose unsent bytes do not shrink for `write_timeout_s` (a client that does
  not read its stream) is aborted; the stream's handler sees the failed write, stops the stream's
  compute and frees its slot.
- **count**: at most `max_connections` are open. At the cap, a new connection takes the place of
  the oldest one with no request in a handler (a slow-header or idle one: slow clients churn, new
  clients are served): one that never finished a request first, then the longest idle kept-alive
  one; when every connection has a request running, the new one is closed.

Invariants: every accepted socket is in `connections` until it is closed, so the cap counts file
descriptors the port holds (a TLS handshake in progress included); nothing here reads or writes
application data; every deadline is checked by one sweep on the event loop (no timer per byte)."""

from __future__ import annotations

import asyncio
import dataclasses
import resource
import socket
import ssl
import sys
from collections import OrderedDict

from .bodies import BODIES_PER_ADDRESS, BODY_MEMORY_BYTES

#: how often the deadlines are checked (a connection lives at most this much past its deadline)
SWEEP_S = 0.25
#: each connection's kernel send buffer (asked; Linux keeps twice it for its bookkeeping): bounds
#: what a client that does not read pins in kernel
#: memory (loopback's autotuning grows it to 4 MiB: a whole long stream fits, and the write that
#: would reveal the stall never blocks); a stream of tokens needs far less
SEND_BUFFER_BYTES = 256 * 2**10


@dataclasses.dataclass(frozen=True)
class HttpLimits:
    """`serve --http-*` limits; None for the connection cap: derived from the file limit."""

    header_timeout_s: float = 10.0  # TLS handshake + request line + headers
    body_timeout_s: float = 30.0  # the whole body, once the headers are in
    idle_timeout_s: float = 15.0  # a kept-alive connection between requests
    write_timeout_s: float = 30.0  # unsent bytes that do not shrink
    max_connections: int | None = None  # None: min(512, a quarter of the open-file limit)
    max_in_flight_per_principal: int | None = None  # None: the global cap without authentication, half of it with
    allowed_hosts: tuple[str, ...] = ()  # Host names accepted on a plaintext port beside IP literals and localhost
    cors_origins: tuple[str, ...] = ()  # Origins a browser page may call from (CORS; "*": any); none by default
    body_memory_bytes: int = BODY_MEMORY_BYTES  # bodies being read at once, together (bodies.py)
    max_bodies_per_address: int = BODIES_PER_ADDRESS  # bodies arriving at once from one address, without authentication

    def connection_cap(self) -> int:
        if self.max_connections is not None:
            return self.max_connections
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        return max(16, min(512, soft // 4)) if soft != resource.RLIM_INFINITY else 512


def raise_open_file_limit() -> tuple[int, int]:
    """Raises this process's soft open-file limit to its hard limit (each connection on either port
    costs a descriptor; 1,024 is a common soft default); returns (soft, hard) after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):  # a hard limit the kernel caps lower (nr_open): keep the soft one
            pass
    return resource.getrlimit(resource.RLIMIT_NOFILE)


class _Connection:
    __slots__ = (
        "raw",
        "transport",
        "opened",
        "free_since",
        "first_byte",
        "busy",
        "served",
        "stall_since",
        "unsent",
        "protocol",
    )

    def __init__(self, raw: asyncio.Transport, now: float):
        self.raw = raw  # the socket's transport (the TLS one wraps it)
        self.transport = None  # what aiohttp writes to, once a handshake (if any) is done
        self.opened = self.free_since = now
        self.first_byte: float | None = None  # first byte of a request not yet in a handler
        self.busy = 0  # requests of this connection in a handler
        self.served = False  # a request has been answered (the connection is kept alive)
        self.stall_since: float | None = None  # since when the unsent bytes have not shrunk
        self.unsent = 0
        self.protocol = None


class _GuardedProtocol(asyncio.Protocol):
    """One connection: counted from accept, handed to aiohttp's protocol after its handshake."""

    def __init__(self, guard: "ConnectionGuard"):
        self.guard = guard
        self.conn: _Connection | None = None
        self.inner: asyncio.Protocol | None = None
        self.early: list[bytes] = []  # what arrived after the handshake, before aiohttp's protocol took over
        self.handshake: asyncio.Task | None = None

    def connection_made(self, transport) -> None:
        self.conn = self.guard._opened(transport, self)
        if self.conn is None:
            return
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
            except OSError:
                pass
        if self.guard.ssl_context is None:
            self._start(transport)
        else:
            transport.pause_reading()  # start_tls takes the socket over from here
            self.handshake = self.guard.loop.create_task(self._handshake(transport))  # held: a task needs a reference

    async def _handshake(self, raw) -> None:
        try:
            tls = await self.guard.loop.start_tls(
                raw,
                self,
                self.guard.ssl_context,
                server_side=True,
                ssl_handshake_timeout=self.guard.limits.header_timeout_s,
            )
        except (OSError, ssl.SSLError, asyncio.TimeoutError, ConnectionError, RuntimeError):
            raw.abort()
            self.guard._closed(self.conn)
            return
        if tls is None or self.conn.raw.is_closing():
            self.guard._closed(self.conn)
            return
        self._start(tls)

    def _start(self, transport) -> None:
        self.conn.transport = transport
        self.guard.by_transport[transport] = self.conn
        self.inner = self.guard.protocol_factory()
        self.inner.connection_made(transport)
        for data in self.early:  # a request sent with the handshake's last flight
            self.inner.data_received(data)
        self.early.clear()

    def data_received(self, data: bytes) -> None:
        conn = self.conn
        if conn is not None and conn.busy == 0 and conn.first_byte is None:
            conn.first_byte = self.guard.loop.time()
        if self.inner is not None:
            self.inner.data_received(data)
        else:
            self.early.append(data)

    def eof_received(self):
        return self.inner.eof_received() if self.inner is not None else None

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    def connection_lost(self, exc) -> None:
        if self.conn is not None:
            self.guard._closed(self.conn)
        if self.inner is not None:
            self.inner.connection_lost(exc)


class ConnectionGuard:
    """The listening socket's protocol factory and the sweep over every open connection."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, protocol_factory, limits: HttpLimits, ssl_context: ssl.SSLContext | None
    ):
        self.loop, self.protocol_factory, self.limits, self.ssl_context = loop, protocol_factory, limits, ssl_context
        self.cap = limits.connection_cap()
        self.connections: OrderedDict[_Connection, None] = OrderedDict()  # oldest first
        self.by_transport: dict[object, _Connection] = {}
        self.closed_by_reason: dict[str, int] = {}
        self._sweeper: asyncio.Task | None = None

    def __call__(self) -> asyncio.Protocol:
        return _GuardedProtocol(self)

    def start(self) -> None:
        self._sweeper = self.loop.create_task(self._sweep_forever())

    def stop(self) -> None:
        """Stops the sweep and closes what aiohttp does not know of yet (TLS handshakes in progress)."""
        if self._sweeper is not None:
            self._sweeper.cancel()
        for conn in list(self.connections):
            if conn.transport is None:
                self._close(conn, "shutting down")

    # --- requests (called by the endpoint's middleware) --------------------------------------

    def request_started(self, transport) -> None:
        conn = self.by_transport.get(transport)
        if conn is not None:
            conn.busy += 1
            conn.first_byte = None

    def request_ended(self, transport) -> None:
        conn = self.by_transport.get(transport)
        if conn is not None:
            conn.busy = max(0, conn.busy - 1)
            conn.served, conn.free_since = True, self.loop.time()

    # --- connections --------------------------------------------------------------------------

    def _opened(self, raw, protocol: _GuardedProtocol) -> _Connection | None:
        if len(self.connections) >= self.cap:
            # a connection that never finished a request (a slow or silent one) before a client's idle
            # kept-alive one, the longest waiting first
            idle = [c for c in self.connections if c.busy == 0 and c.unsent == 0]
            victim = min(idle, key=lambda c: (c.served, c.free_since), default=None)
            if victim is None:  # every connection is serving a request: this one waits its turn elsewhere
                self._count("over the connection cap")
                raw.abort()
                return None
            self._close(victim, "made room at the connection cap")
        conn = _Connection(raw, self.loop.time())
        conn.protocol = protocol
        self.connections[conn] = None
        return conn

    def _closed(self, conn: _Connection) -> None:
        self.connections.pop(conn, None)
        if conn.transport is not None:
            self.by_transport.pop(conn.transport, None)

    def _close(self, conn: _Connection, reason: str) -> None:
        self._count(reason)
        self._closed(conn)
        (conn.transport or conn.raw).abort()
        if conn.transport is not None and not conn.raw.is_closing():
            conn.raw.abort()

    def _count(self, reason: str) -> None:
        self.closed_by_reason[reason] = self.closed_by_reason.get(reason, 0) + 1

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            try:
                self.sweep()
            except Exception as e:  # noqa: BLE001 - a bug here must not stop the deadlines
                print(f"llama-shard: HTTP connection sweep: {type(e).__name__}: {e}", file=sys.stderr, flush=True)

    def sweep(self) -> None:
        """Closes each connection past one of its deadlines."""
        now, lim = self.loop.time(), self.limits
        for conn in list(self.connections):
            transport = conn.transport
            unsent = transport.get_write_buffer_size() if transport is not None and not transport.is_closing() else 0
            if unsent == 0:
                if conn.unsent:  # a response just went out whole: the idle time starts now
                    conn.free_since = now
                conn.stall_since = None
            elif conn.stall_since is None or unsent < conn.unsent:
                conn.stall_since = now  # progress
            conn.unsent = unsent
            if conn.stall_since is not None and now - conn.stall_since > lim.write_timeout_s:
                self._close(conn, "write timeout (the client does not read)")
                continue
            if conn.busy or unsent:
                continue
            if not conn.served:  # handshake and first headers, from accept
                deadline, reason = conn.opened + lim.header_timeout_s, "header timeout"
            elif conn.first_byte is not None:  # the next request's headers, from its first byte
                deadline, reason = conn.first_byte + lim.header_timeout_s, "header timeout"
            else:
                deadline, reason = conn.free_since + lim.idle_timeout_s, "idle timeout"
            if now > deadline:
                self._close(conn, reason)
