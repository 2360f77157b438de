"""One Generate stream of the head's loop, in parts: its tokens and positions (`Positions`), its
drafts (`Drafting`), where its steps go (`Placement`), its use of shared prefixes (`PrefixUse`), what
its reader gets (`StreamOutput`, with its request's `RequestProof`: the nonce its receipts are under)
and its grammar's state at the tail (`GrammarSync`). Changed only by
the scheduler's thread that steps it (and `cancel`, from any thread, which only sets a reason).

A new feature of a stream is a part of its own (or a field of the part it belongs to), not a field
of `Stream`."""

from __future__ import annotations

from ...engine.hot_kv import StepKind
from ...proto import shard_pb2 as pb
from ...structured.replay import GrammarSync
from ..proofs import RequestProof
from .drafting import Drafting
from .output import StreamOutput
from .placement import Placement
from .positions import GENERATE_CHUNK, Positions, SentStep
from .prefix_use import PrefixUse


class Stream:
    """One Generate call: the request, its bounds, and its parts."""

    __slots__ = (
        "principal",
        "key",
        "req",
        "params",
        "max_tokens",
        "deadline",
        "pos",
        "drafting",
        "place",
        "prefix",
        "out",
        "grammar",
    )

    def __init__(
        self,
        principal: str,
        key: str,
        req: pb.GenerateRequest,
        params,
        max_tokens: int,
        cached: int,
        deadline: float | None,
        detokenize,
        events=None,
        max_drafts: int = 0,
        draft_model=None,
        row_by_row: bool = True,
        route: list[pb.Hop] | None = None,
        handed_from: list[str] | None = None,
        proof: RequestProof | None = None,
    ):
        self.principal, self.key, self.req = principal, key, req
        self.params = params  # the sampler's (None: greedy without a sampler)
        self.max_tokens = max_tokens
        self.deadline = deadline
        self.pos = Positions(req.prompt, cached)
        self.drafting = Drafting(max_drafts, draft_model, row_by_row)
        self.place = Placement(route or [], handed_from)
        self.prefix = PrefixUse()
        self.out = StreamOutput(detokenize, events)
        self.grammar = GrammarSync()  # with a grammar: whether the tail holds its state (else a replay)
        if proof is not None:  # its receipt's nonce: how its final event is settled
            self.out.proof = proof

    @property
    def done(self) -> bool:
        return self.out.done

    def cancel(self, reason: str) -> None:
        self.out.cancel(reason)

    def request(
        self, wire_dtype: int, cost: list[float] | None = None, drafts: list[int] | None = None
    ) -> tuple[StepKind, pb.StepRequest]:
        """The stream's next step (its SentStep in `pos.sent`): a prompt chunk, or a token with drafts
        (from the drafter at the route's step cost `cost`, or the `drafts` given; none without either)."""
        pos = self.pos
        start = pos.computed
        end = self.prefix.step_end(start, start + GENERATE_CHUNK)
        if drafts is None:
            drafts = self.drafting.drafts(self.key, pos, self.max_tokens, cost) if cost is not None else []
        chunk = pos.tokens[start:end] + drafts
        final = start + len(chunk) - len(drafts) == len(pos.tokens)
        opening = self.prefix.opening(start, pos.first_step)
        storing = self.prefix.storing(start + len(chunk), bool(drafts))
        # a prefill at `start` also cuts positions the route holds past it (rejected drafts)
        kind = (
            StepKind.PREFILL
            if pos.first_step or len(chunk) > 1 or opening or storing or pos.held > start
            else StepKind.DECODE
        )
        req = pb.StepRequest(
            session_id=self.req.session_id,
            route_epoch=self.req.route_epoch,
            token_ids=chunk,
            reply_dtype=wire_dtype,
            position=start,
            draft_tokens=drafts,
            row_by_row=bool(drafts) and self.drafting.row_by_row,
            receipt_nonce=self.out.proof.nonce,
        )
        if self.place.handed_from:
            req.handed_from.extend(["", *self.place.handed_from])  # the head's own stage never changes
        if opening or storing:
            req.prefix.keys.extend(self.prefix.plan.keys)
            req.prefix.open_tokens, req.prefix.store_tokens = opening, storing
        if final:
            self._sample_here(req)
        pos.sent = SentStep(len(chunk), final, drafts)
        return kind, req

    def _sample_here(self, req: pb.StepRequest) -> None:
        """The step ends where the tail samples: what it returns and the sampler's whole state."""
        req.logprobs, req.top_logprobs = self.req.logprobs, self.req.top_logprobs
        if self.params is not None:
            window = self.params.penalty_last_n
            req.sampler.params.CopyFrom(self.req.sampling)
            req.sampler.draws = self.pos.draws
            req.sampler.recent.extend(self.pos.tokens[-window:] if window else [])
            if self.req.sampling.grammar:
                self.grammar.fill(req.sampler, self.pos.generated)
