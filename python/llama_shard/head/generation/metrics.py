"""The head's generation metrics (Prometheus) and the draft totals Info reports."""

from __future__ import annotations

import threading
from collections.abc import Callable

from prometheus_client import Counter, Gauge, Histogram


class GenerationMetrics:
    def __init__(self, registry, running: Callable[[], int]):
        self.active = Gauge("llama_shard_generate_streams", "Generate streams running on this head", registry=registry)
        self.active.set_function(running)
        self.ttft = Histogram(
            "llama_shard_generate_time_to_first_token_seconds",
            "Time from a Generate call to its first token",
            registry=registry,
            buckets=(0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30),
        )
        self.itl = Histogram(
            "llama_shard_generate_inter_token_seconds",
            "Time between a stream's tokens",
            registry=registry,
            buckets=(0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2),
        )
        self.drafted = Counter(
            "llama_shard_draft_tokens", "Drafts Generate streams sent to be verified", registry=registry
        )
        self.accepted = Counter("llama_shard_draft_accepted_tokens", "Drafts the tail accepted", registry=registry)
        self.drafted_total = self.accepted_total = 0
        self._lock = threading.Lock()  # streams of several route loops count here (Info reads these)

    def count_drafts(self, drafted: int, accepted: int) -> None:
        self.drafted.inc(drafted)
        self.accepted.inc(accepted)
        with self._lock:
            self.drafted_total += drafted
            self.accepted_total += accepted
