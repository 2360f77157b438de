"""The OpenAI-compatible HTTP endpoint of a head worker (`serve --http-port P`): /v1/chat/completions,
/v1/completions, /v1/models and /health.

Each request becomes a Generate stream of this head's own loop (`GenerationLoops.open`, in process):
the same checks, sampling, admission and limits as the gRPC `Generate`, on the route the head's
`--peer` flags give in order. A request carries the whole conversation; the head continues the
caller's own session that holds the longest common token prefix (or the one `X-Session-Id` names),
so a chat's next turn computes only its new tokens.

Why aiohttp: one well-kept library gives the HTTP/1.1 server, streamed responses (server-sent
events), a bound on the request body (413 before it is read in full) and TLS through `ssl`, on one
event loop thread beside gRPC's pool; no second server process or ASGI adapter to run.

Invariants: nothing a client sends reaches llama.cpp unchecked (every parameter is checked here,
then again by `GenerationLoops`); every error is OpenAI's JSON shape with its status; a closed
connection cancels its stream before the next step (the session's KV stays for the next turn).
A request is refused by what it costs before it costs it: its connection is counted and timed from
accept (`guard`); its body is read holding a place bounded in memory and per caller (`bodies`),
and its in-flight slot (global and per principal) is taken once the body is whole; a body longer
than the context could hold as tokens is refused by its length before it is read; rendering and
tokenizing run on a bounded pool off the event loop, their output bounded."""
from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import ipaddress
import json
import re
import ssl
import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from aiohttp import HttpVersion11, web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..._native import SamplingParams, json_schema_to_grammar
from ...errors import InvalidInputError
from ...proto import shard_pb2 as pb
from ...proto.requests import MAX_STOP_TOKENS, check_grammar
from ...worker.security import ANONYMOUS, ServerSecurity, file_mtimes
from ..generation import GenerationLoops, Refusal, RefusalReason, Stream
from .bodies import MAX_BODY_BYTES, BodyReaders
from .chat_template import ModelChat
from .errors import HttpError, outcome_status, refusal_error
from .guard import ConnectionGuard, HttpLimits
from .requests import INT32_MAX, PARAM_NAMES, check_keys, flag, generate_request, number, output_schema
from .responses import CompletionFormat, StopTrimmer
from .tool_calls import ToolCallStream, ToolRequest, history_message, parse_calls, template_renders_tools

#: room in a body for what is not prompt text (parameters, JSON syntax, the template's own text)
BODY_OVERHEAD_BYTES = 64 * 2**10
#: renders and tokenizations at once: one core at most for text that may yet be refused (the
#: compute threads keep the others); each holds a prompt's text and tokens, more would only queue
TOKENIZE_THREADS = 1
#: characters of a long prompt tokenized first: text that makes more tokens than the context from
#: its start alone is refused without tokenizing the rest
PROBE_CHARS_PER_TOKEN = 8
#: a message's role: a name, never text the tokenizer could read as a turn marker
ROLE = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,31}")
#: a preflight's Access-Control-Request-Headers: header names, comma-separated (at most 1 KiB)
_HEADER_NAMES = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+(\s*,\s*[A-Za-z0-9!#$%&'*+.^_`|~-]+)*", re.ASCII)
#: the session ids the endpoint gives new conversations begin with this
NEW_SESSION_PREFIX = "oai-"


class _LoopEvents:
    """A stream's events handed from the head's group threads to the endpoint's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.queue = loop, asyncio.Queue()

    def put(self, event: pb.GenerateEvent) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the endpoint's loop has closed (shutdown): nobody reads this stream
            pass


# --- the endpoint -----------------------------------------------------------------------------------

class OpenAIEndpoint:
    """The HTTP server of one head worker, on its own event loop thread."""

    def __init__(self, generation: GenerationLoops, model, security: ServerSecurity, host: str, port: int,
                 max_in_flight: int, limits: HttpLimits = HttpLimits(),
                 split_special_tokens: bool = False, chat_template: str | None = None, registry=None):
        # what the endpoint uses of its worker: the head's generation loop (its whole interface to the
        # route), the model (tokenizer, template, vocabulary) and the worker's security (TLS, principals)
        self.generation, self.model, self.security = generation, model, security
        self.host, self.port = host, port
        # the route's health (replicas.Replicas.health: SERVING, or the stage with no healthy replica);
        # None: this head holds the whole model. Requests go down the head's own route (forward empty).
        self.route_health = None
        self.limits = limits
        self.max_in_flight, self.in_flight = max_in_flight, 0
        # one principal may hold all slots of a node it has to itself (no authentication: one principal),
        # half of them where tenants share it
        self.max_in_flight_per_principal = limits.max_in_flight_per_principal or (
            max(1, max_in_flight // 2) if security.authenticated else max_in_flight)
        self.in_flight_by_principal: dict[str, int] = {}
        # a body that could not fit the context as tokens is refused by its length: text bytes never
        # exceed the body's (JSON escapes are longer than what they stand for), a token covers at most
        # the vocabulary's longest token's bytes
        self.max_token_bytes = _longest_token_bytes(model)
        self.max_body_bytes = min(MAX_BODY_BYTES, generation.context_tokens * self.max_token_bytes
                                  + BODY_OVERHEAD_BYTES)
        # bodies on their way in: bounded in memory and per caller (an address without authentication)
        self.bodies = BodyReaders(limits, self.max_body_bytes, self.max_in_flight_per_principal,
                                  security.authenticated)
        self._tokenizer_pool = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="http-tokenize")
        self.split_special_tokens = split_special_tokens  # message text never parsed as special tokens
        self.model_id = Path(model.path).name.removesuffix(".gguf")
        self.created = int(time.time())
        self.eog = list(model.eog_tokens)
        # the CLI's --chat and the demo render conversations the same way (with the GGUF's template)
        self.chat = ModelChat(model, chat_template)
        self.registry = registry  # the worker's Prometheus registry, served at /metrics too
        self.bos_text, self.template = self.chat.bos_text, self.chat.template
        self._pieces: OrderedDict[int, str] = OrderedDict()
        self.loop: asyncio.AbstractEventLoop | None = None
        self._tls_reloads = 0  # certificate sets loaded since start (see _ssl_context)
        self._runner: web.AppRunner | None = None
        self._listener: asyncio.AbstractServer | None = None
        self.guard: ConnectionGuard | None = None
        self._thread: threading.Thread | None = None

    # --- life ---------------------------------------------------------------------------------

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
                    state["failed"] = now  # a half-written file: keep the last good context, read it again once it changes
            if conn.context is not state["ctx"]:
                conn.context = state["ctx"]

        state["ctx"] = load()
        return state["ctx"]

    @property
    def scheme(self) -> str:
        return "https" if self.security.tls_cert else "http"

    def start(self) -> "OpenAIEndpoint":
        """Binds the port (OSError when it cannot) and serves on a thread of its own."""
        self.loop = asyncio.new_event_loop()
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[self._errors])
        app.on_response_prepare.append(self._cors_headers)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/v1/models/{model_id}", self._model)
        app.router.add_post("/tokenize", self._tokenize_route, expect_handler=self._expect)
        app.router.add_post("/detokenize", self._detokenize_route, expect_handler=self._expect)
        app.router.add_post("/apply-template", self._apply_template, expect_handler=self._expect)
        app.router.add_get("/props", self._props)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/chat/completions", self._chat, expect_handler=self._expect)
        app.router.add_post("/v1/completions", self._completions, expect_handler=self._expect)
        # aiohttp's own keep-alive timer covers a connection that sends nothing; the guard the rest
        self._runner = web.AppRunner(app, handle_signals=False, access_log=None,
                                     keepalive_timeout=self.limits.idle_timeout_s)

        async def setup() -> int:
            await self._runner.setup()
            # the guard, not aiohttp's site, accepts: it counts a connection before its TLS handshake
            self.guard = ConnectionGuard(asyncio.get_running_loop(), self._runner.server, self.limits,
                                         self._ssl_context())
            self._listener = await asyncio.get_running_loop().create_server(
                self.guard, self.host, self.port, backlog=128, reuse_address=True)
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
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)

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
            return self._too_large().response()
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

    async def _expect(self, request: web.Request) -> web.StreamResponse | None:
        """`Expect: 100-continue` (curl's for a large body): what needs no body is checked before the
        client is told to send it (aiohttp's own handler says "continue" first)."""
        if request.version != HttpVersion11:
            return None
        if request.headers.get("Expect", "").lower() != "100-continue":
            return HttpError(417, f"unknown Expect: {request.headers.get('Expect', '')[:64]}").response()
        try:
            self._check_browser(request)
            principal = self._principal(request)
            if request.content_length is not None and request.content_length > self.max_body_bytes:
                raise self._too_large()
            refusal = (self.bodies.refusal(request.remote, principal, request.content_length)
                       or self._slot_refusal(principal))
            if refusal is not None:
                raise refusal
        except HttpError as e:
            response = e.response()
            response.force_close()  # the body was never asked for
            return response
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # as aiohttp's own handler: the response has not begun
        return None

    def _too_large(self) -> HttpError:
        return HttpError(413, f"the request body is over {self.max_body_bytes} bytes: more than this worker's context "
                              f"({self.generation.context_tokens} tokens) can hold",
                         code="context_length_exceeded")

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
            raise HttpError(403, f"the Host header {str(host)[:64]!r} does not name this worker; an operator can allow "
                                 "a name with serve --http-allowed-host", code="host_not_allowed")

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
        allowed = (asked if len(asked) <= 1024 and _HEADER_NAMES.fullmatch(asked)
                   else "Authorization, Content-Type, X-Session-Id")
        return web.Response(status=204, headers={
            "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
            "Access-Control-Allow-Headers": allowed or "Authorization, Content-Type, X-Session-Id",
            "Access-Control-Max-Age": "600"})

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

    def _principal(self, request: web.Request) -> str:
        sec = self.security
        if not sec.authenticated:
            return ANONYMOUS
        principal = None
        if sec.tokens is not None:
            value = request.headers.get("Authorization", "")
            principal = sec.tokens.principal(value[len("Bearer "):]) if value.startswith("Bearer ") else None
        else:
            tls = request.transport.get_extra_info("ssl_object") if request.transport else None
            if tls is not None and tls.session_reused and self._tls_reloads:
                # a TLS 1.2 session resumed from before a certificate change was not checked against
                # the current client CA: a new handshake is
                raise HttpError(401, "a resumed TLS session from before a certificate change: reconnect",
                                code="invalid_api_key")
            cert = request.transport.get_extra_info("peercert") if request.transport else None
            for rdn in (cert or {}).get("subject", ()):
                for key, value in rdn:
                    if key == "commonName" and principal is None:  # the first, as gRPC's x509_common_name
                        principal = value
        if principal is None or not principal.strip():  # a certificate without a name is no credential
            raise HttpError(401, "no valid credentials: send Authorization: Bearer <token>, or a client "
                                 "certificate with a common name", code="invalid_api_key")
        return principal

    async def _health(self, request: web.Request) -> web.Response:
        if self.generation.stopping:
            raise HttpError(503, "the worker is shutting down")
        if self.route_health is not None:
            ok, detail = self.route_health()
            if not ok:
                raise HttpError(503, f"the route cannot serve: {detail}", code="route_unavailable")
        return web.json_response({"status": "ok"})

    async def _models(self, request: web.Request) -> web.Response:
        self._principal(request)
        return web.json_response({"object": "list", "data": [
            {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "llama-shard"}]})

    async def _model(self, request: web.Request) -> web.Response:
        self._principal(request)
        name = request.match_info["model_id"]
        if name not in (self.model_id, Path(self.model.path).name):
            raise HttpError(404, f"the model {name[:80]!r} does not exist here; this route serves {self.model_id!r}",
                            "model", "model_not_found")
        return web.json_response({"id": self.model_id, "object": "model", "created": self.created,
                                  "owned_by": "llama-shard"})

    async def _tokenize_route(self, request: web.Request) -> web.Response:
        """llama-server's /tokenize: {"content", "add_special" (false), "with_pieces" (false)} ->
        {"tokens": [id, ...]} or [{"id", "piece"}, ...]: what a prompt costs against the context."""
        principal = self._principal(request)
        body = await self._body(request, principal)
        with self._slot(principal):
            content = body.get("content")
            if not isinstance(content, str):
                raise HttpError(400, "content must be a string", "content")
            add_special, with_pieces = flag(body, "add_special"), flag(body, "with_pieces")
            tokens = await self._off_loop(lambda: self.model.tokenize(content, add_special=add_special))
            if not with_pieces:
                return web.json_response({"tokens": tokens})
            pieces = await self._off_loop(lambda: [self.model.detokenize([t]) for t in tokens])
            return web.json_response({"tokens": [{"id": t, "piece": p} for t, p in zip(tokens, pieces)]})

    async def _detokenize_route(self, request: web.Request) -> web.Response:
        """llama-server's /detokenize: {"tokens": [id, ...]} -> {"content"}."""
        principal = self._principal(request)
        body = await self._body(request, principal)
        with self._slot(principal):
            tokens = body.get("tokens")
            n_vocab = self.model.info.n_vocab
            if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) and
                                                       0 <= t < n_vocab for t in tokens):
                raise HttpError(400, f"tokens must be a list of token ids (0..{n_vocab - 1})", "tokens")
            return web.json_response({"content": await self._off_loop(self.model.detokenize, tokens)})

    @contextlib.contextmanager
    def _slot(self, principal: str):
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
            return HttpError(429, f"this worker serves at most {self.max_in_flight} requests at once "
                                  "(serve --max-concurrent-rpcs)")
        mine = self.in_flight_by_principal.get(principal, 0)
        if mine >= self.max_in_flight_per_principal:
            return HttpError(429, f"this caller has {mine} requests in flight here, its most "
                                  "(serve --http-max-requests-per-principal)")
        return None

    async def _body(self, request: web.Request, principal: str) -> dict:
        """The request's JSON object: its length checked before it is read, read within the body
        timeout while it holds a place of `bodies` (the caller's and the memory's), parsed with its
        depth bounded by Python's recursion limit (a 400, not a 500)."""
        if self.generation.stopping:
            raise HttpError(503, "the worker is shutting down")
        if request.content_length is not None and request.content_length > self.max_body_bytes:
            raise self._too_large()
        try:
            with self.bodies.reading(request.remote, principal, request.content_length):
                raw = await asyncio.wait_for(request.read(), self.limits.body_timeout_s)
        except asyncio.TimeoutError:
            raise HttpError(408, f"the request body did not arrive within {self.limits.body_timeout_s:g} s "
                                 "(serve --http-body-timeout)", close=True) from None
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
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise HttpError(400, "model must be a string", "model")
        if model and model not in (self.model_id, Path(self.model.path).name):
            raise HttpError(404, f"the model {model!r} does not exist here; this route serves {self.model_id!r}",
                            "model", "model_not_found")
        n = number(body, "n", 1, 1 << 20, integer=True)
        if n is not None and n != 1:
            raise HttpError(400, "n must be 1: a route generates one choice per request", "n")
        return body

    async def _off_loop(self, fn, *args):
        """A render or tokenization on the bounded pool (the event loop serves other clients meanwhile)."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, fn, *args)

    # --- the two generation endpoints ---------------------------------------------------------

    def _messages(self, body: dict) -> list[dict]:
        """The request's messages as the template reads them (a 400 naming `messages` otherwise)."""
        if self.template is None:
            raise HttpError(400, "this model has no chat template (tokenizer.chat_template): use /v1/completions",
                            "messages")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise HttpError(400, "messages must be a non-empty list", "messages")
        rendered = []
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise HttpError(400, "each message must be an object with a string role", "messages")
            if not ROLE.fullmatch(m["role"]):  # a role is the template's word, never a turn marker of its own
                raise HttpError(400, "a message's role must be a name (a letter, then up to 31 letters, digits, _ or -)",
                                "messages")
            content = m.get("content")
            if isinstance(content, list):  # content parts: text only
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in content):
                    raise HttpError(400, "only text content parts are supported", "messages")
                content = "".join(p["text"] for p in content)
            if content is None:
                content = ""
            if not isinstance(content, str):
                raise HttpError(400, "a message's content must be a string or a list of text parts", "messages")
            rendered.append(history_message(m, m["role"], content))
        return rendered

    def _tools(self, body: dict) -> ToolRequest | None:
        """The request's tools, None when it has none or `tool_choice` is none (a 400 for a template
        that renders no tools)."""
        tools = ToolRequest(body) if "tools" in body or "tool_choice" in body else None
        if tools is not None and tools.choice == "none":
            return None  # as OpenAI: the model answers in text (the tools are not rendered)
        if tools is not None and not template_renders_tools(self.chat.source):
            raise HttpError(400, "this model's chat template does not render tools as <tool_call> blocks; start "
                                 "the worker with --chat-template-file holding one that does", "tools")
        return tools

    async def _apply_template(self, request: web.Request) -> web.Response:
        """llama-server's /apply-template: {"messages", "tools"?} -> {"prompt"}: the text a chat request
        with these messages would generate from (before tokenization)."""
        principal = self._principal(request)
        body = await self._body(request, principal)
        with self._slot(principal):
            unknown = sorted(set(body) - {"messages", "tools", "tool_choice", "parallel_tool_calls", "model"})
            if unknown:
                raise HttpError(400, f"unrecognized request argument: {unknown[0][:64]!r}", unknown[0][:64])
            rendered, tools = self._messages(body), self._tools(body)
            listed = tools.tools if tools is not None else None
            return web.json_response({"prompt": await self._off_loop(lambda: self.chat.text(rendered, tools=listed))})

    async def _props(self, request: web.Request) -> web.Response:
        """llama-server's /props: what a client asks before it sends (the context, the template, the
        slots, the special tokens)."""
        self._principal(request)
        model = self.model
        return web.json_response({
            "model_alias": self.model_id, "model_path": Path(model.path).name,
            "n_ctx": self.generation.context_tokens, "total_slots": self.max_in_flight,
            "chat_template": self.chat.source or "",
            "bos_token": self.bos_text, "eos_token": model.detokenize([model.token_eos]) if model.token_eos >= 0 else "",
            "default_generation_settings": {"n_ctx": self.generation.context_tokens, "params": _default_params()},
            "build_info": f"llama-shard {_version()}"})

    async def _metrics(self, request: web.Request) -> web.Response:
        """The worker's Prometheus metrics (as --metrics-port serves them), behind the port's auth."""
        self._principal(request)
        if self.registry is None:
            raise HttpError(404, "this worker keeps no metrics")
        data = await self._off_loop(generate_latest, self.registry)
        return web.Response(body=data, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        principal = self._principal(request)
        body = await self._body(request, principal)
        with self._slot(principal):
            return await self._chat_in_slot(request, principal, body)

    async def _chat_in_slot(self, request: web.Request, principal: str, body: dict) -> web.StreamResponse:
        check_keys(body, "chat")
        rendered = self._messages(body)
        top = number(body, "top_logprobs", 0, INT32_MAX, integer=True) or 0
        logprobs = flag(body, "logprobs")
        if top and not logprobs:
            raise HttpError(400, "top_logprobs needs logprobs: true", "top_logprobs")

        tools = self._tools(body)

        def prompt_tokens() -> list[int]:
            listed = tools.tools if tools is not None else None
            if self.split_special_tokens:
                return self._tokenize_split(rendered, listed)
            return self._tokenize(self.chat.text(rendered, tools=listed))

        tokens = await self._off_loop(prompt_tokens)
        return await self._generate(request, principal, body, tokens, chat=True, logprobs=logprobs, top=top,
                                    param_names={}, tools=tools)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        principal = self._principal(request)
        body = await self._body(request, principal)
        with self._slot(principal):
            return await self._completions_in_slot(request, principal, body)

    async def _completions_in_slot(self, request: web.Request, principal: str, body: dict) -> web.StreamResponse:
        check_keys(body, "completions")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # one prompt in a list
        if isinstance(prompt, str):
            tokens = await self._off_loop(self._tokenize, prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            n_vocab = self.model.info.n_vocab
            if not all(0 <= t < n_vocab for t in prompt):
                raise HttpError(400, f"a prompt token is outside the vocabulary (0..{n_vocab - 1})", "prompt")
            tokens = self._fits_context(list(prompt))
        else:
            raise HttpError(400, "prompt must be a string or a list of token ids (one prompt per request)", "prompt")
        for name in ("echo", "suffix"):
            if body.get(name):
                raise HttpError(400, f"{name} is not supported", name)
        best_of = number(body, "best_of", 1, 1 << 20, integer=True)
        if best_of not in (None, 1):
            raise HttpError(400, "best_of must be 1", "best_of")
        top = number(body, "logprobs", 0, INT32_MAX, integer=True)
        return await self._generate(request, principal, body, tokens, chat=False, logprobs=top is not None,
                                    top=top or 0, param_names={"top_logprobs": "logprobs"})

    def _tokenize(self, text: str) -> list[int]:
        context = self.generation.context_tokens
        try:
            probe = PROBE_CHARS_PER_TOKEN * context
            if len(text) > 2 * probe:  # a start that alone overflows the context ends it (a few tokens' slack
                # for the cut: the start's tokens are the whole text's but for the last few)
                n = len(self.model.tokenize(text[:probe]))
                if n > context + 8:
                    raise HttpError(400, f"the prompt is over {n - 8} tokens from its first {probe} characters; a "
                                         f"session here holds {context}", "prompt", "context_length_exceeded")
            tokens = self.model.tokenize(text)
        except InvalidInputError as e:
            raise HttpError(400, str(e), "prompt") from None
        if not tokens:
            raise HttpError(400, "the prompt is empty", "prompt")
        return self._fits_context(tokens)

    def _tokenize_split(self, messages: list[dict], tools: list | None = None) -> list[int]:
        """`--http-split-special-tokens`: a message's text is plain text (transformers'
        split_special_tokens), so a caller's `<|im_end|>` is those characters, never the turn marker;
        the template's own text keeps its special tokens. Only a message whose text holds special-token
        text tokenizes differently: the rendered prompt is found to hold that text verbatim (in order)
        and is cut around it, the cuts tokenized with special tokens parsed, the text without. A prompt
        without such text is tokenized in one piece, exactly as without the option. A template that
        changes such a text (trims, splits it) is refused: its marks could not be told from the text."""
        model = self.model
        # what the template renders besides the messages' text (tools, calls, a tool's name) is not cut
        # out as plain text: it may not hold special-token text at all
        for param, values in (("tools", [json.dumps(t, ensure_ascii=False) for t in tools or []]),
                              ("messages", [json.dumps([m.get("tool_calls"), m.get("name")], ensure_ascii=False)
                                            for m in messages if "tool_calls" in m or "name" in m])):
            for value in values:
                if model.tokenize(value, add_special=False, parse_special=True) != \
                        model.tokenize(value, add_special=False, parse_special=False):
                    raise HttpError(400, "with --http-split-special-tokens, tools and tool calls may not hold "
                                         "special-token text", param)
        text = self.template.render(messages, tools=tools)
        if self.bos_text and text.startswith(self.bos_text):
            text = text[len(self.bos_text):]
        plain = []  # (start, end) of each message text that holds special-token text
        at = 0
        try:
            for m in messages:
                content = m["content"]
                if not content or model.tokenize(content, add_special=False, parse_special=True) == \
                        model.tokenize(content, add_special=False, parse_special=False):
                    continue
                found = text.find(content, at)
                if found < 0:
                    raise HttpError(400, "with --http-split-special-tokens a message's text that holds special-token "
                                         "text must appear in the rendered prompt as it was sent; this template "
                                         "changes it", "messages")
                plain.append((found, found + len(content)))
                at = found + len(content)
            if not plain:
                return self._tokenize(text)
            tokens, at = [], 0
            for begin, end in plain:
                if at < begin or not tokens:
                    tokens += model.tokenize(text[at:begin], add_special=not tokens, parse_special=True)
                tokens += model.tokenize(text[begin:end], add_special=False, parse_special=False)
                at = end
            if at < len(text):
                tokens += model.tokenize(text[at:], add_special=False, parse_special=True)
        except InvalidInputError as e:
            raise HttpError(400, str(e), "messages") from None
        return self._fits_context(tokens)

    def _fits_context(self, tokens: list[int]) -> list[int]:
        context = self.generation.context_tokens
        if len(tokens) >= context:
            raise HttpError(400, f"the prompt is {len(tokens)} tokens; a session here holds {context}, the prompt "
                                 "and at least one generated token", "prompt", "context_length_exceeded")
        return tokens

    def _piece(self, token: int) -> str:
        """One token's own text (for logprobs), remembered."""
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = self.model.detokenize([token])
            if len(self._pieces) > 4096:
                self._pieces.popitem(last=False)
        return piece

    def _session(self, request: web.Request, principal: str, tokens: list[int]) -> tuple[str, int]:
        """The caller's session to continue: the one X-Session-Id names, else the principal's session
        (no stream running) holding the longest common prefix of these tokens, else a new one; a
        caller at its session cap (--max-sessions-per-principal) takes over its least recently used
        endpoint session instead (the route truncates it to what the prompts share), so new
        conversations do not wait for a TTL."""
        pinned = request.headers.get("X-Session-Id")
        if pinned is not None:
            if not 0 < len(pinned) <= 128 or not pinned.isprintable() or not pinned.isascii():
                raise HttpError(400, "X-Session-Id must be 1 to 128 printable ASCII characters", "X-Session-Id")
            return pinned, 0
        found = self.generation.session_to_continue(principal, tokens, NEW_SESSION_PREFIX)
        return found if found is not None else (f"{NEW_SESSION_PREFIX}{uuid.uuid4().hex}", 0)

    async def _generate(self, request: web.Request, principal: str, body: dict, tokens: list[int], *, chat: bool,
                        logprobs: bool, top: int, param_names: dict[str, str],
                        tools: ToolRequest | None = None) -> web.StreamResponse:
        """Runs the request as a stream of the head's loop and answers it, streamed or whole."""
        stream_it = flag(body, "stream")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise HttpError(400, "stream_options must be an object", "stream_options")
        include_usage = flag(options, "include_usage")
        user = body.get("user")
        if user is not None and not isinstance(user, str):
            raise HttpError(400, "user must be a string", "user")
        req = generate_request(body, tokens, self.generation.context_tokens, self.eog[:MAX_STOP_TOKENS],
                               logprobs=logprobs, top=top)
        schema = output_schema(body)
        if schema is not None:  # llama.cpp's converter, on the tokenizer pool (a schema may take a while)
            try:
                req.sampling.grammar = await self._off_loop(json_schema_to_grammar, schema)
            except InvalidInputError as e:
                raise HttpError(400, f"response_format: {e}", "response_format") from None
            param_names = param_names | {"grammar": "response_format"}
        if tools is not None and tools.choice == "required":  # every answer a call: a grammar of the calls
            if req.sampling.grammar:
                raise HttpError(400, "tool_choice required (or a named function) takes no grammar or "
                                     "response_format of its own", "tool_choice")
            try:
                call = await self._off_loop(json_schema_to_grammar, json.dumps(tools.call_schema()))
            except InvalidInputError as e:
                raise HttpError(400, f"tools: a tool's parameters: {e}", "tools") from None
            req.sampling.grammar = tools.grammar(call)
            param_names = param_names | {"grammar": "tools"}
        if req.sampling.grammar:  # llama.cpp's parser on the pool, not the event loop (the loop's check then
            # finds its verdict kept)
            try:
                await self._off_loop(check_grammar, SamplingParams(grammar=req.sampling.grammar), self.model)
            except InvalidInputError as e:
                raise HttpError(400, str(e), param_names.get("grammar", "grammar")) from None
        req.session_id, req.route_epoch = self._session(request, principal, tokens)
        events = _LoopEvents(asyncio.get_running_loop())
        stream = self._open(request, principal, req, events, param_names)
        fmt = CompletionFormat(f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time()),
                               self.model_id, chat, self._piece, self.model.token_bytes)
        started: list[web.StreamResponse] = []  # a streamed answer once its headers are sent
        try:
            if stream_it:
                return await self._streamed(request, req, stream, events, fmt, include_usage, started, tools)
            return await self._whole(request, req, stream, events, fmt, tools is not None)
        except ConnectionError:  # the client went away mid-stream: its stream stops at the next step
            stream.cancel("the client closed the connection")
            return started[0] if started else None
        except asyncio.CancelledError:
            stream.cancel("the client closed the connection")
            raise
        finally:
            stream.cancel("the request ended")  # a no-op once the stream is done

    def _open(self, request: web.Request, principal: str, req: pb.GenerateRequest, events,
              param_names: dict[str, str]) -> Stream:
        """The request's running stream; the refusal's HttpError otherwise."""
        stream = self.generation.open(principal, req, None, events=events)
        if isinstance(stream, Refusal) and stream.reason is RefusalReason.SESSION_BUSY \
                and request.headers.get("X-Session-Id") is None:
            # another request took it first: choose again (that one is now running, so not it)
            req.session_id, req.route_epoch = self._session(request, principal, list(req.prompt))
            stream = self.generation.open(principal, req, None, events=events)
        if isinstance(stream, Refusal):
            raise refusal_error(stream, PARAM_NAMES | param_names)
        return stream

    @staticmethod
    def _client_text(req: pb.GenerateRequest):
        """What a client reads of each token event: (text, logprob items or None), text held back
        where a stop sequence may begin and never including one."""
        trimmer = StopTrimmer(list(req.stop))
        stop_ids = set(req.stop_token_ids)
        want_logprobs = req.logprobs or req.top_logprobs

        def read(tok: pb.GeneratedToken) -> tuple[str, list | None]:
            text = "" if tok.token_id in stop_ids else trimmer.feed(tok.piece)
            return text, ([(tok.token_id, tok.logprob, list(tok.top_logprobs))] if want_logprobs else None)
        return trimmer, read

    @staticmethod
    def _finish_reason(final: pb.GenerateFinal, streamed: bool) -> str | HttpError:
        """OpenAI's finish_reason for a stream's end, or the error to answer instead."""
        if final.finish_reason in ("stop", "length"):
            return final.finish_reason
        if final.finish_reason == "error" or not streamed:
            where = f" (stage {final.stage})" if final.stage else ""
            return HttpError(outcome_status(final.outcome), f"generation failed{where}: {final.detail}")
        return "length"  # cancelled or shutdown while streaming: ended as OpenAI ends a cut stream

    async def _streamed(self, request: web.Request, req: pb.GenerateRequest, stream: Stream, events,
                        fmt: CompletionFormat, include_usage: bool, started: list,
                        tools: ToolRequest | None = None) -> web.StreamResponse:
        """Server-sent events: a chunk per token (its text empty while held back), the final chunk,
        usage when asked, [DONE]; an error after the first byte is an error event."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               "X-Session-Id": req.session_id})
        await response.prepare(request)
        started.append(response)

        async def send(obj: dict) -> None:
            await self._write(request, response, b"data: " + json.dumps(obj).encode() + b"\n\n")
        if fmt.chat:
            await send(fmt.first_chunk())
        trimmer, read = self._client_text(req)
        # under the grammar of the calls (required, a named function) arguments stream as written
        calls = ToolCallStream(progressive=tools.choice == "required") if tools is not None else None
        while True:
            event = await events.queue.get()
            if event.HasField("final"):
                break
            if request.transport is None or request.transport.is_closing():
                stream.cancel("the client closed the connection")  # also without a write to fail
            text, lp = read(event.token)
            if calls is None:
                await send(fmt.chunk(text, None, lp))
                continue
            text, deltas = calls.feed(text)
            if text or lp is not None:  # no empty content between calls' deltas (a token's logprobs go out)
                await send(fmt.chunk(text or None, None, lp))
            for delta in deltas:
                await send(fmt.tool_chunk(delta))
        final = event.final
        finish = self._finish_reason(final, streamed=True)
        if isinstance(finish, HttpError):
            await send(json.loads(finish.response().body))
            return response
        tail = trimmer.flush() if final.finish_reason != "stop" else ""
        if calls is not None:
            tail, deltas = calls.feed(tail)
            rest, more = calls.flush()
            tail += rest
            for delta in deltas + more:
                await send(fmt.tool_chunk(delta))
            if calls.calls and finish == "stop":
                finish = "tool_calls"
        await send(fmt.chunk(tail or None, finish, None))
        if include_usage:
            await send(fmt.usage_chunk(fmt.usage(final)))
        await self._write(request, response, b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _whole(self, request: web.Request, req: pb.GenerateRequest, stream: Stream, events,
                     fmt: CompletionFormat, with_tools: bool = False) -> web.Response:
        """One JSON answer once the stream has ended (a closed connection is seen at the next token)."""
        trimmer, read = self._client_text(req)
        texts: list[str] = []
        lp_items: list | None = [] if req.logprobs or req.top_logprobs else None
        while True:
            event = await events.queue.get()
            if event.HasField("final"):
                break
            if request.transport is None or request.transport.is_closing():
                stream.cancel("the client closed the connection")
            text, lp = read(event.token)
            texts.append(text)
            if lp:
                lp_items.extend(lp)
        final = event.final
        finish = self._finish_reason(final, streamed=False)
        if isinstance(finish, HttpError):
            raise finish
        tail = trimmer.flush() if final.finish_reason != "stop" else ""
        content, calls = "".join(texts) + tail, []
        if with_tools:
            content, calls = parse_calls(content)
            if calls and finish == "stop":
                finish = "tool_calls"
        return web.json_response(fmt.whole(content, finish, lp_items, fmt.usage(final), calls),
                                 headers={"X-Session-Id": req.session_id})

    async def _write(self, request: web.Request, response: web.StreamResponse, data: bytes) -> None:
        """A stream's write. A client that stops reading is dropped by the guard's sweep once its unsent
        bytes have not shrunk for the write timeout (a slow reader that makes progress is not): the
        pending write then fails (ConnectionError) and the stream stops at the next step."""
        await response.write(data)


def _default_params() -> dict:
    """What a request that sets no sampling parameter gets (the native sampler's defaults), in
    llama-server's names."""
    p = SamplingParams()
    return {"temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p, "min_p": p.min_p,
            "repeat_last_n": p.penalty_last_n, "repeat_penalty": p.penalty_repeat}


def _version() -> str:
    try:
        return importlib.metadata.version("llama-shard")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        return "unknown"


def _longest_token_bytes(model) -> int:
    """The most bytes any token of the model's vocabulary stands for (its text in the GGUF, which is at
    least its bytes: byte-level and SentencePiece spellings are never shorter than what they spell)."""
    from ...engine.models import gguf_token_texts

    texts = gguf_token_texts(model.path)
    return max((len(t.encode("utf-8", "surrogatepass")) for t in texts), default=0) or 256
