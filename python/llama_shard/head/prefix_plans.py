"""A head's decisions about shared prefixes: which stored prefix a stream opens, which it stores
(the keys and names are every worker's: worker/prefixes.py, whose docstring says how prefixes work)."""

from __future__ import annotations

import threading
from collections import OrderedDict

from ..worker.prefixes import PREFIX_BLOCK_TOKENS, PrefixNames, block_keys

#: prefix keys seen recently, per head: a prefix is stored the second time it is seen
SIGHTINGS_CAP = 4096


class PrefixPlan:
    """What a stream's prefill does with shared prefixes: open from `open_tokens` (0: none), store
    at `store_tokens` (0: none); `keys` cover the blocks up to the larger of the two."""

    __slots__ = ("keys", "open_tokens", "store_tokens")

    def __init__(self, keys: list[int], open_tokens: int, store_tokens: int):
        self.keys, self.open_tokens, self.store_tokens = keys, open_tokens, store_tokens


class PrefixPlanner:
    """The head's plans over its worker's names; remembers which prefixes it saw (bounded)."""

    def __init__(self, names: PrefixNames):
        self.names = names
        self._lock = threading.Lock()
        self._seen: OrderedDict[int, None] = OrderedDict()  # local names seen once, least recent first

    @property
    def share(self) -> str:
        return self.names.share

    def plan(
        self, principal: str, tokens: list[int], held: int, keep: int = 0, may_open: bool = True
    ) -> PrefixPlan | None:
        """The head's decision for a stream whose session holds its first `held` tokens: open from
        the longest stored prefix longer than that, and store the longest prefix past the opened one
        that was seen before (or that `keep` covers). Only whole blocks before the prompt's last
        token count (the tail needs at least one token to compute). `may_open` False (a shard after
        this one lacked the prefix): nothing is opened, and the prefix that would have been is
        stored again, for the shards that lost it. None: nothing to do."""
        if not self.names.enabled:
            return None
        n = (len(tokens) - 1) // PREFIX_BLOCK_TOKENS
        if n == 0:
            return None
        keys = block_keys(tokens, n)
        scope = self.names.scope(principal, shared=True)
        names = [self.names.local(scope, k) for k in keys]
        stored = 0  # the longest prefix this worker holds, past what the session holds
        for i in range(n, 0, -1):
            if (
                i * PREFIX_BLOCK_TOKENS > held
                and self.names.manager.prefix_length(names[i - 1]) == i * PREFIX_BLOCK_TOKENS
            ):
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
                if (
                    clean
                    and i * PREFIX_BLOCK_TOKENS > start
                    and (names[i - 1] in self._seen or i * PREFIX_BLOCK_TOKENS <= keep)
                    and self.names.manager.prefix_length(names[i - 1]) == 0
                ):
                    store = i
                    break
            for name in names:
                self._seen[name] = None
                self._seen.move_to_end(name)
            while len(self._seen) > SIGHTINGS_CAP:
                self._seen.popitem(last=False)
        if not opened and not store:
            return None
        return PrefixPlan(keys[: max(opened, store)], opened * PREFIX_BLOCK_TOKENS, store * PREFIX_BLOCK_TOKENS)
