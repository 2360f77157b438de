"""Conversions between the wire protocol (proto/shard.proto) and the Python contract types.

Hidden states travel as raw little-endian rows with their shape: float32 by default, float16 when a
caller asks for half the bytes (its parity cost is measured in tests/test_wire_and_worker.py). A
tensor from the wire is checked completely (dtype, rank, width, row count, byte length, finite
values) before anything reaches an engine.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import grpc
import numpy as np

from .._native import Tier
from ..errors import InvalidInputError
from . import shard_pb2 as pb

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


#: a channel to a worker retries a lost connection after 0.1 s, backing off to at most 1 s (gRPC's
#: default grows to 120 s): a restarted worker is reached again within a second
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000)]
#: how long a call keeps retrying UNAVAILABLE: longer than the longest backoff (1 s plus gRPC's
#: 20% jitter), so one reconnection attempt always falls inside it
RECONNECT_WINDOW_S = 3.0

T = TypeVar("T")


def call_reconnecting(call: Callable[[], T], deadline: float | None = None) -> T:
    """call() (one gRPC call); UNAVAILABLE (not connected, or reconnecting after a restart) is
    retried every 0.25 s for up to RECONNECT_WINDOW_S, never past `deadline` (time.monotonic()).
    Only for calls that are safe to repeat: a step with its position (a decode that did run is
    answered again by the retry rule, a prefill recomputes the same cells), Release, Info."""
    give_up = time.monotonic() + RECONNECT_WINDOW_S
    if deadline is not None:
        give_up = min(give_up, deadline)
    while True:
        try:
            return call()
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() + 0.25 > give_up:
                raise
            time.sleep(0.25)


def tier_name(tier: Tier) -> str:
    """The wire's name of a tier (SessionReply.tier, SessionInfo.tier): "hot", "warm" or "disk"."""
    return tier.name.lower()
