"""The pure-numpy executable specification of llama-shard.

- `ReferenceModel` / `ReferenceShard` (model.py): a dense Llama read from the same GGUF with the
  `gguf` package, stateless and KV-cached, with the shard boundary contract;
- `ReferenceHotKvEngine` (engine.py): the Hot KV state machine (admission, eviction, misses) over
  per-layer numpy K/V, with the same interface as the native `HotKvEngine`; `HotKvStateManager`
  runs on either, and tests drive both in lockstep.
"""

from .engine import ReferenceHotKvEngine
from .model import (
    NATIVE_LOGIT_ATOL,
    REFERENCE_ARCHITECTURES,
    ReferenceHparams,
    ReferenceModel,
    ReferenceShard,
    ReferenceShardInfo,
)
from .results import StepResult
from .sequences import SequenceKv

__all__ = [
    "NATIVE_LOGIT_ATOL",
    "REFERENCE_ARCHITECTURES",
    "ReferenceHparams",
    "ReferenceModel",
    "ReferenceShard",
    "ReferenceShardInfo",
    "SequenceKv",
    "ReferenceHotKvEngine",
    "StepResult",
]
