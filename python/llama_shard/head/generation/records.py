"""What the route holds of each session after its last stream: what the session's next stream may
reuse, and which of a caller's sessions a new conversation continues. Bounded (least recently
finished first out); under the loop's lock, with the streams it says are running."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Container
from typing import NamedTuple

from .positions import common_prefix


class RouteHolds(NamedTuple):
    """What the route holds of a session after its last stream: what its next stream may reuse."""

    epoch: int
    tokens: list[int]
    route: tuple[str, ...] = ()  # the replicas that hold it (the addresses of its last route)


class SessionRecords:
    def __init__(self, cap: int, security, sessions: Callable[[], list], lock: threading.Condition):
        """`lock`: the loop's (the running streams are read with the records, as one view)."""
        self.cap, self.security, self.sessions = cap, security, sessions
        self._records: OrderedDict[str, RouteHolds] = OrderedDict()  # engine key -> holds, oldest first
        self._lock = lock

    def __bool__(self) -> bool:
        return bool(self._records)

    def get(self, key: str) -> RouteHolds | None:
        return self._records.get(key)

    def keep(self, key: str, holds: RouteHolds) -> list[str]:
        """Records what the route holds of `key`; the keys pushed out by the bound."""
        with self._lock:
            self._records[key] = holds
            self._records.move_to_end(key)
            out = []
            while len(self._records) > self.cap:
                out.append(self._records.popitem(last=False)[0])
        return out

    def drop(self, key: str) -> None:
        """The session's state on the route is unknown, or was changed from outside a stream."""
        if key in self._records:
            with self._lock:
                self._records.pop(key, None)

    def longest_prefix(self, principal: str, tokens: list[int], running: Container[str]) -> tuple[str, int] | None:
        """(session id, epoch) of the principal's session, with no stream running, whose record
        shares the longest common prefix with `tokens`; None if none does. A session is continued
        only where the prefix covers at least half of what it holds: a new chat that shares only a
        system prompt with another does not cut that one's tail (it gets a session of its own)."""
        tag = self.security.tag(principal)
        with self._lock:  # the candidates only
            mine = [
                (key, record.epoch, record.tokens)
                for key, record in self._records.items()
                if key not in running and self.security.owner_of_key(key)[0] == tag
            ]
        best, best_n = None, 0
        for key, epoch, held in mine:  # a record's list is replaced, never changed: safe to read here
            n = common_prefix(held, tokens)
            if n > best_n and 2 * n >= len(held):
                best, best_n = (self.security.owner_of_key(key)[1], epoch), n
        return best

    def least_recent(self, principal: str, prefix: str, running: Container[str]) -> tuple[str, int] | None:
        """(session id, epoch) of the principal's least recently finished session that the engine
        still holds, with no stream running, whose id begins with `prefix`; None if there is none
        (a record outlives a session the engine evicted: continuing that one would be a new session)."""
        tag = self.security.tag(principal)
        held = {r.session_id for r in self.sessions()}
        with self._lock:
            for key, record in self._records.items():  # oldest first
                owner, sid = self.security.owner_of_key(key)
                if key in held and key not in running and owner == tag and sid.startswith(prefix):
                    return sid, record.epoch
        return None
