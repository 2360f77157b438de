"""The llama-shard exception hierarchy: every error the package raises derives from LlamaShardError.

Caller mistakes (invalid input) and failures (an unloadable file, a failed computation) are
exceptions; expected outcomes of serving (cache misses, a refusal: `WhyNot`) are values.
"""

from __future__ import annotations

import enum
from typing import NamedTuple


class Why(enum.Enum):
    """The kinds of an expected "no" (`WhyNot`): what a caller may act on."""

    NO_REPLICA = "no_replica"  # a stage of the head's route has no (other) healthy replica
    ROUTE_UNSTABLE = "route_unstable"  # the route changed too often in one step
    CALLER_CAP = "caller_cap"  # the principal holds as many sessions as its cap allows
    FORWARD = "forward"  # a chained step this worker cannot forward (a loop, too many hops)
    WIRE_DTYPE = "wire_dtype"  # a replica of the route does not read rows of that type
    BAD_REPORT = "bad_report"  # a member's report is out of its bounds (the mesh's planner)
    NO_PLAN = "no_plan"  # no split of the model fits the members' memory


class WhyNot(NamedTuple):
    """An expected "no" as a value, not an exception: its kind and the text that tells the caller."""

    kind: Why
    text: str

    def __str__(self) -> str:
        return self.text


class LlamaShardError(Exception):
    """Base class of every llama-shard error."""


class InvalidInputError(LlamaShardError, ValueError):
    """The caller sent something invalid (shape, dtype, id, range, position); nothing was changed.
    `param`: the wire's name of the parameter refused, where one is (an entry point maps it to its own)."""

    def __init__(self, message: str = "", param: str | None = None):
        super().__init__(message)
        self.param = param


class ModelLoadError(LlamaShardError, RuntimeError):
    """The GGUF file is missing, unreadable, corrupt, or was rejected by llama.cpp."""


class UncertifiedArchitectureError(ModelLoadError):
    """A shard range was requested for an architecture that is not patched and parity-tested."""


class CapacityError(LlamaShardError, RuntimeError):
    """The context has no room left (KV cells or sequences); nothing was changed."""


class ComputeError(LlamaShardError, RuntimeError):
    """llama.cpp failed a computation; every position the call added was removed again."""


# --- the Hot KV State contract (names kept from the seed contract) ---------------------------


class StaleRouteEpochError(LlamaShardError):
    """The request's route epoch is older than the session's current epoch; nothing was changed."""

    def __init__(self, message: str, current_epoch: int | None = None):
        super().__init__(message)
        self.current_epoch = current_epoch


class IncompatibleCacheRecipeError(LlamaShardError):
    """The request's KV recipe does not match this shard's (architecture, dtype, geometry, range)."""


class KvBudgetExceededError(LlamaShardError):
    """The step cannot fit the session or token budget even with every other session evicted."""


class KvCacheMissError(LlamaShardError):
    """Raised by `get()` where a value API would return a CacheMiss; carries it as `.miss`."""

    def __init__(self, miss):
        super().__init__(
            f"cache miss for ({miss.session_id!r}, {miss.route_epoch}): {miss.reason.value}"
            + (f" ({miss.detail})" if miss.detail else "")
        )
        self.miss = miss


__all__ = [
    "LlamaShardError",
    "InvalidInputError",
    "ModelLoadError",
    "UncertifiedArchitectureError",
    "CapacityError",
    "ComputeError",
    "StaleRouteEpochError",
    "IncompatibleCacheRecipeError",
    "KvBudgetExceededError",
    "KvCacheMissError",
]
