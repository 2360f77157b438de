"""The llama-shard exception hierarchy: every error the package raises derives from LlamaShardError.

Caller mistakes (invalid input) and failures (an unloadable file, a failed computation) are
exceptions; expected outcomes of serving (cache misses) are values, not exceptions.
"""
from __future__ import annotations


class LlamaShardError(Exception):
    """Base class of every llama-shard error."""


class InvalidInputError(LlamaShardError, ValueError):
    """The caller sent something invalid (shape, dtype, id, range, position); nothing was changed."""


class ModelLoadError(LlamaShardError, RuntimeError):
    """The GGUF file is missing, unreadable, corrupt, or was rejected by llama.cpp."""


class UncertifiedArchitectureError(ModelLoadError):
    """A shard range was requested for an architecture that is not patched and parity-tested."""


class CapacityError(LlamaShardError, RuntimeError):
    """The context has no room left (KV cells or sequences); nothing was changed."""


class ComputeError(LlamaShardError, RuntimeError):
    """llama.cpp failed a computation; every position the call added was removed again."""


__all__ = [
    "LlamaShardError",
    "InvalidInputError",
    "ModelLoadError",
    "UncertifiedArchitectureError",
    "CapacityError",
    "ComputeError",
]
