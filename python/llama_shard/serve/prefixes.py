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
import threading
from collections import OrderedDict

import numpy as np

from ..errors import InvalidInputError

#: tokens per block of a prefix key (a multiple of the loop's chunk: see the module's docstring)
PREFIX_BLOCK_TOKENS = 256
#: prefix keys seen recently, per worker: a prefix is stored the second time it is seen
SIGHTINGS_CAP = 4096
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
    ids = np.asarray(tokens[:n * PREFIX_BLOCK_TOKENS], dtype="<i4")
    keys, prev = [], _SEED
    for i in range(n):
        prev = hashlib.blake2b(prev + ids[i * PREFIX_BLOCK_TOKENS:(i + 1) * PREFIX_BLOCK_TOKENS].tobytes(),
                               digest_size=8).digest()
        keys.append(int.from_bytes(prev, "little"))
    return keys


class PrefixPlan:
    """What a stream's prefill does with shared prefixes: open from `open_tokens` (0: none), store
    at `store_tokens` (0: none); `keys` cover the blocks up to the larger of the two."""

    __slots__ = ("keys", "open_tokens", "store_tokens")

    def __init__(self, keys: list[int], open_tokens: int, store_tokens: int):
        self.keys, self.open_tokens, self.store_tokens = keys, open_tokens, store_tokens


class PrefixNames:
    """One worker's names for prefixes and, on a head, its decisions about them."""

    def __init__(self, manager, fingerprint: str, share: str = "principal", model_path: str | None = None):
        """`model_path`: the model file, whose digest names cover (read here with a prefix store,
        else at the first prefix step a worker forwards)."""
        if share not in SHARE_MODES:
            raise InvalidInputError(f"share_prefixes must be one of {', '.join(SHARE_MODES)}, got {share!r}")
        self.manager, self.share = manager, share
        self._recipe = fingerprint.encode()
        self._model_path = model_path
        self._digest: bytes | None = None  # the model file's digest, read at the first prefix step
        self._lock = threading.Lock()
        self._seen: OrderedDict[int, None] = OrderedDict()  # local names seen once, least recent first
        if self.enabled:
            self._model()

    @property
    def enabled(self) -> bool:
        return self.manager.config.prefix_bytes > 0

    def _model(self) -> bytes:
        """The model file's digest (the weights the recipe does not name: a fine-tune and its base
        share a recipe), read once; the same function the disk tier names its files' model by."""
        if self._digest is None:
            from .._native import model_digest  # reads the file without the GIL
            self._digest = model_digest(self._model_path).encode() if self._model_path else b""
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

    def plan(self, principal: str, tokens: list[int], held: int, keep: int = 0, may_open: bool = True) -> PrefixPlan | None:
        """The head's decision for a stream whose session holds its first `held` tokens: open from
        the longest stored prefix longer than that, and store the longest prefix past the opened one
        that was seen before (or that `keep` covers). Only whole blocks before the prompt's last
        token count (the tail needs at least one token to compute). `may_open` False (a shard after
        this one lacked the prefix): nothing is opened, and the prefix that would have been is
        stored again, for the shards that lost it. None: nothing to do."""
        if not self.enabled:
            return None
        n = (len(tokens) - 1) // PREFIX_BLOCK_TOKENS
        if n == 0:
            return None
        keys = block_keys(tokens, n)
        scope = self.scope(principal, shared=True)
        names = [self.local(scope, k) for k in keys]
        stored = 0  # the longest prefix this worker holds, past what the session holds
        for i in range(n, 0, -1):
            if i * PREFIX_BLOCK_TOKENS > held and self.manager.prefix_length(names[i - 1]) == i * PREFIX_BLOCK_TOKENS:
                stored = i
                break
        opened = stored if may_open else 0
        start = max(held, opened * PREFIX_BLOCK_TOKENS)
        store = 0 if may_open else stored
        # only a prefix computed as a fresh prompt is: not over tokens an earlier stream left (its
        # generated tokens were computed one by one, and would round otherwise)
        clean = start == opened * PREFIX_BLOCK_TOKENS
        with self._lock:
            for i in range(n, store, -1):
                if (clean and i * PREFIX_BLOCK_TOKENS > start
                        and (names[i - 1] in self._seen or i * PREFIX_BLOCK_TOKENS <= keep)
                        and self.manager.prefix_length(names[i - 1]) == 0):
                    store = i
                    break
            for name in names:
                self._seen[name] = None
                self._seen.move_to_end(name)
            while len(self._seen) > SIGHTINGS_CAP:
                self._seen.popitem(last=False)
        if not opened and not store:
            return None
        return PrefixPlan(keys[:max(opened, store)], opened * PREFIX_BLOCK_TOKENS, store * PREFIX_BLOCK_TOKENS)
