"""Shared prefixes on a route: sessions that begin alike compute their common start once, on every shard.

- The head names a session's prefixes by a chain of keys over whole blocks of PREFIX_BLOCK_TOKENS
  tokens (`block_keys`): key i covers every token before the end of block i. Middle and tail shards
  see only hidden rows; the keys travel with the prefill (StepRequest.prefix) so that they name the
  same prefixes.
- Every shard keeps a prefix under its own name for a key (`PrefixNames.local`): the key, the
  caller's principal (unless the operator shares prefixes with every caller: `--share-prefixes all`,
  and then only for steps that may speak for everyone: `PrefixNames.scope`), the worker's recipe
  (model shape, range, K/V type, attention kernel) and its model file's digest. A worker mixes its
  model's digest into the keys it forwards (`forwarded`), so a later shard's name covers every
  weight its input came through. A caller never reaches another principal's prefixes, and a shard
  never opens bytes another model wrote.
- The head's generation loop decides (`PrefixNames.plan`): a stream whose prompt starts with a
  stored prefix opens from it and computes the rest; a prefix seen before (or one the caller marks,
  GenerateRequest.keep_prefix) is stored by the step that ends at its last block.

Why blocks of 256 tokens: the head's loop cuts a prompt into chunks at multiples of GENERATE_CHUNK
(256) from position 0, and llama.cpp's results may depend on how a prompt is cut (upstream's CPU
flash-attention kernels, which a quantized cache still takes, round a step of under 64 query rows
otherwise; patch 0010's kernel and attention without flash attention do not). A prefix that ends
at a chunk boundary
leaves a session opened from it computing exactly the chunks a session without it computes after
that boundary, so its tokens and logits are the same bytes (tests/test_prefixes.py).
"""

from __future__ import annotations

import hashlib

import numpy as np

from ..errors import InvalidInputError

#: tokens per block of a prefix key (a multiple of the loop's chunk: see the module's docstring)
PREFIX_BLOCK_TOKENS = 256
SHARE_MODES = ("principal", "all")


class _SharedScope:
    def __repr__(self) -> str:
        return "SHARED"


#: the scope of prefixes shared with every caller (`--share-prefixes all`): no principal's scope
SHARED = _SharedScope()


def _scoped(scope) -> bytes:
    """A scope as bytes no other scope has: a tag, then a principal's name with its length."""
    if scope is SHARED:
        return b"A"
    name = scope.encode("utf-8", "surrogatepass")
    return b"P" + len(name).to_bytes(4, "little") + name


_SEED = hashlib.blake2b(b"llama-shard prefix keys v1", digest_size=8).digest()


def block_keys(tokens, n_blocks: int | None = None) -> list[int]:
    """The chained keys of the whole blocks of `tokens` (at most n_blocks): key i is the first 8
    bytes of BLAKE2b(key i-1, block i's token ids as little-endian int32), block -1's key a constant."""
    n = len(tokens) // PREFIX_BLOCK_TOKENS if n_blocks is None else min(n_blocks, len(tokens) // PREFIX_BLOCK_TOKENS)
    ids = np.asarray(tokens[: n * PREFIX_BLOCK_TOKENS], dtype="<i4")
    keys, prev = [], _SEED
    for i in range(n):
        prev = hashlib.blake2b(
            prev + ids[i * PREFIX_BLOCK_TOKENS : (i + 1) * PREFIX_BLOCK_TOKENS].tobytes(), digest_size=8
        ).digest()
        keys.append(int.from_bytes(prev, "little"))
    return keys


class PrefixNames:
    """One worker's names for prefixes (a head's decisions about them: head/prefix_plans.py)."""

    def __init__(self, manager, fingerprint: str, share: str = "principal", model_path: str | None = None):
        """`model_path`: the model file, whose digest names cover (read here with a prefix store,
        else at the first prefix step a worker forwards)."""
        if share not in SHARE_MODES:
            raise InvalidInputError(f"share_prefixes must be one of {', '.join(SHARE_MODES)}, got {share!r}")
        self.manager, self.share = manager, share
        self._recipe = fingerprint.encode()
        self._model_path = model_path
        self._digest: bytes | None = None  # the model file's digest, read at the first prefix step
        if self.enabled:
            self._model()

    @property
    def enabled(self) -> bool:
        return self.manager.config.prefix_bytes > 0

    def _model(self) -> bytes:
        """The model file's digest (the weights the recipe does not name: a fine-tune and its base
        share a recipe), read once: what a replica's must match (a range file names its source's)."""
        if self._digest is None:
            from ..engine.range_file import (
                content_digest,  # (read once per file: its header, then its bytes without the GIL)
            )

            self._digest = content_digest(self._model_path).encode() if self._model_path else b""
        return self._digest

    def scope(self, principal: str, shared: bool):
        """Whose prefixes a step reaches: every caller's (SHARED) when the worker shares them and the
        step may speak for everyone (`shared`: a head, which computes what it stores from the
        tokens; a trusted forwarder; a worker without authentication), else its principal's own."""
        return SHARED if self.share == "all" and shared else principal

    def local(self, scope, key: int) -> int:
        """This worker's name for a prefix key within `scope`: covers its recipe (model shape, range,
        K/V type, attention kernel) and its model file."""
        return self._hash(key.to_bytes(8, "little") + _scoped(scope) + self._recipe + b"\0" + self._model())

    def forwarded(self, keys, scope, wire_dtype: int) -> list[int]:
        """The keys this worker sends the next one: mixed with the scope they were named in here,
        its recipe (its range: the layers the rows went through), its model file and the rows' wire
        type, so that a later shard's names cover everything its input depends on, and a step that
        entered the route anywhere else (a caller stepping a middle worker, another head) never
        names what the route's own steps name."""
        suffix = _scoped(scope) + self._recipe + b"\0" + self._model() + wire_dtype.to_bytes(4, "little")
        return [self._hash(k.to_bytes(8, "little") + suffix) for k in keys]

    @staticmethod
    def _hash(data: bytes) -> int:
        return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
