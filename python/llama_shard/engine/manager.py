"""HotKvStateManager: the seed contract's session operations over a Hot KV engine (the adapter,
adapter.py, runs steps through it).

The manager is thin: it checks arguments, reads the clock, hands steps to the engine and turns the
engine's status into the contract's values and exceptions:

    OK -> SessionInfo / BoundaryBundle / TailOutput      CACHE_MISS -> CacheMiss(reason)
    STALE_EPOCH -> StaleRouteEpochError                   BUDGET_EXCEEDED -> KvBudgetExceededError

Steps always go through a queue: for a native `ShardModel`, the native `StepLoop` (continuous
batching: concurrent callers share engine steps, long prefills are chunked; callers wait without
the GIL); for the numpy `ReferenceShard`, the same rules run synchronously in the engine and step loop the shard brings
(`ReferenceShard.hot_kv_engine`: this package never imports the reference).
All session state lives in the engine, which serialises calls itself; the manager holds none.
"""

from __future__ import annotations

import functools
import os
import struct
from collections.abc import Callable, Sequence

from .._native import (
    DEFAULT_GATHER_S,
    DEFAULT_PREFILL_CHUNK,
    HotKvConfig,
    HotKvEngine,
    MissReason,
    ShardModel,
    Status,
    StepLoop,
)
from ..errors import (
    ComputeError,
    IncompatibleCacheRecipeError,
    InvalidInputError,
    KvBudgetExceededError,
    KvCacheMissError,
    LlamaShardError,
    StaleRouteEpochError,
)
from .hot_kv import (
    CacheMiss,
    CacheMissReason,
    HotKvStateConfig,
    SessionInfo,
    SessionRecord,
    Step,
    check_count,
    check_key,
    monotonic_clock,
)
from .recipe import KvCacheRecipe, kv_recipe_for

_REASONS = {MissReason.__members__[r.name]: r for r in CacheMissReason}
_ENGINE_DEFAULTS = HotKvConfig()


# A hand-over's bytes (export_session / import_session): a header naming what they were made by,
# then the engine's state of the session (native: llama.cpp's sequence state of the owned layers;
# the reference: its own arrays). The state carries no identity of its own (another layer range of
# the same shape restores without an error), so the receiver checks the header first:
#   magic "LSHO", u32 version, u8 engine (0 native, 1 reference), u16-prefixed recipe fingerprint
#   (architecture, KV type, geometry, owned range, total layers), u16-prefixed model digest (the
#   model file's size and XXH3-128, as the disk tier's files), u32 seq_len, u64 state bytes.
_HANDOVER_MAGIC = b"LSHO"
_HANDOVER_VERSION = 1
_HANDOVER_HEAD = struct.Struct("<4sIB")
_HANDOVER_TAIL = struct.Struct("<IQ")


@functools.lru_cache(maxsize=16)
def _model_identity(path: str, size: int, mtime_ns: int) -> str:
    """The model digest a hand-over names (one read of the file, once per file version; a range
    file's is its source's)."""
    from .range_file import content_digest

    return content_digest(path)


def _check_prefix(key, length) -> None:
    if isinstance(key, bool) or not isinstance(key, int) or not 0 <= key < 1 << 64:
        raise InvalidInputError(f"a prefix key is an unsigned 64-bit integer, got {key!r}")
    check_count("length", length)
    if length < 1:
        raise InvalidInputError(f"a prefix holds at least 1 token, got {length}")


class HotKvStateManager:
    """The Hot KV state of one shard: (route_session_id, route_epoch) -> cached KV of the owned layers.

    Step options: `n_batch` (most tokens in one engine step), `max_step_sessions` (most sessions in
    one step; None: max_sessions), `prefill_chunk` (most tokens of one prefill per step while other
    sessions wait), `gather_s` (after a step, the longest wait for as many sessions as it had)."""

    def __init__(
        self,
        model,
        config: HotKvStateConfig | None = None,
        clock: Callable[[], float] | None = None,
        *,
        n_batch: int = _ENGINE_DEFAULTS.n_batch,
        n_threads: int | None = None,
        recent_capacity: int = _ENGINE_DEFAULTS.recent_capacity,
        max_step_sessions: int | None = None,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        gather_s: float = DEFAULT_GATHER_S,
    ):
        self.config = config if config is not None else HotKvStateConfig()
        if not isinstance(self.config, HotKvStateConfig):
            raise InvalidInputError("config must be a HotKvStateConfig")
        for name, value in (
            ("n_batch", n_batch),
            ("prefill_chunk", prefill_chunk),
            ("max_step_sessions", max_step_sessions or 1),
        ):
            check_count(name, value)
            if value < 1:
                raise InvalidInputError(f"{name} must be >= 1")
        if not 0 <= gather_s <= 1:
            raise InvalidInputError("gather_s must be in [0, 1] seconds")
        self.clock = clock if clock is not None else monotonic_clock
        self.model = model
        self.recipe: KvCacheRecipe = kv_recipe_for(
            model, self.config.kv_type, self.config.flash_attn
        )  # raises for an uncertified architecture
        # the one configuration both engines take
        engine_config = self.config.engine_config(
            n_batch=n_batch,
            n_threads=n_threads,
            recent_capacity=recent_capacity,
            recipe_fingerprint=self.recipe.fingerprint(),
        )
        if isinstance(model, ShardModel):
            self.engine = HotKvEngine(model, engine_config)
            self._loop = StepLoop(self.engine, 0, max_step_sessions or 0, prefill_chunk, gather_s)
        elif hasattr(model, "hot_kv_engine"):  # another engine comes with its model (the numpy reference's)
            self.engine, self._loop = model.hot_kv_engine(engine_config, max_step_sessions, prefill_chunk)
        else:
            raise InvalidInputError(
                f"a HotKvStateManager runs a ShardModel or a model that brings its engine "
                f"(hot_kv_engine), not {type(model).__name__}"
            )
        self.n_batch = int(self.engine.n_batch)

    # --- outcome mapping --------------------------------------------------------------------------

    def _session(self, sid: str, epoch: int, r) -> SessionInfo:
        return SessionInfo(
            session_id=sid,
            route_epoch=epoch,
            seq_len=r.seq_len,
            seq_id=r.seq_id,
            owned_layers=self.recipe.owned_layers,
            bytes_per_token=self.recipe.bytes_per_token(),
            tier=r.tier,
        )

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
                f"request recipe {recipe.canonical()} does not match this shard's {self.recipe.canonical()}"
            )

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

    # --- the prefix store -------------------------------------------------------------------------

    def store_prefix(self, session_id: str, route_epoch: int, key: int, length: int) -> bool:
        """Copies the hot session, which holds exactly `length` tokens, into the prefix store under
        `key` (a caller's 64-bit name for those tokens: `serve.prefixes` makes them); True when
        stored, False when the key is held already, the store is off or too small, or the session is
        warm or gone (nothing changes then)."""
        check_key(session_id, route_epoch)
        _check_prefix(key, length)
        r = self.engine.store_prefix(session_id, int(route_epoch), int(key), int(length), self.clock())
        if r.status == Status.CACHE_MISS:
            return False
        self.outcome(session_id, route_epoch, r)  # a stale epoch raises
        return bool(r.changed)

    def open_prefix(self, session_id: str, route_epoch: int, key: int, length: int) -> SessionInfo | CacheMiss:
        """Makes the session hold a copy of the prefix stored under `key` (`length` tokens), whatever
        it held; a PREFIX_EVICTED miss, nothing changed, when this shard does not hold it."""
        check_key(session_id, route_epoch)
        _check_prefix(key, length)
        r = self.engine.open_prefix(session_id, int(route_epoch), int(key), int(length), self.clock())
        return self.outcome(session_id, route_epoch, r) or self._session(session_id, route_epoch, r)

    def prefix_length(self, key: int) -> int:
        """The length of the prefix stored under `key`; 0 when none."""
        _check_prefix(key, 1)
        return int(self.engine.prefix_length(int(key)))

    # --- hand-over (a draining worker's sessions to a replica of the same shard) --------------------

    def export_session(self, session_id: str, route_epoch: int) -> tuple[SessionInfo, bytes] | CacheMiss:
        """The session's KV as bytes for `import_session` on a replica (same model, range and
        recipe; any limits), with where it is here. Nothing moves: a warm session is copied from
        its tier. A session not held is the CacheMiss resolve gives; an older epoch raises
        StaleRouteEpochError. An empty session (seq_len 0) has no KV: the receiver opens it."""
        check_key(session_id, route_epoch)
        r, state = self.engine.export_session(session_id, int(route_epoch), self.clock())
        miss = self.outcome(session_id, route_epoch, r)
        if miss is not None:
            return miss
        return self._session(session_id, route_epoch, r), self._seal(int(r.seq_len), state)

    def import_session(self, session_id: str, route_epoch: int, seq_len: int, state: bytes) -> SessionInfo:
        """Makes (session_id, route_epoch) hold the exported session `state` of seq_len tokens, hot:
        what it held at that epoch is replaced, an older epoch superseded. Raises, with nothing
        changed: IncompatibleCacheRecipeError (bytes of another recipe, range or model),
        InvalidInputError (not an export of seq_len tokens, or bytes the engine refuses),
        KvBudgetExceededError (seq_len over context_tokens or budget_tokens), StaleRouteEpochError
        (a newer epoch is held). Other sessions may leave the hot set to make room."""
        check_key(session_id, route_epoch)
        check_count("seq_len", seq_len)
        if seq_len < 1:
            raise InvalidInputError("an imported session holds at least 1 token (open an empty one instead)")
        if not isinstance(state, (bytes, bytearray)):
            raise InvalidInputError(f"state must be bytes, got {type(state).__name__}")
        payload = self._unseal(int(seq_len), bytes(state))
        r = self.engine.import_session(session_id, int(route_epoch), int(seq_len), payload, self.clock())
        miss = self.outcome(session_id, route_epoch, r)
        if miss is not None:  # the engines answer none (a guard)
            raise KvCacheMissError(miss)
        return self._session(session_id, route_epoch, r)

    def model_digest(self) -> str:
        """The model file's size and XXH3-128 ('' for a model without a file; a range file names its
        source's): what replicas of a shard must share (one read of the file, once per file version)."""
        path = getattr(self.model, "path", None) or getattr(getattr(self.model, "model", None), "path", None)
        if path is None:
            return ""
        st = os.stat(path)
        return _model_identity(str(path), st.st_size, st.st_mtime_ns)

    def _handover_identity(self) -> tuple[int, bytes, bytes]:
        """(engine kind, recipe fingerprint, model digest) a hand-over's header carries."""
        return (
            (0 if isinstance(self.model, ShardModel) else 1),
            self.recipe.fingerprint().encode(),
            self.model_digest().encode(),
        )

    def _handover_limit(self) -> int:
        """The most state bytes a session of this shard can take: twice its K/V at context_tokens, and 1 MiB."""
        return self.recipe.bytes_per_token() * self.config.context_tokens * 2 + (1 << 20)

    def _seal(self, seq_len: int, state: bytes) -> bytes:
        engine, recipe, model = self._handover_identity()
        return b"".join(
            [
                _HANDOVER_HEAD.pack(_HANDOVER_MAGIC, _HANDOVER_VERSION, engine),
                struct.pack("<H", len(recipe)),
                recipe,
                struct.pack("<H", len(model)),
                model,
                _HANDOVER_TAIL.pack(seq_len, len(state)),
                state,
            ]
        )

    def _unseal(self, seq_len: int, blob: bytes) -> bytes:
        """The state inside a hand-over's bytes, once its header names this shard and seq_len."""
        if len(blob) > self._handover_limit() + 1024:
            raise InvalidInputError(
                f"a hand-over of {len(blob)} bytes is larger than any session of this shard "
                f"({self._handover_limit()} bytes at most)"
            )
        engine, recipe, model = self._handover_identity()
        try:
            magic, version, their_engine = _HANDOVER_HEAD.unpack_from(blob, 0)
            at = _HANDOVER_HEAD.size
            fields = []
            for _ in range(2):
                (n,) = struct.unpack_from("<H", blob, at)
                fields.append(blob[at + 2 : at + 2 + n])
                at += 2 + n
            their_len, size = _HANDOVER_TAIL.unpack_from(blob, at)
            at += _HANDOVER_TAIL.size
        except struct.error:
            raise InvalidInputError("not a session hand-over (truncated header)") from None
        if magic != _HANDOVER_MAGIC or version != _HANDOVER_VERSION:
            raise InvalidInputError("not a session hand-over (or another version of one)")
        if their_engine != engine:
            raise IncompatibleCacheRecipeError("the hand-over is another engine's state (native and reference differ)")
        if fields[0] != recipe:
            raise IncompatibleCacheRecipeError(
                f"the hand-over is of another KV recipe (range, geometry or KV type); "
                f"this shard's is {self.recipe.canonical()}"
            )
        if fields[1] != model:
            raise IncompatibleCacheRecipeError(
                f"the hand-over is of another model file ({fields[1].decode(errors='replace')}, "
                f"this shard runs {model.decode()})"
            )
        if their_len != seq_len:
            raise InvalidInputError(f"the hand-over holds {their_len} tokens, not {seq_len}")
        if size != len(blob) - at:
            raise InvalidInputError(f"the hand-over's state is {len(blob) - at} bytes, its header says {size}")
        return blob[at:]

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
        return [(r.session_id, r.route_epoch) for r in self.sessions()]

    def sessions(self) -> list[SessionRecord]:
        """Cached sessions: the hot ones least recently used first, then the warm ones (tier
        Tier.WARM or Tier.DISK, seq_id -1); as of the last engine call that finished."""
        return [SessionRecord._make(t) for t in self.engine.sessions()]

    def stats(self) -> dict:
        """The engine's counters, among them live_sessions, reserved_tokens, evictions_*, misses
        (by reason) and the warm tier's spills, restores, warm_drops, warm_sessions, warm_bytes."""
        return dict(self.engine.stats())

    def check_invariants(self) -> None:
        self.engine.check_invariants()
