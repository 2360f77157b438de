"""What leaves and enters the reference engine whole (as the native engine's): shared prefixes stored
and opened, a session exported for a hand-over and imported from one, every session persisted at
shutdown. A part of `ReferenceHotKvEngine` (its base), on the engine's state and under its lock."""

from __future__ import annotations

import copy

#: RESTORE_BUCKETS: upper bounds of the restore-time buckets (native HOT_KV_RESTORE_BUCKETS); the last is +Inf
from .._native import (
    MissReason,
    Tier,
)
from ..errors import InvalidInputError
from .checks import validate_key
from .locking import serialised
from .results import BUDGET_EXCEEDED, INVALID_INPUT, OK, STALE_EPOCH, IdPlacement, StepResult
from .sequences import state_kv, state_of
from .warm_tier import WarmEntry


class SessionTransfers:
    # --- the prefix store (as the native store_prefix / open_prefix / prefix_length) ----------------

    @serialised
    def store_prefix(self, session_id: str, epoch: int, key: int, length: int, now: float) -> StepResult:
        if not 1 <= length <= self.context_tokens:
            raise InvalidInputError(f"a prefix holds 1 to {self.context_tokens} tokens (context_tokens), got {length}")
        now = self._begin(session_id, epoch, now)
        s, res = self._identify(session_id, epoch, query=True)
        if s is None:
            return res
        if s.seq_len != length:
            raise InvalidInputError(f"the session holds {s.seq_len} tokens, not the prefix's {length}")
        res = StepResult(seq_len=s.seq_len, seq_id=s.seq_id, tier=Tier.HOT)
        if not self._prefixes.enabled or key in self._prefixes:
            return res
        res.changed = self._prefixes.insert(key, copy.deepcopy(s.kv), self.sizes.prefix_entry_bytes(length), now)
        return res

    @serialised
    def open_prefix(self, session_id: str, epoch: int, key: int, length: int, now: float) -> StepResult:
        if length < 1:
            raise InvalidInputError(f"a prefix holds at least 1 token, got {length}")
        now = self._begin(session_id, epoch, now)
        entry, res = self._lookup_prefix(session_id, epoch, key, length)
        if entry is None:
            return res
        s, res = self._replace_for_prefix(session_id, epoch, length, now)
        if s is None:
            return res
        # the restore: a copy of the entry (the reference's copies cannot fail, nor hold a sliding window)
        s.kv = copy.deepcopy(entry.kv)
        s.last_start, s.last_input = -1, None
        self._touch(session_id, s, now)
        self._reserved += length
        self._prefixes.hit(key, now)
        return StepResult(seq_len=s.seq_len, seq_id=s.seq_id, tier=Tier.HOT)

    def _lookup_prefix(self, session_id: str, epoch: int, key: int, length: int):
        """(the entry to open from, None) or (None, the answer: a stale epoch, a counted miss, BUDGET_EXCEEDED)."""
        _, res = self._identify(session_id, epoch, query=True)  # a stale epoch is that, whatever the store holds
        if res.status == STALE_EPOCH:
            return None, res
        entry = self._prefixes.find(key, length)
        if entry is None:
            return None, self._counted(
                self._miss(
                    MissReason.PREFIX_EVICTED,
                    f"this shard does not hold the prefix of {length} tokens: the head computes it",
                )
            )
        if length > self.context_tokens or length > self.budget_tokens:
            return None, StepResult(
                status=BUDGET_EXCEEDED,
                detail=f"a prefix of {length} tokens does not fit this shard's context or budget",
            )
        return entry, res

    def _replace_for_prefix(self, session_id: str, epoch: int, length: int, now: float):
        """(the session that will hold the prefix, emptied, with room made; or None, the stale answer): a
        warm copy is dropped, an older epoch superseded (not counted as a miss)."""
        s, res = self._identify(session_id, epoch)
        if res.status == STALE_EPOCH:
            return None, res
        if res.tier in (
            Tier.WARM,
            Tier.DISK,
        ):  # its warm copy is about to be replaced: dropped (a warm drop), not restored
            self._warm.discard(session_id)
            s = None
        held = s.seq_len if s is not None else 0
        room = self._make_room(max(0, length - held), s is None, [session_id], [])  # never touches the prefix store
        assert room  # length <= budget: every other session can leave
        if s is None:
            s = self._create(session_id, epoch, now, IdPlacement())
        self._reserved -= held
        return s, res

    @serialised
    def prefix_length(self, key: int) -> int:
        return self._prefixes.length(key)

    @serialised
    def persist(self, now: float) -> int:
        """As the native persist: with a disk tier, every hot and host-warm session goes to disk;
        without one, every session is released."""
        self._tick(now)
        if self.warm_disk_bytes <= 0:
            for sid in list(self._live):
                self._drop(sid, MissReason.RELEASED)
            self._warm.release_host_all()
            return 0
        for sid in list(self._live):
            if self._live[sid].seq_len == 0:
                self._drop(sid, MissReason.RELEASED)
                continue
            s = self._live[sid]
            if self._warm.put(sid, WarmEntry(s.epoch, copy.deepcopy(s.kv), s.last_used, 0)):
                self._counters["spills"] += 1
                self._free_hot(sid)
            else:
                self._drop(sid, MissReason.RELEASED)
        self._warm.demote_host_all()
        return len(self._warm.disk)

    # --- hand-over (as the native export_session / import_session; the state is the reference's own:
    # a header, then per owned layer K and V as little-endian float16, which holds its f16 cache exactly)

    @serialised
    def export_session(self, session_id: str, epoch: int, now: float) -> tuple[StepResult, bytes]:
        self._begin(session_id, epoch, now)
        s, res = self._identify(session_id, epoch, query=True)
        if s is not None:
            res, kv = StepResult(seq_len=s.seq_len, seq_id=s.seq_id, tier=Tier.HOT), s.kv
        elif res.status == OK:  # warm: copied where it is (the reference's disk tier is simulated: it cannot fail)
            kv = self._warm.find(session_id)[0].kv
        else:
            return self._counted(res), b""
        if kv.seq_len == 0:
            return res, b""
        return res, state_of(self.shard, kv)

    @serialised
    def import_session(self, session_id: str, epoch: int, seq_len: int, state: bytes, now: float) -> StepResult:
        validate_key(session_id, epoch)
        if seq_len < 1:
            raise InvalidInputError(f"an imported session holds at least 1 token, got {seq_len}")
        _, res = self._identify(session_id, epoch, query=True)  # identity first; every check before anything changes
        if res.status == STALE_EPOCH:
            return res
        if seq_len > self.context_tokens or seq_len > self.budget_tokens:
            return StepResult(
                status=BUDGET_EXCEEDED,
                detail=f"a session of {seq_len} tokens does not fit this shard's "
                f"context_tokens {self.context_tokens} or budget_tokens {self.budget_tokens}",
            )
        kv, why = state_kv(self.shard, state, seq_len)
        if kv is None:
            return StepResult(
                status=INVALID_INPUT, detail=f"the state of {seq_len} tokens cannot be restored here: {why}"
            )
        now = self._begin(session_id, epoch, now)
        s, _ = self._replace_for_prefix(session_id, epoch, seq_len, now)  # emptied, room made (as open_prefix)
        s.kv, s.last_start, s.last_input = kv, -1, None
        self._touch(session_id, s, now)
        self._reserved += seq_len
        return StepResult(seq_len=s.seq_len, seq_id=s.seq_id, tier=Tier.HOT)
