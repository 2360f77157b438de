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
from .errors import (
    ComputeError,
    IncompatibleCacheRecipeError,
    InvalidInputError,
    KvBudgetExceededError,
    KvCacheMissError,
    LlamaShardError,
    StaleRouteEpochError,
)
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
    def outcome(sid: str, epoch: int, r) -> CacheMiss | None:
        """None for OK, the CacheMiss for a miss; raises the contract's exception for the rest."""
        if r.status == "OK":
            return None
        if r.status == "CACHE_MISS":
            return CacheMiss(session_id=sid, route_epoch=epoch, reason=_REASONS[r.miss], detail=r.detail)
        if r.status == "STALE_EPOCH":
            raise StaleRouteEpochError(f"({sid!r}, {epoch}): {r.detail}", current_epoch=r.current_epoch)
        if r.status == "BUDGET_EXCEEDED":
            raise KvBudgetExceededError(f"({sid!r}, {epoch}): {r.detail}")
        if r.status == "INVALID_INPUT":
            raise InvalidInputError(r.detail)
        if r.status == "COMPUTE_ERROR":
            raise ComputeError(f"({sid!r}, {epoch}): {r.detail}")
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
        self.outcome(session_id, route_epoch, r)
        return self._session(session_id, route_epoch, r)

    def truncate(self, session_id: str, route_epoch: int, length: int) -> SessionInfo | CacheMiss:
        check_key(session_id, route_epoch)
        check_count("length", length)
        r = self.engine.truncate(session_id, int(route_epoch), int(length), self.clock())
        return self.outcome(session_id, route_epoch, r) or self._session(session_id, route_epoch, r)

    def release(self, session_id: str, route_epoch: int) -> bool:
        """Releases exactly this epoch's state; True if something was released."""
        check_key(session_id, route_epoch)
        r = self.engine.release(session_id, int(route_epoch), self.clock())
        self.outcome(session_id, route_epoch, r)
        return bool(r.changed)

    def resolve(self, session_id: str, route_epoch: int) -> SessionInfo | CacheMiss:
        check_key(session_id, route_epoch)
        r = self.engine.resolve(session_id, int(route_epoch), self.clock())
        return self.outcome(session_id, route_epoch, r) or self._session(session_id, route_epoch, r)

    def get(self, session_id: str, route_epoch: int) -> SessionInfo:
        out = self.resolve(session_id, route_epoch)
        if isinstance(out, CacheMiss):
            raise KvCacheMissError(out)
        return out

    def sweep(self) -> int:
        """Evicts every session idle longer than ttl_seconds now; returns how many."""
        return int(self.engine.sweep(self.clock()))

    # --- steps (used by KvBoundaryAdapter and StepScheduler) --------------------------------------

    def step_batch(self, requests: Sequence[tuple]) -> list[tuple]:
        """One batched engine step. requests: (session_id, epoch, "prefill" | "decode", position,
        tokens, hidden) with position = start_pos (prefill) or expected_seq_len (decode), -1 for
        none; returns one (engine result, output or None) per request, each answered on its own."""
        return self.engine.step(list(requests), self.clock())

    @property
    def n_decode_calls(self) -> int:
        """llama_decode calls the engine made (batched steps make fewer than tokens computed)."""
        return int(self.engine.n_decode_calls)

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

    With a `StepScheduler`, concurrent callers' steps are batched together (continuous batching) and
    prefills are cut into the scheduler's prefill_chunk pieces; without one, every call is its own
    engine step. `prefill_async` / `decode_async` await the same steps from asyncio.
    """

    def __init__(self, model, manager: HotKvStateManager, scheduler=None):
        if manager.model is not model:
            raise InvalidInputError("the adapter's model must be the manager's model")
        if scheduler is not None and scheduler.manager is not manager:
            raise InvalidInputError("the scheduler must drive this adapter's manager")
        self.model = model
        self.manager = manager
        self.scheduler = scheduler

    @staticmethod
    def _hidden(boundary) -> np.ndarray | None:
        if boundary is None:
            return None
        return boundary.hidden if isinstance(boundary, BoundaryBundle) else boundary

    def _finish(self, sid: str, epoch: int, r, out):
        miss = self.manager.outcome(sid, epoch, r)
        if miss is not None:
            return miss
        if self.model.info.is_tail:
            return TailOutput(session_id=sid, route_epoch=epoch, seq_len=r.seq_len, logits=out,
                              token_id=int(np.argmax(out)))
        return BoundaryBundle(session_id=sid, route_epoch=epoch, start_pos=r.seq_len - out.shape[0], hidden=out)

    # --- the requests a step is made of -----------------------------------------------------------

    def _prefill_requests(self, session_id, route_epoch, token_ids, boundary, start_pos):
        """The prefill as (request, n_rows) chunks: one without a scheduler, prefill_chunk-sized with one."""
        check_key(session_id, route_epoch)
        if start_pos is not None:
            check_count("start_pos", start_pos)
        hidden = self._hidden(boundary)
        chunk = self.scheduler.prefill_chunk if self.scheduler is not None else None
        data = token_ids if token_ids is not None else hidden
        n = len(data) if data is not None and hasattr(data, "__len__") else 0
        first = -1 if start_pos is None else int(start_pos)
        if chunk is None or n <= chunk or (token_ids is not None and hidden is not None):
            return [(session_id, int(route_epoch), "prefill", first, token_ids, hidden)]
        pieces = []
        for k in range(0, n, chunk):
            part = data[k:k + chunk]
            if hidden is not None:
                part = np.ascontiguousarray(part) if isinstance(part, np.ndarray) else part
            pos = first if k == 0 else -1
            pieces.append((session_id, int(route_epoch), "prefill", pos,
                           part if token_ids is not None else None, part if hidden is not None else None))
        return pieces

    def _decode_request(self, session_id, route_epoch, token_ids, boundary, expected_seq_len):
        check_key(session_id, route_epoch)
        if expected_seq_len is not None:
            check_count("expected_seq_len", expected_seq_len)
        return (session_id, int(route_epoch), "decode", -1 if expected_seq_len is None else int(expected_seq_len),
                token_ids, self._hidden(boundary))

    def _combine(self, sid, epoch, answers):
        """Maps chunk answers to one outcome; hidden rows of every chunk are concatenated."""
        outs = []
        for r, out in answers:
            result = self._finish(sid, epoch, r, out)
            if isinstance(result, CacheMiss):
                return result
            outs.append(result)
        if len(outs) == 1 or self.model.info.is_tail:
            return outs[-1]
        return BoundaryBundle(session_id=sid, route_epoch=epoch, start_pos=outs[0].start_pos,
                              hidden=np.concatenate([o.hidden for o in outs]))

    # --- public API -------------------------------------------------------------------------------

    def prefill(self, session_id: str, route_epoch: int, token_ids: Sequence[int] | np.ndarray | None = None,
                boundary=None, start_pos: int | None = None, recipe: KvCacheRecipe | None = None):
        """Appends a prompt chunk at start_pos (default: the cached length; 0 re-prefills from scratch)."""
        self.manager.check_recipe(recipe)
        return self._one(("prefill", session_id, route_epoch, token_ids, boundary, start_pos))

    def decode(self, session_id: str, route_epoch: int, token_ids: Sequence[int] | np.ndarray | None = None,
               boundary=None, expected_seq_len: int | None = None, recipe: KvCacheRecipe | None = None):
        """Appends decode token(s) at the cached length; expected_seq_len must match it when given."""
        self.manager.check_recipe(recipe)
        return self._one(("decode", session_id, route_epoch, token_ids, boundary, expected_seq_len))

    def _one(self, step: tuple):
        out, = self.step_many([step])
        if isinstance(out, LlamaShardError):
            raise out
        return out

    def step_many(self, steps: Sequence[tuple]) -> list:
        """Several sessions' steps run together (a micro-batch): each step is
        (kind, session_id, route_epoch, token_ids, boundary, position) with kind "prefill" (position:
        start_pos) or "decode" (position: expected_seq_len), position None for none. With a scheduler
        the steps share batched engine steps (prefills chunk by chunk); returns, in order, what
        `prefill`/`decode` would have returned for each, or the LlamaShardError it would have raised."""
        n = len(steps)
        results: list = [None] * n
        chunks: list[list[tuple]] = [[] for _ in range(n)]
        seen: set = set()
        for i, step in enumerate(steps):
            try:
                if not isinstance(step, tuple) or len(step) != 6:
                    raise InvalidInputError("a step is (kind, session_id, route_epoch, token_ids, boundary, position)")
                kind, sid, epoch, tokens, boundary, position = step
                if isinstance(sid, str):
                    if sid in seen:
                        raise InvalidInputError(f"session {sid!r} has more than one step in this batch")
                    seen.add(sid)
                if kind == "prefill":
                    chunks[i] = self._prefill_requests(sid, epoch, tokens, boundary, position)
                elif kind == "decode":
                    chunks[i] = [self._decode_request(sid, epoch, tokens, boundary, position)]
                else:
                    raise InvalidInputError(f"a step is 'prefill' or 'decode', not {kind!r}")
            except LlamaShardError as e:
                results[i] = e
        answers: list[list] = [[] for _ in range(n)]
        for k in range(max((len(c) for c in chunks), default=0)):
            # the k-th chunk of every step still going; a step stops at its first answer that is not OK
            active = [i for i in range(n) if results[i] is None and k < len(chunks[i])
                      and (not answers[i] or answers[i][-1][0].status == "OK")]
            if not active:
                break
            requests = [chunks[i][k] for i in active]
            if self.scheduler is None:
                got = self.manager.step_batch(requests)
            else:
                # a lone step coalesces with other callers' (window); a micro-batch starts at once
                futures = (self.scheduler.submit_many(requests) if len(requests) > 1
                           else [self.scheduler.submit(*requests[0])])
                got = []
                for fut in futures:
                    try:
                        got.append(fut.result())
                    except LlamaShardError as e:
                        got.append(e)
            for i, answer in zip(active, got):
                if isinstance(answer, LlamaShardError):
                    results[i] = answer
                else:
                    answers[i].append(answer)
        for i, step in enumerate(steps):
            if results[i] is None:
                try:
                    results[i] = self._combine(step[1], step[2], answers[i])
                except LlamaShardError as e:
                    results[i] = e
        return results

    async def prefill_async(self, session_id: str, route_epoch: int, token_ids=None, boundary=None,
                            start_pos: int | None = None, recipe: KvCacheRecipe | None = None):
        """`prefill` for asyncio callers: needs a scheduler; the event loop is never blocked."""
        import asyncio

        self._require_scheduler()
        self.manager.check_recipe(recipe)
        answers = []
        for req in self._prefill_requests(session_id, route_epoch, token_ids, boundary, start_pos):
            answers.append(await asyncio.wrap_future(self.scheduler.submit(*req)))
            if answers[-1][0].status != "OK":
                break
        return self._combine(session_id, route_epoch, answers)

    async def decode_async(self, session_id: str, route_epoch: int, token_ids=None, boundary=None,
                           expected_seq_len: int | None = None, recipe: KvCacheRecipe | None = None):
        """`decode` for asyncio callers: needs a scheduler; the event loop is never blocked."""
        import asyncio

        self._require_scheduler()
        self.manager.check_recipe(recipe)
        req = self._decode_request(session_id, route_epoch, token_ids, boundary, expected_seq_len)
        r, out = await asyncio.wrap_future(self.scheduler.submit(*req))
        return self._finish(session_id, route_epoch, r, out)

    def _require_scheduler(self):
        if self.scheduler is None:
            raise InvalidInputError("the async API needs a StepScheduler (KvBoundaryAdapter(model, manager, scheduler))")
