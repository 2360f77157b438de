"""What the reference's stores and engine hold of a shard: a sequence's K/V (`SequenceKv`), and what
the engine asks of the shard that computes it (`KvShard`). Below the model, the stores and the
engine alike, so none of them imports another to name these."""
from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from ..errors import InvalidInputError


class SequenceKv:
    """K/V of one sequence for the owned layers of a shard: {layer: (k, v)}, rows = positions 0..len-1."""

    def __init__(self, n_head_kv: int, head_dim: int, owned_layers: range):
        empty = np.zeros((0, n_head_kv, head_dim))
        self.layers = {il: (empty, empty) for il in owned_layers}

    @property
    def seq_len(self) -> int:
        first = next(iter(self.layers.values()))
        return first[0].shape[0]

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.seq_len:
            raise InvalidInputError(f"cannot truncate a sequence of {self.seq_len} to {length}")
        self.layers = {il: (k[:length], v[:length]) for il, (k, v) in self.layers.items()}

    def nbytes(self, dtype_bytes: int = 2) -> int:
        return sum(k.size + v.size for k, v in self.layers.values()) * dtype_bytes


class KvShard(Protocol):
    """The shard a `ReferenceHotKvEngine` computes with (`ReferenceShard`)."""

    info: Any
    model: Any
    owned_layers: range

    def new_sequence(self) -> SequenceKv: ...

    def forward(self, seq: SequenceKv, tokens=None, hidden: np.ndarray | None = None,
                n_logits: int = 1) -> np.ndarray: ...
