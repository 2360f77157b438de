"""HotKvStateManager and KvBoundaryAdapter: the seed contract over a Hot KV engine.

The manager is thin: it checks arguments, reads the clock, calls the engine (the native
`HotKvEngine` for a `ShardModel`, or the numpy `ReferenceHotKvEngine` for a `ReferenceShard`), and
turns the engine's status into the contract's values and exceptions:

    OK -> SessionInfo / BoundaryBundle / TailOutput      CACHE_MISS -> CacheMiss(reason)
    STALE_EPOCH -> StaleRouteEpochError                   BUDGET_EXCEEDED -> KvBudgetExceededError

All state lives in the engine, which serialises calls itself; the manager holds none.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ._native import HotKvEngine, ShardModel
from .errors import IncompatibleCacheRecipeError, InvalidInputError, KvBudgetExceededError, KvCacheMissError, StaleRouteEpochError
from .hot_kv import (
    BoundaryBundle,
    CacheMiss,
    CacheMissReason,
    HotKvStateConfig,
    KvCacheRecipe,
    SessionInfo,
    TailOutput,
    check_count,
    check_key,
    kv_recipe_for,
    monotonic_clock,
)

_REASONS = {r.name: r for r in CacheMissReason}


class HotKvStateManager:
    """The Hot KV state of one shard: (route_session_id, route_epoch) -> cached KV of the owned layers."""

    def __init__(self, model, config: HotKvStateConfig | None = None, clock: Callable[[], float] | None = None,
                 *, n_batch: int = 512, n_threads: int | None = None, recent_capacity: int = 4096):
        self.config = config if config is not None else HotKvStateConfig()
        if not isinstance(self.config, HotKvStateConfig):
            raise InvalidInputError("config must be a HotKvStateConfig")
        self.clock = clock if clock is not None else monotonic_clock
        self.model = model
        self.recipe: KvCacheRecipe = kv_recipe_for(model)  # raises for an uncertified architecture
        c = self.config
        if isinstance(model, ShardModel):
            self.engine = HotKvEngine(model, c.max_sessions, c.context_tokens, c.budget_tokens, float(c.ttl_seconds),
                                      n_batch, n_threads, recent_capacity)
        else:
            from .reference.engine import ReferenceHotKvEngine
            self.engine = ReferenceHotKvEngine(model, c.max_sessions, c.context_tokens, c.budget_tokens,
                                               float(c.ttl_seconds), n_batch, recent_capacity)

    # --- outcome mapping --------------------------------------------------------------------------

    def _session(self, sid: str, epoch: int, r) -> SessionInfo:
        return SessionInfo(session_id=sid, route_epoch=epoch, seq_len=r.seq_len, seq_id=r.seq_id,
                           owned_layers=self.recipe.owned_layers, bytes_per_token=self.recipe.bytes_per_token())

    @staticmethod
    def _raise_or_miss(sid: str, epoch: int, r) -> CacheMiss | None:
        if r.status == "OK":
            return None
        if r.status == "CACHE_MISS":
            return CacheMiss(session_id=sid, route_epoch=epoch, reason=_REASONS[r.miss], detail=r.detail)
        if r.status == "STALE_EPOCH":
            raise StaleRouteEpochError(f"({sid!r}, {epoch}): {r.detail}", current_epoch=r.current_epoch)
        if r.status == "BUDGET_EXCEEDED":
            raise KvBudgetExceededError(f"({sid!r}, {epoch}): {r.detail}")
        raise AssertionError(f"unknown engine status {r.status}")

    def check_recipe(self, recipe: KvCacheRecipe | None) -> None:
        if recipe is None:
            return
        if not isinstance(recipe, KvCacheRecipe):
            raise InvalidInputError("recipe must be a KvCacheRecipe")
        if not self.recipe.is_compatible(recipe):
            raise IncompatibleCacheRecipeError(
                f"request recipe {recipe.canonical()} does not match this shard's {self.recipe.canonical()}")

    # --- lifecycle --------------------------------------------------------------------------------

    def open(self, session_id: str, route_epoch: int, recipe: KvCacheRecipe | None = None) -> SessionInfo:
        check_key(session_id, route_epoch)
        self.check_recipe(recipe)
        r = self.engine.open(session_id, int(route_epoch), self.clock())
        self._raise_or_miss(session_id, route_epoch, r)
        return self._session(session_id, route_epoch, r)

    def truncate(self, session_id: str, route_epoch: int, length: int) -> SessionInfo | CacheMiss:
        check_key(session_id, route_epoch)
        check_count("length", length)
        r = self.engine.truncate(session_id, int(route_epoch), int(length), self.clock())
        return self._raise_or_miss(session_id, route_epoch, r) or self._session(session_id, route_epoch, r)

    def release(self, session_id: str, route_epoch: int) -> bool:
        """Releases exactly this epoch's state; True if something was released."""
        check_key(session_id, route_epoch)
        r = self.engine.release(session_id, int(route_epoch), self.clock())
        self._raise_or_miss(session_id, route_epoch, r)
        return bool(r.changed)

    def resolve(self, session_id: str, route_epoch: int) -> SessionInfo | CacheMiss:
        check_key(session_id, route_epoch)
        r = self.engine.resolve(session_id, int(route_epoch), self.clock())
        return self._raise_or_miss(session_id, route_epoch, r) or self._session(session_id, route_epoch, r)

    def get(self, session_id: str, route_epoch: int) -> SessionInfo:
        out = self.resolve(session_id, route_epoch)
        if isinstance(out, CacheMiss):
            raise KvCacheMissError(out)
        return out

    def sweep(self) -> int:
        """Evicts every session idle longer than ttl_seconds now; returns how many."""
        return int(self.engine.sweep(self.clock()))

    # --- steps (used by KvBoundaryAdapter) --------------------------------------------------------

    def prefill_step(self, session_id, route_epoch, start_pos, tokens, hidden):
        check_key(session_id, route_epoch)
        if start_pos is not None:
            check_count("start_pos", start_pos)
        r, out = self.engine.prefill(session_id, int(route_epoch), self.clock(),
                                     -1 if start_pos is None else int(start_pos), tokens=tokens, hidden=hidden)
        return r, out

    def decode_step(self, session_id, route_epoch, expected_seq_len, tokens, hidden):
        check_key(session_id, route_epoch)
        if expected_seq_len is not None:
            check_count("expected_seq_len", expected_seq_len)
        r, out = self.engine.decode(session_id, int(route_epoch), self.clock(),
                                    -1 if expected_seq_len is None else int(expected_seq_len), tokens=tokens, hidden=hidden)
        return r, out

    # --- introspection ----------------------------------------------------------------------------

    @property
    def session_count(self) -> int:
        return int(self.engine.stats()["live_sessions"])

    @property
    def reserved_tokens(self) -> int:
        return int(self.engine.stats()["reserved_tokens"])

    @property
    def total_bytes(self) -> int:
        """KV bytes held by live sessions (owned layers only)."""
        return int(self.engine.stats()["reserved_bytes"])

    def session_keys(self) -> list[tuple[str, int]]:
        """Live (route_session_id, route_epoch) keys, least recently used first."""
        return [(sid, int(epoch)) for sid, epoch, *_ in self.engine.sessions()]

    def stats(self) -> dict:
        return dict(self.engine.stats())

    def check_invariants(self) -> None:
        self.engine.check_invariants()


class KvBoundaryAdapter:
    """Runs cached prefill/decode steps through a manager with the shard boundary contract.

    The head takes `token_ids`; other shards take `boundary` (a BoundaryBundle, or a float32
    (n_tokens, n_embd) array). A non-tail shard returns a BoundaryBundle for the next shard, the tail
    a TailOutput with the last token's logits and its greedy token; a step that cannot be served
    from cache returns a CacheMiss.
    """

    def __init__(self, model, manager: HotKvStateManager):
        if manager.model is not model:
            raise InvalidInputError("the adapter's model must be the manager's model")
        self.model = model
        self.manager = manager

    @staticmethod
    def _hidden(boundary) -> np.ndarray | None:
        if boundary is None:
            return None
        return boundary.hidden if isinstance(boundary, BoundaryBundle) else boundary

    def _finish(self, sid: str, epoch: int, r, out):
        miss = self.manager._raise_or_miss(sid, epoch, r)
        if miss is not None:
            return miss
        if self.model.info.is_tail:
            return TailOutput(session_id=sid, route_epoch=epoch, seq_len=r.seq_len, logits=out,
                              token_id=int(np.argmax(out)))
        return BoundaryBundle(session_id=sid, route_epoch=epoch, start_pos=r.seq_len - out.shape[0], hidden=out)

    def prefill(self, session_id: str, route_epoch: int, token_ids: Sequence[int] | np.ndarray | None = None,
                boundary=None, start_pos: int | None = None, recipe: KvCacheRecipe | None = None):
        """Appends a prompt chunk at start_pos (default: the cached length; 0 re-prefills from scratch)."""
        self.manager.check_recipe(recipe)
        r, out = self.manager.prefill_step(session_id, route_epoch, start_pos, token_ids, self._hidden(boundary))
        return self._finish(session_id, route_epoch, r, out)

    def decode(self, session_id: str, route_epoch: int, token_ids: Sequence[int] | np.ndarray | None = None,
               boundary=None, expected_seq_len: int | None = None, recipe: KvCacheRecipe | None = None):
        """Appends decode token(s) at the cached length; expected_seq_len must match it when given."""
        self.manager.check_recipe(recipe)
        r, out = self.manager.decode_step(session_id, route_epoch, expected_seq_len, token_ids, self._hidden(boundary))
        return self._finish(session_id, route_epoch, r, out)

