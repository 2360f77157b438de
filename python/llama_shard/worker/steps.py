"""Running steps on a worker: a batch of (kind, StepRequest) parsed and checked, admitted, computed
together by the engine, its rows forwarded down the route, each step answered with a typed reply.

`StepRunner` knows no gRPC call: the servicer's handlers (worker.py) give it the caller they
authenticated and the workers a step passed through, and the head's generation loop runs its own
steps here too (through `HeadHost.run_steps`). Every check runs before anything is computed, so a
step refused changes no state.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import NamedTuple

import grpc
import numpy as np

from .._native import SamplingParams
from ..engine.adapter import KvBoundaryAdapter
from ..engine.hot_kv import MIXED_NUMERICS, BoundaryBundle, CacheMiss, Step, StepKind, TailOutput
from ..engine.manager import HotKvStateManager
from ..errors import (
    ComputeError,
    IncompatibleCacheRecipeError,
    InvalidInputError,
    KvBudgetExceededError,
    LlamaShardError,
    StaleRouteEpochError,
    Why,
    WhyNot,
)
from ..proto import shard_pb2 as pb
from ..proto.requests import MAX_DRAFTS
from ..proto.wire import call_reconnecting, decode_tensor, encode_tensor, wire_dtype_name, wire_dtypes_for
from ..receipts.chain import (
    NONCE_BYTES,
    CommittedStep,
    ReceiptChains,
    answer_of,
    logits_digest,
    rows_digest,
    tokens_digest,
)
from ..structured.replay import SAMPLER_STATE_MISS
from .admission import SessionCapRefused, SessionOwners
from .handover import NOT_HANDED_OVER, HandedIn, SessionMoves
from .peers import MAX_FORWARD_HOPS, Peers
from .prefixes import PREFIX_BLOCK_TOKENS, PrefixNames, block_keys
from .sampling import SamplerStateMissing, StepSamplingChecks, TailSamplers, log_softmax_of, verify
from .security import ServerSecurity
from .session_order import SessionOrder


class PrefixSteps(NamedTuple):
    """What a step does with shared prefixes: open from one (its tokens and this worker's key for
    it; 0: none) and/or store one when it ends."""

    open_tokens: int
    open_key: int
    store_tokens: int
    store_key: int


class StepRunner:
    def __init__(
        self,
        model,
        manager: HotKvStateManager,
        adapter: KvBoundaryAdapter,
        security: ServerSecurity,
        peers: Peers,
        owners: SessionOwners,
        prefixes: PrefixNames,
        samplers: TailSamplers,
        worker_id: str,
        moves: SessionMoves | None = None,
        handed_in: HandedIn | None = None,
    ):
        self.info = model.info
        self.manager, self.adapter, self.security = manager, adapter, security
        self.peers, self.owners, self.prefixes, self.samplers = peers, owners, prefixes, samplers
        self.fingerprint = manager.recipe.fingerprint()
        self.numerics = manager.config.numerics
        self.wire_dtypes = wire_dtypes_for(model.info.n_embd)
        # each session's steps in the order sent: one pipelined stream's windows per session wait at once
        self.order = SessionOrder(4 * manager.config.max_sessions, 2 * manager.config.max_sessions)
        self.forwarded_bytes: dict[str, int] = {}  # hidden-row bytes the next hop took, by wire type
        self._forwarded_lock = threading.Lock()
        config = manager.config
        self.sampling_checks = StepSamplingChecks(
            self.info.n_vocab, config.context_tokens, 2 * config.max_sessions, model
        )
        self.worker_id = worker_id  # this worker in the visited list
        self.own_addresses = frozenset()  # set by ShardWorker once bound: forwards to these are loops
        self.moves = moves if moves is not None else SessionMoves()  # a drain's sessions (handover.py)
        self.handed_in = handed_in if handed_in is not None else HandedIn(4 * config.max_sessions)
        # each request's commitments (receipt_nonce), signed by Receipt: about as many steps in all as
        # twice the tokens the KV budget holds (a step is at least one token)
        self.receipts = ReceiptChains(4 * config.max_sessions, 2 * manager.stats()["budget_tokens"])
        self._queued = itertools.count()  # the engine's order of the steps a head records

    def run(
        self,
        principal: str,
        visited: tuple[str, ...],
        items: list[tuple],
        forward,
        deadline: float,
        batch: bool,
        own_loop: bool = False,
        prefix_scope=None,
        assertion: bytes | None = None,
    ) -> list[pb.StepReply]:
        """Parses every (kind, StepRequest), runs the valid ones together, answers each on its own; a
        chained call then sends the computed rows on to forward[0] and answers what it replied. The
        gRPC handlers and the head's generation loop (`own_loop`: its prefix plans are its own) both
        run steps here; raises SessionCapRefused when the principal's session cap
        refuses a new session. `prefix_scope`: whose shared prefixes the steps reach (None: the
        principal's, or every caller's for the head's own loop when the worker shares them).
        `assertion`: the forwarder's, passed on to the next hop (None: this worker signs)."""
        if prefix_scope is None:
            prefix_scope = self.prefixes.scope(principal, shared=own_loop)
        refusal = self.forward_refusal(forward, visited)
        if refusal is not None:  # before anything is computed, and before the hops are copied
            return [pb.StepReply(outcome=pb.OUTCOME_INVALID_ARGUMENT, detail=refusal.text) for _ in items]
        forward = list(forward)
        replies: list = [None] * len(items)
        parsed = []
        entered: list[str] = []  # sessions whose steps run here now: a drain waits for them
        try:
            for i, (kind, req) in enumerate(items):
                try:
                    step = self._parse_step(kind, req, principal)
                    if req.follows:  # before it counts as running here: a drain does not wait for it
                        self.order.wait_turn([step], deadline)
                    entry = (
                        i,
                        step,
                        self.sampling_checks.params((step.session_id, step.route_epoch), req),
                        self._parse_prefix(req, step, prefix_scope, own_loop),
                    )
                except LlamaShardError as e:
                    replies[i] = self._reply(req, e)
                    continue
                replies[i] = self._enter(step, deadline, entered) or self._handed(step, req)
                if replies[i] is None:
                    parsed.append(entry)
            return self._run_parsed(
                principal, visited, items, forward, deadline, batch, prefix_scope, assertion, replies, parsed
            )
        finally:
            for key in entered:
                self.moves.leave(key)

    def _enter(self, step: Step, deadline: float, entered: list[str]) -> pb.StepReply | None:
        """None: the step may run here (its key added to `entered`); else the answer of a draining
        worker: the replica its session was handed to, or a refusal of a new session."""
        moved = self.moves.enter(step.session_id, deadline)
        if moved is not None and moved.to is None:
            return pb.StepReply(
                outcome=pb.OUTCOME_UNAVAILABLE,
                detail="this worker is draining: the session's hand-over outlasted the step's deadline",
            )
        if moved is not None:
            return pb.StepReply(
                outcome=pb.OUTCOME_UNAVAILABLE,
                moved_to=moved.to,
                detail=f"this worker is draining: the session was handed to {moved.to}",
            )
        entered.append(step.session_id)
        try:
            new = self.moves.draining and isinstance(self.manager.resolve(step.session_id, step.route_epoch), CacheMiss)
        except LlamaShardError:  # a stale epoch: the step answers it
            new = False
        if new:
            return pb.StepReply(
                outcome=pb.OUTCOME_UNAVAILABLE,
                detail="this worker is draining: it takes no new session (a replica of its layers does)",
            )
        return None

    def _handed(self, step: Step, req: pb.StepRequest) -> pb.StepReply | None:
        """None: the step may run here; else the miss of a step whose head expects the session to have
        arrived by a hand-over that this worker did not receive (nothing is computed)."""
        handed_from = req.handed_from[0] if req.handed_from else ""
        if self.handed_in.step(step.session_id, step.route_epoch, handed_from):
            return None
        return pb.StepReply(
            outcome=pb.OUTCOME_CACHE_MISS,
            miss_reason=NOT_HANDED_OVER,
            detail="the session was not handed to this worker by the replica the head last placed it on",
        )

    def _run_parsed(
        self,
        principal: str,
        visited: tuple[str, ...],
        items: list[tuple],
        forward: list,
        deadline: float,
        batch: bool,
        prefix_scope,
        assertion: bytes | None,
        replies: list,
        parsed: list,
    ) -> list[pb.StepReply]:
        """run()'s steps once parsed and let in: admitted, computed, forwarded, answered."""
        refused = self.owners.admit(principal, [step.session_id for _, step, _, _ in parsed])
        if refused is not None:
            raise SessionCapRefused(refused.text)
        ready = []
        for entry in parsed:  # a step from a shared prefix starts from a copy of it
            i, step, _, prefix = entry
            try:
                opened = (
                    self.manager.open_prefix(step.session_id, step.route_epoch, prefix.open_key, prefix.open_tokens)
                    if prefix is not None and prefix.open_tokens
                    else None
                )
            except LlamaShardError as e:  # a stale epoch, a prefix over the budget: this step's answer
                opened = e
            if isinstance(opened, (CacheMiss, LlamaShardError)):
                replies[i] = self._reply(items[i][1], opened)
            else:
                ready.append(entry)
        steps = [step for _, step, _, _ in ready]
        queued, queued_at = self._on_queued(ready, items)
        outs = self.adapter.step_many(steps, queued) if steps else []
        computed = []
        commits: dict[int, CommittedStep] = {}  # steps of a request with a nonce: committed once answered OK
        orders = {i: queued_at[id(step)] for i, step, _, _ in ready if id(step) in queued_at}
        for (i, step, params, prefix), out in zip(ready, outs):
            if prefix is not None and prefix.store_tokens and isinstance(out, (BoundaryBundle, TailOutput)):
                try:
                    self.manager.store_prefix(step.session_id, step.route_epoch, prefix.store_key, prefix.store_tokens)
                except LlamaShardError:
                    pass  # the session moved on since (a newer epoch, another step): nothing is stored
            req = items[i][1]
            if forward and isinstance(out, BoundaryBundle):
                try:  # its rows as the wire type asked (q8_0 refuses values beyond its range)
                    computed.append((i, step.kind, out, encode_tensor(out.hidden, req.reply_dtype)))
                except LlamaShardError as e:
                    replies[i] = self._reply(req, e)
                    continue
                out_digest = rows_digest(computed[-1][3]) if req.receipt_nonce else b""
            else:
                replies[i] = self._reply(req, out, params, (step.session_id, step.route_epoch))
                out_digest = (
                    (rows_digest(replies[i].hidden) if replies[i].HasField("hidden") else _tail_digest(out))
                    if req.receipt_nonce and isinstance(out, (BoundaryBundle, TailOutput))
                    else b""
                )
            if out_digest:
                commits[i] = self._committed(step, req, out, out_digest)
        if computed:
            for i, reply in zip(
                [i for i, _, _, _ in computed],
                self._forward(
                    principal, items, computed, forward, deadline, batch, visited, prefix_scope, assertion, orders
                ),
            ):
                replies[i] = reply
        for i, commit in commits.items():  # only what the whole route answered OK: every stage commits alike
            if replies[i].outcome == pb.OUTCOME_OK:
                self.receipts.commit(commit, [] if replies[i].HasField("hidden") else answer_of(replies[i]))
        return replies

    def _on_queued(self, ready: list, items: list[tuple]):
        """The engine's on_queued for these steps: the sessions' order, and where a head records steps
        for a spot check, their place in this worker's engine order (filled in the dict returned)."""
        recorded = {id(step) for i, step, _, _ in ready if self.receipts.recording(items[i][1].receipt_nonce)}
        queued_at: dict[int, int] = {}
        if not recorded:
            return self.order.queued, queued_at

        def queued(qsteps) -> None:
            for st in qsteps:  # before order.queued lets a session's next step in
                if id(st) in recorded:
                    queued_at[id(st)] = next(self._queued)
            self.order.queued(qsteps)

        return queued, queued_at

    def _committed(self, step: Step, req, out, out_digest: bytes) -> CommittedStep:
        n = step.n_tokens
        pos = out.start_pos if isinstance(out, BoundaryBundle) else out.seq_len - n
        in_digest = rows_digest(req.hidden) if req.HasField("hidden") else tokens_digest(req.token_ids)
        return CommittedStep((step.session_id, step.route_epoch, req.receipt_nonce), pos, n, in_digest, out_digest)

    def forward_refusal(self, forward, visited: tuple[str, ...] = ()) -> WhyNot | None:
        """Why a step cannot be served here (None: it can): a forwarding loop, or a chained call
        this worker cannot forward. Checked before anything is computed; `forward` (the request's
        repeated field) is read by length first, so a huge list costs nothing before its refusal."""
        why = self._forward_problem(forward, visited)
        return WhyNot(Why.FORWARD, why) if why is not None else None

    def _forward_problem(self, forward, visited: tuple[str, ...]) -> str | None:
        if self.worker_id in visited:
            return "a forwarding loop: this step already passed through this worker"
        if not forward:
            return None
        if self.info.is_tail:
            return "this worker is the tail of the model: there is no next worker to forward to"
        # each later stage owns at least one layer: no more hops than layers after this shard
        hops_left = min(MAX_FORWARD_HOPS, self.info.n_layer - 1 - self.info.last)
        if len(forward) > hops_left:
            return (
                f"{len(forward)} hops after this worker (layers {self.info.first}-{self.info.last} of "
                f"{self.info.n_layer}): a route has at most {hops_left} more"
            )
        addresses = [hop.address for hop in forward]
        if len(set(addresses)) != len(addresses):
            return "the forward list names a worker twice: a route visits each worker once"
        if self.own_addresses.intersection(addresses):
            return "the forward list names this worker: a route visits each worker once"
        if forward[0].address not in self.peers.allowed:
            return (
                f"this worker does not forward to {forward[0].address!r}; its operator allows "
                f"{sorted(self.peers.allowed) or 'no peers'} (serve --peer HOST:PORT)"
            )
        return None

    def _forward(
        self,
        principal: str,
        items: list[tuple],
        computed: list[tuple],
        forward: list,
        deadline: float,
        batch: bool,
        visited: tuple[str, ...] = (),
        prefix_scope=None,
        assertion: bytes | None = None,
        orders: dict[int, int] | None = None,
    ) -> list[pb.StepReply]:
        """Sends each computed step's rows to forward[0] (one call: the same RPC, or a StepBatch)
        within the caller's deadline and returns its replies, their stage counted from this worker."""
        hop, rest = forward[0], forward[1:]
        nexts = []
        for i, kind, out, hidden in computed:
            req = items[i][1]
            nxt = pb.StepRequest(
                session_id=req.session_id,
                route_epoch=req.route_epoch,
                recipe_fingerprint=hop.recipe_fingerprint,
                reply_dtype=req.reply_dtype,
                return_logits=req.return_logits,
                hidden=hidden,
                logprobs=req.logprobs,
                top_logprobs=req.top_logprobs,
                numerics=self.numerics,
                receipt_nonce=req.receipt_nonce,
            )
            if req.HasField("sampler"):
                nxt.sampler.CopyFrom(req.sampler)
            nxt.draft_tokens.extend(req.draft_tokens)
            nxt.row_by_row = req.row_by_row
            nxt.follows = req.follows
            nxt.handed_from.extend(req.handed_from[1:])
            if req.HasField("prefix"):  # the keys, mixed with what this hop adds (PrefixNames.forwarded)
                nxt.prefix.CopyFrom(req.prefix)
                del nxt.prefix.keys[:]
                nxt.prefix.keys.extend(self.prefixes.forwarded(req.prefix.keys, prefix_scope, req.reply_dtype))
            # always explicit: a retried hop that did run is answered again (a decode, by the retry
            # rule) or recomputes the same cells (a prefill at its position), never a double append
            nxt.position = out.start_pos
            nexts.append((kind, nxt))

        def forward_once():
            timeout = max(deadline - time.monotonic(), 0.001)
            return self.peers.call(
                hop.address, nexts, rest, timeout, batch, principal, visited + (self.worker_id,), assertion
            )

        try:
            # as the route client does; a hop the head has another replica of fails at once (it fails over)
            replies = forward_once() if hop.fail_fast else call_reconnecting(forward_once, deadline)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:  # reached, and full: no reason to fail over
                detail = f"worker {hop.address} is full: {e.details()}"
                return [pb.StepReply(outcome=pb.OUTCOME_BUDGET_EXCEEDED, detail=detail, stage=1) for _ in computed]
            detail = f"worker {hop.address} could not be reached: {e.code().name}: {e.details()}"
            return [pb.StepReply(outcome=pb.OUTCOME_UNAVAILABLE, detail=detail, stage=1) for _ in computed]
        with self._forwarded_lock:  # counted once delivered: a hop that could not be reached got none
            for _, nxt in nexts:
                name = wire_dtype_name(nxt.hidden.dtype)
                self.forwarded_bytes[name] = self.forwarded_bytes.get(name, 0) + len(nxt.hidden.data)
        for r in replies:
            r.stage += 1
        for (i, kind, _, _), (_, nxt), r in zip(computed, nexts, replies):  # a head's spot checks replay these
            if r.outcome == pb.OUTCOME_OK and self.receipts.recording(nxt.receipt_nonce):
                self.receipts.keep_sent(nxt.receipt_nonce, (orders or {}).get(i, 0), kind, nxt)
        return replies

    def _parse_step(self, kind: StepKind | None, req, principal: str) -> Step:
        """The Step for a wire request (keyed for its principal), checked; raises the contract's
        error otherwise."""
        if kind is None:
            raise InvalidInputError("a batched step needs kind STEP_KIND_PREFILL or STEP_KIND_DECODE")
        if req.recipe_fingerprint and req.recipe_fingerprint != self.fingerprint:
            raise IncompatibleCacheRecipeError("the request's KV recipe fingerprint does not match this shard's")
        if req.numerics and req.numerics != self.numerics:
            raise IncompatibleCacheRecipeError(
                f"this worker computes with {self.numerics}, the one before it with {req.numerics[:80]}: {MIXED_NUMERICS}"
            )
        if len(req.token_ids) and req.HasField("hidden"):
            raise InvalidInputError("send token_ids or hidden, not both")
        if req.receipt_nonce and len(req.receipt_nonce) != NONCE_BYTES:
            raise InvalidInputError(f"a receipt nonce is {NONCE_BYTES} bytes, got {len(req.receipt_nonce)}")
        if req.reply_dtype not in self.wire_dtypes:
            raise InvalidInputError(
                f"reply_dtype {wire_dtype_name(req.reply_dtype)}: this worker's rows travel as "
                f"{', '.join(map(wire_dtype_name, self.wire_dtypes))}"
            )
        n_tokens = len(req.token_ids)  # counted before anything is converted: a huge list costs nothing more
        if n_tokens > self.manager.config.context_tokens:
            raise KvBudgetExceededError(
                f"{n_tokens} token ids: a session holds at most {self.manager.config.context_tokens} (context_tokens)"
            )
        tokens = list(req.token_ids) if n_tokens else None
        hidden = (
            decode_tensor(req.hidden, self.info.n_embd, self.manager.config.context_tokens)
            if req.HasField("hidden")
            else None
        )
        position = req.position if req.HasField("position") else None
        key = self.security.engine_key(principal, req.session_id)
        n_drafts = len(req.draft_tokens)
        if n_drafts:
            self._check_drafts(req, kind, tokens, hidden, n_drafts)
        elif req.row_by_row:
            raise InvalidInputError("row_by_row belongs to a step with drafts (a verification)")
        if kind == StepKind.PREFILL:
            return Step.prefill(
                key,
                req.route_epoch,
                tokens,
                hidden,
                start_pos=position,
                logit_rows=n_drafts + 1 if self.info.is_tail and n_drafts else 1,
                row_by_row=req.row_by_row,
            )
        return Step.decode(key, req.route_epoch, tokens, hidden, expected_seq_len=position)

    def _check_drafts(self, req, kind, tokens, hidden, n_drafts: int) -> None:
        """A verification step (StepRequest.draft_tokens) fits the protocol, or InvalidInputError."""
        if n_drafts > MAX_DRAFTS:
            raise InvalidInputError(f"a step carries at most {MAX_DRAFTS} drafts, got {n_drafts}")
        if kind != StepKind.PREFILL or not req.HasField("position"):
            raise InvalidInputError("a step with drafts is a prefill at an explicit position")
        n_rows = len(tokens) if tokens is not None else (hidden.shape[0] if hidden is not None else 0)
        if n_rows != n_drafts + 1:  # every shard refuses before computing: no long row-by-row steps
            raise InvalidInputError(
                f"a step with {n_drafts} drafts is {n_drafts + 1} tokens (the last sampled one, "
                f"then the drafts), got {n_rows}"
            )
        if any(not 0 <= t < self.info.n_vocab for t in req.draft_tokens):
            raise InvalidInputError(f"a draft token is outside the vocabulary (0..{self.info.n_vocab - 1})")
        if tokens is not None and tokens[-n_drafts:] != list(req.draft_tokens):
            raise InvalidInputError("the drafts must be the step's last token ids")
        if req.logprobs or req.top_logprobs:
            raise InvalidInputError("a step with drafts returns its tokens, not logprobs; send it without drafts")

    def _parse_prefix(self, req, step: Step, scope, own_loop: bool) -> PrefixSteps | None:
        """(open tokens, its local key, store tokens, its local key) for a step's prefix plan, or None;
        raises InvalidInputError for a plan that does not fit the step (nothing is computed then)."""
        if not req.HasField("prefix"):
            return None
        plan, B = req.prefix, PREFIX_BLOCK_TOKENS
        n_keys = len(plan.keys)  # counted before anything is converted
        if n_keys > self.manager.config.context_tokens // B:
            raise InvalidInputError(
                f"a prefix plan names at most {self.manager.config.context_tokens // B} blocks "
                f"(context_tokens / {B}), got {n_keys}"
            )
        if step.kind != StepKind.PREFILL or not req.HasField("position"):
            raise InvalidInputError("a prefix plan comes with a prefill at an explicit position")
        opening, storing = plan.open_tokens, plan.store_tokens
        for name, n in (("open_tokens", opening), ("store_tokens", storing)):
            if n < 0 or n % B or n > n_keys * B:
                raise InvalidInputError(
                    f"prefix {name} must be a multiple of {B} covered by the plan's {n_keys} keys, got {n}"
                )
        if opening and step.position != opening:
            raise InvalidInputError(
                f"a step opened from a prefix of {opening} tokens starts at position {opening}, not {step.position}"
            )
        if storing and storing != step.position + step.n_tokens:
            raise InvalidInputError(
                f"a step storing a prefix of {storing} tokens must end there, not at {step.position + step.n_tokens}"
            )
        if self.info.first == 0 and not own_loop:
            # a head checks what it can: the keys of the step's own tokens, from position 0
            if opening or step.position != 0 or step.token_ids is None:
                raise InvalidInputError(
                    "a head opens a shared prefix for its own generation loop only; send the "
                    "tokens from position 0 (with keys, to store a prefix)"
                )
            if list(plan.keys) != block_keys(step.token_ids, n_keys) or n_keys > len(step.token_ids) // B:
                raise InvalidInputError("the prefix keys do not match the step's tokens")
        if not (opening or storing):
            return None
        local = self.prefixes.local
        return PrefixSteps(
            opening,
            local(scope, plan.keys[opening // B - 1]) if opening else 0,
            storing,
            local(scope, plan.keys[storing // B - 1]) if storing else 0,
        )

    def _reply(self, req, out, params: SamplingParams | None = None, key: tuple | None = None) -> pb.StepReply:
        """The typed reply for a step's outcome, or for the contract error it raised; the tail
        samples here when the step carries a sampler state (params, checked by StepSamplingChecks)."""
        if isinstance(out, StaleRouteEpochError):
            return pb.StepReply(outcome=pb.OUTCOME_STALE_EPOCH, detail=str(out), current_epoch=out.current_epoch or 0)
        if isinstance(out, KvBudgetExceededError):
            return pb.StepReply(outcome=pb.OUTCOME_BUDGET_EXCEEDED, detail=str(out))
        if isinstance(out, IncompatibleCacheRecipeError):
            return pb.StepReply(outcome=pb.OUTCOME_INCOMPATIBLE_RECIPE, detail=str(out))
        if isinstance(out, InvalidInputError):
            return pb.StepReply(outcome=pb.OUTCOME_INVALID_ARGUMENT, detail=str(out))
        if isinstance(out, (ComputeError, LlamaShardError)):
            return pb.StepReply(outcome=pb.OUTCOME_INTERNAL, detail=str(out))
        if isinstance(out, CacheMiss):
            return pb.StepReply(outcome=pb.OUTCOME_CACHE_MISS, miss_reason=out.reason.name, detail=out.detail)
        if isinstance(out, TailOutput):
            drafts = list(req.draft_tokens)
            rows = out.rows if out.rows is not None else out.logits.reshape(1, -1)
            try:
                if params is not None:
                    tokens = self.samplers.sample_rows(key, params, req.sampler, rows, drafts)
                else:
                    tokens = verify(rows, drafts, lambda row: int(np.argmax(row)))
            except SamplerStateMissing as e:  # the head sends the step again with the grammar's tokens
                return pb.StepReply(outcome=pb.OUTCOME_CACHE_MISS, miss_reason=SAMPLER_STATE_MISS, detail=str(e))
            except LlamaShardError as e:  # e.g. a non-finite logit: this step fails, not the batch
                return pb.StepReply(outcome=pb.OUTCOME_INTERNAL, detail=f"sampling failed: {e}")
            token = tokens[-1]
            reply = pb.StepReply(outcome=pb.OUTCOME_OK, seq_len=out.seq_len, token_id=token)
            if drafts:
                reply.tokens.extend(tokens)
            if req.logprobs or req.top_logprobs:
                logprob, top = log_softmax_of(out.logits, token, req.top_logprobs)
                reply.logprob = logprob
                reply.top_logprobs.extend(pb.TokenLogprob(token_id=t, logprob=lp) for t, lp in top)
            if req.return_logits:  # n_vocab floats per row computed (a verification's: each row): only when asked
                reply.logits.CopyFrom(encode_tensor(rows))
            return reply
        assert isinstance(out, BoundaryBundle)
        return pb.StepReply(
            outcome=pb.OUTCOME_OK,
            seq_len=out.start_pos + out.hidden.shape[0],
            hidden=encode_tensor(out.hidden, req.reply_dtype),
        )


def _tail_digest(out: TailOutput) -> bytes:
    """A tail step's output: every logit row it computed (a verification's, or the last token's)."""
    return logits_digest(out.rows if out.rows is not None else out.logits.reshape(1, -1))
