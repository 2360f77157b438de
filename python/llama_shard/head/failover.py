"""A head's decisions when a later stage's replica does not take a step (beside replicas.py, which
keeps the replicas' states): follow the session to the replica a drained one handed it to, or fail
over to another replica of that stage, where the session continues only if it was handed there."""

from __future__ import annotations

from typing import NamedTuple

from ..errors import WhyNot
from ..proto import shard_pb2 as pb
from ..proto.requests import FEATURE_GRAMMAR_DIGEST

#: route changes (a failover, a hand-over followed) one step may cause before its stream ends with
#: an error: a route whose replicas all fail in turn is not retried forever
MAX_ROUTE_CHANGES = 4


class RouteChange(NamedTuple):
    route: list[pb.Hop]  # the new route: the failed stage's hop replaced
    handed_from: list[str]  # StepRequest.handed_from of each later stage for the step sent again ([]: none)
    moved: bool  # a hand-over followed (else a failover)
    continues: bool  # the new route holds the session: the same step again (else a re-prefill)


def addresses(route: list[pb.Hop]) -> tuple[str, ...]:
    return tuple(h.address for h in route)


def reroute(
    replicas, route: list[pb.Hop], reply: pb.StepReply, handed: list[str], held_before: bool
) -> RouteChange | WhyNot:
    """The route after stage `reply.stage`'s replica refused a step, or why there is none.
    `handed`: the checks the step named (handed_from); `held_before`: the step was a stream's first
    on a session the route held (the failed replica may have drained, handing it to another one)."""
    k = reply.stage - 1
    failed = route[k].address
    hop = replicas.moved(failed, reply.moved_to) if reply.moved_to else None
    if hop is not None:  # the session is there now: the other stages keep what they must still check
        return RouteChange(
            [*route[:k], hop, *route[k + 1 :]],
            [h if i != k else "" for i, h in enumerate(handed)],
            moved=True,
            continues=True,
        )
    hop = replicas.failover(failed, reply.detail)
    if isinstance(hop, WhyNot):
        return hop
    new = [*route[:k], hop, *route[k + 1 :]]
    if len(set(addresses(new))) != len(new):
        # the replica that took the failed stage served another stage of this route before (a mesh
        # moved it there): the route is chosen again, keeping what still holds, and re-prefilled
        fresh = replicas.choose(prefer=addresses(new))
        return fresh if isinstance(fresh, WhyNot) else RouteChange(fresh, [], moved=False, continues=False)
    # an idle session's head learns of a drain only now: the new replica says whether it took it
    named = replicas.handed_from(addresses(route), addresses(new)) if held_before else None
    if named:
        return RouteChange(
            new,
            [named[i] or (handed[i] if i < len(handed) else "") for i in range(len(new))],
            moved=False,
            continues=True,
        )
    return RouteChange(new, [], moved=False, continues=False)


def tail_keeps_grammar(replicas, route: list[pb.Hop]) -> bool:
    """Whether a stream down `route` may name its grammar's state by digest: the head is the tail,
    or every worker of the route lists the feature (an older tail refuses a step without tokens)."""
    if not route:
        return True
    return replicas is not None and replicas.supports(addresses(route), FEATURE_GRAMMAR_DIGEST)
