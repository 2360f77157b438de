"""HotKvStateManager and KvBoundaryAdapter: the seed contract over a Hot KV engine.

The manager is thin: it checks arguments, reads the clock, hands steps to the engine and turns the
engine's status into the contract's values and exceptions:

    OK -> SessionInfo / BoundaryBundle / TailOutput      CACHE_MISS -> CacheMiss(reason)
    STALE_EPOCH -> StaleRouteEpochError                   BUDGET_EXCEEDED -> KvBudgetExceededError

Steps always go through a queue: for a native `ShardModel`, the native `StepLoop` (continuous
batching: concurrent callers share engine steps, long prefills are chunked; callers wait without
the GIL); for the numpy `ReferenceShard`, the same rules run synchronously in `_ReferenceLoop`.
All session state lives in the engine, which serialises calls itself; the manager holds none.
"""
from __future__ import annotations

import asyncio
import os
import threading
import weakref
from collections.abc import Callable, Sequence

import numpy as np

from ._native import (DEFAULT_GATHER_S, DEFAULT_N_BATCH, DEFAULT_PREFILL_CHUNK, DEFAULT_RECENT_CAPACITY, HotKvEngine,
                      MissReason, ShardModel, Status, StepKind, StepLoop, Tier)
from .errors import (
    CapacityError,
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
    Step,
    TailOutput,
    check_count,
    check_key,
    kv_recipe_for,
    monotonic_clock,
)

_REASONS = {MissReason.__members__[r.name]: r for r in CacheMissReason}
_TIERS = {Tier.HOT: "hot", Tier.WARM: "warm", Tier.DISK: "disk", Tier.NONE: "hot"}


class HotKvStateManager:
    """The Hot KV state of one shard: (route_session_id, route_epoch) -> cached KV of the owned layers.

    Step options: `n_batch` (most tokens in one engine step), `max_step_sessions` (most sessions in
    one step; None: max_sessions), `prefill_chunk` (most tokens of one prefill per step while other
    sessions wait), `gather_s` (after a step, the longest wait for as many sessions as it had)."""

    def __init__(self, model, config: HotKvStateConfig | None = None, clock: Callable[[], float] | None = None,
                 *, n_batch: int = DEFAULT_N_BATCH, n_threads: int | None = None,
                 recent_capacity: int = DEFAULT_RECENT_CAPACITY, max_step_sessions: int | None = None,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, gather_s: float = DEFAULT_GATHER_S):
        self.config = config if config is not None else HotKvStateConfig()
        if not isinstance(self.config, HotKvStateConfig):
            raise InvalidInputError("config must be a HotKvStateConfig")
        for name, value in (("n_batch", n_batch), ("prefill_chunk", prefill_chunk), ("max_step_sessions", max_step_sessions or 1)):
            check_count(name, value)
            if value < 1:
                raise InvalidInputError(f"{name} must be >= 1")
        if not 0 <= gather_s <= 1:
            raise InvalidInputError("gather_s must be in [0, 1] seconds")
        self.clock = clock if clock is not None else monotonic_clock
        self.model = model
        c = self.config
        self.recipe: KvCacheRecipe = kv_recipe_for(model, c.kv_type)  # raises for an uncertified architecture
        if isinstance(model, ShardModel):
            self.engine = HotKvEngine(model, c.max_sessions, c.context_tokens, c.budget_tokens, float(c.ttl_seconds),
                                      n_batch, n_threads, recent_capacity, c.warm_bytes, float(c.warm_ttl_seconds), c.kv_type,
                                      c.warm_dir or "", c.warm_disk_bytes, self.recipe.fingerprint())
            self._loop = StepLoop(self.engine, 0, max_step_sessions or 0, prefill_chunk, gather_s)
        else:
            from .reference.engine import ReferenceHotKvEngine
            # the reference simulates the disk tier (same decisions and sizes, no files)
            self.engine = ReferenceHotKvEngine(model, c.max_sessions, c.context_tokens, c.budget_tokens,
                                               float(c.ttl_seconds), n_batch, recent_capacity, c.warm_bytes,
                                               float(c.warm_ttl_seconds), c.kv_type,
                                               c.warm_disk_bytes if c.warm_dir is not None else 0,
                                               self.recipe.fingerprint())
            self._loop = _ReferenceLoop(self.engine, max_step_sessions, prefill_chunk)
        self.n_batch = int(self.engine.n_batch)

    # --- outcome mapping --------------------------------------------------------------------------

    def _session(self, sid: str, epoch: int, r) -> SessionInfo:
        return SessionInfo(session_id=sid, route_epoch=epoch, seq_len=r.seq_len, seq_id=r.seq_id,
                           owned_layers=self.recipe.owned_layers, bytes_per_token=self.recipe.bytes_per_token(),
                           tier=_TIERS[r.tier])

    @staticmethod
    def outcome(sid: str, epoch: int, r) -> CacheMiss | None:
        """None for OK, the CacheMiss for a miss; raises the contract's exception for the rest."""
        status = r.status
        if status == Status.OK:
            return None
        if status == Status.CACHE_MISS:
            return CacheMiss(session_id=sid, route_epoch=epoch, reason=_REASONS[r.miss], detail=r.detail)
        if status == Status.STALE_EPOCH:
            raise StaleRouteEpochError(f"({sid!r}, {epoch}): {r.detail}", current_epoch=r.current_epoch)
        if status == Status.BUDGET_EXCEEDED:
            raise KvBudgetExceededError(f"({sid!r}, {epoch}): {r.detail}")
        if status == Status.INVALID_INPUT:
            raise InvalidInputError(r.detail)
        if status == Status.COMPUTE_ERROR:
            raise ComputeError(f"({sid!r}, {epoch}): {r.detail}")
        raise AssertionError(f"unknown engine status {status}")

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
        if r.changed:
            self._loop.session_left(session_id)
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

    def persist(self) -> int:
        """For a worker shutting down with a disk tier: writes every hot and warm session to
        warm_dir (a worker restarted on it resumes them); returns the sessions on disk. Without a
        disk tier, sessions are dropped."""
        return int(self.engine.persist(self.clock()))

    def sweep(self) -> int:
        """Evicts every session idle longer than ttl_seconds now; returns how many."""
        return int(self.engine.sweep(self.clock()))

    # --- steps --------------------------------------------------------------------------------------

    def submit(self, steps: Sequence[Step], notify_fd: int = -1) -> list:
        """Queues steps together (a micro-batch shares an engine step where the caps allow); returns
        per step a ticket to wait on, or the InvalidInputError that step raised (it was not queued).
        A ticket's `wait()` releases the GIL; `result` and `output` are read once it is done."""
        now = self.clock()
        out: list = []
        tickets = []
        for step in steps:
            try:
                if not isinstance(step, Step):
                    raise InvalidInputError(f"a step is a llama_shard.Step, not {type(step).__name__}")
                ticket = self._loop.ticket(step, now, notify_fd)
            except InvalidInputError as e:
                out.append(e)
                continue
            out.append(ticket)
            tickets.append(ticket)
        if tickets:
            self._loop.submit(tickets)
        return out

    def step_batch(self, steps: Sequence[Step]) -> list:
        """Runs steps together and waits: per step (engine result, output or None), or the
        InvalidInputError it raised."""
        answers = []
        for t in self.submit(steps):
            if isinstance(t, LlamaShardError):
                answers.append(t)
            else:
                t.wait()
                answers.append((t.result, t.output))
        return answers

    def loop_stats(self) -> dict:
        """The step loop's counters: steps, requests, chunks, tokens, busy_seconds, pending."""
        return dict(self._loop.stats())

    def close(self) -> None:
        """Completes every queued step, then stops the step loop (steps after this are refused)."""
        self._loop.close()

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
        """Cached (route_session_id, route_epoch) keys: hot ones least recently used first, then warm ones."""
        return [(sid, int(epoch)) for sid, epoch, *_ in self.engine.sessions()]

    def sessions(self) -> list[tuple[str, int, int, int, float, str]]:
        """Cached sessions as (session_id, epoch, seq_id, seq_len, last_used, tier): the hot ones
        least recently used first, then the warm ones (tier "warm" or "disk", seq_id -1)."""
        return list(self.engine.sessions())

    def stats(self) -> dict:
        """The engine's counters, among them live_sessions, reserved_tokens, evictions_*, misses
        (by reason) and the warm tier's spills, restores, warm_drops, warm_sessions, warm_bytes."""
        return dict(self.engine.stats())

    def check_invariants(self) -> None:
        self.engine.check_invariants()


class _ReferenceTicket:
    """A reference-engine step: the StepTicket interface, completed during submission."""

    def __init__(self, step: Step, now: float):
        self.step, self.now = step, now
        self.offset, self.start, self.outs = 0, -1, []
        self.result = self.output = None
        self.finished = self.submitted = self.deferred = False

    def finish(self, result, output=None) -> None:
        self.result, self.output, self.finished = result, output, True

    def done(self) -> bool:
        return self.finished

    def wait(self, timeout: float | None = None) -> bool:
        return self.finished


class _ReferenceLoop:
    """The native StepLoop's rules for the numpy reference engine, run synchronously at submission:
    one request per session per step in submission order, at most max_step_sessions sessions and
    n_batch tokens per step, prefills cut into chunks (prefill_chunk while other sessions wait), a
    refused later chunk truncated back, a prefill that cannot fit even alone refused up front."""

    def __init__(self, engine, max_step_sessions: int | None, prefill_chunk: int):
        self.engine = engine
        self.max_step_tokens = engine.n_batch
        self.max_step_sessions = min(max_step_sessions or engine.max_sessions, engine.max_sessions)
        self.prefill_chunk = min(prefill_chunk, engine.n_batch)
        self._lock = threading.Lock()
        self._closed = False
        self._stats = {"steps": 0, "requests": 0, "chunks": 0, "tokens": 0, "busy_seconds": 0.0, "pending": 0}

    def ticket(self, step: Step, now: float, notify_fd: int = -1) -> _ReferenceTicket:
        self.engine.validate_step(step)
        return _ReferenceTicket(step, now)

    def submit(self, tickets: list) -> None:
        from .reference.engine import StepResult

        if self._closed:
            raise CapacityError("the step loop is closed")
        if len({id(t) for t in tickets}) != len(tickets) or any(t.submitted for t in tickets):
            raise InvalidInputError("a ticket is submitted once")
        for t in tickets:
            t.submitted = True
        e = self.engine
        for t in tickets:
            end = max(t.step.position, 0) + t.step.n_tokens
            if t.step.kind == StepKind.PREFILL and (end > e.context_tokens or end > e.budget_tokens):
                t.finish(StepResult(status=Status.BUDGET_EXCEEDED, detail=f"{t.step.n_tokens} tokens exceed "
                                    f"context_tokens {e.context_tokens} or budget_tokens {e.budget_tokens}"))
        with self._lock:
            pending = [t for t in tickets if not t.finished]
            while pending:
                self._run(self._form(pending))
                pending = [t for t in pending if not t.finished]

    def _form(self, pending: list) -> list:
        heads, seen = [], set()  # each session's oldest pending request
        for t in pending:
            if t.step.session_id not in seen:
                seen.add(t.step.session_id)
                heads.append(t)
        others_waiting = len(heads) > 1
        parts, room = [], self.max_step_tokens
        # deferred (BUSY) first, then decodes, whole; then prefills
        for deferred, kind in ((True, None), (False, StepKind.DECODE), (False, StepKind.PREFILL)):
            for t in heads:
                if len(parts) >= self.max_step_sessions or room == 0:
                    return parts
                if t.deferred != deferred or (kind is not None and t.step.kind != kind):
                    continue
                left = t.step.n_tokens - t.offset
                if t.step.kind == StepKind.PREFILL:
                    n = min(left, min(self.prefill_chunk, room) if others_waiting else room)
                elif left > room:
                    continue
                else:
                    n = left
                parts.append((t, n))
                room -= n
        return parts

    def _run(self, parts: list) -> None:
        now, requests = max(t.now for t, _ in parts), []
        for t, n in parts:
            step, k = t.step, t.offset
            data = step.token_ids if step.token_ids is not None else step.hidden
            chunk = data[k:k + n]
            position = step.position if k == 0 else t.start + k
            requests.append(Step(step.kind, step.session_id, step.route_epoch,
                                 chunk if step.token_ids is not None else None,
                                 np.ascontiguousarray(chunk) if step.hidden is not None else None,
                                 start_pos=position if step.kind == StepKind.PREFILL and position >= 0 else None,
                                 expected_seq_len=position if step.kind == StepKind.DECODE and position >= 0 else None))
        answers = self.engine.step(requests, now)
        self._stats["steps"] += 1
        for (t, n), (r, out) in zip(parts, answers):
            step = t.step
            self._stats["chunks"] += 1
            self._stats["tokens"] += n
            t.deferred = r.status == Status.BUSY
            if t.deferred:
                continue  # stays pending; the next step takes it first
            if r.status == Status.OK:
                if t.offset == 0:
                    t.start = r.seq_len - n
                t.offset += n
                t.outs.append(out)
                if t.offset < step.n_tokens:
                    continue
                t.finish(r, np.concatenate(t.outs) if out.ndim == 2 and len(t.outs) > 1 else out)
            else:
                if t.offset > 0 and r.status not in (Status.CACHE_MISS, Status.STALE_EPOCH):
                    held = self.engine.resolve(step.session_id, step.route_epoch, now)
                    if held.status == Status.OK and held.seq_len >= t.start:
                        self.engine.truncate(step.session_id, step.route_epoch, t.start, now)
                        r.seq_len = t.start
                t.finish(r)
            self._stats["requests"] += 1

    def stats(self) -> dict:
        return dict(self._stats)

    def session_left(self, session_id: str) -> None:
        pass

    def close(self) -> None:
        self._closed = True


# ---------------------------------------------------------------------------------------------
# asyncio: completions arrive as bytes on a pipe the event loop watches (no thread per request)
# ---------------------------------------------------------------------------------------------


class _AsyncCompletions:
    """One per event loop: the native loop writes a byte to `fd` when a ticket completes; the event
    loop wakes, and every awaited ticket that is done gets its future resolved."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        _close_retired_pipes()
        self.loop = loop
        self._read, self.fd = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self.fd, False)
        self._waiting: dict = {}
        loop.add_reader(self._read, self._drain)
        weakref.finalize(loop, _retire_pipe, self._read, self.fd, self._waiting)

    def wait(self, ticket) -> asyncio.Future:
        fut = self.loop.create_future()
        if ticket.done():
            fut.set_result(None)
        else:
            self._waiting[ticket] = fut
        return fut

    def _drain(self) -> None:
        try:
            while os.read(self._read, 4096):
                pass
        except BlockingIOError:
            pass
        for ticket in [t for t in self._waiting if t.done()]:
            fut = self._waiting.pop(ticket)
            if not fut.done():
                fut.set_result(None)


# A pipe is closed only once no ticket can still write to it: a ticket completes in the native
# thread after its event loop may be gone, and a byte written to a closed (then reused) fd number
# would land in someone else's file.
_RETIRED: list[tuple[int, int, list]] = []


def _retire_pipe(read_fd: int, write_fd: int, waiting: dict) -> None:
    _RETIRED.append((read_fd, write_fd, list(waiting)))
    _close_retired_pipes()


def _close_retired_pipes() -> None:
    for entry in list(_RETIRED):
        read_fd, write_fd, tickets = entry
        if all(t.done() for t in tickets):
            _RETIRED.remove(entry)
            for fd in (read_fd, write_fd):
                try:
                    os.close(fd)
                except OSError:
                    pass


_COMPLETIONS: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _AsyncCompletions]" = weakref.WeakKeyDictionary()


def _completions() -> _AsyncCompletions:
    loop = asyncio.get_running_loop()
    c = _COMPLETIONS.get(loop)
    if c is None:
        c = _COMPLETIONS[loop] = _AsyncCompletions(loop)
    return c


class KvBoundaryAdapter:
    """Runs cached prefill/decode steps through a manager with the shard boundary contract.

    The head takes `token_ids`; other shards take `boundary` (a BoundaryBundle, or a float32
    (n_tokens, n_embd) array). A non-tail shard returns a BoundaryBundle for the next shard, the tail
    a TailOutput with the last token's logits and its greedy token; a step that cannot be served
    from cache returns a CacheMiss.

    Concurrent callers are batched: every step goes to the manager's step loop, which runs the
    steps of different sessions that are pending together in one engine step (continuous
    batching) and cuts long prefills into chunks. A lone caller pays no wait. Threads wait without
    the GIL; `prefill_async` / `decode_async` / `step_many_async` await the same steps from asyncio.
    """

    def __init__(self, model, manager: HotKvStateManager):
        if manager.model is not model:
            raise InvalidInputError("the adapter's model must be the manager's model")
        self.model = model
        self.manager = manager
        self._is_tail = bool(model.info.is_tail)

    @staticmethod
    def _hidden(boundary) -> np.ndarray | None:
        if boundary is None:
            return None
        return boundary.hidden if isinstance(boundary, BoundaryBundle) else boundary

    def finish(self, step: Step, r, out):
        """The contract's value for a completed step: TailOutput / BoundaryBundle / CacheMiss (or raises)."""
        sid, epoch = step.session_id, step.route_epoch
        miss = self.manager.outcome(sid, epoch, r)
        if miss is not None:
            return miss
        if self._is_tail:
            return TailOutput(session_id=sid, route_epoch=epoch, seq_len=r.seq_len, logits=out,
                              token_id=int(np.argmax(out)))
        return BoundaryBundle(session_id=sid, route_epoch=epoch, start_pos=r.seq_len - out.shape[0], hidden=out)

    def _answer(self, step, ticket):
        if isinstance(ticket, LlamaShardError):
            return ticket
        try:
            return self.finish(step, ticket.result, ticket.output)
        except LlamaShardError as e:
            return e

    # --- public API -------------------------------------------------------------------------------

    def prefill(self, session_id: str, route_epoch: int, token_ids: Sequence[int] | np.ndarray | None = None,
                boundary=None, start_pos: int | None = None, recipe: KvCacheRecipe | None = None):
        """Appends a prompt chunk at start_pos (default: the cached length; 0 re-prefills from scratch)."""
        self.manager.check_recipe(recipe)
        return self._one(Step.prefill(session_id, route_epoch, token_ids, self._hidden(boundary), start_pos))

    def decode(self, session_id: str, route_epoch: int, token_ids: Sequence[int] | np.ndarray | None = None,
               boundary=None, expected_seq_len: int | None = None, recipe: KvCacheRecipe | None = None):
        """Appends decode token(s) at the cached length; expected_seq_len must match it when given."""
        self.manager.check_recipe(recipe)
        return self._one(Step.decode(session_id, route_epoch, token_ids, self._hidden(boundary), expected_seq_len))

    def _one(self, step: Step):
        ticket, = self.manager.submit([step])
        if isinstance(ticket, LlamaShardError):
            raise ticket
        ticket.wait()
        return self.finish(step, ticket.result, ticket.output)

    def _submit_micro_batch(self, steps: Sequence[Step], notify_fd: int = -1) -> list:
        """Queues a micro-batch: one step per session (a repeated session's later step is refused)."""
        seen, valid, tickets = set(), [], [None] * len(steps)
        for i, step in enumerate(steps):
            sid = getattr(step, "session_id", None)
            if isinstance(sid, str) and sid in seen:
                tickets[i] = InvalidInputError(f"session {sid!r} has more than one step in this batch")
                continue
            seen.add(sid)
            valid.append(i)
        for i, t in zip(valid, self.manager.submit([steps[i] for i in valid], notify_fd)):
            tickets[i] = t
        return tickets

    def step_many(self, steps: Sequence[Step]) -> list:
        """Several sessions' steps queued together (a micro-batch, one step per session); returns,
        in order, what `prefill`/`decode` would have returned for each, or the LlamaShardError it
        would have raised."""
        tickets = self._submit_micro_batch(steps)
        for t in tickets:
            if not isinstance(t, LlamaShardError):
                t.wait()
        return [self._answer(step, t) for step, t in zip(steps, tickets)]

    # --- asyncio ----------------------------------------------------------------------------------

    async def step_many_async(self, steps: Sequence[Step]) -> list:
        """`step_many` for asyncio callers: the event loop is never blocked, and no thread waits."""
        completions = _completions()
        tickets = self._submit_micro_batch(steps, completions.fd)
        # every ticket is tracked before the first await: a cancelled caller leaves none untracked,
        # so the pipe is not closed while a queued ticket can still write to it
        waits = [completions.wait(t) for t in tickets if not isinstance(t, LlamaShardError)]
        for w in waits:
            await w
        return [self._answer(step, t) for step, t in zip(steps, tickets)]

    async def _one_async(self, step: Step):
        out, = await self.step_many_async([step])
        if isinstance(out, LlamaShardError):
            raise out
        return out

    async def prefill_async(self, session_id: str, route_epoch: int, token_ids=None, boundary=None,
                            start_pos: int | None = None, recipe: KvCacheRecipe | None = None):
        """`prefill` for asyncio callers."""
        self.manager.check_recipe(recipe)
        return await self._one_async(Step.prefill(session_id, route_epoch, token_ids, self._hidden(boundary), start_pos))

    async def decode_async(self, session_id: str, route_epoch: int, token_ids=None, boundary=None,
                           expected_seq_len: int | None = None, recipe: KvCacheRecipe | None = None):
        """`decode` for asyncio callers."""
        self.manager.check_recipe(recipe)
        return await self._one_async(Step.decode(session_id, route_epoch, token_ids, self._hidden(boundary),
                                                 expected_seq_len))
