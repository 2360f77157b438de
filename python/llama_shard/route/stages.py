"""A route's stages from the caller's side: each worker (`RemoteStage`, gRPC) or a shard in this
process (`LocalStage`), what each says of itself (`StageInfo`), and the checks of a route they form."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import grpc
import numpy as np

from ..engine.adapter import KvBoundaryAdapter
from ..engine.hot_kv import MIXED_NUMERICS, BoundaryBundle, CacheMiss, HotKvStateConfig, Step, StepKind, TailOutput
from ..engine.manager import HotKvStateManager
from ..engine.models import placement
from ..engine.pipeline import check_tiling
from ..errors import InvalidInputError, LlamaShardError
from ..proto import shard_pb2 as pb
from ..proto import shard_pb2_grpc as pb_grpc
from ..proto.credentials import ClientSecurity
from ..proto.wire import RECONNECT_OPTIONS, call_reconnecting, decode_tensor, encode_tensor


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
    numerics: str = ""  # route_numerics: K/V type and attention ("": not known)
    backend: str = ""  # where its layers run, for people ("cpu (haswell)", "Vulkan0 (...)"; "": not known)
    device: str = ""  # the facts (InfoReply.device, device_layers, kernels; "": an older worker)
    device_layers: int = 0
    kernels: str = ""

    @property
    def owned_layers(self) -> int:
        return self.last - self.first + 1


@dataclasses.dataclass
class StepOutcome:
    """What a stage answered: hidden rows (non-tail), logits + token (tail), or a miss."""

    hidden: np.ndarray | None = None
    logits: np.ndarray | None = None
    token_id: int | None = None
    miss: str | None = None


class LocalStage:
    """An engine in this process (with its own manager, whose step loop batches concurrent steps)."""

    def __init__(self, model, config: HotKvStateConfig | None = None, *, n_batch: int = 512):
        self.model = model
        self.manager = HotKvStateManager(model, config, n_batch=n_batch)
        self.adapter = KvBoundaryAdapter(model, self.manager)
        i = model.info
        where = placement(model)
        self.info = StageInfo(
            i.first,
            i.last,
            i.n_layer,
            i.n_embd,
            i.architecture,
            f"local {i.first}-{i.last}",
            self.manager.config.numerics,
            where.text(i.n_owned_layers),
            *where,
        )

    def step_many(self, steps: Sequence[Step]) -> list:
        """One StepOutcome or RouteError per step."""
        return [self._outcome(out) for out in self.adapter.step_many(steps)]

    def _outcome(self, out):
        if isinstance(out, LlamaShardError):
            return RouteError(f"{self.info.name}: {type(out).__name__}: {out}")
        if isinstance(out, CacheMiss):
            return StepOutcome(miss=out.reason.name)
        if isinstance(out, TailOutput):
            return StepOutcome(logits=out.logits, token_id=out.token_id)
        assert isinstance(out, BoundaryBundle)
        return StepOutcome(hidden=out.hidden)

    def release(self, sid, epoch) -> None:
        self.manager.release(sid, epoch)

    def close(self) -> None:
        self.manager.close()


class RemoteStage:
    """A worker reached over gRPC."""

    def __init__(
        self,
        address: str,
        *,
        timeout_s: float = 60.0,
        wire_dtype: int = pb.DTYPE_FLOAT32,
        return_logits: bool = False,
        security: ClientSecurity = ClientSecurity(),
    ):
        self.address = address
        self.return_logits = return_logits
        self.timeout_s = timeout_s
        self.wire_dtype = wire_dtype
        self.channel = security.channel(
            address,
            [
                ("grpc.max_receive_message_length", 64 * 2**20),
                ("grpc.max_send_message_length", 64 * 2**20),
                *RECONNECT_OPTIONS,
            ],
        )
        self.stub = pb_grpc.ShardServiceStub(self.channel)
        try:
            r = self.stub.Info(pb.InfoRequest(), timeout=timeout_s)
        except grpc.RpcError as e:
            raise RouteError(f"worker {address} is not reachable: {e.code().name}: {e.details()}") from None
        self.info = StageInfo(
            r.first,
            r.last,
            r.n_layer,
            r.n_embd,
            r.architecture,
            f"{address} ({r.first}-{r.last})",
            r.numerics,
            r.backend,
            r.device,
            r.device_layers,
            r.kernels,
        )
        self.fingerprint = r.recipe_fingerprint
        self.peers = frozenset(r.peers)  # the workers it forwards chained steps to

    def _call(self, method, request, retry: bool = True):
        # UNAVAILABLE is retried while the channel reconnects, and a DEADLINE_EXCEEDED once: the
        # same request again, which is safe when it may have run already: a decode at its expected
        # position is answered again (the worker's retry rule; a lost reply costs one step, not a
        # re-prefill), a prefill at its position recomputes the same cells, a release is
        # idempotent, Info only reads. A step without a position is sent once (retry=False)
        def once():
            return method(request, timeout=self.timeout_s)

        try:
            if not retry:
                return once()
            try:
                return call_reconnecting(once)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise
                return call_reconnecting(once)
        except grpc.RpcError as e:
            raise RouteError(f"worker {self.info.name} failed: {e.code().name}: {e.details()}") from None

    def _request(self, step: Step, return_logits: bool | None = None) -> pb.StepRequest:
        req = pb.StepRequest(
            session_id=step.session_id,
            route_epoch=step.route_epoch,
            recipe_fingerprint=self.fingerprint,
            reply_dtype=self.wire_dtype,
            return_logits=self.return_logits if return_logits is None else return_logits,
        )
        if step.position >= 0:
            req.position = step.position
        if step.token_ids is not None:
            req.token_ids.extend(int(t) for t in step.token_ids)
        if step.hidden is not None:
            req.hidden.CopyFrom(encode_tensor(step.hidden, self.wire_dtype))
        return req

    def step_many(self, steps: Sequence[Step], chain: Sequence["RemoteStage"] = ()) -> list:
        """One StepOutcome or RouteError per step. One step goes as Prefill/Decode (the worker may
        batch it with other clients' steps), several as one StepBatch message; RouteError is raised
        when the worker cannot be reached. With `chain` (the stages after this one), the worker
        forwards the rows itself and the answers are the last stage's."""
        forward = [pb.Hop(address=s.address, recipe_fingerprint=s.fingerprint) for s in chain]
        logits = chain[-1].return_logits if chain else None  # the tail's setting
        if len(steps) == 1:
            step = steps[0]
            method = self.stub.Prefill if step.kind == StepKind.PREFILL else self.stub.Decode
            request = self._request(step, logits)
            request.forward.extend(forward)
            replies = [self._call(method, request, retry=step.position >= 0)]
        else:
            kinds = {StepKind.PREFILL: pb.STEP_KIND_PREFILL, StepKind.DECODE: pb.STEP_KIND_DECODE}
            batch = pb.StepBatchRequest(
                steps=[pb.BatchedStep(kind=kinds[s.kind], step=self._request(s, logits)) for s in steps],
                forward=forward,
            )
            replies = list(self._call(self.stub.StepBatch, batch, retry=all(s.position >= 0 for s in steps)).replies)
            if len(replies) != len(steps):
                raise RouteError(f"worker {self.info.name} answered {len(replies)} of {len(steps)} steps")
        route = [self, *chain]
        return [self._outcome(reply, route) for reply in replies]

    def _outcome(self, reply, route: Sequence["RemoteStage"]):
        """A reply as a StepOutcome or RouteError; `route` names the stage a chained reply came from."""
        stage = route_stage(route, reply.stage)
        if reply.outcome == pb.OUTCOME_CACHE_MISS:
            return StepOutcome(miss=reply.miss_reason)
        if reply.outcome != pb.OUTCOME_OK:
            where = f" (stage {reply.stage} of the chain)" if len(route) > 1 else ""
            return RouteError(f"worker {stage.info.name}{where}: {pb.Outcome.Name(reply.outcome)}: {reply.detail}")
        if stage.info.last == stage.info.n_layer - 1:  # the tail: the token, and the logits if asked
            logits = (
                decode_tensor(reply.logits, len(reply.logits.data) // 4, 1)[0] if reply.HasField("logits") else None
            )
            return StepOutcome(logits=logits, token_id=reply.token_id)
        return StepOutcome(hidden=decode_tensor(reply.hidden, stage.info.n_embd, 1 << 20))

    def release(self, sid, epoch) -> None:
        self._call(self.stub.Release, pb.SessionRequest(session_id=sid, route_epoch=epoch))

    def stats(self) -> pb.InfoReply:
        return self._call(self.stub.Info, pb.InfoRequest())

    def close(self) -> None:
        self.channel.close()


def route_stage(route: Sequence, stage: int):
    """The stage a chained reply names (clamped: a worker's number is not trusted as an index)."""
    return route[min(max(stage, 0), len(route) - 1)]


def route_backends(stages: Sequence) -> str:
    """Each stage's backend, and what the route promises: stages on one backend give the whole
    model's logits to the bit; a route across backends agrees with it only as closely as their
    kernels round alike (docs/devices.md has the measured agreement)."""
    infos = [s.info for s in stages]
    lines = [f"{i.name}: {i.backend or 'backend not reported'}" for i in infos]
    kinds = set()
    for i in infos:
        # some owned layers on the device, the rest on the CPU: two backends in one stage
        partial = not i.device or i.device_layers != i.owned_layers
        kinds.add("partial offload" if partial else (i.device, i.kernels))
    promise = (
        "one backend: split = whole to the bit"
        if len(kinds) == 1 and "partial offload" not in kinds
        else "mixed backends: close to the whole model, not equal to it (other kernels round differently)"
    )
    return "; ".join(lines) + f" ({promise})"


def check_route(stages: Sequence) -> None:
    """Ranges tile the model exactly and the stages agree on the model, the K/V type and the
    attention kernel (clear errors otherwise). Stages on different backends chain (route_backends
    says what such a route promises)."""
    infos = [s.info for s in stages]
    if not infos:
        raise InvalidInputError("a route needs at least one stage")
    ref = infos[0]
    for i in infos[1:]:
        if (i.n_layer, i.n_embd, i.architecture) != (ref.n_layer, ref.n_embd, ref.architecture):
            raise InvalidInputError(
                f"stage {i.name} serves a different model ({i.architecture}, {i.n_layer} layers, "
                f"n_embd {i.n_embd}) than {ref.name}"
            )
        if i.numerics and ref.numerics and i.numerics != ref.numerics:
            raise InvalidInputError(
                f"stage {i.name} computes with {i.numerics}, {ref.name} with {ref.numerics}: {MIXED_NUMERICS}"
            )
    check_tiling([(i.first, i.last) for i in infos], ref.n_layer)


def can_chain(stages: Sequence) -> bool:
    """Every stage is a worker, and each one forwards to the next (the next is among its peers)."""
    return (
        len(stages) > 1
        and all(isinstance(s, RemoteStage) for s in stages)
        and all(b.address in a.peers for a, b in zip(stages, stages[1:]))
    )
