"""The route client: drives a session through the shards of a route, local or remote (gRPC),
re-prefilling after a miss and retrying a lost reply (`client`), over its stages (`stages`)."""

from .client import RouteClient, RouteSession
from .stages import LocalStage, RemoteStage, RouteError, StageInfo, StepOutcome, can_chain, check_route

__all__ = [
    "LocalStage",
    "RemoteStage",
    "RouteClient",
    "RouteError",
    "RouteSession",
    "StageInfo",
    "StepOutcome",
    "can_chain",
    "check_route",
]
