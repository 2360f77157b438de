"""A worker's Prometheus metrics (serve --metrics-port): the engine's, read at scrape time, and its step RPCs'."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

if TYPE_CHECKING:
    from ..engine.manager import HotKvStateManager


class EngineCollector:
    """Reads the engine's counters at scrape time: nothing to keep in sync on the hot path."""

    def __init__(self, manager: HotKvStateManager, labels: dict[str, str]):
        self.manager = manager
        self.labels = labels

    def collect(self):
        st = self.manager.stats()
        names, values = list(self.labels), list(self.labels.values())
        for name, key, doc in [
            ("llama_shard_live_sessions", "live_sessions", "Live route sessions"),
            ("llama_shard_reserved_tokens", "reserved_tokens", "Tokens held by live sessions"),
            ("llama_shard_budget_tokens", "budget_tokens", "Token budget of this shard"),
            ("llama_shard_reserved_kv_bytes", "reserved_bytes", "KV bytes held (owned layers)"),
            ("llama_shard_warm_sessions", "warm_sessions", "Sessions whose KV is in the warm tier"),
            ("llama_shard_warm_bytes", "warm_bytes", "Bytes the warm tier holds"),
            ("llama_shard_warm_capacity_bytes", "warm_capacity", "The warm tier's bound"),
            ("llama_shard_disk_sessions", "disk_sessions", "Warm sessions held in files (--warm-dir)"),
            ("llama_shard_disk_bytes", "disk_bytes", "Bytes of the disk tier's files"),
            ("llama_shard_prefix_entries", "prefix_entries", "Shared prefixes held (--prefix-memory)"),
            ("llama_shard_prefix_bytes", "prefix_bytes", "Bytes the prefix store holds"),
            ("llama_shard_prefix_capacity_bytes", "prefix_capacity", "The prefix store's bound"),
        ]:
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, st[key])
            yield g
        ev = CounterMetricFamily("llama_shard_evictions", "Sessions evicted, by reason", labels=names + ["reason"])
        ev.add_metric(values + ["ttl"], st["evictions_ttl"])
        ev.add_metric(values + ["lru"], st["evictions_lru"])
        yield ev
        ms = CounterMetricFamily(
            "llama_shard_cache_misses", "Cache misses returned, by reason", labels=names + ["reason"]
        )
        for reason, n in st["misses"].items():
            ms.add_metric(values + [reason], n)
        yield ms
        for name, key, doc in [
            ("llama_shard_spills", "spills", "Sessions moved from the hot set to the warm tier"),
            ("llama_shard_restores", "restores", "Warm sessions brought back hot, without a re-prefill"),
            ("llama_shard_warm_drops", "warm_drops", "Warm sessions dropped (LRU by bytes, TTL, release, new epoch)"),
            ("llama_shard_disk_restores", "disk_restores", "Restores read from the disk tier (part of restores)"),
            ("llama_shard_disk_failures", "disk_failures", "Disk tier writes or reads that failed (logged)"),
            ("llama_shard_prefix_hits", "prefix_hits", "Sessions opened from a stored shared prefix"),
            ("llama_shard_prefix_tokens_saved", "prefix_tokens_saved", "Tokens those sessions did not compute"),
            ("llama_shard_prefix_stores", "prefix_stores", "Shared prefixes stored"),
            ("llama_shard_prefix_evictions", "prefix_evictions", "Shared prefixes dropped to make room"),
        ]:
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(values, st[key])
            yield c
        # how this worker computes a verification of n tokens (--draft-verify exact), decided by its first
        # one of that size: one call where that was proven to give one-token steps' bytes and was faster
        v = GaugeMetricFamily(
            "llama_shard_verification_rows",
            "1 per verification size (tokens) decided: one call, or row by row and why",
            labels=names + ["tokens", "verdict"],
        )
        for n, verdict in getattr(self.manager.engine, "whole_rows_verdicts", {}).items():
            v.add_metric(values + [str(n), verdict], 1)
        yield v
        h = HistogramMetricFamily("llama_shard_restore_seconds", "Time to restore a warm session's KV", labels=names)
        cumulative, buckets = 0, []
        for le, n in st["restore_buckets"]:
            cumulative += n
            buckets.append(("+Inf" if le == float("inf") else repr(le), cumulative))
        h.add_metric(values, buckets, st["restore_seconds"])
        yield h


class StepMetrics:
    """The step RPCs' latency and size, and the sessions handed over (Prometheus), every label
    exported from the start (zero counts), so a scrape before the first step sees the series."""

    def __init__(self, registry, step_kinds):
        self.seconds = Histogram(
            "llama_shard_step_seconds",
            "Latency of a prefill/decode RPC",
            ["kind"],
            registry=registry,
            buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5),
        )
        self.tokens = Histogram(
            "llama_shard_step_tokens",
            "Tokens in a prefill/decode RPC",
            ["kind"],
            registry=registry,
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
        )
        self.handovers = Counter(
            "llama_shard_handover_sessions",
            "Sessions handed to a replica (sent) or taken from one (received)",
            ["direction"],
            registry=registry,
        )
        self.handover_total = 0  # both directions (Info)
        self._lock = threading.Lock()
        for label in ("prefill", "decode", "batch"):
            self.seconds.labels(label)
        for kind in step_kinds:
            self.tokens.labels(kind.lower())

    def step(self, label: str, seconds: float, items: list[tuple]) -> None:
        """One step RPC of (kind, StepRequest) items (kind None: refused as invalid)."""
        self.seconds.labels(label).observe(seconds)
        for kind, req in items:
            n = len(req.token_ids) or (req.hidden.shape[0] if len(req.hidden.shape) == 2 else 0)
            self.tokens.labels(kind.name.lower() if kind is not None else "invalid").observe(n)

    def handed(self, direction: str, n: int) -> None:
        with self._lock:
            self.handover_total += n
        self.handovers.labels(direction).inc(n)
