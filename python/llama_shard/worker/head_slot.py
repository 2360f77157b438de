"""What a worker asks of the head that may sit on it: the one seam between every worker's code and
the head's (head/role.py fills it). A worker without a head answers Generate UNIMPLEMENTED; the
worker package never imports the head's."""

from __future__ import annotations

from typing import Protocol

import grpc


class HeadSlot(Protocol):
    def serve_generate(self, principal: str, request, context):
        """The Generate stream's events, for a caller already authenticated."""

    def forget(self, key: str) -> None:
        """A step from outside the head's loop, a truncation, a release or a hand-over touched the
        session: the loop's record of it is no longer the route's."""

    def has_records(self) -> bool:
        """Whether forget has anything to forget (every other step pays one check)."""

    def stop_stream(self, key: str, why: str, timeout: float) -> None:
        """A stream running on the session ends before the session is released."""

    def info_fields(self) -> dict:
        """The head's part of InfoReply (streams, drafts, replicas, failovers)."""


class NoHead:
    """The slot of a worker that runs no head."""

    def serve_generate(self, principal: str, request, context):
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "this worker runs no head: Generate is not served here")
        yield from ()

    def forget(self, key: str) -> None:
        pass

    def has_records(self) -> bool:
        return False

    def stop_stream(self, key: str, why: str, timeout: float) -> None:
        pass

    def info_fields(self) -> dict:
        return {}
