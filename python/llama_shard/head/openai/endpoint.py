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
The port, TLS, callers, browsers' rules, bodies and slots are `HttpServer`'s (server.py); a body
longer than the context could hold as tokens is refused by its length before it is read; rendering and
tokenizing run on a bounded pool off the event loop, their output bounded."""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import time
import uuid
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..._native import SamplingParams
from ...errors import InvalidInputError
from ...proto import shard_pb2 as pb
from ...proto.requests import MAX_STOP_TOKENS
from ...structured.checks import check_grammar
from ...structured.schema import grammar_from_schema
from ...worker.security import ServerSecurity
from ..generation import GenerationLoops, Refusal, RefusalReason, Stream
from .answers import streamed, whole
from .bodies import MAX_BODY_BYTES
from .chat_template import ModelChat
from .errors import HttpError, refusal_error
from .guard import HttpLimits
from .prompts import Prompts
from .requests import INT32_MAX, PARAM_NAMES, check_keys, flag, generate_request, number, output_schema
from .responses import CompletionFormat
from .server import HttpServer
from .tool_calls import ToolRequest

#: room in a body for what is not prompt text (parameters, JSON syntax, the template's own text)
BODY_OVERHEAD_BYTES = 64 * 2**10
#: renders and tokenizations at once: one core at most for text that may yet be refused (the
#: compute threads keep the others); each holds a prompt's text and tokens, more would only queue
TOKENIZE_THREADS = 1
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

    def __init__(
        self,
        generation: GenerationLoops,
        model,
        security: ServerSecurity,
        host: str,
        port: int,
        max_in_flight: int,
        limits: HttpLimits = HttpLimits(),
        split_special_tokens: bool = False,
        chat_template: str | None = None,
        registry=None,
    ):
        # what the endpoint uses of its worker: the head's generation loop (its whole interface to the
        # route), the model (tokenizer, template, vocabulary) and the worker's security (TLS, principals)
        self.generation, self.model = generation, model
        # the route's health (replicas.Replicas.health: SERVING, or the stage with no healthy replica);
        # None: this head holds the whole model. Requests go down the head's own route (forward empty).
        self.route_health = None
        self.mesh = None  # the mesh this head plans (head/options.py MeshView): its plan in /props
        # a body that could not fit the context as tokens is refused by its length: text bytes never
        # exceed the body's (JSON escapes are longer than what they stand for), a token covers at most
        # the vocabulary's longest token's bytes
        self.max_token_bytes = _longest_token_bytes(model)
        max_body_bytes = min(MAX_BODY_BYTES, generation.context_tokens * self.max_token_bytes + BODY_OVERHEAD_BYTES)
        self.http = HttpServer(
            security,
            host,
            port,
            limits,
            max_in_flight,
            max_body_bytes,
            f"more than this worker's context ({generation.context_tokens} tokens) can hold",
            lambda: generation.stopping,
        )
        self._tokenizer_pool = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="http-tokenize")
        self.model_id = Path(model.path).name.removesuffix(".gguf")
        self.created = int(time.time())
        self.eog = list(model.eog_tokens)
        # the CLI's --chat and the demo render conversations the same way (with the GGUF's template)
        self.chat = ModelChat(model, chat_template)
        self.registry = registry  # the worker's Prometheus registry, served at /metrics too
        self.prompts = Prompts(model, self.chat, generation.context_tokens, split_special_tokens)
        self._pieces: OrderedDict[int, str] = OrderedDict()

    # --- life ---------------------------------------------------------------------------------

    @property
    def port(self) -> int:
        return self.http.port

    @property
    def scheme(self) -> str:
        return self.http.scheme

    def start(self) -> OpenAIEndpoint:
        """Binds the port (OSError when it cannot) and serves on a thread of its own."""
        self.http.start(self._routes)
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self.http.stop(timeout_s)
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    def _routes(self, app: web.Application) -> None:
        expect = self.http.expect
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/v1/models/{model_id}", self._model)
        app.router.add_post("/tokenize", self._tokenize_route, expect_handler=expect)
        app.router.add_post("/detokenize", self._detokenize_route, expect_handler=expect)
        app.router.add_post("/apply-template", self._apply_template, expect_handler=expect)
        app.router.add_get("/props", self._props)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/chat/completions", self._chat, expect_handler=expect)
        app.router.add_post("/v1/completions", self._completions, expect_handler=expect)

    async def _body(self, request: web.Request, principal: str) -> dict:
        """The request's JSON object (HttpServer.read_json), for this route's model, one choice."""
        body = await self.http.read_json(request, principal)
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise HttpError(400, "model must be a string", "model")
        if model and model not in (self.model_id, Path(self.model.path).name):
            raise HttpError(
                404,
                f"the model {model!r} does not exist here; this route serves {self.model_id!r}",
                "model",
                "model_not_found",
            )
        n = number(body, "n", 1, 1 << 20, integer=True)
        if n is not None and n != 1:
            raise HttpError(400, "n must be 1: a route generates one choice per request", "n")
        return body

    async def _off_loop(self, fn, *args):
        """A render or tokenization on the bounded pool (the event loop serves other clients meanwhile)."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, fn, *args)

    # --- life ---------------------------------------------------------------------------------

    # --- every request ------------------------------------------------------------------------

    # --- CORS (off unless --http-cors-origin names the page's origin) ---------------------------

    async def _health(self, request: web.Request) -> web.Response:
        if self.generation.stopping:
            raise HttpError(503, "the worker is shutting down")
        if self.route_health is not None:
            ok, detail = self.route_health()
            if not ok:
                raise HttpError(503, f"the route cannot serve: {detail}", code="route_unavailable")
        return web.json_response({"status": "ok"})

    async def _models(self, request: web.Request) -> web.Response:
        self.http.principal(request)
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": self.model_id, "object": "model", "created": self.created, "owned_by": "llama-shard"}],
            }
        )

    async def _model(self, request: web.Request) -> web.Response:
        self.http.principal(request)
        name = request.match_info["model_id"]
        if name not in (self.model_id, Path(self.model.path).name):
            raise HttpError(
                404,
                f"the model {name[:80]!r} does not exist here; this route serves {self.model_id!r}",
                "model",
                "model_not_found",
            )
        return web.json_response(
            {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "llama-shard"}
        )

    async def _tokenize_route(self, request: web.Request) -> web.Response:
        """llama-server's /tokenize: {"content", "add_special" (false), "with_pieces" (false)} ->
        {"tokens": [id, ...]} or [{"id", "piece"}, ...]: what a prompt costs against the context."""
        principal = self.http.principal(request)
        body = await self._body(request, principal)
        with self.http.slot(principal):
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
        principal = self.http.principal(request)
        body = await self._body(request, principal)
        with self.http.slot(principal):
            tokens = body.get("tokens")
            n_vocab = self.model.info.n_vocab
            if not isinstance(tokens, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < n_vocab for t in tokens
            ):
                raise HttpError(400, f"tokens must be a list of token ids (0..{n_vocab - 1})", "tokens")
            return web.json_response({"content": await self._off_loop(self.model.detokenize, tokens)})

    # --- the two generation endpoints ---------------------------------------------------------

    async def _apply_template(self, request: web.Request) -> web.Response:
        """llama-server's /apply-template: {"messages", "tools"?} -> {"prompt"}: the text a chat request
        with these messages would generate from (before tokenization)."""
        principal = self.http.principal(request)
        body = await self._body(request, principal)
        with self.http.slot(principal):
            unknown = sorted(set(body) - {"messages", "tools", "tool_choice", "parallel_tool_calls", "model"})
            if unknown:
                raise HttpError(400, f"unrecognized request argument: {unknown[0][:64]!r}", unknown[0][:64])
            rendered, tools = self.prompts.messages(body), self.prompts.tools(body)
            listed = tools.tools if tools is not None else None
            return web.json_response({"prompt": await self._off_loop(lambda: self.chat.text(rendered, tools=listed))})

    async def _props(self, request: web.Request) -> web.Response:
        """llama-server's /props: what a client asks before it sends (the context, the template, the
        slots, the special tokens)."""
        self.http.principal(request)
        model = self.model
        return web.json_response(
            {
                "model_alias": self.model_id,
                "model_path": Path(model.path).name,
                "n_ctx": self.generation.context_tokens,
                "total_slots": self.http.max_in_flight,
                "chat_template": self.chat.source or "",
                "bos_token": self.chat.bos_text,
                "eos_token": model.detokenize([model.token_eos]) if model.token_eos >= 0 else "",
                "default_generation_settings": {"n_ctx": self.generation.context_tokens, "params": _default_params()},
                "build_info": f"llama-shard {_version()}",
                **({"mesh": self._mesh_props()} if self.mesh is not None else {}),
            }
        )

    def _mesh_props(self) -> dict:
        """A mesh's plan as people read it, and each member (serve --mesh-members)."""
        members = [
            {
                "member_id": m.member_id,
                "address": m.address,
                "state": m.state,
                "layers": [m.first, m.last] if m.first >= 0 else None,
                "memory_bytes": m.memory_bytes,
                "layer_ms": round(m.layer_s * 1e3, 4),
                "fetched_bytes": m.fetched_bytes,
            }
            for m in self.mesh.members()
        ]
        return {"plan": self.mesh.describe(), "members": members}

    async def _metrics(self, request: web.Request) -> web.Response:
        """The worker's Prometheus metrics (as --metrics-port serves them), behind the port's auth."""
        self.http.principal(request)
        if self.registry is None:
            raise HttpError(404, "this worker keeps no metrics")
        data = await self._off_loop(generate_latest, self.registry)
        return web.Response(body=data, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        principal = self.http.principal(request)
        body = await self._body(request, principal)
        with self.http.slot(principal):
            return await self._chat_in_slot(request, principal, body)

    async def _chat_in_slot(self, request: web.Request, principal: str, body: dict) -> web.StreamResponse:
        check_keys(body, "chat")
        rendered = self.prompts.messages(body)
        top = number(body, "top_logprobs", 0, INT32_MAX, integer=True) or 0
        logprobs = flag(body, "logprobs")
        if top and not logprobs:
            raise HttpError(400, "top_logprobs needs logprobs: true", "top_logprobs")

        tools = self.prompts.tools(body)

        tokens = await self._off_loop(self.prompts.chat_tokens, rendered, tools)
        return await self._generate(
            request, principal, body, tokens, chat=True, logprobs=logprobs, top=top, param_names={}, tools=tools
        )

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        principal = self.http.principal(request)
        body = await self._body(request, principal)
        with self.http.slot(principal):
            return await self._completions_in_slot(request, principal, body)

    async def _completions_in_slot(self, request: web.Request, principal: str, body: dict) -> web.StreamResponse:
        check_keys(body, "completions")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # one prompt in a list
        if isinstance(prompt, str):
            tokens = await self._off_loop(self.prompts.tokenize, prompt)
        elif (
            isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            tokens = self.prompts.token_ids(prompt)
        else:
            raise HttpError(400, "prompt must be a string or a list of token ids (one prompt per request)", "prompt")
        for name in ("echo", "suffix"):
            if body.get(name):
                raise HttpError(400, f"{name} is not supported", name)
        best_of = number(body, "best_of", 1, 1 << 20, integer=True)
        if best_of not in (None, 1):
            raise HttpError(400, "best_of must be 1", "best_of")
        top = number(body, "logprobs", 0, INT32_MAX, integer=True)
        return await self._generate(
            request,
            principal,
            body,
            tokens,
            chat=False,
            logprobs=top is not None,
            top=top or 0,
            param_names={"top_logprobs": "logprobs"},
        )

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

    async def _generate(
        self,
        request: web.Request,
        principal: str,
        body: dict,
        tokens: list[int],
        *,
        chat: bool,
        logprobs: bool,
        top: int,
        param_names: dict[str, str],
        tools: ToolRequest | None = None,
    ) -> web.StreamResponse:
        """Runs the request as a stream of the head's loop and answers it, streamed or whole."""
        stream_it = flag(body, "stream")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise HttpError(400, "stream_options must be an object", "stream_options")
        include_usage = flag(options, "include_usage")
        user = body.get("user")
        if user is not None and not isinstance(user, str):
            raise HttpError(400, "user must be a string", "user")
        req = generate_request(
            body, tokens, self.generation.context_tokens, self.eog[:MAX_STOP_TOKENS], logprobs=logprobs, top=top
        )
        schema = output_schema(body)
        if schema is not None:  # llama.cpp's converter, on the tokenizer pool (a schema may take a while)
            try:
                req.sampling.grammar = await self._off_loop(grammar_from_schema, schema)
            except InvalidInputError as e:
                raise HttpError(400, f"response_format: {e}", "response_format") from None
            param_names = param_names | {"grammar": "response_format"}
        if tools is not None and tools.choice == "required":  # every answer a call: a grammar of the calls
            if req.sampling.grammar:
                raise HttpError(
                    400,
                    "tool_choice required (or a named function) takes no grammar or response_format of its own",
                    "tool_choice",
                )
            try:
                call = await self._off_loop(grammar_from_schema, json.dumps(tools.call_schema()))
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
        fmt = CompletionFormat(
            f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            int(time.time()),
            self.model_id,
            chat,
            self._piece,
            self.model.token_bytes,
        )
        started: list[web.StreamResponse] = []  # a streamed answer once its headers are sent
        try:
            if stream_it:
                return await streamed(request, req, stream, events, fmt, include_usage, started, tools)
            return await whole(request, req, stream, events, fmt, tools is not None)
        except ConnectionError:  # the client went away mid-stream: its stream stops at the next step
            stream.cancel("the client closed the connection")
            return started[0] if started else None
        except asyncio.CancelledError:
            stream.cancel("the client closed the connection")
            raise
        finally:
            stream.cancel("the request ended")  # a no-op once the stream is done

    def _open(
        self, request: web.Request, principal: str, req: pb.GenerateRequest, events, param_names: dict[str, str]
    ) -> Stream:
        """The request's running stream; the refusal's HttpError otherwise."""
        stream = self.generation.open(principal, req, None, events=events)
        if (
            isinstance(stream, Refusal)
            and stream.reason is RefusalReason.SESSION_BUSY
            and request.headers.get("X-Session-Id") is None
        ):
            # another request took it first: choose again (that one is now running, so not it)
            req.session_id, req.route_epoch = self._session(request, principal, list(req.prompt))
            stream = self.generation.open(principal, req, None, events=events)
        if isinstance(stream, Refusal):
            raise refusal_error(stream, PARAM_NAMES | param_names)
        return stream


def _default_params() -> dict:
    """What a request that sets no sampling parameter gets (the native sampler's defaults), in
    llama-server's names."""
    p = SamplingParams()
    return {
        "temperature": p.temperature,
        "top_k": p.top_k,
        "top_p": p.top_p,
        "min_p": p.min_p,
        "repeat_last_n": p.penalty_last_n,
        "repeat_penalty": p.penalty_repeat,
    }


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
