"""The reference engine's warm tier, as the native `warm_tier` (warm_tier.h): sessions that left the hot
set, in host memory or, past it, in a simulated disk tier (the same decisions and byte counts as the
native files; no files: a reference engine does not outlive its process). The engine (engine.py) holds
the lock and the hot set; the tier keeps the entries, accounts for their bytes, chooses what leaves,
and tells the engine of every entry it drops (`on_drop`, for stale-epoch fencing).

Invariants (`check`): a key is in one tier; each tier's bytes are the sum of its entries' and within
its capacity; each tier is ordered by last use; the pinned session is never moved out."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

from .._native import MissReason, Tier

if TYPE_CHECKING:
    from .sequences import SequenceKv


@dataclasses.dataclass
class WarmEntry:
    epoch: int
    kv: "SequenceKv"
    last_used: float
    nbytes: int

    @property
    def seq_len(self) -> int:
        return self.kv.seq_len


class WarmTier:
    def __init__(
        self,
        host_bytes: int,
        disk_bytes: int,
        ttl_seconds: float,
        *,
        host_entry_bytes: Callable[[str, int], int],
        disk_bound_bytes: Callable[[str, int], int],
        file_bytes: Callable[[str, int], int],
        on_drop: Callable[[str, int, MissReason], None],
    ):
        self.host_bytes, self.disk_bytes, self.ttl_seconds = host_bytes, disk_bytes, ttl_seconds
        self._host_entry_bytes, self._disk_bound_bytes, self._file_bytes = (
            host_entry_bytes,
            disk_bound_bytes,
            file_bytes,
        )
        self._on_drop = on_drop
        self.host: "collections.OrderedDict[str, WarmEntry]" = collections.OrderedDict()  # LRU order
        self.disk: "collections.OrderedDict[str, WarmEntry]" = collections.OrderedDict()  # LRU order
        self.host_held = self.disk_held = 0
        self._pinned: str | None = None  # being restored: never moved out
        self.counters = collections.Counter()  # warm_drops, disk_spills, disk_restores

    @property
    def enabled(self) -> bool:
        return self.host_bytes > 0 or self.disk_bytes > 0

    @property
    def has_disk(self) -> bool:
        return self.disk_bytes > 0

    def __len__(self) -> int:
        return len(self.host) + len(self.disk)

    def __contains__(self, sid: str) -> bool:
        return sid in self.host or sid in self.disk

    def find(self, sid: str) -> tuple[WarmEntry | None, Tier]:
        if sid in self.host:
            return self.host[sid], Tier.WARM
        if sid in self.disk:
            return self.disk[sid], Tier.DISK
        return None, Tier.NONE

    @contextlib.contextmanager
    def pin(self, sid: str | None):
        self._pinned = sid
        try:
            yield
        finally:
            self._pinned = None

    @staticmethod
    def _insert_by_last_used(tier: "collections.OrderedDict[str, WarmEntry]", sid: str, w: WarmEntry) -> None:
        """As the native insert_by_last_used: after every entry used no later."""
        later = [k for k, v in tier.items() if v.last_used > w.last_used]
        tier[sid] = w
        for k in later:
            tier.move_to_end(k)

    def put(self, sid: str, w: WarmEntry) -> bool:
        """A session leaving the hot set: host memory, else the disk tier; False when neither takes it."""
        return self._store_host(sid, w) or self._store_disk(sid, w)

    def _store_host(self, sid: str, w: WarmEntry) -> bool:
        nbytes = self._host_entry_bytes(sid, w.seq_len)
        # the warm session being restored (pinned) is never moved out to make room for this one
        pinned = self.host.get(self._pinned) if self._pinned is not None else None
        if nbytes + (pinned.nbytes if pinned else 0) > self.host_bytes:
            return False
        while self.host_held + nbytes > self.host_bytes:
            self._demote(next(k for k in self.host if k != self._pinned))
        w.nbytes = nbytes
        self._insert_by_last_used(self.host, sid, w)
        self.host_held += nbytes
        return True

    def _store_disk(self, sid: str, w: WarmEntry) -> bool:
        if self.disk_bytes <= 0:
            return False
        bound = self._disk_bound_bytes(sid, w.seq_len)
        pinned = self.disk.get(self._pinned) if self._pinned is not None else None
        if bound + (pinned.nbytes if pinned else 0) > self.disk_bytes:
            return False
        while self.disk_held + bound > self.disk_bytes:
            self.drop(next(k for k in self.disk if k != self._pinned), MissReason.EVICTED_LRU)
        w.nbytes = self._file_bytes(sid, w.seq_len)
        self._insert_by_last_used(self.disk, sid, w)
        self.disk_held += w.nbytes
        self.counters["disk_spills"] += 1
        return True

    def _demote(self, sid: str) -> None:
        """The host tier's session moves to disk, or is dropped (EVICTED_LRU) if it cannot."""
        w = self.host.pop(sid)
        self.host_held -= w.nbytes
        if not self._store_disk(sid, w):
            self.counters["warm_drops"] += 1
            self._on_drop(sid, w.epoch, MissReason.EVICTED_LRU)

    def _remove(self, sid: str) -> tuple[WarmEntry, bool]:
        """(entry, from disk), removed from its tier."""
        if sid in self.host:
            w = self.host.pop(sid)
            self.host_held -= w.nbytes
            return w, False
        w = self.disk.pop(sid)
        self.disk_held -= w.nbytes
        return w, True

    def drop(self, sid: str, reason: MissReason, remembered_epoch: int = -1) -> None:
        w, _ = self._remove(sid)
        self.counters["warm_drops"] += 1
        self._on_drop(sid, remembered_epoch if remembered_epoch >= 0 else w.epoch, reason)

    def discard(self, sid: str) -> None:
        """Removes the entry whose copy is being replaced (a prefix opened over it): a warm drop, untold."""
        self._remove(sid)
        self.counters["warm_drops"] += 1

    def take(self, sid: str) -> WarmEntry:
        """The entry, restored hot: removed from its tier."""
        w, from_disk = self._remove(sid)
        self.counters["disk_restores"] += int(from_disk)
        return w

    def sweep(self, now: float) -> int:
        n = 0
        for tier in (self.disk, self.host):  # the native order
            while self.ttl_seconds > 0 and tier:
                sid, w = next(iter(tier.items()))
                if now - w.last_used <= self.ttl_seconds:
                    break
                self.drop(sid, MissReason.EVICTED_TTL)
                n += 1
        return n

    def release_host_all(self) -> None:
        for sid in list(self.host):
            self.drop(sid, MissReason.RELEASED)

    def demote_host_all(self) -> None:
        for sid in list(self.host):
            self._demote(sid)

    def check(self, fail) -> None:
        if any(sid in self.disk for sid in self.host):
            fail("a warm session is also hot, on disk or in the dropped table")
        if sum(w.nbytes for w in self.host.values()) != self.host_held or self.host_held > self.host_bytes:
            fail("warm bytes held disagree with the entries or exceed warm_bytes")
        if sum(w.nbytes for w in self.disk.values()) != self.disk_held or self.disk_held > self.disk_bytes:
            fail("disk bytes held disagree with the entries or exceed warm_disk_bytes")
        for tier in (self.host, self.disk):
            times = [w.last_used for w in tier.values()]
            if times != sorted(times):
                fail("warm LRU order disagrees with last_used")
