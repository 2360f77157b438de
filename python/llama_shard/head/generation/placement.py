"""Where a stream's steps go: its route (one replica per later stage), what the first step there
must check (a hand-over's sender), and how often the route changed (head/failover.py decides how)."""

from __future__ import annotations

from ...errors import Why, WhyNot
from ...proto import shard_pb2 as pb
from ..failover import MAX_ROUTE_CHANGES, RouteChange, addresses, reroute


class Placement:
    __slots__ = ("route", "rerouted", "handed_from", "failovers", "moves", "changes_in_row")

    def __init__(self, route: list[pb.Hop], handed_from: list[str] | None = None):
        self.route = route  # the rest of the route: one replica per later stage
        self.rerouted = False  # its route changed: the scheduler moves it to that route's loop
        self.handed_from = handed_from or []  # its first step: StepRequest.handed_from of each later stage
        self.failovers = 0  # times a replica failed and the session moved to another
        self.moves = 0  # times a draining replica had handed the session over
        self.changes_in_row = 0  # route changes since its last step that went through

    def addresses(self) -> tuple[str, ...]:
        return addresses(self.route)

    def claim_handed(self) -> list[str]:
        """A hand-over is claimed by the first step that goes (a miss re-prefills without it)."""
        handed, self.handed_from = self.handed_from, []
        return handed

    def reroute(self, replicas, reply: pb.StepReply, handed: list[str], held_before: bool) -> RouteChange | WhyNot:
        """The route after a later stage refused the step (head/failover.py), or why the stream ends."""
        self.changes_in_row += 1
        if self.changes_in_row > MAX_ROUTE_CHANGES:
            return WhyNot(
                Why.ROUTE_UNSTABLE, f"the route changed {MAX_ROUTE_CHANGES} times in one step; last: {reply.detail}"
            )
        change = reroute(replicas, self.route, reply, handed, held_before)
        if isinstance(change, WhyNot):
            return change
        if change.moved:
            self.moves += 1
        else:
            self.failovers += 1
        self.route, self.handed_from, self.rerouted = change.route, change.handed_from, True
        return change
