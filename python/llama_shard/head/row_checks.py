"""Spot checks across kernels: a stage whose only other replica computes on other kernels (a CPU of
another variant, a GPU) cannot be held to equal bytes, so its rows are compared within a tolerance
(receipts/tolerance.py).

The head replays the kept steps stage by stage, unchained, as a new session of its own:

- each stage's own worker first, on the very inputs the route gave it (at the positions the route
  gave, never its own say), answering its rows (the tail: its logit rows) to the head. From them the
  head computes the worker's commitment again and demands it equal what the worker signed in its
  receipt: the rows it answers now are the rows it sent then. The tail's tokens must follow from its
  own logit rows (the head draws them again with the step's sampler state). Its rows are the next
  stage's inputs, so each stage is judged on its own inputs and kernel noise never crosses stages;
- then the stage's partner, on the same inputs: a replica of the same kernels must give equal bytes;
  one of other kernels must come within the tolerance on every row.

A worker whose answer contradicts itself (a length it was not given, rows that do not decode, tokens
its rows do not give) or that does not repeat its commitment fails alone. One that refuses its
replay (any outcome but OK, or no answer) is marked `refused` on its stage: the head replays once
more and strikes a worker that refused both times, unless it restarted since the request
(head/proofs.py, `RouteProofs._refused`): a cheat that tells
replays apart cannot refuse them all for free, and an honest one under load refuses rarely (its
budget evicts idle sessions first; docs/benchmarks.md, "Across kernels"). A worker
and partner that disagree are arbitrated by a third replica (`arbitrate`), each of the two held to
repeating its first answers."""

from __future__ import annotations

import dataclasses
import secrets

import grpc
import numpy as np

from .._native import MAX_CONTEXT_TOKENS
from ..errors import LlamaShardError
from ..proto import shard_pb2 as pb
from ..proto.wire import decode_tensor
from ..receipts.chain import Commitment, answer_of, logits_digest, rows_digest, tokens_digest
from ..receipts.tolerance import HIDDEN_TOLERANCE, LOGITS_TOLERANCE, Closeness
from ..worker.sampling import StepSamplingChecks, TailSamplers, verify

#: a release's bound (a worker that does not answer one frees the session at its TTL)
RELEASE_S = 10.0


def outcome_name(outcome: int) -> str:
    """An answer's outcome by name; a number the wire does not define, as a number (never raises)."""
    return pb.Outcome.Name(outcome) if outcome in pb.Outcome.values() else f"outcome {outcome}"


class ReplyProblem(Exception):
    """A replayed step's OK answer that contradicts itself or its step: the answerer's fault."""


@dataclasses.dataclass
class StageRows:
    """One stage's part of a row replay: its worker's answers, and its partner's against them."""

    hop: pb.Hop
    partner: pb.Hop | None
    exact: bool  # the partner computes on the same kernels: equal bytes, not a tolerance
    tail: bool
    commitment: Commitment = dataclasses.field(default_factory=Commitment)
    closeness: Closeness = dataclasses.field(default_factory=Closeness)
    # with a partner, for a third replica: the requests it was given (hidden rows or tokens), and
    # the digests of each side's answers (each must repeat them); the rows themselves (a tail's:
    # n_vocab floats each) are not kept but asked again
    inputs: list = dataclasses.field(default_factory=list)
    worker_digests: list = dataclasses.field(default_factory=list)
    partner_digests: list = dataclasses.field(default_factory=list)
    differs: bool = False  # an exact partner's bytes (or tokens) differed
    worker_failed: str = ""  # its worker's answer contradicted itself (the stage's mismatch)
    partner_failed: str = ""  # its partner's did
    stopped: str = ""  # why the partner's replay stopped early (it did not answer)
    refused: str = ""  # why its worker did not answer its replay (refused it, or did not answer at all)
    refusal: str = ""  # the refusal's outcome (OUTCOME_...) or the call's status (DEADLINE_EXCEEDED, ...)
    parted: int = 0  # a tail of other kernels: steps whose tokens differed (near ties)

    @property
    def compared(self) -> int:
        return len(self.partner_digests)

    @property
    def tolerance(self) -> float:
        return LOGITS_TOLERANCE if self.tail else HIDDEN_TOLERANCE

    def agrees(self) -> bool:
        return not self.differs if self.exact else self.closeness.within(self.tolerance)


def _answer(reply: pb.StepReply, req: pb.StepRequest, tail: bool) -> tuple[np.ndarray, bytes]:
    """A replayed step's rows and the digest of its answer (rows, and a tail's tokens), or
    ReplyProblem."""
    n = len(req.token_ids) if not req.HasField("hidden") else req.hidden.shape[0]
    if reply.seq_len != req.position + n:
        raise ReplyProblem(
            f"it answered a length of {reply.seq_len} for positions {req.position}..{req.position + n - 1}"
        )
    t = reply.logits if tail else reply.hidden
    want = len(req.draft_tokens) + 1 if tail else n
    if len(t.shape) != 2 or t.shape[0] != want or t.shape[1] < 1:
        raise ReplyProblem(f"it answered rows of shape {list(t.shape)}, not {want} rows")
    dtype = pb.DTYPE_FLOAT32 if tail else req.reply_dtype
    if t.dtype != dtype:
        raise ReplyProblem(f"it answered rows of type {t.dtype}, not {dtype}")
    if not tail and req.HasField("hidden") and t.shape[1] != req.hidden.shape[1]:
        raise ReplyProblem(f"it answered rows of {t.shape[1]} columns, not the model's {req.hidden.shape[1]}")
    try:
        rows = decode_tensor(t, t.shape[1], t.shape[0])
    except LlamaShardError as e:
        raise ReplyProblem(f"its rows do not decode: {e}") from None
    digest = logits_digest(rows) if tail else rows_digest(t)
    return rows, digest + (tokens_digest(answer_of(reply)) if tail else b"")


def _next_request(sent: pb.StepRequest, rows: pb.Tensor, position: int, numerics: str) -> pb.StepRequest:
    """What a worker sends the next stage for `sent` (worker/steps.py, _forward), with `rows`."""
    nxt = pb.StepRequest(
        reply_dtype=sent.reply_dtype,
        hidden=rows,
        logprobs=sent.logprobs,
        top_logprobs=sent.top_logprobs,
        numerics=numerics,
        position=position,
        row_by_row=sent.row_by_row,
    )
    if sent.HasField("sampler"):
        nxt.sampler.CopyFrom(sent.sampler)
    nxt.draft_tokens.extend(sent.draft_tokens)
    return nxt


class RowReplay:
    """Replays a request's kept steps stage by stage (see the module's text). `peers`: how the head
    reaches workers; `timeout_s`: each call's bound."""

    def __init__(self, peers, timeout_s: float):
        self.peers, self.timeout_s = peers, timeout_s
        self.session_id = secrets.token_hex(12)  # a session like any other to the workers
        self._checks = self._samplers = None  # the tail's sampler, drawn again here (made on first use)

    def _call(self, hop: pb.Hop, kind, req: pb.StepRequest) -> pb.StepReply:
        mine = pb.StepRequest()
        mine.CopyFrom(req)
        mine.session_id, mine.route_epoch, mine.recipe_fingerprint = self.session_id, 1, hop.recipe_fingerprint
        [reply] = self.peers.call(hop.address, [(kind, mine)], [], self.timeout_s, False)
        return reply

    def run(self, stages: list[StageRows], steps: list, numerics: str) -> str | None:
        """Replays `steps` (the (kind, StepRequest) the head sent its first later stage, each at an
        explicit position) through `stages`; None, or why the replay of the route's own workers did
        not complete (a worker whose answer contradicted itself is marked on its stage; a partner
        that stops, on its). Every session it opened is released."""
        try:
            for kind, sent in steps:
                why = self._step(stages, kind, sent, numerics)
                if why is not None:
                    return why
            return None
        finally:
            self.release([h for s in stages for h in (s.hop, s.partner) if h is not None])

    def _step(self, stages: list[StageRows], kind, sent: pb.StepRequest, numerics: str) -> str | None:
        if not sent.HasField("position"):  # (a step a worker forwards always has one)
            return "a kept step has no explicit position"
        req = pb.StepRequest()
        req.CopyFrom(sent)
        req.receipt_nonce = b""  # nothing is committed for a check
        req.ClearField("prefix")
        del req.handed_from[:], req.forward[:]
        req.follows = False
        done = []  # (stage, position, n, in digest, out digest)
        for i, stage in enumerate(stages):
            req.return_logits = stage.tail
            try:
                reply = self._call(stage.hop, kind, req)
            except grpc.RpcError as e:
                stage.refusal = e.code().name
                stage.refused = f"stage {i + 1}'s worker did not answer its replay: {stage.refusal}"
                return stage.refused
            if reply.outcome != pb.OUTCOME_OK:
                stage.refusal = outcome_name(reply.outcome)
                stage.refused = f"stage {i + 1}'s worker answered its replay {stage.refusal}: {reply.detail[:200]}"
                return stage.refused
            try:
                rows, digest = _answer(reply, req, stage.tail)
                if stage.tail:
                    self._check_tokens(reply, req, rows, 1)
            except ReplyProblem as e:
                stage.worker_failed = str(e)
                return f"stage {i + 1}'s worker contradicted itself"
            n = reply.seq_len - req.position
            in_digest = rows_digest(req.hidden) if req.HasField("hidden") else tokens_digest(req.token_ids)
            out_digest = digest[:-32] if stage.tail else digest
            done.append((stage, req.position, n, in_digest, out_digest))
            if stage.partner is not None and not (stage.stopped or stage.partner_failed):
                stage.inputs.append((kind, pb.StepRequest.FromString(req.SerializeToString())))
                stage.worker_digests.append(digest)
                self._partner(stage, kind, req, reply, rows, digest)
            if stage.tail:
                answer = answer_of(reply)
                for s, pos, k, ind, outd in done:  # every stage commits the tail's answer to a step
                    s.commitment.add(pos, k, ind, outd, answer)
                return None
            req = _next_request(sent, reply.hidden, req.position, numerics)
        return "the route has no tail"

    def _drawn(self, req: pb.StepRequest, rows: np.ndarray, who: int) -> list[int] | None:
        """The tokens a tail's logit rows give for `req`, as the tail draws them (worker/steps.py,
        _reply): greedy, or its sampler rebuilt from the step's state; None where the head cannot
        draw them (a grammar needs the tail's vocabulary; a state the head's check refuses is the
        head's own problem, not the tail's). `who`: 1 the worker, 2 its partner (samplers apart)."""
        drafts = list(req.draft_tokens)
        if not req.HasField("sampler"):
            return verify(rows, drafts, lambda row: int(np.argmax(row)))
        if req.sampler.params.grammar:
            return None
        if self._samplers is None:
            n_vocab = rows.shape[1]
            self._checks = StepSamplingChecks(n_vocab, MAX_CONTEXT_TOKENS, 2)
            self._samplers = TailSamplers(n_vocab, MAX_CONTEXT_TOKENS, 2)
        key = (self.session_id, who)
        try:
            return self._samplers.sample_rows(key, self._checks.params(key, req), req.sampler, rows, drafts)
        except LlamaShardError:
            return None

    def _check_tokens(self, reply: pb.StepReply, req: pb.StepRequest, rows: np.ndarray, who: int) -> None:
        drawn = self._drawn(req, rows, who)
        if drawn is not None and answer_of(reply) != drawn:
            raise ReplyProblem("its tokens are not the ones its logit rows give with the step's sampler")

    def _partner(self, stage: StageRows, kind, req, reply: pb.StepReply, rows: np.ndarray, digest: bytes) -> None:
        step = len(stage.inputs)
        try:
            got = self._call(stage.partner, kind, req)
        except grpc.RpcError as e:
            stage.stopped = f"its replica did not answer step {step}: {e.code().name}"
            return
        if got.outcome != pb.OUTCOME_OK:
            stage.stopped = f"its replica answered {outcome_name(got.outcome)} at step {step}"
            return
        try:
            theirs, their_digest = _answer(got, req, stage.tail)
            if stage.tail:
                self._check_tokens(got, req, theirs, 2)
        except ReplyProblem as e:
            stage.partner_failed = f"its replica's answer to step {step} contradicted itself: {e}"
            return
        stage.partner_digests.append(their_digest)
        if stage.exact:
            stage.differs |= their_digest != digest
        else:  # (its tokens may part at a near tie: its cells come from the route's rows all the same)
            stage.closeness.add(rows, theirs, centered=stage.tail)
            stage.parted += stage.tail and answer_of(got) != answer_of(reply)

    def arbitrate(
        self, stage: StageRows, third: pb.Hop, exact: tuple[bool, bool], repeats: tuple[bool, bool]
    ) -> tuple[list[str], str]:
        """Replays the stage's compared steps on its worker, its partner and `third`, in step, and says
        who is out and what was found. Each of the two must give a well-formed answer and, where it
        repeats to the bit (`repeats`: on a CPU), its first answers (one that does not is the one
        out); the third then says which of them it agrees with (by equal bytes where they share
        kernels, `exact`: with the worker, with the partner; else within the tolerance). A refusal
        (a busy or unreachable worker) decides nothing: both are out, as with no third."""
        self.session_id = secrets.token_hex(12)  # a fresh session on each of the three
        hops = (stage.hop, stage.partner, third)
        names = (stage.hop.address, stage.partner.address)
        close = (Closeness(), Closeness())
        same = [True, True]
        try:
            for k, (kind, req) in enumerate(stage.inputs[: stage.compared]):
                answers = []
                for who, (hop, first) in enumerate(
                    zip(hops, (stage.worker_digests[k], stage.partner_digests[k], None))
                ):
                    try:
                        got = self._call(hop, kind, req)
                    except grpc.RpcError as e:
                        return list(names), f"not arbitrated: {hop.address} did not answer ({e.code().name})"
                    if got.outcome != pb.OUTCOME_OK:
                        return list(names), f"not arbitrated: {hop.address} answered {outcome_name(got.outcome)}"
                    try:
                        rows, digest = _answer(got, req, stage.tail)
                    except ReplyProblem as e:
                        if who == 2:
                            return list(names), f"not arbitrated: {third.address}'s answer contradicted itself"
                        return [names[who]], f"{names[who]}'s answer contradicted itself ({e})"
                    if who < 2 and repeats[who] and digest != first:
                        return [names[who]], f"{names[who]} did not repeat its answers"
                    answers.append((rows, digest))
                mine = answers[2]
                for who in (0, 1):
                    close[who].add(answers[who][0], mine[0], centered=stage.tail)
                    same[who] &= answers[who][1] == mine[1]
        finally:
            self.release(list(hops))
        agree = [same[w] if exact[w] else close[w].within(stage.tolerance) for w in (0, 1)]
        if agree[0] != agree[1]:
            return [names[1] if agree[0] else names[0]], f"arbitrated by {third.address}"
        return list(names), f"arbitrated by {third.address}: it agrees with {'both' if agree[0] else 'neither'}"

    def release(self, hops: list[pb.Hop]) -> None:
        for hop in hops:
            try:
                self.peers.release(hop.address, self.session_id, 1, min(self.timeout_s, RELEASE_S))
            except grpc.RpcError:
                pass  # its TTL frees it
