"""The gRPC service every worker runs (`ShardService`, proto/shard.proto): its handlers, who calls,
deadlines, sessions, drain and hand-over, Info. The process around it is node.py.

- Every expected outcome is a typed reply; a gRPC status is used only for transport matters
  (deadline, size limit, shutting down).
- Every step RPC is handed straight to the engine's native step loop (steps.py), which batches
  concurrent clients' steps into shared engine steps; handler threads wait on it without the GIL.
- Generate, and the head's part of Info, go to the head that sits on the worker (`HeadSlot`).
"""

from __future__ import annotations

import secrets
import threading
import time

import grpc
from prometheus_client import CollectorRegistry

from .._native import ShardModel
from ..engine.adapter import KvBoundaryAdapter
from ..engine.hot_kv import CacheMiss, StepKind
from ..engine.manager import HotKvStateManager
from ..engine.models import placement
from ..errors import (
    InvalidInputError,
    LlamaShardError,
    StaleRouteEpochError,
)
from ..proto import shard_pb2 as pb
from ..proto import shard_pb2_grpc as pb_grpc
from ..proto.requests import FEATURES, MAX_DRAFTS, MIN_BATCH_TOKENS
from ..proto.wire import Q8_0_BLOCK, WIRE_DTYPES, tier_name, wire_dtypes_for
from ..receipts.keys import NodeKey
from ..receipts.verify import VERSION as RECEIPT_VERSION
from .admission import RequestBounds, SessionCapRefused, SessionOwners
from .handover import HANDOVER_TIMEOUT_S, Drainer, HandedIn, HandoverReceiver, SessionMoves
from .head_slot import HeadSlot, NoHead
from .metrics import StepMetrics
from .options import WorkerOptions
from .peers import MAX_FORWARD_HOPS, VISITED, Peers
from .prefixes import PrefixNames
from .receipts import ReceiptSigner
from .sampling import TailSamplers
from .steps import StepRunner


class ShardServicer(pb_grpc.ShardServiceServicer):
    def __init__(
        self,
        model: ShardModel,
        manager: HotKvStateManager,
        registry: CollectorRegistry,
        options: WorkerOptions | None = None,
    ):
        options = options or WorkerOptions()  # a fresh one each: WorkerOptions is mutable
        self.model = model
        self.info = model.info
        self.manager = manager
        self.security = options.security
        if manager.config.warm_dir is not None:  # resumed sessions keep their owners' tags
            self.security.key_owner_tags(manager.config.warm_dir)
        self.peers = Peers(
            tuple(options.peers), options.max_message_bytes, options.peer_security, sign=self.security.assertion
        )
        self.peers.replicas = frozenset(options.replicas)
        self.moves = SessionMoves()  # a drain's sessions: the steps that come for them are told where they went
        self.owners = SessionOwners(manager, options.max_sessions_per_principal, options.security)
        self.fingerprint = manager.recipe.fingerprint()
        self.placement = placement(model)  # reported, not compared: a route may mix devices
        self.prefixes = PrefixNames(manager, self.fingerprint, options.share_prefixes, model.path)
        self.stopping = threading.Event()
        self.on_draining = None  # ShardWorker: the health service says NOT_SERVING from the drain's start
        self._drain_lock = threading.Lock()
        self.max_hop_s = options.max_hop_s
        self.instance_id = secrets.token_hex(8)  # this process in Info: a head sees a restart by it
        self.model_digest = manager.model_digest()  # a replica's must match (one read of the file)
        self.wire_dtype = _wire_dtype(options.wire_dtype, self.info.n_embd)
        self.route = tuple(options.peers)  # in order: a head's later stages (head/role.py's replicas)
        config = manager.config
        self.bounds = RequestBounds.of(
            config, self.info.n_embd, manager.stats()["kv_bytes_per_token"], options.max_message_bytes
        )
        self.samplers = TailSamplers(self.info.n_vocab, config.context_tokens, 2 * config.max_sessions, model)
        # sessions that arrived by hand-over, untouched since: a head continues them by their sender's id
        self.handed_in = HandedIn(4 * config.max_sessions)
        self.steps = StepRunner(
            model,
            manager,
            KvBoundaryAdapter(model, manager),
            self.security,
            self.peers,
            self.owners,
            self.prefixes,
            self.samplers,
            secrets.token_hex(8),  # this worker in VISITED
            self.moves,
            self.handed_in,
        )
        self.receipt_signer = self._receipt_signer(options.receipt_key)
        if options.n_batch < MIN_BATCH_TOKENS:
            raise InvalidInputError(
                f"batch is {options.n_batch}: a worker computes steps of up to {MIN_BATCH_TOKENS} "
                f"tokens (a verification of {MAX_DRAFTS} drafts); give at least {MIN_BATCH_TOKENS}"
            )
        self.head: HeadSlot = NoHead()  # head/role.py's Head when this worker runs one (attach_head)
        self.metrics = StepMetrics(registry, StepKind.__members__)
        self.receiver = HandoverReceiver(
            manager,
            self.security,
            self.owners,
            self.moves,
            self.fingerprint,
            self.model_digest,
            self.bounds.handover,
            self._handed_in,
        )
        self.drainer = Drainer(
            manager,
            self.peers,
            self.moves,
            self._owner_of,
            self.fingerprint,
            self.model_digest,
            on_moved=lambda n: self.metrics.handed("sent", n),
            sign=self.security.assertion,
            instance_id=self.instance_id,
        )

    def _receipt_signer(self, key: NodeKey | None) -> ReceiptSigner:
        """What this worker signs its receipts as, with the operator's key (serve --receipt-key) or
        one of this process."""
        key = key if key is not None else NodeKey.generate()
        template = pb.ReceiptBody(
            version=RECEIPT_VERSION,
            model_digest=self.model_digest,
            n_layer=self.info.n_layer,
            first=self.info.first,
            last=self.info.last,
            numerics=self.manager.config.numerics,
            backend=f"{self.placement.text(self.info.n_owned_layers)}; {self.placement.kernels}",
            instance_id=self.instance_id,
        )
        return ReceiptSigner(self.steps, key, template)

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
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"a batch takes at most {limit} steps (this shard's max sessions), got {len(request.steps)}",
            )
        kinds = {pb.STEP_KIND_PREFILL: StepKind.PREFILL, pb.STEP_KIND_DECODE: StepKind.DECODE}
        items = [(kinds.get(s.kind), s.step) for s in request.steps]
        return pb.StepBatchReply(
            replies=self._serve(context, "batch", items, request.forward, batch=True, caller=(principal, assertion))
        )

    def Receipt(self, request, context):
        principal, assertion = self._caller(context, step=True)
        remaining = context.time_remaining()
        remaining = self.max_hop_s if remaining is None else min(remaining, self.max_hop_s)
        return self.receipt_signer.sign(
            principal, self._visited(context), request, time.monotonic() + remaining, assertion
        )

    def own_receipts(self, principal: str, request: pb.ReceiptRequest, deadline: float) -> pb.ReceiptReply:
        """The head's generation loop's receipts (HeadHost.receipts): its own stage's, then its route's."""
        return self.receipt_signer.sign(principal, (), request, deadline)

    def attach_head(self, head: HeadSlot) -> None:
        self.head = head

    def Generate(self, request, context):
        principal = self._principal(context)
        if self.stopping.is_set():
            context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is shutting down")
        yield from self.head.serve_generate(principal, request, context)

    def _serve(
        self,
        context,
        label: str,
        items: list[tuple],
        forward=(),
        batch: bool = False,
        caller: tuple[str, bytes | None] | None = None,
    ) -> list[pb.StepReply]:
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
        replies = self._run_steps(principal, assertion, context, items, forward, time.monotonic() + remaining, batch)
        self.metrics.step(label, time.perf_counter() - t0, items)
        return replies

    def _run_steps(
        self,
        principal: str,
        assertion: bytes | None,
        context,
        items: list[tuple],
        forward,
        deadline: float,
        batch: bool,
    ) -> list[pb.StepReply]:
        """Parses every (kind, StepRequest), runs the valid ones together, answers each on its own;
        a chained call then sends the computed rows on to forward[0] and answers what it replied.
        Sessions are the principal's own: the engine key carries its tag. `assertion`: the verified
        one a trusted forwarder's step came with (None: the principal authenticated here)."""
        # whose prefixes the step reaches: a head computes what it stores itself; another shard
        # shares them only with steps a trusted forwarder (or anyone, without authentication) sends
        shared = self.info.first == 0 or not self.security.authenticated or assertion is not None
        try:
            replies = self.steps.run(
                principal,
                self._visited(context),
                items,
                forward,
                deadline,
                batch,
                prefix_scope=self.prefixes.scope(principal, shared),
                assertion=assertion,
            )
        except SessionCapRefused as e:  # nothing computed: the caller holds its share of the sessions
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        # a step from outside the head's generation loop: its record is no longer the route's (only a
        # head that ran streams has records: every other step pays one dict check)
        for _, req in items if self.head.has_records() else ():
            try:
                self.head.forget(self.security.engine_key(principal, req.session_id))
            except LlamaShardError:
                pass  # a session id no key can be made of was answered INVALID_ARGUMENT above
        return replies

    def run_own_steps(self, principal: str, items: list[tuple], forward, deadline: float) -> list[pb.StepReply]:
        """The head's generation loop's steps (HeadHost.run_steps): a batch from no other worker, its
        prefix plans its own."""
        return self.steps.run(principal, (), items, forward, deadline, batch=True, own_loop=True)

    def _visited(self, context) -> tuple[str, ...]:
        """The workers the step passed through before this one (VISITED)."""
        for key, value in context.invocation_metadata():
            if key == VISITED and isinstance(value, str):
                return tuple(v for v in value.split(",")[: MAX_FORWARD_HOPS + 1] if v)
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
            self.head.forget(self.security.engine_key(self._principal(context), request.session_id))
        except LlamaShardError:
            pass  # answered INVALID_ARGUMENT below
        return self._session_call(
            context, self.manager.truncate, request.session_id, request.route_epoch, request.length
        )

    def Release(self, request, context):
        try:  # a stream running on the session ends first (its next step would bring the session back)
            key = self.security.engine_key(self._principal(context), request.session_id)
            remaining = context.time_remaining()
            self.head.stop_stream(
                key, "the session was released", self.max_hop_s if remaining is None else min(remaining, self.max_hop_s)
            )
        except LlamaShardError:
            pass  # answered INVALID_ARGUMENT below
        reply = self._session_call(context, self.manager.release, request.session_id, request.route_epoch)
        if reply.outcome != pb.OUTCOME_INVALID_ARGUMENT:  # a key exists for this id
            key = self.security.engine_key(self._principal(context), request.session_id)
            self.head.forget(key)
            self.samplers.forget((key, request.route_epoch))
            self.steps.sampling_checks.forget((key, request.route_epoch))
        return reply

    # --- drain and hand-over --------------------------------------------------------------------

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
            context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                "only a trusted worker (--forwarder) or an admin may hand sessions over or drain a worker",
            )
        return principal

    def Handover(self, request_iterator, context):
        caller = self._trusted_neighbour(context)
        return self.receiver.receive(caller, request_iterator, context.time_remaining, self.stopping)

    def _handed_in(self, key: str, epoch: int, from_instance: str) -> None:
        """A session arrived by hand-over: the head's record and the kept sampler are not its."""
        self.head.forget(key)
        self.samplers.forget((key, epoch))
        self.handed_in.arrived(key, epoch, from_instance)
        self.metrics.handed("received", 1)

    def Drain(self, request, context):
        self._trusted_neighbour(context)
        if self.security.authenticated and self._principal(context) not in self.security.admins:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, "only an admin may drain a worker")
        targets = (request.to,) if request.to else tuple(self.peers.replicas)
        if request.to and request.to not in self.peers.replicas:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{request.to!r} is not among this worker's replicas (serve --replica): "
                f"{sorted(self.peers.replicas) or 'none'}",
            )
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
            out.append(
                pb.SessionInfo(
                    session_id=sid,
                    route_epoch=r.route_epoch,
                    seq_len=r.seq_len,
                    tier=tier_name(r.tier),
                    owner=self.owners.principal_of(tag),
                )
            )
        return out

    def Info(self, request, context):
        principal = self._principal(context)
        st = self.manager.stats()
        loop = self.manager.loop_stats()
        info = self.info
        return pb.InfoReply(
            model_name=self.model.path.rsplit("/", 1)[-1],
            architecture=info.architecture,
            n_layer=info.n_layer,
            first=info.first,
            last=info.last,
            n_embd=info.n_embd,
            n_vocab=info.n_vocab,
            recipe_fingerprint=self.fingerprint,
            max_sessions=st["max_sessions"],
            context_tokens=st["context_tokens"],
            budget_tokens=st["budget_tokens"],
            live_sessions=st["live_sessions"],
            reserved_tokens=st["reserved_tokens"],
            kv_bytes_per_token=st["kv_bytes_per_token"],
            sessions=self._visible_sessions(principal),
            kv_type=self.manager.config.kv_type,
            flash_attn=self.manager.config.flash_attn,
            numerics=self.manager.config.numerics,
            backend=self.placement.text(info.n_owned_layers),
            device=self.placement.device,
            device_layers=self.placement.device_layers,
            kernels=self.placement.kernels,
            warm_sessions=st["warm_sessions"],
            warm_bytes=st["warm_bytes"],
            warm_capacity=st["warm_capacity"],
            spills=st["spills"],
            restores=st["restores"],
            warm_drops=st["warm_drops"],
            misses=st["misses"],
            evictions_lru=st["evictions_lru"],
            evictions_ttl=st["evictions_ttl"],
            engine_busy_seconds=loop["busy_seconds"],
            engine_steps=loop["steps"],
            engine_requests=loop["requests"],
            peers=sorted(self.peers.allowed),
            max_request_bytes=self.bounds.request,
            max_in_flight_request_bytes=self.bounds.in_flight,
            prefix_entries=st["prefix_entries"],
            prefix_bytes=st["prefix_bytes"],
            prefix_capacity=st["prefix_capacity"],
            prefix_hits=st["prefix_hits"],
            prefix_tokens_saved=st["prefix_tokens_saved"],
            prefix_stores=st["prefix_stores"],
            prefix_evictions=st["prefix_evictions"],
            share_prefixes=self.prefixes.share,
            tokens_computed=st["tokens_computed"],
            instance_id=self.instance_id,
            model_digest=self.model_digest,
            wire_dtypes=self.steps.wire_dtypes,
            wire_dtype=self.wire_dtype,
            forwarded_hidden_bytes=dict(self.steps.forwarded_bytes),
            draining=self.moves.draining,
            handover_sessions=self.metrics.handover_total,
            features=FEATURES,
            receipt_key=self.receipt_signer.key.public,
            **self.head.info_fields(),
        )


def _wire_dtype(name: str, n_embd: int) -> int:
    """The wire type a head's own route uses when a request names none (serve --wire-dtype)."""
    if name not in WIRE_DTYPES:
        raise InvalidInputError(f"wire dtype {name!r}: one of {', '.join(WIRE_DTYPES)}")
    dtype = WIRE_DTYPES[name]
    if dtype not in wire_dtypes_for(n_embd):  # q8_0 only where a row is whole blocks
        raise InvalidInputError(
            f"--wire-dtype {name} carries rows of whole {Q8_0_BLOCK}-value "
            f"blocks; this model's rows have {n_embd} values"
        )
    return dtype
