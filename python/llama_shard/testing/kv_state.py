"""Where the K and V rows lie in a llama.cpp sequence state, for tests that forge values in them.

The layout is the one native/src/kv_state_check.cpp reads (llama-context.cpp state_seq_get_data at
the pin): a u32 magic and the saved seq id, then per cache a u32 stream count and per stream a u32
cell count; a stream with cells lists them (pos i32, n_seq_id u32, seq_id i32), then a u32 "V
transposed" flag and a u32 layer count, then per layer K (type i32, row bytes u64, the rows), then
per layer V (the same, or when transposed: type i32, element bytes u32, elements per cell u32, the
elements)."""

from __future__ import annotations

import dataclasses
import struct


@dataclasses.dataclass(frozen=True)
class Rows:
    kind: str  # "K" or "V"
    cache: int  # 0: the full cache; 1: a sliding-window cache
    layer: int  # index among the cache's layers
    ggml_type: int  # ggml's type id (1: f16, 8: q8_0, 2: q4_0)
    offset: int  # where the rows begin in the state
    size: int  # their bytes


def state_rows(state: bytes) -> list[Rows]:
    """Every layer's K and V rows in `state`, in order."""
    out: list[Rows] = []
    at, cache = 8, 0
    while at < len(state):
        (n_stream,) = struct.unpack_from("<I", state, at)
        at += 4
        for _ in range(n_stream):
            (cells,) = struct.unpack_from("<I", state, at)
            at += 4 + 12 * cells
            if not cells:
                continue
            v_trans, n_layer = struct.unpack_from("<II", state, at)
            at += 8
            for i in range(2 * n_layer):
                kind = "K" if i < n_layer else "V"
                (ggml_type,) = struct.unpack_from("<i", state, at)
                at += 4
                if kind == "K" or not v_trans:
                    (row,) = struct.unpack_from("<Q", state, at)
                    at += 8
                    size = cells * row
                else:
                    el, n_embd = struct.unpack_from("<II", state, at)
                    at += 8
                    size = cells * n_embd * el
                out.append(Rows(kind, cache, i % n_layer, ggml_type, at, size))
                at += size
        cache += 1
    return out


#: f16 bit patterns that are not finite
F16_NAN, F16_INF, F16_NEG_INF = 0x7E00, 0x7C00, 0xFC00


def with_f16(state: bytes, offset: int, bits: int) -> bytes:
    """`state` with the f16 value at `offset` set to `bits`."""
    out = bytearray(state)
    struct.pack_into("<H", out, offset, bits)
    return bytes(out)
