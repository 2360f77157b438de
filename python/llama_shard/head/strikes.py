"""Strikes against a route's worker that, in a spot check's row replay (head/row_checks.py),
refuses to answer twice (unless it restarted since the request), or, on a CPU, does not repeat the
rows it committed to in its receipt.

A worker can tell a replay from live traffic (a session without a nonce or a next stage), so one
that refused them freely would never be checked; an honest worker refuses rarely (a full queue, or
its replay session evicted under load: docs/benchmarks.md, "Across kernels"), and is asked again.

A CPU worker computes a row to the same bytes batched or alone (patch 0010's attention, dense
matrix products), so an honest one repeats its commitment; one that adds fresh noise to its rows
cannot. One miss is not blamed at once: honest workers missed 3 times in two earlier runs of the
study (docs/benchmarks.md, "Across kernels"; cause not found, not seen in 62 requests of 448 tokens
since), so a worker is out only when its replays miss `STRIKES_OUT` times among its last
`STRIKE_WINDOW` checks. Whether a worker computes on the CPU is its own `Info.device`'s say.
Bounded: at most `MAX_WORKERS` workers remembered, the least recently checked forgotten first."""

from __future__ import annotations

import threading
from collections import OrderedDict, deque

#: a worker's last checks remembered
STRIKE_WINDOW = 20
#: misses among them that take a worker out of routes
STRIKES_OUT = 3
#: workers remembered at most
MAX_WORKERS = 1024


class Strikes:
    """Each worker's last `window` checks (missed or not); `out` at `limit` misses among them."""

    def __init__(self, window: int = STRIKE_WINDOW, limit: int = STRIKES_OUT, max_workers: int = MAX_WORKERS):
        assert window >= limit >= 1 and max_workers >= 1
        self.window, self.limit, self.max_workers = window, limit, max_workers
        self._by_worker: OrderedDict[str, deque] = OrderedDict()
        self._lock = threading.Lock()

    def record(self, worker: str, missed: bool) -> int:
        """Records one check of `worker` (`missed`: it refused it, or did not repeat its
        commitment); returns its misses among its last `window` checks."""
        with self._lock:
            last = self._by_worker.pop(worker, None)
            if last is None:
                last = deque(maxlen=self.window)
            last.append(missed)
            self._by_worker[worker] = last
            while len(self._by_worker) > self.max_workers:
                self._by_worker.popitem(last=False)
            return sum(last)

    def out(self, misses: int) -> bool:
        return misses >= self.limit
