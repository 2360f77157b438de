"""Conversions between the wire protocol (proto/shard.proto) and the Python contract types.

Hidden states travel as rows with their shape: float32 by default (exact), float16 (half the
bytes) or llama.cpp's q8_0 blocks (34 bytes per 32 values, 0.27 of float32) when a route asks for
fewer bytes; what each costs in agreement is measured by the benchmark's `wire` section
(docs/benchmarks.md). A tensor from the wire is checked completely (dtype, rank, width, row count,
byte length, finite values and scales) before anything reaches an engine.
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
#: values per q8_0 block, and one block's layout on the wire (llama.cpp's block_q8_0)
Q8_0_BLOCK = 32
_Q8_0 = np.dtype([("d", "<f2"), ("qs", "i1", (Q8_0_BLOCK,))])
#: the wire types by the name a command line gives them (serve --wire-dtype), in the order of their bytes
WIRE_DTYPES = {"f32": pb.DTYPE_FLOAT32, "f16": pb.DTYPE_FLOAT16, "q8_0": pb.DTYPE_Q8_0}
WIRE_DTYPE_NAMES = {v: k for k, v in WIRE_DTYPES.items()}
#: what a worker that does not list its types (Info.wire_dtypes empty: an older one) reads
LEGACY_WIRE_DTYPES = (pb.DTYPE_FLOAT32, pb.DTYPE_FLOAT16)


def wire_dtype_name(dtype: int) -> str:
    return WIRE_DTYPE_NAMES.get(dtype, f"dtype {dtype}")


def wire_row_bytes(n_cols: int, dtype: int) -> int:
    """Bytes one row of n_cols values takes on the wire (InvalidInputError: no such type, or a width
    q8_0 cannot carry)."""
    if dtype == pb.DTYPE_Q8_0:
        if n_cols % Q8_0_BLOCK:
            raise InvalidInputError(f"q8_0 carries rows of a multiple of {Q8_0_BLOCK} values; these have {n_cols}")
        return n_cols // Q8_0_BLOCK * _Q8_0.itemsize
    if dtype not in _NP_DTYPE:
        raise InvalidInputError(f"unknown tensor dtype {dtype}")
    return n_cols * _NP_DTYPE[dtype].itemsize


def wire_dtypes_for(n_cols: int) -> list[int]:
    """The wire types rows of n_cols values can travel as (q8_0: only whole blocks)."""
    return [d for d in WIRE_DTYPES.values() if d != pb.DTYPE_Q8_0 or n_cols % Q8_0_BLOCK == 0]


def quantize_q8_0(rows: np.ndarray) -> bytes:
    """Rows of float values as q8_0 blocks, rounded as llama.cpp's quantize_row_q8_0_ref rounds them
    (d = max|x| / 127 stored as float16, q = round(x / d))."""
    n_rows, n_cols = rows.shape
    x = np.asarray(rows, dtype=np.float32).reshape(n_rows, n_cols // Q8_0_BLOCK, Q8_0_BLOCK)
    d = np.abs(x).max(axis=-1) / np.float32(127.0)
    inv = np.divide(np.float32(1.0), d, out=np.zeros_like(d), where=d > 0)
    if not np.all(d <= np.finfo(np.float16).max):  # (NaN too) the reader would refuse it: this worker says so
        raise InvalidInputError(
            "a hidden row holds values beyond what q8_0 carries (a block scale past float16's "
            "range, or not finite): send this route's rows as f32"
        )
    blocks = np.empty(x.shape[:2], dtype=_Q8_0)
    with np.errstate(over="ignore", invalid="ignore"):
        blocks["d"] = d.astype(np.float16)
        scaled = x * inv[..., None]
        # roundf: halves away from zero (np.rint would round them to even)
        blocks["qs"] = np.clip(np.sign(scaled) * np.floor(np.abs(scaled) + np.float32(0.5)), -127, 127).astype(np.int8)
    return blocks.tobytes()


def dequantize_q8_0(data: bytes, n_rows: int, n_cols: int) -> np.ndarray:
    blocks = np.frombuffer(data, dtype=_Q8_0).reshape(n_rows, n_cols // Q8_0_BLOCK)
    d = blocks["d"].astype(np.float32)
    if not np.isfinite(d).all():
        raise InvalidInputError("hidden holds a q8_0 block whose scale is not finite")
    return (d[..., None] * blocks["qs"].astype(np.float32)).reshape(n_rows, n_cols)


def encode_tensor(array: np.ndarray, dtype: int = pb.DTYPE_FLOAT32) -> pb.Tensor:
    if dtype == pb.DTYPE_Q8_0:
        rows = np.asarray(array, dtype=np.float32)
        if rows.ndim != 2:
            raise InvalidInputError(f"q8_0 carries rows (a 2-d array), not shape {list(rows.shape)}")
        wire_row_bytes(rows.shape[1], dtype)
        return pb.Tensor(shape=list(rows.shape), dtype=dtype, data=quantize_q8_0(rows))
    if dtype not in _NP_DTYPE:
        raise InvalidInputError(f"unknown tensor dtype {dtype}")
    data = np.ascontiguousarray(array, dtype=_NP_DTYPE[dtype])
    return pb.Tensor(shape=list(data.shape), dtype=dtype, data=data.tobytes())


def decode_tensor(t: pb.Tensor, n_cols: int, max_rows: int) -> np.ndarray:
    """A (n_rows, n_cols) float32 array from the wire, or InvalidInputError saying what is wrong."""
    if t.dtype not in WIRE_DTYPE_NAMES:
        raise InvalidInputError(f"unknown tensor dtype {t.dtype}")
    shape = list(t.shape)
    if len(shape) != 2:
        raise InvalidInputError(f"hidden must have shape (n_tokens, {n_cols}), got {shape}")
    rows, cols = shape
    if cols != n_cols:
        raise InvalidInputError(f"hidden has {cols} columns; this shard's n_embd is {n_cols}")
    if not 1 <= rows <= max_rows:
        raise InvalidInputError(f"hidden has {rows} rows; a step takes 1 to {max_rows}")
    need = rows * wire_row_bytes(cols, t.dtype)
    if len(t.data) != need:
        raise InvalidInputError(
            f"hidden data is {len(t.data)} bytes; shape {shape} in {wire_dtype_name(t.dtype)} needs {need}"
        )
    if t.dtype == pb.DTYPE_Q8_0:
        arr = dequantize_q8_0(t.data, rows, cols)
    else:
        dt = _NP_DTYPE[t.dtype]
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
