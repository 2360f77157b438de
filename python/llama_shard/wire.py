"""Conversions between the wire protocol (proto/shard.proto) and the Python contract types.

Hidden states travel as raw little-endian rows with their shape: float32 by default, float16 when a
caller asks for half the bytes (its parity cost is measured in tests/test_wire_and_worker.py). A
tensor from the wire is checked completely (dtype, rank, width, row count, byte length, finite
values) before anything reaches an engine.
"""
from __future__ import annotations

import numpy as np

from .errors import InvalidInputError
from .proto import shard_pb2 as pb

_NP_DTYPE = {pb.DTYPE_FLOAT32: np.dtype("<f4"), pb.DTYPE_FLOAT16: np.dtype("<f2")}

def encode_tensor(array: np.ndarray, dtype: int = pb.DTYPE_FLOAT32) -> pb.Tensor:
    if dtype not in _NP_DTYPE:
        raise InvalidInputError(f"unknown tensor dtype {dtype}")
    data = np.ascontiguousarray(array, dtype=_NP_DTYPE[dtype])
    return pb.Tensor(shape=list(data.shape), dtype=dtype, data=data.tobytes())


def decode_tensor(t: pb.Tensor, n_cols: int, max_rows: int) -> np.ndarray:
    """A (n_rows, n_cols) float32 array from the wire, or InvalidInputError saying what is wrong."""
    if t.dtype not in _NP_DTYPE:
        raise InvalidInputError(f"unknown tensor dtype {t.dtype}")
    shape = list(t.shape)
    if len(shape) != 2:
        raise InvalidInputError(f"hidden must have shape (n_tokens, {n_cols}), got {shape}")
    rows, cols = shape
    if cols != n_cols:
        raise InvalidInputError(f"hidden has {cols} columns; this shard's n_embd is {n_cols}")
    if not 1 <= rows <= max_rows:
        raise InvalidInputError(f"hidden has {rows} rows; a step takes 1 to {max_rows}")
    dt = _NP_DTYPE[t.dtype]
    if len(t.data) != rows * cols * dt.itemsize:
        raise InvalidInputError(f"hidden data is {len(t.data)} bytes; shape {shape} in {dt.name} needs "
                                f"{rows * cols * dt.itemsize}")
    arr = np.frombuffer(t.data, dtype=dt).reshape(rows, cols)
    arr = arr.astype(np.float32) if dt != np.dtype("<f4") else arr
    if not np.isfinite(arr).all():
        raise InvalidInputError("hidden contains a non-finite value")
    return np.ascontiguousarray(arr, dtype=np.float32)
