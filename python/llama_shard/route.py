"""The pipeline client: drives route sessions through an ordered list of shards.

A route is a list of stages, in-process (`LocalStage`, an engine in this process) or remote
(`RemoteStage`, a worker's address). Their layer ranges must tile the model exactly and their
recipes must agree (checked up front). A `RouteSession` keeps its token history on the head side;
when any shard answers with a cache miss, it re-prefills the whole route from token zero (the
seeds' degrade rule) and carries on with the same tokens. Changing the route moves every session
to a new epoch, so state cached under the old route is superseded, never reused by mistake.
"""
from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import grpc
import numpy as np

from .errors import InvalidInputError, LlamaShardError
from .hot_kv import BoundaryBundle, CacheMiss, HotKvStateConfig, TailOutput
from .manager import HotKvStateManager, KvBoundaryAdapter
from .pipeline import check_tiling
from .proto import shard_pb2 as pb
from .proto import shard_pb2_grpc as pb_grpc
from .scheduler import StepScheduler
from .wire import decode_tensor, encode_tensor


class RouteError(LlamaShardError):
    """A shard of the route cannot be reached or answered with an error that re-prefill cannot fix."""


@dataclasses.dataclass(frozen=True)
class StageInfo:
    first: int
    last: int
    n_layer: int
    n_embd: int
    architecture: str
    name: str


@dataclasses.dataclass
class StepOutcome:
    """What a stage answered: hidden rows (non-tail), logits + token (tail), or a miss."""

    hidden: np.ndarray | None = None
    logits: np.ndarray | None = None
    token_id: int | None = None
    miss: str | None = None


class LocalStage:
    """An engine in this process (with its own manager and batching scheduler)."""

    def __init__(self, model, config: HotKvStateConfig | None = None, *, n_batch: int = 512):
        self.model = model
        self.manager = HotKvStateManager(model, config, n_batch=n_batch)
        self.scheduler = StepScheduler(self.manager)
        self.adapter = KvBoundaryAdapter(model, self.manager, self.scheduler)
        i = model.info
        self.info = StageInfo(i.first, i.last, i.n_layer, i.n_embd, i.architecture, f"local {i.first}-{i.last}")

    def step(self, kind, sid, epoch, position, tokens=None, hidden=None) -> StepOutcome:
        fn = self.adapter.prefill if kind == "prefill" else self.adapter.decode
        kw = {"start_pos": position} if kind == "prefill" else {"expected_seq_len": position}
        try:
            out = fn(sid, epoch, token_ids=tokens, boundary=hidden, **kw)
        except LlamaShardError as e:
            raise RouteError(f"{self.info.name}: {type(e).__name__}: {e}") from e
        if isinstance(out, CacheMiss):
            return StepOutcome(miss=out.reason.name)
        if isinstance(out, TailOutput):
            return StepOutcome(logits=out.logits, token_id=out.token_id)
        assert isinstance(out, BoundaryBundle)
        return StepOutcome(hidden=out.hidden)

    def release(self, sid, epoch) -> None:
        self.manager.release(sid, epoch)

    def close(self) -> None:
        self.scheduler.close()


class RemoteStage:
    """A worker reached over gRPC."""

    def __init__(self, address: str, *, timeout_s: float = 60.0, wire_dtype: int = pb.DTYPE_FLOAT32,
                 return_logits: bool = False):
        self.address = address
        self.return_logits = return_logits
        self.timeout_s = timeout_s
        self.wire_dtype = wire_dtype
        self.channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 * 2**20),
                                                               ("grpc.max_send_message_length", 64 * 2**20),
                                                               ("grpc.initial_reconnect_backoff_ms", 100),
                                                               ("grpc.max_reconnect_backoff_ms", 1000)])
        self.stub = pb_grpc.ShardServiceStub(self.channel)
        try:
            r = self.stub.Info(pb.InfoRequest(), timeout=timeout_s)
        except grpc.RpcError as e:
            raise RouteError(f"worker {address} is not reachable: {e.code().name}: {e.details()}") from None
        self.info = StageInfo(r.first, r.last, r.n_layer, r.n_embd, r.architecture, f"{address} ({r.first}-{r.last})")
        self.fingerprint = r.recipe_fingerprint

    def _call(self, method, request, attempts: int = 4):
        # UNAVAILABLE (not connected, or reconnecting after a restart) is retried briefly; a step
        # that did run twice is caught by its expected position and re-prefilled, never doubled
        for attempt in range(attempts):
            try:
                return method(request, timeout=self.timeout_s)
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.UNAVAILABLE and attempt + 1 < attempts:
                    time.sleep(0.25 * (attempt + 1))
                    continue
                raise RouteError(f"worker {self.info.name} failed: {e.code().name}: {e.details()}") from None

    def step(self, kind, sid, epoch, position, tokens=None, hidden=None) -> StepOutcome:
        req = pb.StepRequest(session_id=sid, route_epoch=epoch, recipe_fingerprint=self.fingerprint,
                             reply_dtype=self.wire_dtype, return_logits=self.return_logits)
        if position is not None:
            req.position = position
        if tokens is not None:
            req.token_ids.extend(int(t) for t in tokens)
        if hidden is not None:
            req.hidden.CopyFrom(encode_tensor(hidden, self.wire_dtype))
        reply = self._call(self.stub.Prefill if kind == "prefill" else self.stub.Decode, req)
        if reply.outcome == pb.OUTCOME_CACHE_MISS:
            return StepOutcome(miss=reply.miss_reason)
        if reply.outcome != pb.OUTCOME_OK:
            raise RouteError(f"worker {self.info.name}: {pb.Outcome.Name(reply.outcome)}: {reply.detail}")
        if self.info.last == self.info.n_layer - 1:  # the tail: the token, and the logits if asked
            logits = (decode_tensor(reply.logits, len(reply.logits.data) // 4, 1)[0]
                      if reply.HasField("logits") else None)
            return StepOutcome(logits=logits, token_id=reply.token_id)
        return StepOutcome(hidden=decode_tensor(reply.hidden, self.info.n_embd, 1 << 20))

    def release(self, sid, epoch) -> None:
        self._call(self.stub.Release, pb.SessionRequest(session_id=sid, route_epoch=epoch))

    def stats(self) -> pb.InfoReply:
        return self._call(self.stub.Info, pb.InfoRequest())

    def close(self) -> None:
        self.channel.close()


def check_route(stages: Sequence) -> None:
    """Ranges tile the model exactly and the stages agree on the model (clear errors otherwise)."""
    infos = [s.info for s in stages]
    if not infos:
        raise InvalidInputError("a route needs at least one stage")
    ref = infos[0]
    for i in infos[1:]:
        if (i.n_layer, i.n_embd, i.architecture) != (ref.n_layer, ref.n_embd, ref.architecture):
            raise InvalidInputError(f"stage {i.name} serves a different model ({i.architecture}, {i.n_layer} layers, "
                                    f"n_embd {i.n_embd}) than {ref.name}")
    check_tiling([(i.first, i.last) for i in infos], ref.n_layer)


class RouteClient:
    """An ordered route of stages and the sessions that run through it."""

    def __init__(self, stages: Sequence, *, max_reprefills: int = 3):
        check_route(stages)
        self.stages = list(stages)
        self.epoch = 0
        self.max_reprefills = max_reprefills
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def change_route(self, stages: Sequence) -> None:
        """Moves to a new route; sessions continue under a new epoch (re-prefilled on their next step)."""
        check_route(stages)
        with self._lock:
            self.stages = list(stages)
            self.epoch += 1

    def session(self, session_id: str | None = None) -> "RouteSession":
        return RouteSession(self, session_id or f"route-session-{next(self._ids)}")

    def close(self) -> None:
        for s in self.stages:
            s.close()


class RouteSession:
    """One route session: its token history lives here, on the head side."""

    def __init__(self, client: RouteClient, session_id: str):
        self.client = client
        self.session_id = session_id
        self.history: list[int] = []      # every token whose KV the route should hold
        self.epoch = client.epoch
        self.reprefills = 0

    def _through_route(self, kind: str, position: int | None, tokens: list[int]) -> StepOutcome:
        out = StepOutcome()
        for i, stage in enumerate(self.client.stages):
            out = stage.step(kind, self.session_id, self.epoch, position,
                             tokens=tokens if i == 0 else None, hidden=out.hidden if i else None)
            if out.miss is not None:
                return out
        return out

    def _step(self, kind: str, new_tokens: list[int]) -> StepOutcome:
        if self.epoch != self.client.epoch:
            self.epoch = self.client.epoch  # the route changed: re-prefill under the new epoch
            out = StepOutcome(miss="SUPERSEDED_EPOCH")
        else:
            # prefill appends at, and decode expects, the length the route already holds
            out = self._through_route(kind, len(self.history), new_tokens)
        if out.miss is None:
            self.history.extend(new_tokens)
            return out
        # degrade rule: re-prefill the whole history plus the new tokens from token zero
        for _ in range(self.client.max_reprefills):
            self.reprefills += 1
            full = self.history + new_tokens
            out = self._through_route("prefill", 0, full)
            if out.miss is None:
                self.history = full
                return out
        raise RouteError(f"session {self.session_id}: still a cache miss ({out.miss}) after "
                         f"{self.client.max_reprefills} re-prefills")

    def generate(self, prompt: Sequence[int], max_tokens: int, stop: Sequence[int] = (),
                 on_token: Callable[[int], None] | None = None) -> list[int]:
        """Greedy generation: prefill the prompt, then decode token by token."""
        if not prompt:
            raise InvalidInputError("the prompt is empty")
        out = self._step("prefill", list(prompt))
        generated: list[int] = []
        for _ in range(max_tokens):
            token = int(out.token_id)
            generated.append(token)
            if on_token:
                on_token(token)
            if token in stop or len(generated) == max_tokens:
                break
            out = self._step("decode", [token])
        return generated

    def stream(self, prompt: Sequence[int], max_tokens: int, stop: Sequence[int] = ()) -> Iterator[int]:
        """`generate` as an iterator of tokens."""
        if not prompt:
            raise InvalidInputError("the prompt is empty")
        out = self._step("prefill", list(prompt))
        for i in range(max_tokens):
            token = int(out.token_id)
            yield token
            if token in stop or i + 1 == max_tokens:
                return
            out = self._step("decode", [token])

    def release(self) -> None:
        for stage in self.client.stages:
            try:
                stage.release(self.session_id, self.epoch)
            except RouteError:
                pass  # a worker that is gone holds nothing
