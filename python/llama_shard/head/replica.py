"""One peer of a head as the head sees it (`Replica`): its state, its last Info, its load; why a peer
that answered is no replica (`Refusal`); how often peers are probed (head/replicas.py keeps them)."""

from __future__ import annotations

import dataclasses
import enum

from ..proto import shard_pb2 as pb
from ..proto.wire import LEGACY_WIRE_DTYPES

#: how often an up replica's Info is read again (its load, and a death noticed without a step)
PROBE_S = 1.0
#: how long a probe waits for an answer
PROBE_TIMEOUT_S = 2.0
#: a down replica is probed after BACKOFF_MIN_S, then twice as long after each failed probe
BACKOFF_MIN_S, BACKOFF_MAX_S = 0.25, 5.0
#: how long a failover waits for a replica marked down to answer when its stage has no other
ON_DEMAND_PROBE_S = 1.0
#: failed probes in a row that make an up replica down (the first makes it suspect)
DOWN_AFTER_PROBES = 2


def wire_reads(info: pb.InfoReply) -> tuple[int, ...]:
    """The hidden-row types a peer reads (an older worker, which names none: f32 and f16)."""
    return tuple(info.wire_dtypes) or LEGACY_WIRE_DTYPES


class Refusal(enum.Enum):
    """Why a peer that answered is no replica of a later stage."""

    NOT_LATER = "not a later stage"  # this worker itself, or layers at or before the head's: never probed again
    CONFLICT = "conflict"  # a mesh the operator must fix (refused at start-up)


class ReplicaState(enum.Enum):
    UP = "up"
    SUSPECT = "suspect"
    DOWN = "down"
    PROBING = "probing"
    FAILED_CHECK = "failed-check"  # its bytes differed in a spot check (head/proofs.py): never used again


@dataclasses.dataclass
class Replica:
    """One peer of the head, and what its last answer said."""

    address: str
    order: int  # its place among the --peer flags (ties go to the earlier)
    state: ReplicaState = ReplicaState.DOWN
    info: pb.InfoReply | None = None  # its last Info (None: it never answered)
    refused: str = ""  # why it is no replica of a stage (it answered, a check failed)
    refusal: Refusal | None = None  # which kind of reason that is
    last_error: str = "not reached yet"
    failed_probes: int = 0
    next_probe: float = 0.0
    backoff: float = BACKOFF_MIN_S
    sessions: set = dataclasses.field(default_factory=set)  # the head's engine keys placed on it
    failovers: int = 0  # sessions moved off it after it failed
    restarts: int = 0  # times its instance id changed

    @property
    def range(self) -> tuple[int, int] | None:
        return None if self.info is None or self.refused else (self.info.first, self.info.last)

    @property
    def usable(self) -> bool:
        return self.range is not None and self.state in (ReplicaState.UP, ReplicaState.SUSPECT)

    def load(self) -> float:
        """The share of its sessions in use: the head's own placed sessions, or what its last Info
        counted when that is more (other heads' sessions)."""
        held = max(len(self.sessions), self.info.live_sessions if self.info is not None else 0)
        return held / max(1, self.info.max_sessions if self.info is not None else 1)
