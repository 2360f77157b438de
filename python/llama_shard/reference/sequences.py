"""What the reference's stores and engine hold of a shard: a sequence's K/V (`SequenceKv`), and what
the engine asks of the shard that computes it (`KvShard`). Below the model, the stores and the
engine alike, so none of them imports another to name these."""

from __future__ import annotations

import os
import struct
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

    def forward(
        self, seq: SequenceKv, tokens=None, hidden: np.ndarray | None = None, n_logits: int = 1
    ) -> np.ndarray: ...


#: the native tiers hold each state in whole pages of its own
PAGE = os.sysconf("SC_PAGE_SIZE")
#: a reference state's header: magic, version, first layer, layers, seq_len, n_head_kv, head_dim
STATE_HEAD = struct.Struct("<4sIIIIII")


def state_of(shard: KvShard, kv: SequenceKv) -> bytes:
    """A session's K/V as the bytes a hand-over carries (the reference's own format)."""
    layers, hp = list(shard.owned_layers), shard.model.hparams
    head = STATE_HEAD.pack(b"RFKV", 1, layers[0], len(layers), kv.seq_len, hp.n_head_kv, hp.head_dim)
    return head + b"".join(a.astype("<f2").tobytes() for il in layers for a in kv.layers[il])


def state_kv(shard: KvShard, state: bytes, seq_len: int) -> tuple[SequenceKv | None, str]:
    """The K/V a state holds, or (None, why) if it is not this shard's state of seq_len tokens."""
    layers, hp = list(shard.owned_layers), shard.model.hparams
    if len(state) < STATE_HEAD.size:
        return None, "not a sequence state"
    magic, version, first, n_layers, n, n_head_kv, head_dim = STATE_HEAD.unpack_from(state)
    if (magic, version) != (b"RFKV", 1):
        return None, "not a sequence state"
    if (first, n_layers, n_head_kv, head_dim) != (layers[0], len(layers), hp.n_head_kv, hp.head_dim):
        return (
            None,
            f"rows of layers {first}..{first + n_layers - 1} ({n_head_kv}x{head_dim}), this shard owns another range",
        )
    if n != seq_len:
        return None, f"it holds {n} tokens"
    if len(state) != STATE_HEAD.size + 4 * len(layers) * seq_len * hp.n_head_kv * hp.head_dim:
        return None, "rows past (or short of) the end of the state"
    rows = np.frombuffer(state, dtype="<f2", offset=STATE_HEAD.size).astype(np.float64)
    if not np.isfinite(rows).all():
        return None, "a non-finite K or V value"
    rows = rows.reshape(len(layers), 2, seq_len, hp.n_head_kv, hp.head_dim)
    kv = shard.new_sequence()
    kv.layers = {il: (rows[i, 0].copy(), rows[i, 1].copy()) for i, il in enumerate(layers)}
    return kv, ""


class StateSizes:
    """What the native tiers charge for a session's state, as the reference simulates them (no files)."""

    def __init__(self, shard: KvShard, max_sessions: int, recipe_fingerprint: str, model_digest: str):
        self.shard, self.max_sessions = shard, max_sessions
        self.recipe_fingerprint, self._model_digest = recipe_fingerprint, model_digest

    def warm_entry_bytes(self, session_id: str, seq_len: int) -> int:
        """What the native warm tier charges for a session: the key's bytes and the pages holding
        llama.cpp's sequence state of seq_len tokens (src/llama-kv-cache.cpp state_write: an 8-byte header, the stream
        count and a cell count per stream, v_trans and the layer count, 24 bytes of row headers per
        layer, and per cell its position, seq id count and seq id before the K and V rows)."""
        pages = (
            -(-self._state_bytes(seq_len) // PAGE) * PAGE
        )  # the native tier holds each state in whole pages of its own
        return pages + len(session_id.encode("utf-8", "surrogatepass"))

    def disk_file_bytes(self, session_id: str, seq_len: int) -> int:
        """The size of the native disk tier's file for a session (kv_file_store.cpp: magic, version,
        the recipe fingerprint, range and KV type, the key, epoch, length, payload size, the payload's
        SHA-256 and the header's HMAC-SHA256, then llama.cpp's sequence state)."""
        sid = len(session_id.encode("utf-8", "surrogatepass"))
        header = (
            4
            + 4
            + (4 + len(self.recipe_fingerprint))
            + (4 + len(self._model_digest))
            + 12
            + (4 + 3)
            + (4 + sid)
            + 8
            + 4
            + 8
            + 32
            + 32
        )
        return header + self._state_bytes(seq_len)

    def _state_bytes(self, seq_len: int) -> int:
        """llama.cpp's sequence state of seq_len tokens (see warm_entry_bytes)."""
        n_layers = len(self.shard.owned_layers)
        return 8 + 4 + 4 * self.max_sessions + 8 + 24 * n_layers + seq_len * (12 + self.shard.info.kv_bytes_per_token)

    def prefix_entry_bytes(self, length: int) -> int:
        """What the native prefix store charges for a prefix: its state's whole pages and the 8-byte key."""
        return -(-self._state_bytes(length) // PAGE) * PAGE + 8
