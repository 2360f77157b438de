"""Spot checks across kernels or backends: a stage whose only other replica computes on other
kernels (a CPU of another variant, a GPU) cannot be held to equal bytes, so its rows are compared
within a tolerance (receipts/tolerance.py).

The head replays the kept steps stage by stage, unchained, as a new session of its own:

- each stage's own worker first, on the very inputs the route gave it, answering its rows (the tail:
  its logit rows) to the head. From them the head computes the worker's commitment again and
  demands it equal what the worker signed in its receipt: the rows it answers now are the rows it
  sent then, so it cannot answer the check with other rows than the route's. Its rows are the next
  stage's inputs, so every stage is checked on its own inputs, and one stage's kernel noise never
  reaches another's;
- then the stage's partner, on the same inputs: a replica of the same kernels must give equal bytes;
  one of other kernels must come within the tolerance on every row.

A worker that does not repeat its own commitment is out of routes alone. A stage whose worker and
partner disagree is arbitrated by a third replica where there is one (the one it disagrees with is
out), else both are out, as for exact checks (head/proofs.py)."""

from __future__ import annotations

import dataclasses
import secrets

import grpc
import numpy as np

from ..errors import LlamaShardError
from ..proto import shard_pb2 as pb
from ..proto.wire import decode_tensor
from ..receipts.chain import Commitment, answer_of, logits_digest, rows_digest, tokens_digest
from ..receipts.tolerance import HIDDEN_TOLERANCE, LOGITS_TOLERANCE, Closeness


@dataclasses.dataclass
class StageRows:
    """One stage's part of a row replay: its worker's answers, and its partner's against them."""

    hop: pb.Hop
    partner: pb.Hop | None
    exact: bool  # the partner computes on the same kernels: equal bytes, not a tolerance
    tail: bool
    commitment: Commitment = dataclasses.field(default_factory=Commitment)
    closeness: Closeness = dataclasses.field(default_factory=Closeness)
    # the requests it was given, to replay on a third replica (hidden rows or tokens: small; the
    # answers, logit rows of n_vocab floats at a tail, are not kept but asked again)
    inputs: list = dataclasses.field(default_factory=list)
    compared: int = 0  # steps its partner answered
    differs: bool = False  # an exact partner's bytes (or answers) differed
    stopped: str = ""  # why the partner's replay stopped early
    parted: int = 0  # a tail of other kernels: steps whose tokens differed (near ties)

    @property
    def tolerance(self) -> float:
        return LOGITS_TOLERANCE if self.tail else HIDDEN_TOLERANCE

    def agrees(self) -> bool:
        return not self.differs if self.exact else self.closeness.within(self.tolerance)


def _rows_of(reply: pb.StepReply) -> np.ndarray:
    t = reply.hidden if reply.HasField("hidden") else reply.logits
    if len(t.shape) != 2:
        raise LlamaShardError("a replayed step answered no rows")
    return decode_tensor(t, t.shape[1], t.shape[0])


def _out_digest(reply: pb.StepReply) -> bytes:
    if reply.HasField("hidden"):
        return rows_digest(reply.hidden)
    return logits_digest(_rows_of(reply))


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

    def _call(self, hop: pb.Hop, kind, req: pb.StepRequest) -> pb.StepReply:
        mine = pb.StepRequest()
        mine.CopyFrom(req)
        mine.session_id, mine.route_epoch, mine.recipe_fingerprint = self.session_id, 1, hop.recipe_fingerprint
        [reply] = self.peers.call(hop.address, [(kind, mine)], [], self.timeout_s, False)
        return reply

    def run(self, stages: list[StageRows], steps: list, numerics: str) -> str | None:
        """Replays `steps` (the (kind, StepRequest) the head sent its first later stage) through
        `stages`; None, or why the replay of the route's own workers did not complete (a partner that
        stops is noted on its stage). Every session it opened is released."""
        try:
            for kind, sent in steps:
                why = self._step(stages, kind, sent, numerics)
                if why is not None:
                    return why
            return None
        except grpc.RpcError as e:
            return f"the replay could not reach a worker: {e.code().name}"
        finally:
            self.release([h for s in stages for h in (s.hop, s.partner) if h is not None])

    def _step(self, stages: list[StageRows], kind, sent: pb.StepRequest, numerics: str) -> str | None:
        req = pb.StepRequest()
        req.CopyFrom(sent)
        req.receipt_nonce = b""  # nothing is committed for a check
        req.ClearField("prefix")
        del req.handed_from[:], req.forward[:]
        req.follows = False
        done = []  # (stage, position, n, in digest, out digest)
        for i, stage in enumerate(stages):
            req.return_logits = stage.tail
            reply = self._call(stage.hop, kind, req)
            if reply.outcome != pb.OUTCOME_OK:
                return (
                    f"stage {i + 1}'s worker answered its replay {pb.Outcome.Name(reply.outcome)}: {reply.detail[:200]}"
                )
            n = len(req.token_ids) if not req.HasField("hidden") else req.hidden.shape[0]
            position = reply.seq_len - n
            in_digest = rows_digest(req.hidden) if req.HasField("hidden") else tokens_digest(req.token_ids)
            rows = _rows_of(reply)
            done.append((stage, position, n, in_digest, _out_digest(reply)))
            stage.inputs.append((kind, pb.StepRequest.FromString(req.SerializeToString())))
            if stage.partner is not None and not stage.stopped:
                self._partner(stage, kind, req, reply, rows)
            if stage.tail:
                answer = answer_of(reply)
                for s, pos, k, ind, outd in done:  # every stage commits the tail's answer to a step
                    s.commitment.add(pos, k, ind, outd, answer)
                return None
            req = _next_request(sent, reply.hidden, position, numerics)
        return "the route has no tail"

    def _partner(self, stage: StageRows, kind, req, reply: pb.StepReply, rows: np.ndarray) -> None:
        got = self._call(stage.partner, kind, req)
        if got.outcome != pb.OUTCOME_OK:
            stage.stopped = f"its replica answered {pb.Outcome.Name(got.outcome)} at step {len(stage.inputs)}"
            return
        theirs = _rows_of(got)
        stage.compared += 1
        if stage.exact:
            same_answer = not stage.tail or answer_of(got) == answer_of(reply)
            stage.differs |= _out_digest(got) != _out_digest(reply) or not same_answer
        else:  # (its tokens may part at a near tie: its cells come from the route's rows all the same)
            stage.closeness.add(rows, theirs, centered=stage.tail)
            stage.parted += stage.tail and answer_of(got) != answer_of(reply)

    def third_agrees(self, stage: StageRows, third: pb.Hop, exact: tuple[bool, bool]) -> tuple[bool, bool]:
        """Replays the stage's inputs on `third`, its worker and its partner again, in step: (the
        third agrees with the worker, with the partner), each by equal bytes where they share
        kernels (`exact`: with the worker, with the partner), else within the tolerance."""
        self.session_id = secrets.token_hex(12)  # a fresh session on each of the three
        hops = (stage.hop, stage.partner, third)
        close = (Closeness(), Closeness())
        same = [True, True]
        try:
            for kind, req in stage.inputs[: stage.compared]:
                replies = [self._call(hop, kind, req) for hop in hops]
                if any(r.outcome != pb.OUTCOME_OK for r in replies):
                    return False, False
                worker, partner, mine = (_rows_of(r) for r in replies)
                for k, theirs in enumerate((worker, partner)):
                    close[k].add(theirs, mine, centered=stage.tail)
                    same[k] &= np.array_equal(theirs, mine)
        except grpc.RpcError:
            return False, False
        finally:
            self.release(list(hops))
        return tuple(same[k] if exact[k] else close[k].within(stage.tolerance) for k in (0, 1))

    def release(self, hops: list[pb.Hop]) -> None:
        for hop in hops:
            try:
                self.peers.release(hop.address, self.session_id, 1, self.timeout_s)
            except grpc.RpcError:
                pass  # its TTL frees it
