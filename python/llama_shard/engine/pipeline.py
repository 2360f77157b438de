"""An in-process route: shards whose layer ranges tile a model, run one after the other.

`LocalPipeline` is the smallest complete use of the shard primitives: the head embeds token ids,
each boundary passes the unnormalized residual (float32 (n_tokens, n_embd)) to the next shard, the
tail returns the last token's logits. Every shard keeps its own KV for its own layers, per sequence.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from .._native import CPU_DEVICE, ShardContext, ShardModel
from ..errors import InvalidInputError

LayerRange = tuple[int, int]


def parse_split(text: str) -> list[LayerRange]:
    """'0-14,15-29' -> [(0, 14), (15, 29)]; a single number 'N' is the one-layer range (N, N)."""
    ranges = []
    for part in text.split(","):
        part = part.strip()
        try:
            if "-" in part:
                a, b = part.split("-", 1)
                ranges.append((int(a), int(b)))
            else:
                ranges.append((int(part), int(part)))
        except ValueError:
            raise InvalidInputError(f"bad layer range {part!r} in {text!r}: use FIRST-LAST,FIRST-LAST,...") from None
    return ranges


def check_tiling(ranges: Sequence[LayerRange], n_layer: int) -> None:
    """The ranges must cover [0, n_layer) exactly, in order, without gaps or overlaps."""
    if not ranges:
        raise InvalidInputError("a route needs at least one layer range")
    expected = 0
    for first, last in ranges:
        if first > last:
            raise InvalidInputError(f"layer range {first}-{last} is reversed")
        if first != expected:
            kind = "gap" if first > expected else "overlap"
            raise InvalidInputError(f"layer ranges have a {kind} at layer {min(first, expected)}: {list(ranges)}")
        expected = last + 1
    if expected != n_layer:
        raise InvalidInputError(f"layer ranges end at {expected - 1} but the model has layers 0-{n_layer - 1}")


class LocalPipeline:
    """Shards of one GGUF file in this process, each with its own bounded context."""

    def __init__(
        self,
        path: str | Path,
        split: Sequence[LayerRange] | None = None,
        *,
        n_ctx: int = 2048,
        n_seq_max: int = 4,
        n_batch: int = 512,
        n_threads: int | None = None,
        flash_attn: bool = True,
        device: str = CPU_DEVICE,
        cpu_moe_layers: int = 0,
    ):
        self.path = Path(path)
        self.models: list[ShardModel] = []
        if split is None:
            self.models.append(ShardModel(str(self.path), None, n_threads, device, -1, cpu_moe_layers))
        else:
            split = list(split)
            for first, last in split:
                self.models.append(ShardModel(str(self.path), (first, last), n_threads, device, -1, cpu_moe_layers))
            check_tiling(split, self.models[0].info.n_layer)
        self.contexts = [
            ShardContext(
                m, n_ctx=n_ctx, n_seq_max=n_seq_max, n_batch=n_batch, n_threads=n_threads, flash_attn=flash_attn
            )
            for m in self.models
        ]

    @property
    def head(self) -> ShardModel:
        return self.models[0]

    def step(
        self, seq_id: int, pos: int, tokens: Sequence[int], boundaries: list[np.ndarray] | None = None
    ) -> np.ndarray:
        """Runs `tokens` at `pos` through every shard; returns the tail's logits (n_vocab,).

        When `boundaries` is a list, the hidden state leaving each non-tail shard is appended to it.
        """
        out = self.contexts[0].forward(seq_id, pos, tokens=tokens)
        for ctx in self.contexts[1:]:
            if boundaries is not None:
                boundaries.append(out)
            out = ctx.forward(seq_id, pos, hidden=out)
        return out

    def seq_rm(self, seq_id: int, p0: int) -> None:
        for ctx in self.contexts:
            ctx.seq_rm(seq_id, p0)

    def generate(
        self, prompt: Sequence[int], max_tokens: int, seq_id: int = 0, stop: Sequence[int] = (), sampler=None
    ) -> Iterator[tuple[int, np.ndarray]]:
        """Decoding from a fresh sequence: yields (token, logits that chose it) per step. Greedy, or
        drawn by `sampler` (a TokenSampler; the caller accepts the prompt into it first, as stock does)."""
        if max_tokens < 0:
            raise InvalidInputError("max_tokens must be >= 0")
        self.seq_rm(seq_id, 0)
        n_batch = self.contexts[0].n_batch
        pos = 0
        logits = None
        for start in range(0, len(prompt), n_batch):  # prefill in n_batch chunks
            chunk = list(prompt[start : start + n_batch])
            logits = self.step(seq_id, pos, chunk)
            pos += len(chunk)
        if logits is None:
            raise InvalidInputError("the prompt is empty")
        for _ in range(max_tokens):
            if sampler is None:
                token = int(np.argmax(logits))
            else:
                token = sampler.sample(logits)
                sampler.accept(token)
            yield token, logits
            if token in stop:
                return
            logits = self.step(seq_id, pos, [token])
            pos += 1
