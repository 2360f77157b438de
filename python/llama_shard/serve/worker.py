"""The shard worker: one engine served over gRPC (`llama-shard serve`).

- `ShardService` (proto/shard.proto): every expected outcome is a typed reply; a gRPC status is
  used only for transport matters (deadline, size limit, shutting down).
- Every step RPC is handed straight to the engine's native step loop, which batches concurrent
  clients' steps into shared engine steps; handler threads wait on it without the GIL.
- Standard gRPC health service (`grpc.health.v1`), SERVING once the model is loaded.
- Prometheus metrics (`prometheus-client`) on --metrics-port: live sessions, reserved and budget
  tokens, evictions and misses by reason, step latency, batch size.
- Binds to loopback unless told otherwise; request size limits; SIGTERM/SIGINT: stop accepting,
  finish in-flight steps, release every session, report, exit 0.
"""
from __future__ import annotations

import dataclasses
import queue
import secrets
import signal
import socket
import sys
import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

from .._native import DEFAULT_GATHER_S, DEFAULT_PREFILL_CHUNK, HotKvConfig, ShardModel
from ..engine.adapter import KvBoundaryAdapter
from ..engine.hot_kv import CacheMiss, HotKvStateConfig, StepKind, Tier
from ..engine.manager import HotKvStateManager
from ..engine.models import backend_text
from ..engine.verification_sizes import decide_verification_sizes
from ..engine.verification_sizes import describe as describe_verification_sizes
from ..errors import (
    IncompatibleCacheRecipeError,
    InvalidInputError,
    KvBudgetExceededError,
    LlamaShardError,
    StaleRouteEpochError,
)
from ..proto import shard_pb2 as pb
from ..proto import shard_pb2_grpc as pb_grpc
from ..proto.credentials import ClientSecurity
from ..proto.requests import DEFAULT_MAX_DRAFTS, FEATURES, MAX_DRAFTS, MIN_BATCH_TOKENS, check_max_drafts
from ..proto.wire import Q8_0_BLOCK, WIRE_DTYPES, tier_name, wire_dtypes_for
from . import DEFAULT_MAX_HOP_S
from .admission import AdmitRequests, SessionCapRefused, SessionOwners
from .generation import GenerationLoops, HeadHost, Refusal, max_generate_streams
from .handover import HANDOVER_TIMEOUT_S, Drainer, HandedIn, SessionMoves, state_digest
from .metrics import EngineCollector
from .openai.guard import HttpLimits
from .peers import MAX_FORWARD_HOPS, SERVER_KEEPALIVE_OPTIONS, VISITED, Peers
from .prefixes import PrefixNames
from .replicas import Replicas
from .sampling import TailSamplers
from .security import ServerSecurity
from .speculation import DRAFT_SOURCES, VERIFY_MODES
from .steps import StepRunner

SERVICE_NAME = "llama_shard.v1.ShardService"


@dataclasses.dataclass
class WorkerOptions:
    host: str = "127.0.0.1"
    port: int = 0                      # 0: any free port (see ShardWorker.port)
    metrics_port: int | None = None    # None: no metrics endpoint
    metrics_host: str = "127.0.0.1"    # plaintext and unauthenticated: loopback unless the operator says --insecure
    threads: int | None = None
    device: str = "cpu"                # where the owned layers run: cpu, auto or a device name (Vulkan0)
    gpu_layers: int = -1               # owned layers on the device, the first of the range (-1: all)
    cpu_moe_layers: int = 0            # of those, the first N keep their experts in host memory (-1: all)
    n_batch: int = HotKvConfig().n_batch
    gather_s: float = DEFAULT_GATHER_S     # longest wait for as many sessions as the last step had
    max_step_sessions: int | None = None   # None: up to max_sessions per engine step
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK  # most tokens of one prefill per step while others wait
    max_message_bytes: int = 64 * 2**20
    grace_s: float = 5.0
    peers: tuple[str, ...] = ()            # workers chained steps may be forwarded to (host:port)
    sweep_s: float = 10.0                  # how often idle sessions are checked against the TTLs (0: only on requests)
    security: ServerSecurity = dataclasses.field(default_factory=ServerSecurity)  # TLS, authentication, admins
    peer_security: ClientSecurity = ClientSecurity()  # how this worker reaches its peers
    max_sessions_per_principal: int | None = None    # None: no cap beyond the engine's
    max_concurrent_rpcs: int | None = None           # None: 4 x max sessions, at least 64
    max_hop_s: float = DEFAULT_MAX_HOP_S  # the longest a chained step may hold this worker's handler
    http_port: int | None = None           # the OpenAI-compatible endpoint on `host` (None: off); its route: `peers` in order
    http_limits: HttpLimits = HttpLimits()  # its timeouts, connection cap, per-principal slots, allowed Host names
    http_split_special_tokens: bool = False  # messages' text tokenized as plain text (special tokens' text included)
    chat_template: str | None = None  # replaces the GGUF's chat template on the HTTP endpoint
    share_prefixes: str = "principal"      # whose sessions share prefixes: each principal's own, or "all"
    draft: str = "ngram"                   # speculative decoding's draft source on a head (DRAFT_SOURCES)
    max_drafts: int = DEFAULT_MAX_DRAFTS   # drafts per step a request gets unless it says (0: off)
    draft_model: str | None = None         # a small GGUF of the same vocabulary whose greedy tokens are the drafts
    verify: str = "exact"                  # how the route computes a verification (VERIFY_MODES)
    replicas: tuple[str, ...] = ()         # workers of this one's range it hands its sessions to when drained
    wire_dtype: str = "f32"                # a head: its own route's hidden rows (WIRE_DTYPES) when a request names none


class ShardServicer(pb_grpc.ShardServiceServicer):
    def __init__(self, model: ShardModel, manager: HotKvStateManager, registry: CollectorRegistry,
                 options: WorkerOptions | None = None):
        options = options or WorkerOptions()  # a fresh one each: WorkerOptions is mutable
        self.model = model
        self.info = model.info
        self.manager = manager
        self.adapter = KvBoundaryAdapter(model, manager)
        self.security = options.security
        if manager.config.warm_dir is not None:  # resumed sessions keep their owners' tags
            self.security.key_owner_tags(manager.config.warm_dir)
        self.peers = Peers(tuple(options.peers), options.max_message_bytes, options.peer_security,
                            sign=self.security.assertion)
        self.peers.replicas = frozenset(options.replicas)
        self.moves = SessionMoves()  # a drain's sessions: the steps that come for them are told where they went
        self.owners = SessionOwners(manager, options.max_sessions_per_principal, options.security)
        self.fingerprint = manager.recipe.fingerprint()
        self.numerics = manager.config.numerics
        self.backend = backend_text(model)  # reported, not compared: a route may mix devices
        self.prefixes = PrefixNames(manager, self.fingerprint, options.share_prefixes, model.path)
        self.stopping = threading.Event()
        self.on_draining = None  # ShardWorker: the health service says NOT_SERVING from the drain's start
        self._drain_lock = threading.Lock()
        self.in_flight = 0
        self._lock = threading.Lock()
        self.max_hop_s = options.max_hop_s
        self.worker_id = secrets.token_hex(8)  # this worker in VISITED
        self.instance_id = secrets.token_hex(8)  # this process in Info: a head sees a restart by it
        self.model_digest = manager.model_digest()  # a replica's must match (one read of the file)
        if options.wire_dtype not in WIRE_DTYPES:
            raise InvalidInputError(f"wire dtype {options.wire_dtype!r}: one of {', '.join(WIRE_DTYPES)}")
        self.wire_dtype = WIRE_DTYPES[options.wire_dtype]
        if self.wire_dtype not in wire_dtypes_for(self.info.n_embd):  # q8_0 only where a row is whole blocks
            raise InvalidInputError(f"--wire-dtype {options.wire_dtype} carries rows of whole {Q8_0_BLOCK}-value "
                                    f"blocks; this model's rows have {self.info.n_embd} values")
        # a head's later stages and their replicas (its --peer workers), probed from ShardWorker.start
        self.replicas = (Replicas(self.info, manager.config.numerics, self.model_digest, self.instance_id,
                                  tuple(options.peers), self.peers.info, registry, wire_dtype=self.wire_dtype)
                         if self.info.first == 0 and options.peers else None)
        # no valid request is larger than a full batch of full-context float32 rows: a larger message
        # is refused by gRPC before it is parsed (options.max_message_bytes stays the ceiling)
        config = manager.config
        needed = config.max_sessions * (config.context_tokens * (self.info.n_embd * 4 + 8) + 4096) + (1 << 16)
        self.max_request_bytes = min(options.max_message_bytes, needed)
        # every session's rows at once fit in one such request; twice that may be parsed and handled
        # at once (a pipelined route has two micro-batches in flight), more is RESOURCE_EXHAUSTED
        self.max_in_flight_request_bytes = 2 * self.max_request_bytes
        # a hand-over comes in chunks (each under that bound); their sum is at most a full session's
        # KV with its cells' metadata, and two are gathered at once at most
        self.max_handover_bytes = 2 * manager.stats()["kv_bytes_per_token"] * config.context_tokens + (2 << 20)
        self._handovers_gathered = threading.BoundedSemaphore(2)
        self.samplers = TailSamplers(self.info.n_vocab, config.context_tokens, 2 * config.max_sessions, model)
        # sessions that arrived by hand-over, untouched since: a head continues them by their sender's id
        self.handed_in = HandedIn(4 * manager.config.max_sessions)
        self.steps = StepRunner(model, manager, self.adapter, self.security, self.peers, self.owners, self.prefixes,
                                self.samplers, self.worker_id, self.moves, self.handed_in)
        if options.verify not in VERIFY_MODES:
            raise InvalidInputError(f"verify is one of {', '.join(VERIFY_MODES)}, not {options.verify!r}")
        if options.draft not in DRAFT_SOURCES:
            raise InvalidInputError(f"draft source {options.draft!r}: one of {', '.join(DRAFT_SOURCES)}")
        check_max_drafts(options.max_drafts)
        if options.n_batch < MIN_BATCH_TOKENS:
            raise InvalidInputError(f"batch is {options.n_batch}: a worker computes steps of up to {MIN_BATCH_TOKENS} "
                                    f"tokens (a verification of {MAX_DRAFTS} drafts); give at least {MIN_BATCH_TOKENS}")
        draft_model = None
        if options.draft_model is not None:
            if options.draft == "off":
                raise InvalidInputError("--draft off and --draft-model: a draft model is a draft source; give one")
            if self.info.first != 0:
                raise InvalidInputError(f"--draft-model drafts for Generate streams: it needs the head worker (layers "
                                        f"from 0), not layers {self.info.first}-{self.info.last}")
            from .draft_model import DraftModel

            draft_model = DraftModel(options.draft_model, model.path, config.context_tokens,
                                     max_generate_streams(config.max_sessions, config.warm_bytes), options.threads)
        host = HeadHost(info=self.info, fingerprint=self.fingerprint, context_tokens=config.context_tokens,
                        max_sessions=config.max_sessions, warm_bytes=config.warm_bytes, detokenize=model.detokenize,
                        security=self.security, prefixes=self.prefixes,
                        session_cap=options.max_sessions_per_principal, stopping=self.stopping,
                        max_hop_s=self.max_hop_s, forward_refusal=self.steps.forward_refusal, admit=self.owners.admit,
                        caller_full=self.owners.full, run_steps=self._run_own_steps, sessions=manager.sessions,
                        replicas=self.replicas, vocab_model=model, wire_dtype=self.wire_dtype)
        self.generation = GenerationLoops(host, registry, options.draft, options.max_drafts, draft_model,
                                          row_by_row=options.verify == "exact")
        self.handover_total = 0
        self.handovers = Counter("llama_shard_handover_sessions", "Sessions handed to a replica (sent) or taken "
                                 "from one (received)", ["direction"], registry=registry)
        self.drainer = Drainer(manager, self.peers, self.moves, self._owner_of, self.fingerprint, self.model_digest,
                               on_moved=lambda n: self._count_handover("sent", n), sign=self.security.assertion,
                               instance_id=self.instance_id)
        self.step_seconds = Histogram("llama_shard_step_seconds", "Latency of a prefill/decode RPC", ["kind"],
                                      registry=registry, buckets=(.001, .002, .005, .01, .02, .05, .1, .2, .5, 1, 2, 5))
        self.step_tokens = Histogram("llama_shard_step_tokens", "Tokens in a prefill/decode RPC", ["kind"],
                                     registry=registry, buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512))
        # every label exported from the start (zero counts), so a scrape before the first step sees the series
        for label in ("prefill", "decode", "batch"):
            self.step_seconds.labels(label)
        for kind in StepKind.__members__:
            self.step_tokens.labels(kind.lower())

    # --- steps ---------------------------------------------------------------------------------

    def _principal(self, context, step: bool = False) -> str:
        """The caller's principal (on a step RPC, the one a forwarder acts for); a call without valid
        credentials ends here, UNAUTHENTICATED."""
        return self._caller(context, step)[0]

    def _caller(self, context, step: bool = False) -> tuple[str, bytes | None]:
        """(principal, the verified assertion a forwarded step came with, else None); a call without
        valid credentials, or a forwarder's step without a valid assertion, ends here, UNAUTHENTICATED."""
        caller = self.security.caller(context, step)
        if caller.principal is None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, caller.why)
        self.owners.name(caller.principal, self.security.tag(caller.principal))
        return caller.principal, caller.assertion

    def Prefill(self, request, context):
        return self._serve(context, "prefill", [(StepKind.PREFILL, request)], request.forward)[0]

    def Decode(self, request, context):
        return self._serve(context, "decode", [(StepKind.DECODE, request)], request.forward)[0]

    def StepBatch(self, request, context):
        # before the size check: an unauthenticated caller learns nothing
        principal, assertion = self._caller(context, step=True)
        limit = self.manager.config.max_sessions
        if len(request.steps) > limit:  # refused whole: a reply per step would amplify a bad request
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"a batch takes at most {limit} steps (this shard's max sessions), got {len(request.steps)}")
        kinds = {pb.STEP_KIND_PREFILL: StepKind.PREFILL, pb.STEP_KIND_DECODE: StepKind.DECODE}
        items = [(kinds.get(s.kind), s.step) for s in request.steps]
        return pb.StepBatchReply(replies=self._serve(context, "batch", items, request.forward, batch=True,
                                                     caller=(principal, assertion)))

    def Generate(self, request, context):
        principal = self._principal(context)
        if self.stopping.is_set():
            context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is shutting down")
        remaining = context.time_remaining()
        stream = self.generation.open(principal, request, remaining if remaining is not None and remaining < 1e8 else None)
        if isinstance(stream, Refusal):  # refused before anything was computed
            yield pb.GenerateEvent(final=stream.final)
            return
        context.add_callback(lambda: stream.cancel("the client closed the stream"))
        try:
            while True:
                try:
                    event = stream.events.get(timeout=0.25)
                except queue.Empty:
                    if not context.is_active():
                        return
                    continue
                yield event
                if event.HasField("final"):
                    return
        finally:  # a closed stream stops before its next step (its KV stays)
            stream.cancel("the client closed the stream")

    def _serve(self, context, label: str, items: list[tuple], forward=(), batch: bool = False,
               caller: tuple[str, bytes | None] | None = None) -> list[pb.StepReply]:
        principal, assertion = self._caller(context, step=True) if caller is None else caller
        if self.stopping.is_set():
            context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is shutting down")
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded before the step started")
        # the caller's deadline, never longer than max_hop_s: a call without one (gRPC reports about
        # 7.5e9 s left) or with a long one holds this handler, and the next hop, at most that long
        remaining = self.max_hop_s if remaining is None else min(remaining, self.max_hop_s)
        t0 = time.perf_counter()
        with self._lock:
            self.in_flight += 1
        try:
            replies = self._run_steps(principal, assertion, context, items, forward, time.monotonic() + remaining,
                                      batch)
        finally:
            with self._lock:
                self.in_flight -= 1
        self.step_seconds.labels(label).observe(time.perf_counter() - t0)
        for kind, req in items:
            n = len(req.token_ids) or (req.hidden.shape[0] if len(req.hidden.shape) == 2 else 0)
            self.step_tokens.labels(kind.name.lower() if kind is not None else "invalid").observe(n)
        return replies

    def _run_steps(self, principal: str, assertion: bytes | None, context, items: list[tuple], forward,
                   deadline: float, batch: bool) -> list[pb.StepReply]:
        """Parses every (kind, StepRequest), runs the valid ones together, answers each on its own;
        a chained call then sends the computed rows on to forward[0] and answers what it replied.
        Sessions are the principal's own: the engine key carries its tag. `assertion`: the verified
        one a trusted forwarder's step came with (None: the principal authenticated here)."""
        # whose prefixes the step reaches: a head computes what it stores itself; another shard
        # shares them only with steps a trusted forwarder (or anyone, without authentication) sends
        shared = self.info.first == 0 or not self.security.authenticated or assertion is not None
        try:
            replies = self.steps.run(principal, self._visited(context), items, forward, deadline, batch,
                                     prefix_scope=self.prefixes.scope(principal, shared), assertion=assertion)
        except SessionCapRefused as e:  # nothing computed: the caller holds its share of the sessions
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        # a step from outside the head's generation loop: its record is no longer the route's (only a
        # head that ran streams has records: every other step pays one dict check)
        for (_, req) in items if self.generation.has_records() else ():
            try:
                self.generation.forget(self.security.engine_key(principal, req.session_id))
            except LlamaShardError:
                pass  # a session id no key can be made of was answered INVALID_ARGUMENT above
        return replies

    def _run_own_steps(self, principal: str, items: list[tuple], forward, deadline: float) -> list[pb.StepReply]:
        """The head's generation loop's steps (HeadHost.run_steps): a batch from no other worker, its
        prefix plans its own."""
        return self.steps.run(principal, (), items, forward, deadline, batch=True, own_loop=True)

    def _visited(self, context) -> tuple[str, ...]:
        """The workers the step passed through before this one (VISITED)."""
        for key, value in context.invocation_metadata():
            if key == VISITED and isinstance(value, str):
                return tuple(v for v in value.split(",")[:MAX_FORWARD_HOPS + 1] if v)
        return ()

    # --- sessions --------------------------------------------------------------------------------

    def _session_call(self, context, fn, session_id: str, *args) -> pb.SessionReply:
        principal = self._principal(context)
        try:
            key = self.security.engine_key(principal, session_id)
            out = fn(key, *args)
        except StaleRouteEpochError as e:
            return pb.SessionReply(outcome=pb.OUTCOME_STALE_EPOCH, detail=str(e), current_epoch=e.current_epoch or 0)
        except InvalidInputError as e:
            return pb.SessionReply(outcome=pb.OUTCOME_INVALID_ARGUMENT, detail=str(e))
        if isinstance(out, CacheMiss):
            return pb.SessionReply(outcome=pb.OUTCOME_CACHE_MISS, miss_reason=out.reason.name, detail=out.detail)
        if isinstance(out, bool):
            if out:
                self.owners.forget(principal, key)
            return pb.SessionReply(outcome=pb.OUTCOME_OK, released=out)
        return pb.SessionReply(outcome=pb.OUTCOME_OK, seq_len=out.seq_len, tier=tier_name(out.tier))

    def Truncate(self, request, context):
        try:
            self.generation.forget(self.security.engine_key(self._principal(context), request.session_id))
        except LlamaShardError:
            pass  # answered INVALID_ARGUMENT below
        return self._session_call(context, self.manager.truncate, request.session_id, request.route_epoch, request.length)

    def Release(self, request, context):
        try:  # a stream running on the session ends first (its next step would bring the session back)
            key = self.security.engine_key(self._principal(context), request.session_id)
            remaining = context.time_remaining()
            self.generation.stop_stream(key, "the session was released",
                                        self.max_hop_s if remaining is None else min(remaining, self.max_hop_s))
        except LlamaShardError:
            pass  # answered INVALID_ARGUMENT below
        reply = self._session_call(context, self.manager.release, request.session_id, request.route_epoch)
        if reply.outcome != pb.OUTCOME_INVALID_ARGUMENT:  # a key exists for this id
            key = self.security.engine_key(self._principal(context), request.session_id)
            self.generation.forget(key)
            self.samplers.forget((key, request.route_epoch))
            self.steps.sampling_checks.forget((key, request.route_epoch))
        return reply

    # --- drain and hand-over --------------------------------------------------------------------

    def _count_handover(self, direction: str, n: int) -> None:
        with self._lock:
            self.handover_total += n
        self.handovers.labels(direction).inc(n)

    def _owner_of(self, key: str) -> tuple[str | None, str]:
        """(the principal owning an engine key, its session id); None when it cannot be named."""
        tag, session_id = self.security.owner_of_key(key)
        if tag is None:
            return "", session_id
        principal = self.owners.principal_of(tag)
        return (principal or None), session_id

    def _trusted_neighbour(self, context) -> str:
        """The caller of a hand-over or a drain: on a worker with authentication, a worker it trusts
        (--forwarder) or an admin, else PERMISSION_DENIED."""
        principal = self._principal(context)
        if self.security.authenticated and principal not in (*self.security.forwarders, *self.security.admins):
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          "only a trusted worker (--forwarder) or an admin may hand sessions over or drain a worker")
        return principal

    def Handover(self, request_iterator, context):
        caller = self._trusted_neighbour(context)

        def refused(outcome: int, detail: str) -> pb.SessionReply:
            return pb.SessionReply(outcome=outcome, detail=f"hand-over refused: {detail}")
        request = next(request_iterator, None)
        if request is None:
            return refused(pb.OUTCOME_INVALID_ARGUMENT, "the stream carried no message")
        if self.stopping.is_set() or self.moves.draining:
            return refused(pb.OUTCOME_UNAVAILABLE, "this worker is draining too")
        if request.recipe_fingerprint != self.fingerprint:
            return refused(pb.OUTCOME_INCOMPATIBLE_RECIPE, "the sender's KV recipe is not this worker's "
                           "(another layer range, K/V type or attention kernel)")
        if request.model_digest != self.model_digest:
            return refused(pb.OUTCOME_INCOMPATIBLE_RECIPE, "the sender's model file is not this worker's")
        owner = request.owner
        if self.security.authenticated and (not owner.strip() or owner in self.security.admins):
            return refused(pb.OUTCOME_INVALID_ARGUMENT, "a session on this worker belongs to a named, non-admin principal")
        if not self.security.authenticated and owner:
            return refused(pb.OUTCOME_INVALID_ARGUMENT, "this worker has no authentication: every session is anonymous")
        if (self.security.authenticated and caller not in self.security.admins
                and not self.security.assertion_valid(owner, request.owner_assertion)):
            # a forwarder acts for a principal only with the route key's signature, as on a step
            return refused(pb.OUTCOME_INVALID_ARGUMENT, "a forwarder's hand-over needs the route key's assertion of "
                           "its owner (owner_assertion)")
        if not 0 < request.state_bytes <= self.max_handover_bytes:
            return refused(pb.OUTCOME_INVALID_ARGUMENT, f"state_bytes {request.state_bytes}: a session's state on this "
                           f"worker takes 1 to {self.max_handover_bytes} bytes")
        left = context.time_remaining()
        if not self._handovers_gathered.acquire(timeout=HANDOVER_TIMEOUT_S if left is None else max(0.0, left)):
            return refused(pb.OUTCOME_UNAVAILABLE, "other hand-overs are being received; try another replica")
        try:
            state = self._gather_state(request, request_iterator)
            if state is None:
                return refused(pb.OUTCOME_INVALID_ARGUMENT, f"the stream's chunks do not add up to state_bytes "
                               f"{request.state_bytes}")
            if len(request.state_sha256) != 32 or state_digest(state) != request.state_sha256:
                return refused(pb.OUTCOME_INVALID_ARGUMENT, "the state's SHA-256 does not match its bytes")
            return self._take_over(request, state, owner, refused)
        finally:
            self._handovers_gathered.release()

    @staticmethod
    def _gather_state(first: pb.HandoverRequest, rest) -> bytes | None:
        """The whole state of a hand-over's stream, or None when its chunks pass or miss state_bytes
        (never more than state_bytes is held)."""
        state = bytearray(first.state)
        if len(state) > first.state_bytes:
            return None
        for message in rest:
            if len(state) + len(message.state) > first.state_bytes:
                return None
            state += message.state
        return bytes(state) if len(state) == first.state_bytes else None

    def _take_over(self, request: pb.HandoverRequest, state: bytes, owner: str, refused) -> pb.SessionReply:
        """Handover's last part: the checked state opened here as the session, hot, at its epoch."""
        try:
            key = self.security.engine_key(owner, request.session_id)
            held = self.manager.resolve(key, request.route_epoch)
            if not isinstance(held, CacheMiss):
                # it may be a newer copy (the session failed over here): never replaced by the sender's
                return refused(pb.OUTCOME_INVALID_ARGUMENT, "this worker already holds the session at that epoch; "
                               "it is kept (the sender's copy may be older)")
            self.owners.name(owner, self.security.tag(owner))
            cap = self.owners.admit(owner, [key])
            if cap is not None:
                return refused(pb.OUTCOME_BUDGET_EXCEEDED, cap)
            later = self._used_since(request.seq_len, request.idle_seconds)
            if later is not None:
                return refused(pb.OUTCOME_BUDGET_EXCEEDED, f"no room here but that of a session used {later:.2f} s ago, "
                               f"more recently than this one ({request.idle_seconds:.2f} s)")
            self.manager.import_session(key, request.route_epoch, request.seq_len, state)
        except StaleRouteEpochError as e:
            return pb.SessionReply(outcome=pb.OUTCOME_STALE_EPOCH, detail=f"hand-over refused: {e}",
                                   current_epoch=e.current_epoch or 0)
        except KvBudgetExceededError as e:
            return refused(pb.OUTCOME_BUDGET_EXCEEDED, str(e))
        except IncompatibleCacheRecipeError as e:
            return refused(pb.OUTCOME_INCOMPATIBLE_RECIPE, str(e))
        except InvalidInputError as e:
            return refused(pb.OUTCOME_INVALID_ARGUMENT, str(e))
        except LlamaShardError as e:
            return refused(pb.OUTCOME_INTERNAL, str(e))
        self.generation.forget(key)
        self.samplers.forget((key, request.route_epoch))
        self.handed_in.arrived(key, request.route_epoch, request.from_instance)
        self._count_handover("received", 1)
        return pb.SessionReply(outcome=pb.OUTCOME_OK, seq_len=request.seq_len, tier="hot")

    def _used_since(self, seq_len: int, idle_seconds: float) -> float | None:
        """When opening a handed-over session of `seq_len` tokens would push a hot session out of
        this worker (no warm tier to keep it) and that one was used more recently than the handed
        one: how long ago (a stream between two steps must not lose its KV to an idle session)."""
        config, stats = self.manager.config, self.manager.stats()
        if config.warm_bytes > 0:  # what is pushed out is spilled, and restored at its next step
            return None
        if (stats["live_sessions"] < config.max_sessions
                and stats["reserved_tokens"] + seq_len <= config.budget_tokens):
            return None
        hot = [r for r in self.manager.sessions() if r.tier == Tier.HOT]  # least recently used first
        since = self.manager.clock() - hot[0].last_used if hot else None
        return since if since is not None and since < idle_seconds else None

    def Drain(self, request, context):
        self._trusted_neighbour(context)
        if self.security.authenticated and self._principal(context) not in self.security.admins:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, "only an admin may drain a worker")
        targets = (request.to,) if request.to else tuple(self.peers.replicas)
        if request.to and request.to not in self.peers.replicas:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"{request.to!r} is not among this worker's replicas (serve --replica): "
                          f"{sorted(self.peers.replicas) or 'none'}")
        return self.drain(targets)

    def drain(self, targets: tuple[str, ...]) -> pb.DrainReply:
        """Stops admitting new sessions and hands every live one to `targets` (released where none
        takes it); the steps that come for them afterwards are told where they went. Once: a second
        drain (an admin's during SIGTERM's) answers that one is done or under way."""
        if not self._drain_lock.acquire(blocking=False) or self.moves.draining:
            return pb.DrainReply(detail="this worker is draining already")
        try:
            if self.on_draining is not None:
                self.on_draining()
            return self.drainer.drain(targets, HANDOVER_TIMEOUT_S)
        finally:
            self._drain_lock.release()

    def Resolve(self, request, context):
        return self._session_call(context, self.manager.resolve, request.session_id, request.route_epoch)

    def _visible_sessions(self, principal: str) -> list[pb.SessionInfo]:
        """Session ids for a worker without authentication, or an admin; nobody else sees any."""
        if self.security.authenticated and principal not in self.security.admins:
            return []
        out = []
        for r in self.manager.sessions():
            tag, sid = self.security.owner_of_key(r.session_id)
            out.append(pb.SessionInfo(session_id=sid, route_epoch=r.route_epoch, seq_len=r.seq_len, tier=tier_name(r.tier),
                                      owner=self.owners.principal_of(tag)))
        return out

    def Info(self, request, context):
        principal = self._principal(context)
        st = self.manager.stats()
        loop = self.manager.loop_stats()
        info = self.info
        return pb.InfoReply(
            model_name=self.model.path.rsplit("/", 1)[-1], architecture=info.architecture, n_layer=info.n_layer,
            first=info.first, last=info.last, n_embd=info.n_embd, n_vocab=info.n_vocab,
            recipe_fingerprint=self.fingerprint, max_sessions=st["max_sessions"], context_tokens=st["context_tokens"],
            budget_tokens=st["budget_tokens"], live_sessions=st["live_sessions"], reserved_tokens=st["reserved_tokens"],
            kv_bytes_per_token=st["kv_bytes_per_token"],
            sessions=self._visible_sessions(principal),
            kv_type=self.manager.config.kv_type, flash_attn=self.manager.config.flash_attn, numerics=self.numerics,
            backend=self.backend,
            warm_sessions=st["warm_sessions"], warm_bytes=st["warm_bytes"],
            warm_capacity=st["warm_capacity"], spills=st["spills"], restores=st["restores"], warm_drops=st["warm_drops"],
            misses=st["misses"], evictions_lru=st["evictions_lru"], evictions_ttl=st["evictions_ttl"],
            engine_busy_seconds=loop["busy_seconds"], engine_steps=loop["steps"], engine_requests=loop["requests"],
            peers=sorted(self.peers.allowed), max_request_bytes=self.max_request_bytes,
            max_in_flight_request_bytes=self.max_in_flight_request_bytes,
            generate_streams=len(self.generation.streams),
            prefix_entries=st["prefix_entries"], prefix_bytes=st["prefix_bytes"], prefix_capacity=st["prefix_capacity"],
            prefix_hits=st["prefix_hits"], prefix_tokens_saved=st["prefix_tokens_saved"],
            prefix_stores=st["prefix_stores"], prefix_evictions=st["prefix_evictions"],
            share_prefixes=self.prefixes.share, tokens_computed=st["tokens_computed"],
            draft_source=self.generation.draft_source, drafted_tokens=self.generation.drafted_total,
            accepted_tokens=self.generation.accepted_total, instance_id=self.instance_id,
            model_digest=self.model_digest, replicas=self.replicas.info() if self.replicas is not None else [],
            failovers=self.replicas.failovers_total if self.replicas is not None else 0,
            wire_dtypes=self.steps.wire_dtypes, wire_dtype=self.wire_dtype,
            forwarded_hidden_bytes=dict(self.steps.forwarded_bytes),
            draining=self.moves.draining, handover_sessions=self.handover_total, features=FEATURES)


class ShardWorker:
    """Loads a shard, serves it, and shuts down gracefully."""

    def __init__(self, model_path: str, layers: tuple[int, int] | None, config: HotKvStateConfig,
                 options: WorkerOptions | None = None):
        options = options or WorkerOptions()  # a fresh one each: WorkerOptions is mutable
        self.options = options
        self.model = ShardModel(str(model_path), layers, options.threads, options.device, options.gpu_layers,
                                options.cpu_moe_layers)
        self.manager = HotKvStateManager(self.model, config, n_batch=options.n_batch, n_threads=options.threads,
                                         max_step_sessions=options.max_step_sessions,
                                         prefill_chunk=options.prefill_chunk, gather_s=options.gather_s)
        self.registry = CollectorRegistry()
        info = self.model.info
        self.registry.register(EngineCollector(self.manager, {"layers": f"{info.first}-{info.last}"}))
        self.servicer = ShardServicer(self.model, self.manager, self.registry, options)  # checks the options first
        # each verification size's one-time comparison (one call against row by row) now, not in a request
        try:
            verdicts, seconds = decide_verification_sizes(self.manager)
            if verdicts:
                print(f"llama-shard worker: {describe_verification_sizes(verdicts, seconds)}", file=sys.stderr,
                      flush=True)
        except LlamaShardError as e:  # the first verification of each size decides it, as before
            print(f"llama-shard worker: verification sizes not decided at start-up ({e}); the first "
                  f"verification of each size decides it", file=sys.stderr, flush=True)
        self.health = health.HealthServicer()
        limit = self.servicer.max_request_bytes
        self.admission = AdmitRequests(max_in_flight_bytes=self.servicer.max_in_flight_request_bytes)
        # past max_concurrent_rpcs gRPC itself answers RESOURCE_EXHAUSTED, before any handler runs (and the
        # HTTP endpoint 429, counting its requests in flight)
        self.max_concurrent_rpcs = options.max_concurrent_rpcs or max(64, 4 * config.max_sessions)
        self.server = grpc.server(
            # a Generate stream holds a handler thread for its life: room for every stream beside the steps
            futures.ThreadPoolExecutor(max_workers=max(8, 2 * config.max_sessions)
                                       + max_generate_streams(config.max_sessions, config.warm_bytes),
                                       thread_name_prefix="shard-rpc"),
            options=[("grpc.max_receive_message_length", limit),
                     ("grpc.max_send_message_length", options.max_message_bytes),  # logits can outweigh any request
                     *SERVER_KEEPALIVE_OPTIONS],
            maximum_concurrent_rpcs=self.max_concurrent_rpcs,
            interceptors=[self.admission])
        pb_grpc.add_ShardServiceServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        credentials = options.security.server_credentials()
        try:
            address = f"{options.host}:{options.port}"
            self.port = (self.server.add_secure_port(address, credentials) if credentials is not None
                         else self.server.add_insecure_port(address))
        except RuntimeError as e:  # grpcio raises RuntimeError when the address cannot be bound
            raise OSError(f"cannot bind {options.host}:{options.port}: {e}") from None
        if self.port == 0:
            raise OSError(f"cannot bind {options.host}:{options.port}")
        self.servicer.steps.own_addresses = frozenset(
            f"{h}:{self.port}" for h in {options.host, "127.0.0.1", "localhost", "[::1]", socket.gethostname()})
        self.metrics_port = None
        if options.metrics_port is not None:
            server, _ = start_http_server(options.metrics_port, addr=options.metrics_host, registry=self.registry)
            self.metrics_port = server.server_port
        self.http = None
        if options.http_port is not None and info.first != 0:
            raise InvalidInputError(f"--http-port serves generation: it needs the head worker (layers from 0), "
                                    f"not layers {info.first}-{info.last}")
        if options.http_port is not None:
            from .openai.endpoint import OpenAIEndpoint  # aiohttp and jinja2 load only on a worker that serves HTTP

            self.http = OpenAIEndpoint(self.servicer.generation, self.model, options.security, options.host,
                                       options.http_port, self.max_concurrent_rpcs, options.http_limits,
                                       options.http_split_special_tokens, options.chat_template, self.registry)
        self._stopped = threading.Event()

    @property
    def address(self) -> str:
        return f"{self.options.host}:{self.port}"

    def start(self) -> "ShardWorker":
        if self.http is not None:
            self.http.start()  # binds first: a port in use fails the start, not a request later
        self.server.start()
        self.servicer.on_draining = lambda: self._set_health(False, "draining: handing its sessions to a replica")
        replicas = self.servicer.replicas
        if replicas is None:
            self._set_health(True, "")
        else:  # SERVING while every later stage has a healthy replica
            replicas.start(self._set_health)
        if self.http is not None:
            self.http.route_health = replicas.route_health if replicas is not None else None
        if self.options.sweep_s > 0:
            # TTLs apply on a quiet worker too: idle sessions move warm (or go) without a request
            threading.Thread(target=self._sweep_until_stopped, name="shard-ttl-sweep", daemon=True).start()
        return self

    def _set_health(self, ok: bool, detail: str) -> None:
        if self._stopped.is_set():
            return
        if ok and self.servicer.moves.draining:  # a draining worker takes no new session, whatever its route
            ok, detail = False, "draining: handing its sessions to a replica"
        status = health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
        self.health.set("", status)
        self.health.set(SERVICE_NAME, status)
        if not ok:
            print(f"llama-shard worker: NOT_SERVING: {detail}", file=sys.stderr, flush=True)
        elif self.servicer.replicas is not None:
            print("llama-shard worker: SERVING: every later stage has a healthy replica", file=sys.stderr, flush=True)

    def _sweep_until_stopped(self) -> None:
        while not self._stopped.wait(self.options.sweep_s):
            self.manager.sweep()

    def stop(self) -> dict:
        """With --replica workers: first hands every live session to one of them (the steps that come
        for a session afterwards are told where it went, for up to grace_s). Then stops accepting,
        finishes in-flight steps, writes every session left to the disk tier (with --warm-dir: a
        restarted worker resumes them) or releases it; returns a report."""
        if self._stopped.is_set():
            return {}
        handed = 0
        if self.options.replicas and not self.servicer.moves.draining:
            reply = self.servicer.drain(tuple(self.options.replicas))
            handed = reply.handed_over
            print(f"llama-shard worker: handed {reply.handed_over} session(s) to a replica in {reply.seconds:.2f} s"
                  + (f", released {reply.released}: {reply.detail}" if reply.released else ""), file=sys.stderr,
                  flush=True)
        if self.servicer.moves.moved:  # the heads follow a moved session at its next step
            self.servicer.moves.wait_asked(self.options.grace_s)
        self._stopped.set()
        self.health.enter_graceful_shutdown()
        self.servicer.stopping.set()
        # every stream ends with a final event saying so after its step in flight
        self.servicer.generation.wait_idle(self.options.grace_s)
        if self.http is not None:
            self.http.stop(self.options.grace_s)
        self.server.stop(self.options.grace_s).wait()
        self.manager.close()
        if self.servicer.generation.draft_model is not None:
            self.servicer.generation.draft_model.close()
        if self.servicer.replicas is not None:
            self.servicer.replicas.stop()
        self.servicer.peers.close()
        persisted = released = 0
        if self.manager.config.warm_dir is not None:
            persisted = self.manager.persist()
        else:
            keys = self.manager.session_keys()
            released = sum(1 for sid, ep in keys if self.manager.release(sid, ep))
        st = self.manager.stats()
        return {"released_sessions": released, "persisted_sessions": persisted, "handed_over_sessions": handed,
                "reserved_tokens_after": st["reserved_tokens"]}

    def _reload_credentials(self) -> None:
        """SIGHUP: the token file again (certificates are re-read when their files change)."""
        try:
            self.options.security.reload()
            print("llama-shard worker: credentials reloaded", file=sys.stderr, flush=True)
        except (OSError, ValueError) as e:
            print(f"llama-shard worker: credentials not reloaded, the old ones stay: {e}", file=sys.stderr, flush=True)

    def serve_until_signal(self) -> int:
        # the handler only records the signal: Event.set() from a handler can deadlock on the lock
        # the interrupted Event.wait() in this same thread holds
        received: list[int] = []
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, _frame: received.append(signum))
        reload: list[int] = []
        signal.signal(signal.SIGHUP, lambda signum, _frame: reload.append(signum))
        info = self.model.info
        print(f"llama-shard worker: layers {info.first}-{info.last} of {info.n_layer} ({info.architecture}) "
              f"serving on {self.address}" + (f", metrics on :{self.metrics_port}" if self.metrics_port else "")
              + (f", OpenAI API on {self.http.scheme}://{self.options.host}:{self.http.port}/v1" if self.http else ""),
              file=sys.stderr, flush=True)
        while not received:
            time.sleep(0.1)
            if reload:
                reload.clear()
                self._reload_credentials()
        report = self.stop()
        kept = f"wrote {report['persisted_sessions']} session(s) to {self.manager.config.warm_dir}, " \
            if self.manager.config.warm_dir is not None else ""
        print(f"llama-shard worker: shut down; {kept}released {report['released_sessions']} session(s), "
              f"{report['reserved_tokens_after']} tokens still reserved", file=sys.stderr, flush=True)
        return 0
