"""The HTTP side of a head's endpoint: the port, TLS (following its files), who calls (a token or a
client certificate), what a browser may do (Host, CORS), and what a request holds while it runs
(its body's place, its slot). It serves whatever handlers it is given (endpoint.py's); it knows
nothing of generation.

Invariants: a request is refused by what it costs before it costs it: its connection is counted and
timed from accept (`guard`); its body is read holding a place bounded in memory and per caller
(`bodies`), and its slot (global and per principal) is taken once the body is whole; a body longer
than `max_body_bytes` is refused by its length before it is read. Every error is OpenAI's JSON shape."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import re
import ssl
import threading
from collections.abc import Callable

from aiohttp import HttpVersion11, web

from ...worker.security import ANONYMOUS, ServerSecurity, file_mtimes
from .bodies import BodyReaders
from .errors import HttpError
from .guard import ConnectionGuard, HttpLimits

#: a preflight's Access-Control-Request-Headers: header names, comma-separated (at most 1 KiB)
_HEADER_NAMES = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+(\s*,\s*[A-Za-z0-9!#$%&'*+.^_`|~-]+)*", re.ASCII)


class HttpServer:
    """One port on its own event loop thread (`start`), answering with the handlers it is given."""

    def __init__(
        self,
        security: ServerSecurity,
        host: str,
        port: int,
        limits: HttpLimits,
        max_in_flight: int,
        max_body_bytes: int,
        too_large_why: str,
        stopping: Callable[[], bool],
    ):
        """`too_large_why`: what a body over `max_body_bytes` would be (the 413's reason);
        `stopping`: whether the worker shuts down (a new body is refused 503)."""
        self.security, self.host, self.port, self.limits = security, host, port, limits
        self.max_body_bytes, self.too_large_why, self.stopping = max_body_bytes, too_large_why, stopping
        self.max_in_flight, self.in_flight = max_in_flight, 0
        # one principal may hold all slots of a node it has to itself (no authentication: one principal),
        # half of them where tenants share it
        self.max_in_flight_per_principal = limits.max_in_flight_per_principal or (
            max(1, max_in_flight // 2) if security.authenticated else max_in_flight
        )
        self.in_flight_by_principal: dict[str, int] = {}
        # bodies on their way in: bounded in memory and per caller (an address without authentication)
        self.bodies = BodyReaders(limits, max_body_bytes, self.max_in_flight_per_principal, security.authenticated)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._tls_reloads = 0  # certificate sets loaded since start (see _ssl_context)
        self._runner: web.AppRunner | None = None
        self._listener: asyncio.AbstractServer | None = None
        self.guard: ConnectionGuard | None = None
        self._thread: threading.Thread | None = None

    def _ssl_context(self) -> ssl.SSLContext | None:
        """The TLS context of the port; like the gRPC port's, it follows its files: before each
        handshake (the SNI callback runs with or without a server name) the files' times are
        compared, and a changed set is loaded into a new context the connection switches to (a
        file being rewritten keeps the last good context)."""
        sec = self.security
        if not sec.tls_cert:
            return None
        files = (sec.tls_cert, sec.tls_key, sec.tls_client_ca)

        def load() -> ssl.SSLContext:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.minimum_version = ssl.TLSVersion.TLSv1_2
            # no session tickets: a resumed session would skip the rotated context's checks (its
            # ticket keys are the first context's); TLS 1.2 session ids: see _principal
            ctx.options |= ssl.OP_NO_TICKET
            ctx.num_tickets = 0
            ctx.load_cert_chain(sec.tls_cert, sec.tls_key, password=b"")  # encrypted: fail, never prompt
            if sec.tls_client_ca:
                ctx.load_verify_locations(sec.tls_client_ca)
                ctx.verify_mode = ssl.CERT_REQUIRED
            ctx.sni_callback = follow
            return ctx

        state = {"mtimes": file_mtimes(files)}

        def follow(conn, _server_name, _ctx) -> None:
            now = file_mtimes(files)
            if now != state["mtimes"] and now != state.get("failed"):
                try:
                    state["ctx"], state["mtimes"] = load(), now
                    self._tls_reloads += 1
                except (OSError, ssl.SSLError, ValueError):
                    state["failed"] = (
                        now  # a half-written file: keep the last good context, read it again once it changes
                    )
            if conn.context is not state["ctx"]:
                conn.context = state["ctx"]

        state["ctx"] = load()
        return state["ctx"]

    @property
    def scheme(self) -> str:
        return "https" if self.security.tls_cert else "http"

    def start(self, add_routes: Callable[[web.Application], None]) -> HttpServer:
        """Binds the port (OSError when it cannot) and serves `add_routes`' handlers on a thread of its own."""
        self.loop = asyncio.new_event_loop()
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[self._errors])
        app.on_response_prepare.append(self._cors_headers)
        add_routes(app)
        # aiohttp's own keep-alive timer covers a connection that sends nothing; the guard the rest
        self._runner = web.AppRunner(
            app, handle_signals=False, access_log=None, keepalive_timeout=self.limits.idle_timeout_s
        )

        async def setup() -> int:
            await self._runner.setup()
            # the guard, not aiohttp's site, accepts: it counts a connection before its TLS handshake
            self.guard = ConnectionGuard(
                asyncio.get_running_loop(), self._runner.server, self.limits, self._ssl_context()
            )
            self._listener = await asyncio.get_running_loop().create_server(
                self.guard, self.host, self.port, backlog=128, reuse_address=True
            )
            self.guard.start()
            return self._listener.sockets[0].getsockname()[1]  # the port bound (0 asked for any free one)

        try:
            self.port = self.loop.run_until_complete(setup())
        except OSError as e:
            self.loop.run_until_complete(self._runner.cleanup())
            self.loop.close()
            raise OSError(f"cannot bind the HTTP endpoint on {self.host}:{self.port}: {e}") from None
        self._thread = threading.Thread(target=self.loop.run_forever, name="openai-http", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.loop is None or self._thread is None:
            return

        async def close() -> None:
            self.guard.stop()
            self._listener.close()
            await self._runner.cleanup()

        future = asyncio.run_coroutine_threadsafe(close(), self.loop)
        try:
            future.result(timeout_s)
        except Exception:  # noqa: BLE001 - shutting down: a slow client must not hold the worker
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout_s)
        self.loop = self._thread = None

    # --- every request ------------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        transport = request.transport
        self.guard.request_started(transport)  # its headers are in: the connection's header deadline ends
        try:
            if request.method == "OPTIONS" and self._cors_origin(request) is not None:
                self._check_browser(request)  # the Host rule holds for a preflight too
                return self._preflight(request)
            self._check_browser(request)
            return await handler(request)
        except HttpError as e:
            if not e.close:
                return e.response()
            response = e.response()  # sent whole, then the connection ends (no body is waited for)
            response.force_close()
            try:
                await response.prepare(request)
                await response.write_eof()
            except ConnectionError:  # the client left first (a slow sender giving up): nothing to tell
                pass
            if request.transport is not None:
                request.transport.close()
            return response
        except web.HTTPRequestEntityTooLarge:
            return self.too_large().response()
        except web.HTTPException as e:  # aiohttp's own (an unknown path, a wrong method): in OpenAI's shape
            if e.status < 400:
                raise
            return HttpError(e.status, f"{request.method} {request.path}: {e.reason}").response()
        except (ConnectionError, asyncio.CancelledError):
            raise
        except Exception as e:  # noqa: BLE001 - a bug answers 500 in OpenAI's shape; the worker serves on
            return HttpError(500, f"internal error: {type(e).__name__}").response()
        finally:
            self.guard.request_ended(transport)

    async def expect(self, request: web.Request) -> web.StreamResponse | None:
        """`Expect: 100-continue` (curl's for a large body): what needs no body is checked before the
        client is told to send it (aiohttp's own handler says "continue" first)."""
        if request.version != HttpVersion11:
            return None
        if request.headers.get("Expect", "").lower() != "100-continue":
            return HttpError(417, f"unknown Expect: {request.headers.get('Expect', '')[:64]}").response()
        try:
            self._check_browser(request)
            principal = self.principal(request)
            if request.content_length is not None and request.content_length > self.max_body_bytes:
                raise self.too_large()
            refusal = self.bodies.refusal(request.remote, principal, request.content_length) or self._slot_refusal(
                principal
            )
            if refusal is not None:
                raise refusal
        except HttpError as e:
            response = e.response()
            response.force_close()  # the body was never asked for
            return response
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # as aiohttp's own handler: the response has not begun
        return None

    def too_large(self) -> HttpError:
        return HttpError(
            413,
            f"the request body is over {self.max_body_bytes} bytes: {self.too_large_why}",
            code="context_length_exceeded",
        )

    def _check_browser(self, request: web.Request) -> None:
        """A web page must not drive a worker it can reach (a loopback one above all). A cross-site
        "simple" POST (text/plain, a form) is sent without asking: only application/json needs the
        preflight this endpoint grants only to the origins `--http-cors-origin` names. DNS rebinding makes a page's own name resolve to the
        worker: on a plaintext port its Host header must be an IP literal, a localhost name or one
        the operator allowed (`--http-allowed-host`); over TLS the certificate stops it."""
        if request.method == "POST":
            ctype = request.headers.get("Content-Type", "")
            if ctype.split(";")[0].strip().lower() != "application/json":
                raise HttpError(415, "Content-Type must be application/json", code="unsupported_media_type")
        if self.security.tls_cert:
            return
        host = request.headers.get("Host")
        if host is None or not self._host_allowed(host):
            raise HttpError(
                403,
                f"the Host header {str(host)[:64]!r} does not name this worker; an operator can allow "
                "a name with serve --http-allowed-host",
                code="host_not_allowed",
            )

    # --- CORS (off unless --http-cors-origin names the page's origin) ---------------------------

    def _cors_origin(self, request: web.Request) -> str | None:
        """The request's Origin when the operator allows it (`--http-cors-origin`), else None."""
        origin = request.headers.get("Origin")
        allowed = self.limits.cors_origins
        if origin is None or not allowed:
            return None
        return origin if "*" in allowed or origin.rstrip("/").lower() in allowed else None

    def _preflight(self, request: web.Request) -> web.Response:
        """A browser's OPTIONS before a JSON POST or an authorized GET from an allowed origin."""
        asked = request.headers.get("Access-Control-Request-Headers", "")
        # the headers the page's client asked for (openai-node adds X-Stainless-*), when they are names
        allowed = (
            asked
            if len(asked) <= 1024 and _HEADER_NAMES.fullmatch(asked)
            else "Authorization, Content-Type, X-Session-Id"
        )
        return web.Response(
            status=204,
            headers={
                "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
                "Access-Control-Allow-Headers": allowed or "Authorization, Content-Type, X-Session-Id",
                "Access-Control-Max-Age": "600",
            },
        )

    async def _cors_headers(self, request: web.Request, response: web.StreamResponse) -> None:
        """Every answer to an allowed origin says so (errors too: a page reads why it was refused)."""
        origin = self._cors_origin(request)
        if origin is not None:
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Access-Control-Expose-Headers"] = "X-Session-Id"
            response.headers.add("Vary", "Origin")

    def _host_allowed(self, header: str) -> bool:
        name = header.strip().lower()
        if name.startswith("["):  # [v6]:port
            name = name[1:].partition("]")[0]
        elif name.count(":") == 1:
            name = name.partition(":")[0]
        if name in ("localhost", "localhost.") or name.endswith(".localhost") or name in self.limits.allowed_hosts:
            return True
        try:
            ipaddress.ip_address(name)  # an address literal: no name a page's owner could rebind
        except ValueError:
            return False
        return True

    # --- who calls, and their slots -----------------------------------------------------------

    def principal(self, request: web.Request) -> str:
        sec = self.security
        if not sec.authenticated:
            return ANONYMOUS
        principal = None
        if sec.tokens is not None:
            value = request.headers.get("Authorization", "")
            principal = sec.tokens.principal(value[len("Bearer ") :]) if value.startswith("Bearer ") else None
        else:
            tls = request.transport.get_extra_info("ssl_object") if request.transport else None
            if tls is not None and tls.session_reused and self._tls_reloads:
                # a TLS 1.2 session resumed from before a certificate change was not checked against
                # the current client CA: a new handshake is
                raise HttpError(
                    401, "a resumed TLS session from before a certificate change: reconnect", code="invalid_api_key"
                )
            cert = request.transport.get_extra_info("peercert") if request.transport else None
            for rdn in (cert or {}).get("subject", ()):
                for key, value in rdn:
                    if key == "commonName" and principal is None:  # the first, as gRPC's x509_common_name
                        principal = value
        if principal is None or not principal.strip():  # a certificate without a name is no credential
            raise HttpError(
                401,
                "no valid credentials: send Authorization: Bearer <token>, or a client certificate with a common name",
                code="invalid_api_key",
            )
        return principal

    @contextlib.contextmanager
    def slot(self, principal: str):
        """One of the endpoint's requests in flight, counted globally and for its principal, taken once
        its body is whole (a body on its way holds a place of `bodies` instead: a slow sender holds
        no slot another caller could use)."""
        refusal = self._slot_refusal(principal)
        if refusal is not None:
            raise refusal
        self.in_flight += 1
        self.in_flight_by_principal[principal] = self.in_flight_by_principal.get(principal, 0) + 1
        try:
            yield
        finally:
            self.in_flight -= 1
            left = self.in_flight_by_principal[principal] - 1
            if left:
                self.in_flight_by_principal[principal] = left
            else:
                del self.in_flight_by_principal[principal]

    def _slot_refusal(self, principal: str) -> HttpError | None:
        """The 429 a new request of `principal` gets now, or None when a slot is free for it."""
        if self.in_flight >= self.max_in_flight:
            return HttpError(
                429, f"this worker serves at most {self.max_in_flight} requests at once (serve --max-concurrent-rpcs)"
            )
        mine = self.in_flight_by_principal.get(principal, 0)
        if mine >= self.max_in_flight_per_principal:
            return HttpError(
                429,
                f"this caller has {mine} requests in flight here, its most (serve --http-max-requests-per-principal)",
            )
        return None

    async def read_json(self, request: web.Request, principal: str) -> dict:
        """The request's JSON object: its length checked before it is read, read within the body
        timeout while it holds a place of `bodies` (the caller's and the memory's), parsed with its
        depth bounded by Python's recursion limit (a 400, not a 500)."""
        if self.stopping():
            raise HttpError(503, "the worker is shutting down")
        if request.content_length is not None and request.content_length > self.max_body_bytes:
            raise self.too_large()
        try:
            with self.bodies.reading(request.remote, principal, request.content_length):
                raw = await asyncio.wait_for(request.read(), self.limits.body_timeout_s)
        except asyncio.TimeoutError:
            raise HttpError(
                408,
                f"the request body did not arrive within {self.limits.body_timeout_s:g} s (serve --http-body-timeout)",
                close=True,
            ) from None
        except ConnectionError:  # the client went away mid-body: nothing to answer, nothing to log
            raise HttpError(400, "the connection closed before the body arrived", close=True) from None
        try:
            body = json.loads(raw)
            json.dumps(body, ensure_ascii=False).encode("utf-8")  # "\ud800" escapes decode to lone surrogates
        except RecursionError:
            raise HttpError(400, "the body is JSON nested too deep") from None
        except (ValueError, UnicodeError) as e:
            raise HttpError(400, f"the body is not JSON of valid Unicode: {e}") from None
        if not isinstance(body, dict):
            raise HttpError(400, "the body must be a JSON object")
        return body
