"""The memory plan: what an operator's byte sizes mean for a shard's Hot KV state.

The hot tier is `max_sessions` KV streams, allocated (and touched) when the context is created;
the native engine says how many cells one stream takes (`HotKvConfig.slot_cells`: llama.cpp pads
max(context_tokens, n_batch) to 256) and what a token costs (`kv_bytes_per_token`), so
`--kv-memory SIZE` buys `SIZE // (slot cells x KV bytes per token)` hot slots, and `--max-sessions N`
is N slots. `budget_tokens` then defaults to slots x context_tokens (no cap beyond the slots) and,
when set, caps the tokens held hot. The warm tier holds evicted sessions' KV in at most
`warm_bytes` of host memory, and the prefix store (shared starts of sessions) at most
`prefix_bytes`. A head with a draft model (`serve --draft-model`) holds that model whole and a hot
slot for each Generate stream it runs at once: the draft's own plan (`draft_model_plan`), which its
engine is sized by. The process holds about model + hot + warm + prefixes + draft + a fixed overhead.
"""

from __future__ import annotations

import dataclasses

from .._native import CHECKPOINT_INPUT_ROWS, CHECKPOINTS_PER_SESSION, MAX_SESSIONS, HotKvConfig
from ..errors import InvalidInputError
from .hot_kv import HotKvStateConfig, format_size
from .recipe import kv_bytes_per_token


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    kv_memory: int  # the bytes the operator gave the hot tier
    context_tokens: int
    kv_type: str
    kv_bytes_per_token: int  # K and V over the owned layers
    slot_cells: int  # cells one hot slot allocates (context padded)
    hot_slots: int  # max_sessions
    warm_bytes: int
    model_bytes: int  # the owned weights (0 when unknown)
    budget_tokens: int
    warm_disk_bytes: int = 0  # the disk tier's bound (files, not memory)
    prefix_bytes: int = 0  # the prefix store's bound (host memory)
    draft: "MemoryPlan | None" = None  # the draft model's own plan (serve --draft-model), or none
    recurrent_bytes: int = 0  # a hybrid's recurrent state per slot (fixed size, whatever the length)
    checkpoint_bytes: int = 0  # a hybrid's checkpoints per session at most (host memory)

    @property
    def draft_bytes(self) -> int:
        return self.draft.model_bytes + self.draft.hot_bytes if self.draft is not None else 0

    @property
    def slot_bytes(self) -> int:
        return self.slot_cells * self.kv_bytes_per_token + self.recurrent_bytes

    @property
    def hot_bytes(self) -> int:
        return self.hot_slots * self.slot_bytes

    def config(self, **overrides) -> HotKvStateConfig:
        """The HotKvStateConfig this plan sizes (ttl and the like from `overrides`)."""
        values = dict(
            max_sessions=self.hot_slots,
            context_tokens=self.context_tokens,
            budget_tokens=self.budget_tokens,
            warm_bytes=self.warm_bytes,
            kv_type=self.kv_type,
            warm_disk_bytes=self.warm_disk_bytes,
            prefix_bytes=self.prefix_bytes,
        )
        values.update(overrides)
        return HotKvStateConfig(**values)

    def describe(self) -> str:
        lines = [
            f"hot KV:   {self.hot_slots} slots x {self.slot_cells} cells x {self.kv_bytes_per_token} B/token "
            f"({self.kv_type}) = {format_size(self.hot_bytes)} of {format_size(self.kv_memory)} "
            f"(sessions up to {self.context_tokens} tokens; at most {self.budget_tokens} tokens hot)",
            f"warm KV:  {format_size(self.warm_bytes) if self.warm_bytes else 'off'} in host memory"
            + (f", {format_size(self.warm_disk_bytes)} on disk" if self.warm_disk_bytes else "")
            + ("" if self.warm_bytes or self.warm_disk_bytes else " (an evicted session is a cache miss)"),
            f"prefixes: {format_size(self.prefix_bytes) + ' in host memory' if self.prefix_bytes else 'off'} "
            f"(shared starts of sessions)",
        ]
        if self.recurrent_bytes:
            lines.append(
                f"recurrent: {format_size(self.recurrent_bytes)} of state per slot (in hot KV); checkpoints up to "
                f"{format_size(self.checkpoint_bytes)} per session in host memory"
            )
        if self.draft is not None:
            d = self.draft
            lines.append(
                f"draft:    {format_size(self.draft_bytes)} (a draft model: weights {format_size(d.model_bytes)} "
                f"+ KV of {d.hot_slots} streams x {d.slot_cells} cells x {d.kv_bytes_per_token} B/token)"
            )
        if self.model_bytes:
            lines.append(f"weights:  {format_size(self.model_bytes)} (owned layers)")
            total = (
                self.model_bytes
                + self.hot_bytes
                + self.warm_bytes
                + self.prefix_bytes
                + self.draft_bytes
                + self.hot_slots * self.checkpoint_bytes
            )
            lines.append(f"total:    about {format_size(total)} + compute buffers")
        return "\n".join(lines)


def memory_plan(
    info,
    kv_memory: int | None,
    context_tokens: int,
    n_batch: int = HotKvConfig().n_batch,
    kv_type: str = "f16",
    warm_bytes: int = 0,
    budget_tokens: int | None = None,
    warm_disk_bytes: int = 0,
    *,
    max_sessions: int | None = None,
    prefix_bytes: int = 0,
) -> MemoryPlan:
    """The plan for a shard described by `info` (n_head_kv, head_dim, first, last and, optionally,
    weight_bytes and f16 kv_bytes_per_token: a ShardModel's info or the same read from a GGUF header): `kv_memory` bytes buy
    the hot slots, or `max_sessions` (kv_memory None) names them. InvalidInputError when not even
    one slot fits."""
    n_layers = info.last - info.first + 1
    bpt = kv_bytes_per_token(info.n_head_kv, info.head_dim, n_layers, kv_type)  # validates kv_type for the heads
    f16_bpt = getattr(info, "kv_bytes_per_token", None)
    if f16_bpt is not None:  # what llama.cpp caches (per-layer heads, latent attention's K-only rows; 0 for a
        #                      shard of recurrent or FFN-only layers), at kv_type's size
        bpt = int(f16_bpt) * kv_bytes_per_token(1, 256, 1, kv_type) // kv_bytes_per_token(1, 256, 1, "f16")
    cells = HotKvConfig(context_tokens=context_tokens, n_batch=n_batch).slot_cells
    recurrent = int(getattr(info, "recurrent_bytes", 0) or 0)
    slot = cells * bpt + recurrent
    if kv_memory is None:
        slots = max_sessions if max_sessions is not None else HotKvStateConfig().max_sessions
        kv_memory = slots * slot
    else:
        slots = (
            min(kv_memory // slot, MAX_SESSIONS) if slot else MAX_SESSIONS
        )  # a shard that holds no state per token or session
    if slots < 1:
        raise InvalidInputError(
            f"KV memory {format_size(kv_memory)} does not fit one session of {context_tokens} tokens: one slot takes "
            f"{cells} cells x {bpt} B = {format_size(cells * bpt)} ({kv_type}, layers {info.first}-{info.last}); "
            f"give more memory, a shorter context or a smaller kv_type"
        )
    budget = slots * context_tokens if budget_tokens is None else budget_tokens
    return MemoryPlan(
        kv_memory=kv_memory,
        context_tokens=context_tokens,
        kv_type=kv_type,
        kv_bytes_per_token=bpt,
        slot_cells=cells,
        hot_slots=int(slots),
        warm_bytes=warm_bytes,
        model_bytes=int(getattr(info, "weight_bytes", 0) or 0),
        budget_tokens=budget,
        warm_disk_bytes=warm_disk_bytes,
        prefix_bytes=prefix_bytes,
        recurrent_bytes=recurrent,
        checkpoint_bytes=checkpoints_bytes_per_session(recurrent, int(getattr(info, "n_embd", 0) or 0)),
    )


def checkpoints_bytes_per_session(recurrent_bytes: int, n_embd: int) -> int:
    """The most a hybrid session's checkpoints hold: the recurrent states and the inputs after each
    (hidden rows of n_embd floats; a head's token ids are smaller). 0 for a model without recurrent state."""
    if not recurrent_bytes:
        return 0
    return CHECKPOINTS_PER_SESSION * (recurrent_bytes + CHECKPOINT_INPUT_ROWS * 4 * max(n_embd, 1))


def draft_model_plan(path, context_tokens: int, streams: int) -> MemoryPlan:
    """A draft model's plan (serve --draft-model): the whole model, one hot slot of `context_tokens`
    for each of the `streams` Generate streams the head runs at once (at most MAX_SESSIONS: beyond,
    the least recently drafted stream's draft KV is evicted and prefilled again when it drafts next);
    its engine is sized by it."""
    from .models import gguf_shape

    shape = gguf_shape(path)
    return memory_plan(
        shape.range_info(0, shape.n_layer - 1), None, context_tokens, max_sessions=min(streams, MAX_SESSIONS)
    )
