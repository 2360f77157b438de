"""What steps' replies mean for their streams, and what a stream's reader gets: `settle` (one reply),
`emit` (one token, detokenized, stops checked), `finish` (the final event, always the last). Beside
the detokenizer; the loop's bookkeeping of a finished stream is its `closed` hook."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable

from ...engine.hot_kv import CacheMissReason
from ...errors import WhyNot
from ...proto import shard_pb2 as pb
from ...proto.requests import MAX_REPREFILLS, MAX_STOP_CHARS
from ...structured.replay import SAMPLER_STATE_MISS
from ..failover import tail_keeps_grammar
from ..proofs import NO_PROOF
from .host import HeadHost
from .metrics import GenerationMetrics


class StreamOutput:
    """A stream's reader's side: its events, the text so far, when its tokens came, how it ends."""

    __slots__ = ("events", "detokenize", "text", "t_start", "t_first", "t_last", "stop_reason", "done", "proof")

    def __init__(self, detokenize, events=None):
        self.events = events if events is not None else queue.SimpleQueue()  # put(event): its reader's queue
        self.detokenize = detokenize
        self.text = ""
        self.t_start = time.monotonic()
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.stop_reason: str | None = None  # set from the handler's thread: the loop ends the stream
        self.done = False
        self.proof = NO_PROOF  # head/proofs.py: the request's nonce; its final event waits for its receipt

    def cancel(self, reason: str) -> None:
        if not self.done and self.stop_reason is None:
            self.stop_reason = reason

    def rate(self, n: int) -> float:
        """Tokens per second after the first, of `n` generated."""
        return (n - 1) / (self.t_last - self.t_first) if n > 1 and self.t_last > self.t_first else 0.0


class Outcomes:
    """The loop's outcomes for its streams (called by the thread that steps each stream)."""

    def __init__(self, host: HeadHost, metrics: GenerationMetrics, closed: Callable[[object, bool], None]):
        self.host, self.metrics = host, metrics
        self.closed = closed  # (stream, failed): the loop forgets it, and keeps what the route holds unless failed

    def settle(self, s, reply: pb.StepReply) -> None:
        """What one step's reply means for its stream."""
        pos = s.pos
        handed = s.place.claim_handed()  # (a route change of that step keeps what must still be checked)
        if reply.outcome == pb.OUTCOME_CACHE_MISS:
            self._missed(s, reply)
            return
        if (
            reply.outcome == pb.OUTCOME_UNAVAILABLE
            and self.host.replicas is not None
            and 1 <= reply.stage <= len(s.place.route)
        ):
            self._reroute(s, reply, handed)
            return
        if reply.outcome != pb.OUTCOME_OK:
            self.finish(s, "error", outcome=reply.outcome, stage=reply.stage, detail=reply.detail)
            return
        if pos.first_step:
            s.prefix.opened()
        pos.first_step = False
        pos.misses_in_row = 0
        s.place.changes_in_row = 0
        if not pos.sent.samples:
            pos.computed += pos.sent.n_tokens
            pos.held = pos.computed
            return
        s.grammar.sampled()
        self._sampled(s, reply)

    def _missed(self, s, reply: pb.StepReply) -> None:
        pos = s.pos
        pos.misses_in_row += 1
        grammar = reply.miss_reason == SAMPLER_STATE_MISS
        if not grammar:
            pos.reprefills += 1
        if pos.misses_in_row > MAX_REPREFILLS:
            why = (
                f"the tail refused the grammar's state {MAX_REPREFILLS} times"
                if grammar
                else f"still a cache miss after {MAX_REPREFILLS} re-prefills"
            )
            self.finish(
                s,
                "error",
                outcome=reply.outcome,
                stage=reply.stage,
                miss_reason=reply.miss_reason,
                detail=f"{why}: {reply.detail}",
            )
        elif grammar:
            # the tail keeps no grammar state this step named: the same step again with the tokens
            # (the stages before it applied it: a prefill at the same position cuts there)
            s.grammar.lost()
            pos.holds_sent()
        else:
            if reply.miss_reason == CacheMissReason.PREFIX_EVICTED.name:  # a shard lacks the prefix: computed
                s.prefix.may_open = False
            self.start_over(s)

    def _sampled(self, s, reply: pb.StepReply) -> None:
        """A reply with the tail's token (after the drafts it accepted, if the step carried any)."""
        pos, drafts = s.pos, s.pos.sent.drafts
        tokens = list(reply.tokens) if drafts else [reply.token_id]
        # a tail must not make the head crash: its answer is checked against what was asked
        if not 1 <= len(tokens) <= len(drafts) + 1 or tokens[:-1] != drafts[: len(tokens) - 1]:
            self.finish(
                s,
                "error",
                outcome=pb.OUTCOME_INTERNAL,
                stage=reply.stage,
                detail=f"the tail answered {len(tokens)} tokens that do not verify the {len(drafts)} drafts sent",
            )
            return
        if not 0 <= tokens[-1] < self.host.info.n_vocab:
            self.finish(
                s,
                "error",
                outcome=pb.OUTCOME_INTERNAL,
                stage=reply.stage,
                detail=f"the tail answered token {tokens[-1]}, outside the vocabulary",
            )
            return
        accepted = s.drafting.verified(drafts, tokens, pos.sent.in_run)
        pos.held = pos.computed + pos.sent.n_tokens  # the rejected drafts' positions too, until the next step cuts them
        pos.computed += pos.sent.n_tokens - len(drafts) + accepted
        for i, token in enumerate(tokens):
            s.drafting.unsent_accepted = max(0, accepted - i - 1)  # accepted drafts behind it: a stop here drops them
            if not self.emit(s, token, reply):
                break
        if drafts:  # counted as the client got them (accepted never exceeds the completion's tokens)
            self.metrics.count_drafts(len(drafts), accepted - s.drafting.unsent_accepted)

    @staticmethod
    def start_over(s) -> None:
        """The route lost the session (a miss, a failover): its next step re-prefills it from token
        zero, with the same tokens and draw count, so it samples what it would have anyway."""
        s.pos.start_over()
        s.grammar.lost()
        s.prefix.reset()

    def _reroute(self, s, reply: pb.StepReply, handed: list[str]) -> None:
        """A later stage's replica did not take the step: the session follows its hand-over, or fails
        over to another replica of that stage (head/failover.py); a stage with none ends the stream."""
        replicas = self.host.replicas
        change = s.place.reroute(replicas, reply, handed, s.pos.first_step and bool(s.pos.cached))
        if isinstance(change, WhyNot):
            self.finish(s, "error", outcome=pb.OUTCOME_UNAVAILABLE, stage=reply.stage, detail=change.text)
            return
        s.grammar.lost()  # another replica's tail keeps no grammar state of this session
        if change.continues:
            s.pos.holds_sent()  # the stages before it applied the step: the same step again cuts there
        else:
            s.pos.reprefills += 1
            self.start_over(s)
        s.grammar.by_digest = tail_keeps_grammar(replicas, s.place.route)
        replicas.place(s.key, s.place.addresses())

    def emit(self, s, token: int, reply: pb.StepReply) -> bool:
        """One sampled token to the stream's client; False once the stream has finished."""
        out = s.out
        s.pos.sampled(token, s.params is not None)
        now = time.monotonic()
        if out.t_first is None:
            out.t_first = now
            self.metrics.ttft.observe(now - out.t_start)
        else:
            self.metrics.itl.observe(now - out.t_last)
        out.t_last = now
        text = out.detokenize(s.pos.generated).rstrip("\ufffd")  # an incomplete character comes with a later token
        piece = text[len(out.text) :] if text.startswith(out.text) else ""
        start = max(0, len(out.text) - MAX_STOP_CHARS)
        out.text = text
        event = pb.GeneratedToken(token_id=token, piece=piece)
        if s.req.logprobs or s.req.top_logprobs:
            event.logprob = reply.logprob
            n_vocab = self.host.info.n_vocab  # no more than asked, and only tokens, whatever the tail sent
            event.top_logprobs.extend(a for a in reply.top_logprobs[: s.req.top_logprobs] if 0 <= a.token_id < n_vocab)
        out.events.put(pb.GenerateEvent(token=event))
        if token in s.req.stop_token_ids:
            self.finish(s, "stop", stop=f"token {token}")
            return False
        hit = next((x for x in s.req.stop if x in text[start:]), None)
        if hit is not None:
            self.finish(s, "stop", stop=hit)
        elif len(s.pos.generated) >= s.max_tokens:
            self.finish(s, "length")
        return not s.done

    def finish(
        self,
        s,
        reason: str,
        *,
        outcome: int = pb.OUTCOME_OK,
        stage: int = 0,
        detail: str = "",
        miss_reason: str = "",
        stop: str = "",
    ) -> None:
        if s.out.done:
            return
        s.out.done = True
        final = self._final(s, reason, outcome, stage, detail, miss_reason, stop)
        self.closed(s, reason == "error")
        events = s.out.events
        if self.host.proofs is not None and s.out.proof.nonce:  # the final event comes once its receipt is checked
            self.host.proofs.settle(s, final, lambda f: events.put(pb.GenerateEvent(final=f)))
        else:
            events.put(pb.GenerateEvent(final=final))

    def _final(
        self, s, reason: str, outcome: int, stage: int, detail: str, miss_reason: str, stop: str
    ) -> pb.GenerateFinal:
        pos, out, drafting, place = s.pos, s.out, s.drafting, s.place
        host = self.host
        # a prefix shared among principals (--share-prefixes all) is someone else's start: how much of
        # a prompt it covered is reported to admins only (it says what other callers sent)
        told = s.prefix.opened_tokens if host.prefixes.share != "all" or s.principal in host.security.admins else 0
        n = len(pos.generated)
        return pb.GenerateFinal(
            finish_reason=reason,
            outcome=outcome,
            stage=stage,
            detail=detail,
            miss_reason=miss_reason,
            prompt_tokens=len(s.req.prompt),
            cached_tokens=pos.cached,
            completion_tokens=n,
            reprefills=pos.reprefills,
            time_to_first_token_s=(out.t_first - out.t_start) if out.t_first is not None else 0.0,
            tokens_per_s=out.rate(n),
            seq_len=min(pos.computed, len(pos.tokens)),
            stop=stop,
            prefix_tokens=told,
            drafted_tokens=drafting.control.drafted,
            accepted_tokens=drafting.control.accepted - drafting.unsent_accepted,
            failovers=place.failovers,
            reprefilled_tokens=pos.reprefilled_tokens,
            moves=place.moves,
            pipelined_windows=drafting.windows_sent,
            pipelined_kept=drafting.windows_kept,
        )
