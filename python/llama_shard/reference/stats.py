"""The reference engine's counters as the native engine reports them (HotKvStateManager.stats())."""

from __future__ import annotations

from .._native import RESTORE_BUCKETS
from .results import MISS_REASONS


def engine_stats(engine) -> dict:
    """The reference engine's counters, under the keys the native engine's stats() uses."""
    bpt = engine.shard.info.kv_bytes_per_token
    return {
        "live_sessions": len(engine._live),
        "max_sessions": engine.max_sessions,
        "reserved_tokens": engine._reserved,
        "budget_tokens": engine.budget_tokens,
        "context_tokens": engine.context_tokens,
        "kv_bytes_per_token": bpt,
        "reserved_bytes": engine._reserved * bpt,
        "evictions_ttl": engine._counters["evictions_ttl"],
        "evictions_lru": engine._counters["evictions_lru"],
        "releases": engine._counters["releases"],
        "supersessions": engine._counters["supersessions"],
        "steps": engine._counters["steps"],
        "tokens_computed": engine._counters["tokens_computed"],
        "recent_keys": len(engine._recent),
        "misses": {r.name: engine._misses[r] for r in MISS_REASONS},
        "spills": engine._counters["spills"],
        "restores": engine._counters["restores"],
        "warm_drops": engine._warm.counters["warm_drops"],
        "warm_sessions": len(engine._warm.host),
        "warm_bytes": engine._warm.host_held,
        "warm_capacity": engine.warm_bytes,
        "restore_seconds": engine._counters["restore_seconds"],
        "restore_buckets": list(zip(RESTORE_BUCKETS, engine._restore_buckets)),
        "disk_sessions": len(engine._warm.disk),
        "disk_bytes": engine._warm.disk_held,
        "disk_capacity": engine.warm_disk_bytes,
        "disk_spills": engine._warm.counters["disk_spills"],
        "disk_restores": engine._warm.counters["disk_restores"],
        "disk_loaded": 0,
        "disk_failures": 0,  # no files: nothing to load, nothing to fail
        "prefix_entries": len(engine._prefixes),
        "prefix_bytes": engine._prefixes.held,
        "prefix_capacity": engine.prefix_bytes,
        "prefix_stores": engine._prefixes.counters["stores"],
        "prefix_hits": engine._prefixes.counters["hits"],
        "prefix_tokens_saved": engine._prefixes.counters["tokens_saved"],
        "prefix_evictions": engine._prefixes.counters["evictions"],
        # the reference's dense models hold no recurrent state: no checkpoints
        "checkpoints_taken": 0,
        "checkpoint_restores": 0,
        "checkpoint_tokens": 0,
        "checkpoint_bytes": 0,
    }
