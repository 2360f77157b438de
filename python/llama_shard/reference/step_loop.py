"""The native StepLoop's rules in Python, for the numpy reference engine (the manager drives
either loop the same way): one request per session per step in submission order, the step caps,
prefills cut into chunks, BUSY requests first in the next step. It runs synchronously at submission.
"""

from __future__ import annotations

import threading

import numpy as np

from .._native import Status, StepKind
from ..engine.hot_kv import Step
from ..errors import CapacityError, InvalidInputError
from .results import StepResult


class ReferenceTicket:
    """A reference-engine step: the StepTicket interface, completed during submission."""

    def __init__(self, step: Step, now: float):
        self.step, self.now = step, now
        self.offset, self.start, self.outs = 0, -1, []
        self.result = self.output = None
        self.finished = self.submitted = self.deferred = False

    def finish(self, result, output=None) -> None:
        self.result, self.output, self.finished = result, output, True

    def done(self) -> bool:
        return self.finished

    def wait(self, timeout: float | None = None) -> bool:
        return self.finished


class ReferenceStepLoop:
    """The native StepLoop's rules for the numpy reference engine, run synchronously at submission:
    one request per session per step in submission order, at most max_step_sessions sessions and
    n_batch tokens per step, prefills cut into chunks (prefill_chunk while other sessions wait), a
    refused later chunk truncated back, a prefill that cannot fit even alone refused up front."""

    def __init__(self, engine, max_step_sessions: int | None, prefill_chunk: int):
        self.engine = engine
        self.max_step_tokens = engine.n_batch
        self.max_step_sessions = min(max_step_sessions or engine.max_sessions, engine.max_sessions)
        self.prefill_chunk = min(prefill_chunk, engine.n_batch)
        self._lock = threading.Lock()
        self._closed = False
        self._stats = {"steps": 0, "requests": 0, "chunks": 0, "tokens": 0, "busy_seconds": 0.0, "pending": 0}

    def ticket(self, step: Step, now: float, notify_fd: int = -1) -> ReferenceTicket:
        self.engine.validate_step(step)
        return ReferenceTicket(step, now)

    def submit(self, tickets: list) -> None:
        if self._closed:
            raise CapacityError("the step loop is closed")
        if len({id(t) for t in tickets}) != len(tickets) or any(t.submitted for t in tickets):
            raise InvalidInputError("a ticket is submitted once")
        for t in tickets:
            t.submitted = True
        e = self.engine
        for t in tickets:
            end = max(t.step.position, 0) + t.step.n_tokens
            if t.step.kind == StepKind.PREFILL and (end > e.context_tokens or end > e.budget_tokens):
                t.finish(
                    StepResult(
                        status=Status.BUDGET_EXCEEDED,
                        detail=f"{t.step.n_tokens} tokens exceed "
                        f"context_tokens {e.context_tokens} or budget_tokens {e.budget_tokens}",
                    )
                )
        with self._lock:
            pending = [t for t in tickets if not t.finished]
            while pending:
                self._run(self._form(pending))
                pending = [t for t in pending if not t.finished]

    def _form(self, pending: list) -> list:
        heads, seen = [], set()  # each session's oldest pending request
        for t in pending:
            if t.step.session_id not in seen:
                seen.add(t.step.session_id)
                heads.append(t)
        others_waiting = len(heads) > 1
        parts, room = [], self.max_step_tokens
        # deferred (BUSY) first, then decodes, whole; then prefills
        for deferred, kind in ((True, None), (False, StepKind.DECODE), (False, StepKind.PREFILL)):
            for t in heads:
                if len(parts) >= self.max_step_sessions or room == 0:
                    return parts
                if t.deferred != deferred or (kind is not None and t.step.kind != kind):
                    continue
                left = t.step.n_tokens - t.offset
                if t.step.kind == StepKind.PREFILL and t.step.logit_rows == 1:
                    n = min(left, min(self.prefill_chunk, room) if others_waiting else room)
                elif left > room:
                    continue
                else:
                    n = left
                parts.append((t, n))
                room -= n
        return parts

    def _run(self, parts: list) -> None:
        now, requests = max(t.now for t, _ in parts), []
        for t, n in parts:
            step, k = t.step, t.offset
            data = step.token_ids if step.token_ids is not None else step.hidden
            chunk = data[k : k + n]
            position = step.position if k == 0 else t.start + k
            requests.append(
                Step(
                    step.kind,
                    step.session_id,
                    step.route_epoch,
                    chunk if step.token_ids is not None else None,
                    np.ascontiguousarray(chunk) if step.hidden is not None else None,
                    start_pos=position if step.kind == StepKind.PREFILL and position >= 0 else None,
                    expected_seq_len=position if step.kind == StepKind.DECODE and position >= 0 else None,
                    logit_rows=step.logit_rows if n == step.n_tokens else 1,
                )
            )
        answers = self.engine.step(requests, now)
        self._stats["steps"] += 1
        for (t, n), (r, out) in zip(parts, answers):
            step = t.step
            self._stats["chunks"] += 1
            self._stats["tokens"] += n
            t.deferred = r.status == Status.BUSY
            if t.deferred:
                continue  # stays pending; the next step takes it first
            if r.status == Status.OK:
                if t.offset == 0:
                    t.start = r.seq_len - n
                t.offset += n
                t.outs.append(out)
                if t.offset < step.n_tokens:
                    continue
                t.finish(r, np.concatenate(t.outs) if out.ndim == 2 and len(t.outs) > 1 else out)
            else:
                if t.offset > 0 and r.status not in (Status.CACHE_MISS, Status.STALE_EPOCH):
                    held = self.engine.resolve(step.session_id, step.route_epoch, now)
                    if held.status == Status.OK and held.seq_len >= t.start:
                        cut = self.engine.truncate(step.session_id, step.route_epoch, t.start, now)
                        r.seq_len = t.start if cut.status == Status.OK else 0  # as the native loop
                t.finish(r)
            self._stats["requests"] += 1

    def stats(self) -> dict:
        return dict(self._stats)

    def session_left(self, session_id: str) -> None:
        pass

    def close(self) -> None:
        self._closed = True
