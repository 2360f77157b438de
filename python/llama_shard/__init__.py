"""llama-shard: run a contiguous layer range of a GGUF model on a pinned, patched llama.cpp.

- `ShardModel(path, layers=None | (first, last), n_threads=None)` loads the owned layers only;
  `.info` describes the shard, `.tokenize()` / `.detokenize()` use the model's vocabulary.
- `ShardContext(model, n_ctx=, n_seq_max=, n_batch=)` is one bounded llama.cpp context holding
  several sequences; `.forward(seq_id, pos, tokens=... | hidden=...)` runs the owned layers and returns
  the residual of every token (non-tail, float32 (n_tokens, n_embd)) or the last token's logits
  (tail, float32 (n_vocab,)); `.seq_rm(seq_id, p0)` drops a sequence's suffix.
- `llama_shard.reference` is the pure-numpy executable specification.
"""
from __future__ import annotations

from . import errors
from ._native import ModelInfo, ShardContext, ShardModel, certified_architectures
from .errors import (
    CapacityError,
    ComputeError,
    InvalidInputError,
    LlamaShardError,
    ModelLoadError,
    UncertifiedArchitectureError,
)
from .models import embedded_model_path

__version__ = "0.1.0"

__all__ = [
    "ShardModel",
    "ShardContext",
    "ModelInfo",
    "certified_architectures",
    "embedded_model_path",
    "errors",
    "LlamaShardError",
    "InvalidInputError",
    "ModelLoadError",
    "UncertifiedArchitectureError",
    "CapacityError",
    "ComputeError",
]
