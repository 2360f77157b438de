"""Continuous batching: concurrent callers' steps coalesced into batched engine steps.

Callers (threads, or asyncio tasks through `KvBoundaryAdapter.*_async`) submit one step each and
wait on a future; a single worker thread takes what has arrived, waits at most `window_s` after the
oldest pending request for others to join, and runs one `HotKvStateManager.step_batch` with at most
one request per session and at most `max_batch_tokens` tokens. The engine packs the step into as
few llama_decode calls as its n_batch allows. A group submitted together (`submit_many`: a
micro-batch its client already formed) starts at once with whatever else is pending: it pays no
window. Long prefills are cut into `prefill_chunk`-token pieces by the adapter, so a long prompt
does not stall the decoders sharing the worker.
"""
from __future__ import annotations

import collections
import dataclasses
import threading
import time
from concurrent.futures import Future

from .errors import InvalidInputError


@dataclasses.dataclass
class _Pending:
    request: tuple          # (session_id, epoch, kind, position, tokens, hidden)
    n_tokens: int
    future: Future
    arrived: float
    grouped: bool = False   # part of a micro-batch submitted together: no window to wait for


class StepScheduler:
    """Coalesces concurrent steps of different sessions into batched engine steps."""

    def __init__(self, manager, *, window_s: float = 0.002, max_batch_tokens: int | None = None,
                 prefill_chunk: int = 64, max_batch_sessions: int | None = None):
        if window_s < 0 or prefill_chunk < 1 or (max_batch_sessions is not None and max_batch_sessions < 1):
            raise InvalidInputError("window_s must be >= 0, prefill_chunk and max_batch_sessions >= 1")
        self.manager = manager
        self.window_s = float(window_s)
        self.max_batch_tokens = int(max_batch_tokens or manager.engine.n_batch)
        # a cap on sessions per step bounds a step's latency (micro-batches for pipelining are
        # formed by the client: RouteClient.generate_many)
        self.max_batch_sessions = int(max_batch_sessions or manager.config.max_sessions)
        self._last_batch = 0
        self.prefill_chunk = int(min(prefill_chunk, self.max_batch_tokens))
        self._pending: collections.deque[_Pending] = collections.deque()
        self._cv = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        self.steps = 0            # batched steps run
        self.requests = 0         # requests answered
        self.busy_seconds = 0.0   # wall time inside engine steps

    # --- submission ------------------------------------------------------------------------------

    def submit(self, session_id, epoch, kind: str, position: int, tokens=None, hidden=None) -> Future:
        return self._enqueue([(session_id, epoch, kind, position, tokens, hidden)], grouped=False)[0]

    def submit_many(self, requests) -> list[Future]:
        """A micro-batch of requests (one per session), queued together and started without a window."""
        return self._enqueue(list(requests), grouped=True)

    def _enqueue(self, requests: list[tuple], grouped: bool) -> list[Future]:
        now = time.monotonic()
        pending = []
        for req in requests:
            tokens, hidden = req[4], req[5]
            n = len(tokens) if tokens is not None else (int(hidden.shape[0]) if hasattr(hidden, "shape") and hidden.ndim == 2 else 1)
            pending.append(_Pending(tuple(req), max(n, 1), Future(), now, grouped))
        with self._cv:
            if self._closed:
                raise RuntimeError("the scheduler is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="llama-shard-scheduler", daemon=True)
                self._thread.start()
            self._pending.extend(pending)
            self._cv.notify()
        return [p.future for p in pending]

    def close(self) -> None:
        """Finishes what was submitted, then stops the worker."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join()

    # --- the worker ------------------------------------------------------------------------------

    def _take(self) -> list[_Pending] | None:
        with self._cv:
            while not self._pending and not self._closed:
                self._cv.wait()
            if not self._pending:
                return None
            # wait for others only when there are others: a lone caller (last step had one request
            # and nobody else is queued) pays no window, nor does a micro-batch formed by its client
            head = self._pending[0]
            window = self.window_s if not head.grouped and (self._last_batch > 1 or len(self._pending) > 1) else 0.0
            deadline = head.arrived + window
            while not self._closed:
                sessions = {p.request[0] for p in self._pending}
                tokens = sum(p.n_tokens for p in self._pending)
                remaining = deadline - time.monotonic()
                # everyone who can share a step is here, or the window is over
                if remaining <= 0 or tokens >= self.max_batch_tokens or len(sessions) >= self.max_batch_sessions:
                    break
                self._cv.wait(remaining)
            batch, seen, tokens, keep = [], set(), 0, collections.deque()
            while self._pending:
                p = self._pending.popleft()
                sid = p.request[0]
                fits = not batch or (tokens + p.n_tokens <= self.max_batch_tokens and len(batch) < self.max_batch_sessions)
                if sid in seen or not fits:
                    keep.append(p)  # one request per session per step; the rest waits its turn
                    continue
                seen.add(sid)
                tokens += p.n_tokens
                batch.append(p)
            self._pending = keep
            self._last_batch = len(batch)
            return batch

    def _run(self) -> None:
        while True:
            batch = self._take()
            if batch is None:
                return
            self._execute(batch)

    def _execute(self, batch: list[_Pending]) -> None:
        """Runs one engine step and answers every request in it."""
        t0 = time.perf_counter()
        try:
            answers = self.manager.step_batch([p.request for p in batch])
        except BaseException as e:  # noqa: BLE001 - handed to every waiting caller
            for p in batch:
                p.future.set_exception(e)
            return
        finally:
            self.busy_seconds += time.perf_counter() - t0
            self.steps += 1
            self.requests += len(batch)
        for p, answer in zip(batch, answers):
            p.future.set_result(answer)
