"""The reference engine's prefix store, as the native `prefix_store` (prefix_store.h): copies of shared
session starts by key, their bytes (what the native store charges: the state's whole pages and the
8-byte key) within a capacity, and the eviction order. The engine (engine.py) holds the lock and the
sessions; the store only keeps entries, accounts for them and chooses what to evict.

Invariants (`check`): held is the sum of the entries' bytes and <= capacity; each length is in
[1, context_tokens]; the entry with the least last_used + hits x PREFIX_HIT_SECONDS (hits up to
PREFIX_HIT_CAP) is evicted first, the oldest stored on a tie."""

from __future__ import annotations

import collections
import dataclasses
from typing import TYPE_CHECKING

from .._native import PREFIX_HIT_CAP, PREFIX_HIT_SECONDS

if TYPE_CHECKING:
    from .sequences import SequenceKv


@dataclasses.dataclass
class PrefixEntry:
    kv: "SequenceKv"
    last_used: float
    nbytes: int
    stamp: int
    hits: int = 0

    @property
    def length(self) -> int:
        return self.kv.seq_len


class PrefixStore:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self._entries: dict[int, PrefixEntry] = {}
        self.held = 0
        self._stamp = 0
        self.counters = collections.Counter()  # stores, hits, tokens_saved, evictions

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def __contains__(self, key: int) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def length(self, key: int) -> int:
        e = self._entries.get(key)
        return e.length if e is not None else 0

    def find(self, key: int, length: int) -> PrefixEntry | None:
        e = self._entries.get(key)
        return e if e is not None and e.length == length else None

    def _evict_one(self) -> None:
        def score(e: PrefixEntry) -> tuple[float, int]:
            return e.last_used + PREFIX_HIT_SECONDS * min(e.hits, PREFIX_HIT_CAP), e.stamp

        key = min(self._entries, key=lambda k: score(self._entries[k]))
        self.held -= self._entries.pop(key).nbytes
        self.counters["evictions"] += 1

    def insert(self, key: int, kv: "SequenceKv", nbytes: int, now: float) -> bool:
        """Stores a copy's entry (evicting to make room); False when it can never fit."""
        self._stamp += 1
        if nbytes > self.capacity:
            return False
        while self.held + nbytes > self.capacity:
            self._evict_one()
        self._entries[key] = PrefixEntry(kv, now, nbytes, self._stamp)
        self.held += nbytes
        self.counters["stores"] += 1
        return True

    def hit(self, key: int, now: float) -> None:
        e = self._entries[key]
        e.hits += 1
        e.last_used = now
        self.counters["hits"] += 1
        self.counters["tokens_saved"] += e.length

    def check(self, context_tokens: int, fail) -> None:
        if sum(e.nbytes for e in self._entries.values()) != self.held or self.held > self.capacity:
            fail("prefix bytes held disagree with the entries or exceed prefix_bytes")
        if any(not 1 <= e.length <= context_tokens for e in self._entries.values()):
            fail("prefix length outside [1, context_tokens]")
