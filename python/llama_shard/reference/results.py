"""What the reference engine answers: a step's or an operation's `StepResult`, in the native enums
(one status and miss-reason type for both engines)."""

from __future__ import annotations

import dataclasses

from .._native import MissReason, Status, Tier

OK, CACHE_MISS, STALE_EPOCH, BUDGET_EXCEEDED = Status.OK, Status.CACHE_MISS, Status.STALE_EPOCH, Status.BUDGET_EXCEEDED
INVALID_INPUT, COMPUTE_ERROR, BUSY = Status.INVALID_INPUT, Status.COMPUTE_ERROR, Status.BUSY
MISS_REASONS = tuple(r for r in MissReason.__members__.values() if r != MissReason.NONE)


@dataclasses.dataclass
class StepResult:
    status: Status = OK
    miss: MissReason = MissReason.NONE
    seq_len: int = 0
    seq_id: int = -1
    current_epoch: int = -1
    changed: bool = False
    tier: Tier = Tier.NONE
    detail: str = ""


def stale(epoch: int, current: int, which: str) -> StepResult:
    return StepResult(
        status=STALE_EPOCH,
        current_epoch=current,
        detail=f"route epoch {epoch} is older than the session's {which} epoch {current}",
    )


@dataclasses.dataclass
class IdPlacement:
    """As the native id_placement: a step's new sessions take ids together; a single request's, the lowest."""

    to_place: int = 0
    last: int = -1
