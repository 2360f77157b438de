"""What a grammar stream's steps tell the tail about the tokens sampled so far (the replay).

The tail's grammar state is the grammar advanced by every token sampled under it. The tail keeps it
per session between steps (sampling.TailSamplers); a step names the state it expects by a running
digest of the tokens (`grammar_digest`, 16 bytes) instead of carrying them all, so
a step is the same size at token 100 and at token 10,000. The tokens themselves go only where the
tail must rebuild the grammar by replaying them: the stream's first sampled step, after the route
lost or changed the session (a miss, a failover, a hand-over followed), and after the tail said it
holds no matching state (OUTCOME_CACHE_MISS, SAMPLER_STATE: its kept state was evicted, or it is a
replica that never had it).

A tail of an older version (one that does not list `grammar_digest` in its Info) gets the tokens in
every step, as before.

Invariants: `replay` is set whenever the tail cannot be known to hold the state; the digest of a
list of tokens is that of each prefix extended, so a window sent ahead on assumed tokens, then
rolled back, costs no rehash of what was kept."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..proto import shard_pb2 as pb

#: a grammar's sampled tokens, as SamplerState.generated_digest names them: a chain over the tokens,
#: so the head and the tail each extend it a token at a time (neither rehashes the whole output)
GRAMMAR_DIGEST_BYTES = 16
GRAMMAR_DIGEST_EMPTY = bytes(GRAMMAR_DIGEST_BYTES)
#: StepReply.miss_reason of a tail that keeps no grammar state matching a step's digest
SAMPLER_STATE_MISS = "SAMPLER_STATE"


def grammar_digest(tokens, after: bytes = GRAMMAR_DIGEST_EMPTY) -> bytes:
    """The running digest `after` extended by `tokens`, one token at a time."""
    digest = after
    for t in tokens:
        digest = hashlib.blake2b(
            digest + int(t).to_bytes(4, "little", signed=True), digest_size=GRAMMAR_DIGEST_BYTES
        ).digest()
    return digest


class GrammarSync:
    """One stream's side of the tail's grammar state."""

    def __init__(self):
        self.replay = True  # the next sampled step carries every generated token
        self.by_digest = False  # the route's tail keeps the state (InfoReply.features): else always a replay
        self.replays = 0  # sampled steps that carried them
        self._tokens: list[int] = []
        self._digests = [GRAMMAR_DIGEST_EMPTY]  # _digests[i]: the digest of _tokens[:i]

    def fill(self, sampler: "pb.SamplerState", generated: list[int]) -> None:
        """The state's grammar part for a step after `generated`."""
        if self.replay or not self.by_digest:
            sampler.generated.extend(generated)
            self.replays += 1
        else:
            sampler.generated_digest = self.digest(generated)

    def digest(self, generated: list[int]) -> bytes:
        kept = self._tokens
        n = min(len(kept), len(generated))
        if kept[:n] != generated[:n]:  # rolled back onto other tokens: keep the common prefix
            n = next(i for i in range(n) if kept[i] != generated[i])
        del kept[n:], self._digests[n + 1 :]
        for t in generated[n:]:
            kept.append(t)
            self._digests.append(grammar_digest((t,), self._digests[-1]))
        return self._digests[len(generated)]

    def sampled(self) -> None:
        """A sampled step went through: the tail holds the state it reached."""
        self.replay = False

    def lost(self) -> None:
        """The tail may not hold it (a re-prefill, another replica, its own say)."""
        self.replay = True
