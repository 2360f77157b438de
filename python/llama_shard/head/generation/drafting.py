"""A stream's speculative decoding: where its drafts come from, how many a step carries
(`DraftControl`, head/speculation.py), and what its windows sent ahead counted."""

from __future__ import annotations

from ..speculation import NGRAM_LONG, DraftControl, NgramDrafter
from .positions import Positions


class Drafting:
    __slots__ = (
        "control",
        "draft_model",
        "drafter",
        "long_match",
        "row_by_row",
        "unsent",
        "unsent_accepted",
        "windows_sent",
        "windows_kept",
    )

    def __init__(self, max_drafts: int, draft_model=None, row_by_row: bool = True):
        self.control = DraftControl(max_drafts)  # drafts per step, counters
        self.draft_model = draft_model if max_drafts else None  # draft_model.DraftModel, or prompt lookup:
        self.drafter = NgramDrafter() if max_drafts and draft_model is None else None
        self.long_match = True  # the kind of match the step's drafts came from
        self.row_by_row = row_by_row  # how the route computes its verifications
        self.unsent: int | None = None  # a draft not sent (k was 0), to learn from
        self.unsent_accepted = 0  # of the last verification's accepted drafts, those not yet sent
        self.windows_sent = 0  # steps sent while an earlier one was in flight (pipelining)
        self.windows_kept = 0  # of those, the ones whose replies counted

    @property
    def on(self) -> bool:
        return self.drafter is not None or self.draft_model is not None

    def drafts(self, key: str, pos: Positions, max_tokens: int, cost: list[float]) -> list[int]:
        """The drafts for a step that continues generation (none while the prompt is being sent): as
        many as DraftControl finds worth it at the route's step cost, never past max_tokens."""
        if not self.on or pos.first_step or pos.computed != len(pos.tokens) - 1:
            return []
        room = min(self.control.max_drafts, max_tokens - len(pos.generated) - 1)
        if self.draft_model is not None:  # each draft costs a step of the draft model: k first
            k = min(self.control.k(cost), room)
            return self.draft_model.propose(key, pos.tokens, k) if k > 0 else []
        candidates, n = self.drafter.propose(pos.tokens, room)
        self.long_match = n >= NGRAM_LONG
        if not candidates:
            self.control.no_candidate()
        k = self.control.k(cost, self.long_match, probe=False) if candidates else 0  # unsent drafts teach it
        self.unsent = candidates[0] if candidates and k == 0 else None  # checked against the step's token
        return candidates[:k]

    def guess(self, key: str, own: list[int], full: list[int], n: int) -> list[int]:
        """`n` tokens that may follow `full` (the stream's `own` tokens and those assumed after them):
        a window sent ahead's guessed first token and its drafts."""
        if self.draft_model is not None:
            return self.draft_model.propose(key, full, n)
        self.drafter.propose(own, 0)  # the stream's own tokens indexed; the assumed ones only read
        return self.drafter.propose(full, n, index=False)[0]

    def verified(self, drafts: list[int], tokens: list[int], in_run: bool) -> int:
        """A verification's answer (`tokens`: the accepted drafts, then the tail's own) learnt from;
        how many drafts were accepted."""
        accepted = len(tokens) - 1
        if self.unsent is not None:
            self.control.unsent(tokens[0] == self.unsent, self.long_match)
            self.unsent = None
        self.control.update(len(drafts), accepted, self.long_match, in_run=in_run)
        return accepted
