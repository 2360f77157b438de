"""The reference engine's checks: a request's key and input before anything changes (as the native
engine's), and its invariants across its rooms (`check_invariants`, the tests' oracle)."""

from __future__ import annotations

import numpy as np

from .._native import MAX_EPOCH, MAX_SESSION_ID_BYTES
from ..errors import InvalidInputError
from .locking import serialised


def validate_key(sid: str, epoch: int) -> None:
    if not isinstance(sid, str) or isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)):
        raise InvalidInputError("a request's key is (str session id, int epoch)")
    if not sid or len(sid.encode("utf-8", "surrogatepass")) > MAX_SESSION_ID_BYTES:
        raise InvalidInputError(f"session id must be 1 to {MAX_SESSION_ID_BYTES} bytes")
    if epoch < 0 or epoch > MAX_EPOCH:
        raise InvalidInputError(f"route epoch must be 0 to {MAX_EPOCH}, got {epoch}")


def validate_input(
    info, n_batch: int, tokens, hidden, limit: int | None = None
) -> tuple[list[int] | None, np.ndarray | None, int]:
    """(tokens, hidden, n) of a step's input, checked as the native engine checks it."""
    limit = n_batch if limit is None else limit
    if (tokens is None) == (hidden is None):
        raise InvalidInputError("pass exactly one of tokens (head shard) or hidden (non-head shard)")
    if tokens is not None:
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise InvalidInputError("tokens must be one-dimensional")
        if arr.size and arr.dtype.kind not in "iu":
            raise InvalidInputError("tokens must be integers")
        if not info.is_head:
            raise InvalidInputError("token ids sent to a non-head shard")
        n = int(arr.size)
        if n < 1:
            raise InvalidInputError("empty input: at least one token is required")
        if n > limit:
            raise InvalidInputError(f"a step takes 1 to {limit} tokens (the step size), got {n}")
        if arr.min() < 0 or arr.max() >= info.n_vocab:
            raise InvalidInputError("token id outside the vocabulary")
        return [int(t) for t in arr], None, n
    if not isinstance(hidden, np.ndarray) or hidden.dtype != np.float32:
        raise InvalidInputError("hidden must be a numpy float32 array")
    if hidden.ndim != 2 or hidden.shape[1] != info.n_embd:
        raise InvalidInputError(f"hidden must have shape (n_tokens, {info.n_embd})")
    if not hidden.flags.c_contiguous:
        raise InvalidInputError("hidden must be C-contiguous")
    if info.is_head:
        raise InvalidInputError("hidden state sent to the head shard: send token ids")
    n = int(hidden.shape[0])
    if n < 1 or n > limit:
        raise InvalidInputError(f"a step takes 1 to {limit} tokens (the step size), got {n}")
    if not np.isfinite(hidden).all():
        raise InvalidInputError("hidden state contains a non-finite value")
    return None, hidden, n


class EngineInvariants:
    """A part of `ReferenceHotKvEngine` (its base): the tests' oracle, on its state, under its lock."""

    @serialised
    def check_invariants(self) -> None:
        """The engine's invariants across its rooms (AssertionError naming the first that fails)."""

        def fail(what: str):
            raise AssertionError(f"reference engine invariant violated: {what}")

        if len(self._live) > self.max_sessions:
            fail("more live sessions than max_sessions")
        ids = [s.seq_id for s in self._live.values()]
        if self._free_ids != sorted(self._free_ids, reverse=True):
            fail("free seq ids are not in descending order")
        if sorted(ids + self._free_ids) != list(range(self.max_sessions)):
            fail("seq ids leaked or duplicated")
        owned = set(self.shard.owned_layers)
        for s in self._live.values():
            if set(s.kv.layers) != owned:
                fail("a session holds K/V for layers it does not own")
            if any(k.shape[0] != s.seq_len or v.shape[0] != s.seq_len for k, v in s.kv.layers.values()):
                fail("owned layers disagree on the session length")
            if s.seq_len > self.context_tokens:
                fail("session longer than context_tokens")
        if sum(s.seq_len for s in self._live.values()) != self._reserved:
            fail("reserved tokens != sum of session lengths")
        if self._reserved > self.budget_tokens:
            fail("reserved tokens exceed the budget")
        times = [s.last_used for s in self._live.values()]
        if times != sorted(times):
            fail("LRU order disagrees with last_used")
        if len(self._recent) > self.recent_capacity:
            fail("the table of dropped keys outgrew its capacity")
        if any(sid in self._live for sid in self._recent):
            fail("a live session is also in the dropped table")
        self._warm.check(fail)
        if any(sid in self._live or sid in self._recent for sid in [*self._warm.host, *self._warm.disk]):
            fail("a warm or disk session is also hot or in the dropped table")
        self._prefixes.check(self.context_tokens, fail)
        c = self._counters
        # across the rooms: every spill is restored, dropped, or still warm
        if c["spills"] != c["restores"] + self._warm.counters["warm_drops"] + len(self._warm):
            fail("spills != restores + warm drops + warm and disk sessions")
