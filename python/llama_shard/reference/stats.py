"""The reference engine's counters as the native engine reports them (HotKvStateManager.stats()): a part of
`ReferenceHotKvEngine` (its base), on the engine's state and under its lock."""

from __future__ import annotations

from .._native import RESTORE_BUCKETS
from .locking import serialised
from .results import MISS_REASONS


class EngineStats:
    @serialised
    def stats(self) -> dict:
        """The engine's counters, under the keys the native engine's stats() uses."""
        bpt = self.shard.info.kv_bytes_per_token
        return {
            "live_sessions": len(self._live),
            "max_sessions": self.max_sessions,
            "reserved_tokens": self._reserved,
            "budget_tokens": self.budget_tokens,
            "context_tokens": self.context_tokens,
            "kv_bytes_per_token": bpt,
            "reserved_bytes": self._reserved * bpt,
            "evictions_ttl": self._counters["evictions_ttl"],
            "evictions_lru": self._counters["evictions_lru"],
            "releases": self._counters["releases"],
            "supersessions": self._counters["supersessions"],
            "steps": self._counters["steps"],
            "tokens_computed": self._counters["tokens_computed"],
            "recent_keys": len(self._recent),
            "misses": {r.name: self._misses[r] for r in MISS_REASONS},
            "spills": self._counters["spills"],
            "restores": self._counters["restores"],
            "warm_drops": self._warm.counters["warm_drops"],
            "warm_sessions": len(self._warm.host),
            "warm_bytes": self._warm.host_held,
            "warm_capacity": self.warm_bytes,
            "restore_seconds": self._counters["restore_seconds"],
            "restore_buckets": list(zip(RESTORE_BUCKETS, self._restore_buckets)),
            "disk_sessions": len(self._warm.disk),
            "disk_bytes": self._warm.disk_held,
            "disk_capacity": self.warm_disk_bytes,
            "disk_spills": self._warm.counters["disk_spills"],
            "disk_restores": self._warm.counters["disk_restores"],
            "disk_loaded": 0,
            "disk_failures": 0,  # no files: nothing to load, nothing to fail
            "prefix_entries": len(self._prefixes),
            "prefix_bytes": self._prefixes.held,
            "prefix_capacity": self.prefix_bytes,
            "prefix_stores": self._prefixes.counters["stores"],
            "prefix_hits": self._prefixes.counters["hits"],
            "prefix_tokens_saved": self._prefixes.counters["tokens_saved"],
            "prefix_evictions": self._prefixes.counters["evictions"],
            # the reference's dense models hold no recurrent state: no checkpoints
            "checkpoints_taken": 0,
            "checkpoint_restores": 0,
            "checkpoint_tokens": 0,
            "checkpoint_bytes": 0,
        }
