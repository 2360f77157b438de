"""Conversions between the wire protocol (proto/shard.proto) and the Python contract types.

Hidden states travel as raw little-endian rows with their shape: float32 by default, float16 when a
caller asks for half the bytes (its parity cost is measured in tests/test_wire_and_worker.py). A
tensor from the wire is checked completely (dtype, rank, width, row count, byte length, finite
values) before anything reaches an engine.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

import grpc
import numpy as np
from google.protobuf.message import DecodeError

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


class _Unparsable:
    """What a request that did not parse becomes, so the handler can refuse it cleanly."""

    def __init__(self, error: DecodeError):
        self.error = error


class _Overloaded:
    """What a request becomes when the bytes already in flight leave no room for it."""

    def __init__(self, size: int, in_flight: int, limit: int):
        self.size, self.in_flight, self.limit = size, in_flight, limit


class _InFlightBytes:
    """The request bytes this worker has admitted and not yet answered."""

    def __init__(self, limit: int):
        self.limit, self.held = limit, 0
        self._lock = threading.Lock()

    def take(self, n: int) -> bool:
        with self._lock:
            if self.held + n > self.limit:
                return False
            self.held += n
            return True

    def give_back(self, n: int) -> None:
        with self._lock:
            self.held -= n


class _Admitted:
    """A parsed request holding its share of the in-flight bytes. The share goes back when the
    handler returns, or when gRPC drops the call before the handler runs (a cancelled call: this
    object is freed, and with it the share)."""

    def __init__(self, message, size: int, budget: _InFlightBytes):
        self.message, self._size, self._budget = message, size, budget

    def release(self) -> None:
        size, self._size = self._size, 0
        if size:
            self._budget.give_back(size)

    def __del__(self):
        self.release()


class AdmitRequests(grpc.ServerInterceptor):
    """Every unary request passes here before its handler.
    - Bytes that do not parse get INVALID_ARGUMENT with the parser's reason. gRPC's own answer to a
      request its deserializer rejects is INTERNAL, which reads as a fault of the worker on a
      dashboard; the fault is the caller's.
    - The request bytes being parsed and handled at once are bounded: a request that would take the
      total past `max_in_flight_bytes` gets RESOURCE_EXHAUSTED before it is parsed. gRPC bounds
      each message (the receive limit) and the calls (max_concurrent_rpcs), not their sum; a parsed
      message takes up to 5x its bytes (one-byte token ids become 4-byte ints), and a handler keeps
      its request while it waits for the engine or the next hop, so every handler thread could hold
      a maximum-size request at once. (Parsing itself holds the GIL: parses do not overlap.)
    Each method's wrapped handler is made once (the handlers are registered before the server
    starts), not per call."""

    def __init__(self, max_in_flight_bytes: int):
        self._wrapped: dict[str, object] = {}
        self.in_flight = _InFlightBytes(max_in_flight_bytes)

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        wrapped = self._wrapped.get(method)
        if wrapped is None:
            wrapped = self._wrap(method, continuation(handler_call_details))
            if wrapped is not None:  # only registered methods: a caller's made-up names are not kept
                self._wrapped[method] = wrapped
        return wrapped

    def _wrap(self, method: str, handler):
        if handler is None or handler.unary_unary is None or handler.request_deserializer is None:
            return handler
        parse, behavior, budget = handler.request_deserializer, handler.unary_unary, self.in_flight

        def admit_and_parse(data: bytes):
            if not budget.take(len(data)):
                return _Overloaded(len(data), budget.held, budget.limit)
            admitted = _Admitted(None, len(data), budget)
            try:
                admitted.message = parse(data)
            except DecodeError as e:
                admitted.release()
                return _Unparsable(e)
            return admitted

        def handle(request, context):
            if isinstance(request, _Unparsable):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method}: the request does not parse: {request.error}")
            if isinstance(request, _Overloaded):
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"{method}: {request.in_flight} request bytes are in flight, {request.size} more would pass "
                              f"this worker's bound of {request.limit}; retry shortly")
            try:
                return behavior(request.message, context)
            finally:
                request.release()

        return handler._replace(request_deserializer=admit_and_parse, unary_unary=handle)


def tier_name(tier: Tier) -> str:
    """The wire's name of a tier (SessionReply.tier, SessionInfo.tier): "hot", "warm" or "disk"."""
    return tier.name.lower()
