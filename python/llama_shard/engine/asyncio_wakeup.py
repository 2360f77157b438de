"""How asyncio callers wait for native step tickets without a thread each: the native step loop
writes a byte to a pipe the event loop watches when a ticket completes.
"""

from __future__ import annotations

import asyncio
import os
import weakref


class _AsyncCompletions:
    """One per event loop: the native loop writes a byte to `fd` when a ticket completes; the event
    loop wakes, and every awaited ticket that is done gets its future resolved."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        _close_retired_pipes()
        self.loop = loop
        self._read, self.fd = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self.fd, False)
        self._waiting: dict = {}
        loop.add_reader(self._read, self._drain)
        weakref.finalize(loop, _retire_pipe, self._read, self.fd, self._waiting)

    def wait(self, ticket) -> asyncio.Future:
        fut = self.loop.create_future()
        if ticket.done():
            fut.set_result(None)
        else:
            self._waiting[ticket] = fut
        return fut

    def _drain(self) -> None:
        try:
            while os.read(self._read, 4096):
                pass
        except BlockingIOError:
            pass
        for ticket in [t for t in self._waiting if t.done()]:
            fut = self._waiting.pop(ticket)
            if not fut.done():
                fut.set_result(None)


# A pipe is closed only once no ticket can still write to it: a ticket completes in the native
# thread after its event loop may be gone, and a byte written to a closed (then reused) fd number
# would land in someone else's file.
_RETIRED: list[tuple[int, int, list]] = []


def _retire_pipe(read_fd: int, write_fd: int, waiting: dict) -> None:
    _RETIRED.append((read_fd, write_fd, list(waiting)))
    _close_retired_pipes()


def _close_retired_pipes() -> None:
    for entry in list(_RETIRED):
        read_fd, write_fd, tickets = entry
        if all(t.done() for t in tickets):
            _RETIRED.remove(entry)
            for fd in (read_fd, write_fd):
                try:
                    os.close(fd)
                except OSError:
                    pass


_COMPLETIONS: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _AsyncCompletions]" = weakref.WeakKeyDictionary()


def ticket_waiter() -> _AsyncCompletions:
    """The running event loop's waiter for native tickets (made on first use)."""
    loop = asyncio.get_running_loop()
    c = _COMPLETIONS.get(loop)
    if c is None:
        c = _COMPLETIONS[loop] = _AsyncCompletions(loop)
    return c
