"""The order of each session's steps on a worker (`SessionOrder`): a pipelined stream's next window,
which may overtake the one before it between two workers, waits a little for it."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

from ..engine.hot_kv import Step, StepKind

#: the longest a step that starts past the end of its session's last step queued here waits for the
#: step before it (a pipelined stream's windows travel in separate calls, which may arrive out of order)
ORDER_WAIT_S = 1.0
#: a step waits so only when it starts at most this far past that end (the steps a head keeps in
#: flight: at most 4 of at most 256 tokens, generation/loops.py MAX_WINDOWS and stream.GENERATE_CHUNK),
#: not for a position further on (answered at once, as ever)
ORDER_GAP_MAX = 1024


class SessionOrder:
    """Where each session's last step queued here ends, so that a step sent while the one before it
    was in flight (`StepRequest.follows`), which starts further on, waits (at most ORDER_WAIT_S) for
    that step to be queued: the engine runs a session's steps in the order they were queued, and a
    pipelined stream's next window may overtake the one before it between two workers. A session
    this worker has not seen, a step at or before that end, or one more than ORDER_GAP_MAX past it
    never waits, nor does any step while `max_waiting` others wait. Bounded: the least recently
    stepped sessions are forgotten past `cap`."""

    def __init__(self, cap: int, max_waiting: int):
        self._cap, self._max_waiting = cap, max_waiting
        self._waiting = 0
        self._ends: OrderedDict[str, int] = OrderedDict()
        self._cond = threading.Condition()

    @staticmethod
    def _start(step: Step) -> int | None:
        return step.start_pos if step.kind == StepKind.PREFILL else step.expected_seq_len

    def wait_turn(self, steps: list[Step], deadline: float) -> None:
        until = min(deadline, time.monotonic() + ORDER_WAIT_S)
        with self._cond:
            for step in steps:
                start = self._start(step)
                while start is not None and self._waiting < self._max_waiting:
                    end = self._ends.get(step.session_id)
                    left = until - time.monotonic()
                    if end is None or start <= end or start - end > ORDER_GAP_MAX or left <= 0:
                        break
                    self._waiting += 1
                    try:
                        self._cond.wait(left)
                    finally:
                        self._waiting -= 1

    def queued(self, steps: list[Step]) -> None:
        with self._cond:
            for step in steps:
                start = self._start(step)
                if start is None:  # appended where the session ends: not known here
                    self._ends.pop(step.session_id, None)
                    continue
                self._ends[step.session_id] = start + step.n_tokens
                self._ends.move_to_end(step.session_id)
            while len(self._ends) > self._cap:
                self._ends.popitem(last=False)
            self._cond.notify_all()
