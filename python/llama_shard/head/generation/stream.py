"""One Generate stream of the head's loop: its session's tokens on the head, what the route holds of
them, the step in flight and the events for its reader. Changed only by the loop's group thread that
steps it (and `cancel`, from any thread, which only sets a reason)."""
from __future__ import annotations

import queue
import time
from contextlib import contextmanager
from typing import NamedTuple

from ...engine.hot_kv import StepKind
from ...proto import shard_pb2 as pb
from ...worker.prefixes import PREFIX_BLOCK_TOKENS
from ..speculation import NGRAM_LONG, DraftControl, NgramDrafter
from .grammar_sync import GrammarSync

#: prompt tokens per step: a long prompt does not hold up the decoders grouped with it for long
GENERATE_CHUNK = 256
# a shared prefix ends where a chunk of a prompt computed from position 0 ends (prefixes.py says why)
assert PREFIX_BLOCK_TOKENS % GENERATE_CHUNK == 0


class SentStep(NamedTuple):
    """The step a stream has in flight."""
    n_tokens: int        # tokens sent (the chunk, drafts included)
    samples: bool        # whether the tail samples at its end (the prompt's last chunk, or a decode)
    drafts: list[int]    # the drafts it carries after the last sampled token
    in_run: bool = False  # its first token was a guess (a window sent ahead): its drafts follow accepted ones

    @property
    def decodes(self) -> bool:
        """A generation step: one token (the last sampled, or a guess of it) and its drafts, sampled
        (not a prompt's chunk, whose time says nothing of a step's cost by drafts)."""
        return self.samples and self.n_tokens == len(self.drafts) + 1


class Window(NamedTuple):
    """A step sent while the stream's earlier steps are still in flight (pipelining), built as if
    they had all come back as hoped: a prompt's next chunk, or a verification window whose first
    token guesses the token the window before it samples. Its reply counts only if, once those are
    settled, the stream is where the window assumed (`continues`)."""
    start: int            # the position of its first token
    first_token: int      # that token (a guess, for a verification window after another)
    sent: SentStep        # what Stream.sent is while its reply is settled
    end: int              # the position after its last token (what the route may hold past `computed`)
    guess: bool = False   # its first token guesses the token the window before it samples
    stores: bool = False  # it stores a shared prefix: nothing is sent past it until it is back
    ahead: bool = False   # sent while another step was in flight (counted in pipelined_windows)

    def continues(self, s: "Stream") -> bool:
        if s.computed != self.start:
            return False
        # after a guess: the stream's last token (sampled, not computed yet) is the one it guessed
        return not self.guess or (len(s.tokens) == self.start + 1 and s.tokens[-1] == self.first_token)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Stream:
    """One Generate call: its session's tokens on the head, and the events for its handler."""

    def __init__(self, principal: str, key: str, req: pb.GenerateRequest, params, max_tokens: int,
                 cached: int, deadline: float | None, detokenize, events=None, max_drafts: int = 0,
                 draft_model=None, row_by_row: bool = True):
        self.principal, self.key, self.req = principal, key, req
        self.params = params
        self.max_tokens = max_tokens
        self.tokens = list(req.prompt)       # every token; the route holds the first `computed`
        self.computed = cached
        self.held = cached                   # positions the route holds (more than computed after rejected drafts)
        self.cached = cached
        self.first_step = True               # a prefill (at `computed`: truncating what follows)
        self.draws = 0
        self.generated: list[int] = []
        self.reprefills = 0
        self.misses_in_row = 0
        self.deadline = deadline
        self.detokenize = detokenize
        self.text = ""
        self.events = events if events is not None else queue.SimpleQueue()  # put(event): its reader's queue
        self.stop_reason: str | None = None  # set from the handler's thread: the loop ends the stream
        self.done = False
        self.t_start = time.monotonic()
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.sent = SentStep(0, False, [])    # the step in flight
        self.control = DraftControl(max_drafts)  # speculative decoding: drafts per step, counters
        self.draft_model = draft_model if max_drafts else None  # draft_model.DraftModel, or prompt lookup:
        self.drafter = NgramDrafter() if max_drafts and draft_model is None else None
        self.long_match = True                # the kind of match the step's drafts came from
        self.row_by_row = row_by_row          # how the route computes its verifications
        self.unsent: int | None = None        # a draft not sent (k was 0), to learn from
        self.unsent_accepted = 0              # of the last verification's accepted drafts, those not yet sent
        self.group = 0                        # the loop's group (a run of head seq ids)
        self.in_flight = False                # in a group's step now
        self.prefix = None                    # its PrefixPlan (prefixes.py), made at its first step
        self.planned = False
        self.may_open = True                  # False after a shard lacked the prefix: the re-prefill computes it
        self.prefix_tokens = 0                # prompt tokens opened from a shared prefix
        self.route: list[pb.Hop] = []         # the rest of the route: one replica per later stage
        self.rerouted = False                 # its route changed: the loop moves it to that route's group
        self.handed_from: list[str] = []      # its first step: StepRequest.handed_from of each later stage
        self.failovers = 0                    # times a replica failed and the session moved to another
        self.moves = 0                        # times a draining replica had handed the session over
        self.changes_in_row = 0               # route changes since its last step that went through
        self.reprefilled_tokens = 0           # tokens computed again (misses, failovers)
        self.pipelined_windows = 0            # steps sent while an earlier one was in flight
        self.pipelined_kept = 0               # of those, the ones whose replies counted
        self.grammar = GrammarSync()          # with a grammar: whether the tail holds its state (else a replay)

    def cancel(self, reason: str) -> None:
        if not self.done and self.stop_reason is None:
            self.stop_reason = reason

    def plan_prefix(self, prefixes) -> None:
        """At a (re-)prefill's first step: open from the longest shared prefix the head holds, and
        store the one to keep (prefixes.PrefixNames.plan)."""
        self.planned = True
        self.prefix = prefixes.plan(self.principal, self.tokens, self.computed, self.req.keep_prefix, self.may_open)
        if self.prefix is not None and self.prefix.open_tokens:
            self.computed = self.prefix.open_tokens

    def drafts(self, cost: list[float]) -> list[int]:
        """The drafts for a step that continues generation (none while the prompt is being sent): as
        many as DraftControl finds worth it at the route's step cost, never past max_tokens."""
        if (self.drafter is None and self.draft_model is None) or self.first_step \
                or self.computed != len(self.tokens) - 1:
            return []
        room = min(self.control.max_drafts, self.max_tokens - len(self.generated) - 1)
        if self.draft_model is not None:  # each draft costs a step of the draft model: k first
            k = min(self.control.k(cost), room)
            return self.draft_model.propose(self.key, self.tokens, k) if k > 0 else []
        candidates, n = self.drafter.propose(self.tokens, room)
        self.long_match = n >= NGRAM_LONG
        if not candidates:
            self.control.no_candidate()
        k = self.control.k(cost, self.long_match, probe=False) if candidates else 0  # unsent drafts teach it
        self.unsent = candidates[0] if candidates and k == 0 else None  # checked against the step's token
        return candidates[:k]

    @contextmanager
    def assuming(self, assumed: list[int], computed: int):
        """The stream as it will be if the steps in flight come back as hoped: `assumed` tokens after
        its own (accepted drafts, then the guess of the next sampled token) and `computed` positions
        held; restored after (a Window's request is built inside)."""
        saved = (self.tokens, self.generated, self.computed, self.held, self.draws, self.sent)
        n = len(assumed)
        self.tokens, self.generated = self.tokens + assumed, self.generated + assumed
        self.draws += n if self.params is not None else 0
        self.computed = self.held = computed
        try:
            yield
        finally:
            self.tokens, self.generated, self.computed, self.held, self.draws, self.sent = saved

    def request(self, wire_dtype: int, cost: list[float] | None = None,
                drafts: list[int] | None = None) -> tuple[StepKind, pb.StepRequest]:
        """The stream's next step (its SentStep in `sent`): a prompt chunk, or a token with drafts (from
        the drafter at the route's step cost `cost`, or the `drafts` given; none without either)."""
        start = self.computed
        end = start + GENERATE_CHUNK
        plan = self.prefix
        if plan is not None and plan.store_tokens > start:
            end = min(end, plan.store_tokens)  # the step that stores a prefix ends with it
        if drafts is None:
            drafts = self.drafts(cost) if cost is not None else []
        chunk = self.tokens[start:end] + drafts
        final = start + len(chunk) - len(drafts) == len(self.tokens)
        opening = plan.open_tokens if plan is not None and self.first_step and start == plan.open_tokens else 0
        storing = plan.store_tokens if plan is not None and not drafts and start + len(chunk) == plan.store_tokens else 0
        # a prefill at `start` also cuts positions the route holds past it (rejected drafts)
        kind = (StepKind.PREFILL if self.first_step or len(chunk) > 1 or opening or storing or self.held > start
                else StepKind.DECODE)
        req = pb.StepRequest(session_id=self.req.session_id, route_epoch=self.req.route_epoch, token_ids=chunk,
                             reply_dtype=wire_dtype, position=start, draft_tokens=drafts,
                             row_by_row=bool(drafts) and self.row_by_row)
        if self.handed_from:
            req.handed_from.extend(["", *self.handed_from])  # the head's own stage never changes
        if opening or storing:
            req.prefix.keys.extend(plan.keys)
            req.prefix.open_tokens, req.prefix.store_tokens = opening, storing
        if final:
            req.logprobs, req.top_logprobs = self.req.logprobs, self.req.top_logprobs
            if self.params is not None:
                window = self.params.penalty_last_n
                req.sampler.params.CopyFrom(self.req.sampling)
                req.sampler.draws = self.draws
                req.sampler.recent.extend(self.tokens[-window:] if window else [])
                if self.req.sampling.grammar:
                    self.grammar.fill(req.sampler, self.generated)
        self.sent = SentStep(len(chunk), final, drafts)
        return kind, req
