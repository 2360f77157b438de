"""What the head's generation loop may use of its worker: the narrow, named interface between the
loop (`GenerationLoops`) and the gRPC servicer that runs its steps. The servicer builds one; the
loop reads nothing else of it (no private attribute, no manager, no gRPC context)."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ...errors import WhyNot
    from ...proto import shard_pb2 as pb
    from ...worker.prefixes import PrefixNames
    from ...worker.security import ServerSecurity
    from ..proofs import RouteProofs
    from ..replicas import Replicas


def max_generate_streams(max_sessions: int, warm_bytes: int) -> int:
    """Streams a worker runs at once: one per hot session, or two with a warm tier (the sessions of
    the group not computing wait there); more would evict each other at every step."""
    return max_sessions * (2 if warm_bytes else 1)


@dataclasses.dataclass(frozen=True)
class HeadHost:
    """The head worker, as its generation loop sees it."""

    info: object  # the shard's ModelInfo (first, last, n_layer, n_vocab, is_tail)
    fingerprint: str  # its KV recipe's
    context_tokens: int  # a session's most tokens
    max_sessions: int  # hot sessions
    warm_bytes: int  # the warm tier's bound (0: none)
    detokenize: Callable[[list[int]], str]
    security: "ServerSecurity"  # engine keys and their owners, admins
    prefixes: "PrefixNames"  # the head's shared prefixes (plans, whose they are)
    session_cap: int | None  # sessions (and streams) per principal (None: no cap)
    stopping: threading.Event  # set when the worker shuts down
    max_hop_s: float  # the longest one step may take
    #: why a chained step with these hops cannot be served here (None: it can)
    forward_refusal: Callable[[Sequence["pb.Hop"]], "WhyNot | None"]
    #: counts new session keys against the principal's cap; the refusal, or None
    admit: Callable[[str, list[str]], "WhyNot | None"]
    #: whether the principal holds as many sessions as its cap allows
    caller_full: Callable[[str], bool]
    #: runs the loop's (kind, StepRequest) steps for a principal down the route until a deadline:
    #: a reply per step; raises SessionCapRefused when the cap refuses a new session (nothing computed)
    run_steps: Callable[[str, list, list, float], list["pb.StepReply"]]
    #: the engine's session records (session_id = engine key, seq_id)
    sessions: Callable[[], list]
    #: the later stages' replicas (replicas.Replicas): the head's own route and failover; None
    #: without --peer workers
    replicas: "Replicas | None" = None
    #: the vocabulary a grammar's tokens come from (the head's ShardModel; None: no grammar checked here)
    vocab_model: object = None
    #: the hidden rows' type on its own route when a Generate request names none (serve --wire-dtype)
    wire_dtype: int = 0
    #: each request's receipts collected, checked and spot-checked (head/proofs.py; None: no receipts)
    proofs: "RouteProofs | None" = None

    @property
    def max_streams(self) -> int:
        return max_generate_streams(self.max_sessions, self.warm_bytes)
