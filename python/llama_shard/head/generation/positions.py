"""A stream's tokens on the head and what the route holds of them: the positions part of a `Stream`,
the step it has in flight (`SentStep`), and a step sent ahead of others (`Window`)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import NamedTuple

from ...worker.prefixes import PREFIX_BLOCK_TOKENS

#: prompt tokens per step: a long prompt does not hold up the decoders grouped with it for long
GENERATE_CHUNK = 256
# a shared prefix ends where a chunk of a prompt computed from position 0 ends (prefixes.py says why)
assert PREFIX_BLOCK_TOKENS % GENERATE_CHUNK == 0


class SentStep(NamedTuple):
    """The step a stream has in flight."""

    n_tokens: int  # tokens sent (the chunk, drafts included)
    samples: bool  # whether the tail samples at its end (the prompt's last chunk, or a decode)
    drafts: list[int]  # the drafts it carries after the last sampled token
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

    start: int  # the position of its first token
    first_token: int  # that token (a guess, for a verification window after another)
    sent: SentStep  # what Positions.sent is while its reply is settled
    end: int  # the position after its last token (what the route may hold past `computed`)
    guess: bool = False  # its first token guesses the token the window before it samples
    stores: bool = False  # it stores a shared prefix: nothing is sent past it until it is back
    ahead: bool = False  # sent while another step was in flight (counted in pipelined_windows)

    def continues(self, pos: "Positions") -> bool:
        if pos.computed != self.start:
            return False
        # after a guess: the stream's last token (sampled, not computed yet) is the one it guessed
        return not self.guess or (len(pos.tokens) == self.start + 1 and pos.tokens[-1] == self.first_token)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Positions:
    """Every token of the session (the prompt, then each sampled one); the route holds the first
    `computed`, and up to `held` after rejected drafts (the next prefill at `computed` cuts them)."""

    __slots__ = (
        "tokens",
        "generated",
        "computed",
        "held",
        "cached",
        "first_step",
        "draws",
        "sent",
        "reprefills",
        "misses_in_row",
        "reprefilled_tokens",
    )

    def __init__(self, prompt, cached: int):
        self.tokens = list(prompt)
        self.generated: list[int] = []
        self.computed = self.held = self.cached = cached  # `cached`: what the stream found held
        self.first_step = True  # a prefill (at `computed`: truncating what follows)
        self.draws = 0  # the sampler's draws so far (a re-prefill replays them)
        self.sent = SentStep(0, False, [])  # the step in flight
        self.reprefills = 0
        self.misses_in_row = 0
        self.reprefilled_tokens = 0  # tokens computed again (misses, failovers)

    def sampled(self, token: int, draws: bool) -> None:
        """A token the tail sampled (`draws`: a sampler drew it; greedy without params draws none)."""
        if draws:
            self.draws += 1
        self.generated.append(token)
        self.tokens.append(token)

    def start_over(self) -> None:
        """The route lost the session: the next step re-prefills from token zero, same tokens and draws."""
        self.reprefilled_tokens += self.computed
        self.computed, self.held, self.first_step, self.cached = 0, 0, True, 0

    def holds_sent(self) -> None:
        """The stages before one that refused the step applied it: the route may hold its positions."""
        self.held = max(self.held, self.computed + self.sent.n_tokens)

    @contextmanager
    def assuming(self, assumed: list[int], computed: int, draws: bool):
        """The positions as they will be if the steps in flight come back as hoped: `assumed` tokens
        after the stream's own (accepted drafts, then the guess of the next sampled token) and
        `computed` positions held; restored after (a Window's request is built inside)."""
        saved = (self.tokens, self.generated, self.computed, self.held, self.draws, self.sent)
        self.tokens, self.generated = self.tokens + assumed, self.generated + assumed
        self.draws += len(assumed) if draws else 0
        self.computed = self.held = computed
        try:
            yield
        finally:
            self.tokens, self.generated, self.computed, self.held, self.draws, self.sent = saved
