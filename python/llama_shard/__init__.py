"""llama-shard: run a contiguous layer range of a GGUF model on a pinned, patched llama.cpp.

- `ShardModel(path, layers=None | (first, last), n_threads=None)` loads the owned layers only;
  `.info` describes the shard, `.tokenize()` / `.detokenize()` use the model's vocabulary.
- `ShardContext(model, n_ctx=, n_seq_max=, n_batch=)` is one bounded llama.cpp context holding
  several sequences; `.forward(seq_id, pos, tokens=... | hidden=...)` runs the owned layers and returns
  the residual of every token (non-tail, float32 (n_tokens, n_embd)) or the last token's logits
  (tail, float32 (n_vocab,)); `.seq_rm(seq_id, p0)` drops a sequence's suffix.
- `HotKvStateManager(model, config, clock)` keeps per-session KV for the owned layers, keyed by
  (route_session_id, route_epoch), inside a token budget; `KvBoundaryAdapter(model, manager)` runs
  cached prefill/decode steps through it and returns boundary bundles, tail outputs or cache misses.
  Concurrent callers (threads or asyncio tasks) are batched by the engine's native step loop.
- `Step` is the one step type from the adapter through the engines to the wire.
- `llama_shard.reference` is the pure-numpy executable specification (model and Hot KV engine).
"""

from __future__ import annotations

from . import errors
from ._native import (
    HotKvConfig,
    HotKvEngine,
    MissReason,
    ModelInfo,
    SamplingParams,
    ShardContext,
    ShardModel,
    Status,
    StepKind,
    StepLoop,
    StepResult,
    StepTicket,
    Tier,
    TokenSampler,
    certified_architectures,
    cpu_backend,
)
from .engine.adapter import KvBoundaryAdapter
from .engine.hot_kv import (
    BoundaryBundle,
    CacheMiss,
    CacheMissReason,
    HotKvStateConfig,
    ManualClock,
    SessionInfo,
    SessionRecord,
    Step,
    TailOutput,
)
from .engine.manager import HotKvStateManager
from .engine.models import embedded_model_path
from .engine.recipe import KvCacheRecipe, certified_architecture, kv_recipe_for
from .errors import (
    CapacityError,
    ComputeError,
    IncompatibleCacheRecipeError,
    InvalidInputError,
    KvBudgetExceededError,
    KvCacheMissError,
    LlamaShardError,
    ModelLoadError,
    StaleRouteEpochError,
    UncertifiedArchitectureError,
)

__version__ = "0.1.0"

__all__ = [
    "HotKvStateManager",
    "KvBoundaryAdapter",
    "Step",
    "StepKind",
    "Status",
    "MissReason",
    "StepResult",
    "StepTicket",
    "StepLoop",
    "HotKvStateConfig",
    "ManualClock",
    "CacheMiss",
    "CacheMissReason",
    "SessionInfo",
    "SessionRecord",
    "Tier",
    "HotKvConfig",
    "BoundaryBundle",
    "TailOutput",
    "KvCacheRecipe",
    "kv_recipe_for",
    "certified_architecture",
    "StaleRouteEpochError",
    "IncompatibleCacheRecipeError",
    "KvBudgetExceededError",
    "KvCacheMissError",
    "HotKvEngine",
    "ShardModel",
    "SamplingParams",
    "TokenSampler",
    "ShardContext",
    "ModelInfo",
    "certified_architectures",
    "cpu_backend",
    "embedded_model_path",
    "errors",
    "LlamaShardError",
    "InvalidInputError",
    "ModelLoadError",
    "UncertifiedArchitectureError",
    "CapacityError",
    "ComputeError",
]
