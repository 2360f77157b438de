"""The Hot KV state machine in plain Python over numpy K/V: the specification of the native engine.

`ReferenceHotKvEngine` has the interface of the native `HotKvEngine` (native/include/llama_shard/
hot_kv_engine.h) and the same rules, step for step: identity (stale epochs, supersession), token-
reservation admission, LRU eviction by session cap and by budget (never the requester), TTL
eviction, the warm tier (evicted sessions spill a copy of their K/V and come back on their next
step; BUSY for a request that fits alone but not beside what its step admitted), the bounded table
of recently dropped keys, and seq id assignment from a free pool.
Each live session holds a `SequenceKv` with K/V for the owned layers only.
"""

from __future__ import annotations

import bisect
import collections
import copy
import dataclasses
import threading
import time

import numpy as np

#: RESTORE_BUCKETS: upper bounds of the restore-time buckets (native HOT_KV_RESTORE_BUCKETS); the last is +Inf
from .._native import (
    RESTORE_BUCKETS,
    HotKvConfig,
    MissReason,
    StepKind,
    Tier,
    model_digest,
)
from ..engine.hot_kv import SessionRecord, Step
from ..errors import InvalidInputError
from .checks import EngineInvariants, validate_input, validate_key
from .locking import serialised
from .prefix_store import PrefixStore
from .results import BUDGET_EXCEEDED, BUSY, CACHE_MISS, INVALID_INPUT, STALE_EPOCH, IdPlacement, StepResult, stale
from .sequences import KvShard, SequenceKv, StateSizes
from .stats import EngineStats
from .transfers import SessionTransfers
from .warm_tier import WarmEntry, WarmTier


@dataclasses.dataclass
class _Session:
    epoch: int
    seq_id: int
    kv: SequenceKv
    last_used: float
    last_start: int = -1  # the last decode applied: its start and its input (a retry repeats both)
    last_input: bytes | None = None

    @property
    def seq_len(self) -> int:
        return self.kv.seq_len


def _input_bytes(step: Step) -> bytes:
    """A step's input as bytes: what identifies a retried step (the native engine hashes the same)."""
    if step.token_ids is not None:
        return np.asarray(step.token_ids, dtype=np.int32).tobytes()
    return np.asarray(step.hidden, dtype=np.float32).tobytes()


@dataclasses.dataclass
class _Dropped:
    epoch: int
    reason: MissReason
    stamp: int


class ReferenceHotKvEngine(SessionTransfers, EngineStats, EngineInvariants):
    def __init__(self, shard: KvShard, config: HotKvConfig):
        """The native engine's configuration, checked by the same native function; a warm_dir is
        simulated (the same decisions and sizes as the disk tier's files, no files)."""
        config.check()
        if config.kv_type != "f16":
            raise InvalidInputError("the numpy reference computes an f16 cache only")
        warm_disk_bytes = config.warm_disk_bytes if config.warm_dir else 0
        max_sessions = config.max_sessions
        warm_bytes, warm_ttl_seconds, recipe_fingerprint = (
            config.warm_bytes,
            config.warm_ttl_seconds,
            config.recipe_fingerprint,
        )
        self._lock = threading.RLock()
        self.warm_bytes = warm_bytes
        self.warm_ttl_seconds = warm_ttl_seconds
        self.warm_disk_bytes = warm_disk_bytes
        self.recipe_fingerprint = recipe_fingerprint
        path = getattr(shard.model, "path", None)
        self._model_digest = model_digest(str(path)) if warm_disk_bytes > 0 and path is not None else ""
        self._restore_buckets = [0] * len(RESTORE_BUCKETS)
        self.shard = shard
        self.config = config
        self.max_sessions = max_sessions
        self.context_tokens = config.context_tokens
        self.budget_tokens = config.budget_tokens
        self.ttl_seconds = config.ttl_seconds
        self.n_batch = config.n_batch
        self.recent_capacity = config.recent_capacity
        self._live: "collections.OrderedDict[str, _Session]" = collections.OrderedDict()  # LRU order
        self._free_ids = list(range(max_sessions - 1, -1, -1))  # descending: [-1] is the lowest
        self._reserved = 0
        self._recent: dict[str, _Dropped] = {}
        self._recent_order: collections.deque[tuple[str, int]] = collections.deque()
        self._stamp = 0
        self._clock = float("-inf")  # latest `now` seen: engine time never goes back
        self.n_decode_calls = 0
        self._counters = collections.Counter()
        self._misses = collections.Counter()
        # the prefix store: key -> a copy of a session's K/V (hot_kv_engine.h, store_prefix)
        self.prefix_bytes = config.prefix_bytes
        # the engine's rooms (as the native engine's): each keeps its own bytes, invariants and counters
        self._prefixes = PrefixStore(config.prefix_bytes)
        self.sizes = StateSizes(shard, max_sessions, recipe_fingerprint, self._model_digest)
        self._warm = WarmTier(
            warm_bytes,
            warm_disk_bytes,
            warm_ttl_seconds,
            host_entry_bytes=self.sizes.warm_entry_bytes,
            disk_bound_bytes=lambda sid, n: (
                self.sizes._state_bytes(n) + len(sid.encode("utf-8", "surrogatepass")) + 256
            ),
            file_bytes=self.sizes.disk_file_bytes,
            on_drop=self._warm_dropped,
        )

    # --- validation ----------------------------------------------------------------------------

    def validate_step(self, step) -> None:
        """The checks the native StepLoop makes before queueing a llama_shard.Step (a prefill may
        exceed n_batch: it is computed in chunks; a decode may not)."""
        validate_key(step.session_id, step.route_epoch)
        # several rows of logits: computed whole, so within one step's size
        limit = 1 << 30 if step.kind == StepKind.PREFILL and step.logit_rows == 1 else self.n_batch
        validate_input(self.shard.info, self.n_batch, step.token_ids, step.hidden, limit)

    # --- bookkeeping -----------------------------------------------------------------------------

    def _remember(self, sid: str, epoch: int, reason: str) -> None:
        if self.recent_capacity == 0:
            return
        self._stamp += 1
        self._recent[sid] = _Dropped(epoch, reason, self._stamp)
        self._recent_order.append((sid, self._stamp))
        while len(self._recent) > self.recent_capacity or len(self._recent_order) > 2 * self.recent_capacity:
            old_sid, old_stamp = self._recent_order.popleft()
            d = self._recent.get(old_sid)
            if d is not None and d.stamp == old_stamp:
                del self._recent[old_sid]

    _LEAVING = {
        MissReason.EVICTED_TTL: "evictions_ttl",
        MissReason.EVICTED_LRU: "evictions_lru",
        MissReason.RELEASED: "releases",
        MissReason.SUPERSEDED_EPOCH: "supersessions",
    }

    def _free_hot(self, sid: str) -> _Session:
        s = self._live.pop(sid)
        self._reserved -= s.seq_len
        bisect.insort(self._free_ids, s.seq_id, key=lambda i: -i)  # descending: the lowest id is reused first
        return s

    def _drop(self, sid: str, reason: str, remembered_epoch: int = -1) -> None:
        s = self._free_hot(sid)
        self._remember(sid, remembered_epoch if remembered_epoch >= 0 else s.epoch, reason)
        self._counters[self._LEAVING.get(reason, "other")] += 1

    def _warm_dropped(self, sid: str, epoch: int, reason: MissReason) -> None:
        """The warm tier dropped a session: remembered (stale-epoch fencing); a release or a new epoch counted."""
        self._remember(sid, epoch, reason)
        if reason in (MissReason.RELEASED, MissReason.SUPERSEDED_EPOCH):
            self._counters[self._LEAVING[reason]] += 1

    def _leave_hot(self, sid: str, reason: str) -> None:
        """A hot session evicted (LRU or TTL): spilled to the warm tier if it can be, dropped otherwise."""
        s = self._live[sid]
        if not self._warm.enabled or s.seq_len == 0:
            self._drop(sid, reason)
            return
        if not self._warm.put(sid, WarmEntry(s.epoch, copy.deepcopy(s.kv), s.last_used, 0)):
            self._drop(sid, reason)
            return
        self._counters["spills"] += 1
        self._counters[self._LEAVING.get(reason, "other")] += 1
        self._free_hot(sid)

    def _restore(self, sid: str, now: float, ids: IdPlacement) -> _Session:
        t0 = time.perf_counter()
        w = self._warm.take(sid)
        s = _Session(w.epoch, self._take_free_id(ids), copy.deepcopy(w.kv), now)
        self._live[sid] = s
        self._reserved += s.seq_len
        self._counters["restores"] += 1
        seconds = time.perf_counter() - t0
        self._counters["restore_seconds"] += seconds
        self._restore_buckets[bisect.bisect_left(RESTORE_BUCKETS, seconds)] += 1
        self._touch(sid, s, now)
        return s

    def _make_room(self, tokens: int, need_id: bool, keep: list[str], step: list[str]) -> bool:
        """As the native make_room_locked: evict LRU sessions outside `keep` (those outside `step`
        first) until `tokens` more fit the budget and, if need_id, a seq id is free; False (and
        nothing evicted) if that cannot be enough."""
        if self._reserved + tokens > self.budget_tokens or (need_id and not self._free_ids):
            others = [o for k, o in self._live.items() if k not in keep]
            if self._reserved + tokens - sum(o.seq_len for o in others) > self.budget_tokens or (
                need_id and not self._free_ids and not others
            ):
                return False
        while self._reserved + tokens > self.budget_tokens or (need_id and not self._free_ids):
            evicted = self._evict_lru_except(keep, step)
            assert evicted
        return True

    def _evict_lru(self, keep: str) -> bool:
        return self._evict_lru_except([keep])

    def _evict_lru_except(self, keep: list[str], later: list[str] = ()) -> bool:
        for allow_later in (False, True):
            for sid in self._live:
                if sid not in keep and (allow_later or sid not in later):
                    self._leave_hot(sid, MissReason.EVICTED_LRU)
                    return True
        return False

    def _sweep(self, now: float) -> int:
        n = 0
        while self.ttl_seconds > 0 and self._live:
            sid, s = next(iter(self._live.items()))
            if now - s.last_used <= self.ttl_seconds:
                break
            self._leave_hot(sid, MissReason.EVICTED_TTL)
            n += 1
        return n + self._warm.sweep(now)

    def _begin(self, session_id: str, epoch: int, now: float) -> float:
        """The prelude of every single-session request (the native begin_locked)."""
        validate_key(session_id, epoch)
        now = self._tick(now)
        self._sweep(now)
        return now

    def _counted(self, res: StepResult) -> StepResult:
        """The one place a miss is counted (the native count_miss_locked): every CACHE_MISS answered,
        once; stale answers are not misses."""
        if res.status == CACHE_MISS:
            self._misses[res.miss] += 1
        return res

    def _tick(self, now: float) -> float:
        self._clock = max(self._clock, now)
        return self._clock

    def _touch(self, sid: str, s: _Session, now: float) -> None:
        s.last_used = now
        self._live.move_to_end(sid)

    def _create(self, sid: str, epoch: int, now: float, ids: IdPlacement) -> _Session:
        if not self._free_ids:
            self._evict_lru(sid)
        seq_id = self._take_free_id(ids)
        s = _Session(epoch, seq_id, self.shard.new_sequence(), now)
        self._live[sid] = s
        self._recent.pop(sid, None)
        return s

    def _take_free_id(self, ids: IdPlacement) -> int:
        """As the native engine: the id after the one this step created last, else the start of the
        lowest run of free ids long enough for the step's remaining new sessions, else the lowest."""
        free = self._free_ids
        if ids.last >= 0 and ids.last + 1 in free:
            seq_id = ids.last + 1
        else:
            seq_id = free[-1]
            if ids.to_place > 1:
                run_start, run_len = -1, 0
                for i in reversed(free):  # ascending ids
                    if run_len > 0 and i == run_start + run_len:
                        run_len += 1
                    else:
                        run_start, run_len = i, 1
                    if run_len >= ids.to_place:
                        seq_id = run_start
                        break
        free.remove(seq_id)
        ids.last = seq_id
        ids.to_place = max(ids.to_place - 1, 0)
        return seq_id

    @staticmethod
    def _miss(reason: MissReason, detail: str) -> StepResult:
        return StepResult(status=CACHE_MISS, miss=reason, detail=detail)

    @staticmethod
    def _newer_than_cached(epoch: int, cached: int) -> StepResult:
        return StepResult(
            status=CACHE_MISS,
            miss=MissReason.UNKNOWN_SESSION,
            detail=f"nothing is cached for epoch {epoch} (the cached epoch is {cached}; a step at this "
            f"epoch supersedes it)",
        )

    def _identify(self, sid: str, epoch: int, query: bool = False) -> tuple[_Session | None, StepResult]:
        s = self._live.get(sid)
        if s is not None:
            if epoch == s.epoch:
                return s, StepResult()
            if epoch < s.epoch:
                return None, stale(epoch, s.epoch, "current")
            if query:
                return None, self._newer_than_cached(epoch, s.epoch)
            self._drop(sid, MissReason.SUPERSEDED_EPOCH, epoch)
            return None, StepResult(
                status=CACHE_MISS,
                miss=MissReason.SUPERSEDED_EPOCH,
                detail=f"epoch {epoch} supersedes the cached epoch, whose state was dropped",
            )
        w, tier = self._warm.find(sid)
        if w is not None:
            if epoch == w.epoch:  # warm: no session, an OK result saying where it is
                return None, StepResult(seq_len=w.seq_len, tier=tier)
            if epoch < w.epoch:
                return None, stale(epoch, w.epoch, "current")
            if query:
                return None, self._newer_than_cached(epoch, w.epoch)
            self._warm.drop(sid, MissReason.SUPERSEDED_EPOCH, epoch)
            return None, StepResult(
                status=CACHE_MISS,
                miss=MissReason.SUPERSEDED_EPOCH,
                detail=f"epoch {epoch} supersedes the cached epoch, whose state was dropped",
            )
        d = self._recent.get(sid)
        if d is not None:
            if epoch < d.epoch:
                return None, stale(epoch, d.epoch, "last")
            if epoch == d.epoch:
                return None, StepResult(
                    status=CACHE_MISS, miss=d.reason, detail=f"the session's state was dropped: {d.reason.name}"
                )
        return None, StepResult(
            status=CACHE_MISS, miss=MissReason.UNKNOWN_SESSION, detail="no cached state for this session and epoch"
        )

    # --- requests (same signatures as the native HotKvEngine) -------------------------------------

    def _restore_alone(self, sid: str, seq_len: int, now: float) -> tuple[_Session | None, StepResult]:
        with self._warm.pin(sid):
            room = self._make_room(seq_len, True, [sid], [])
        if not room:  # larger than this engine's budget: a guard, as in the native engine
            self._warm.drop(sid, MissReason.EVICTED_LRU)
            return None, self._miss(MissReason.EVICTED_LRU, "the session's warm copy does not fit this shard's budget")
        return self._restore(sid, now, IdPlacement()), StepResult()  # outside a step: the lowest free id

    @serialised
    def open(self, session_id: str, epoch: int, now: float) -> StepResult:
        now = self._begin(session_id, epoch, now)
        s, res = self._identify(session_id, epoch)
        if res.status == STALE_EPOCH:
            return res
        if res.tier in (Tier.WARM, Tier.DISK):
            s, restored = self._restore_alone(session_id, res.seq_len, now)
            self._counted(restored)  # a lost warm copy is a miss even though open answers with a new session
        if s is None:  # nothing cached (not a miss: open asks for a session, and gets one)
            s = self._create(session_id, epoch, now, IdPlacement())
        self._touch(session_id, s, now)
        return StepResult(seq_len=s.seq_len, seq_id=s.seq_id, tier=Tier.HOT)

    @serialised
    def step(self, requests: list[Step], now: float) -> list[tuple[StepResult, np.ndarray | None]]:
        """A batched step with the native engine's rules (see hot_kv_engine.h, step()); each
        request is a llama_shard.Step of at most n_batch tokens (a chunk, for a long prefill)."""
        now = self._tick(now)
        results: list[StepResult | None] = [None] * len(requests)
        inputs: list = [None] * len(requests)
        participants: list[str] = []
        for i, req in enumerate(requests):
            try:
                validate_key(req.session_id, req.route_epoch)
                inputs[i] = validate_input(self.shard.info, self.n_batch, req.token_ids, req.hidden)
                if req.session_id in participants:
                    raise InvalidInputError(f"session '{req.session_id}' appears twice in one step")
                participants.append(req.session_id)
            except InvalidInputError as e:
                results[i] = StepResult(status=INVALID_INPUT, detail=str(e))
        if not participants:  # a step with nothing valid in it changes nothing, not even by time
            return [(r, None) for r in results]
        self._sweep(now)

        # a prefill not live under its epoch creates a session, a step of a warm session restores
        # one: their ids are placed together
        def takes_id(req: Step) -> bool:
            live, (warm, _) = self._live.get(req.session_id), self._warm.find(req.session_id)
            if live is not None and live.epoch == req.route_epoch:
                return False
            return req.kind == StepKind.PREFILL or (warm is not None and warm.epoch == req.route_epoch)

        ids = IdPlacement(to_place=sum(1 for i, req in enumerate(requests) if results[i] is None and takes_id(req)))
        plan = []
        for i, req in enumerate(requests):
            if results[i] is None:
                results[i] = self._admit(req, inputs[i][2], participants, now, plan, i, ids)
        for r in results:
            if r is not None:
                self._counted(r)
        outs: list[np.ndarray | None] = [None] * len(requests)
        if plan:
            self.n_decode_calls += 1  # what one native step costs at least
        for i, s, start, _ in plan:  # the reference computes one session at a time
            toks, hid, n = inputs[i]
            outs[i] = self.shard.forward(s.kv, tokens=toks, hidden=hid, n_logits=requests[i].logit_rows)
            decode = requests[i].kind == StepKind.DECODE  # only decodes can be retried, as natively
            s.last_start, s.last_input = (start, _input_bytes(requests[i])) if decode else (-1, None)
            self._counters["steps"] += 1
            self._counters["tokens_computed"] += n
            results[i] = StepResult(seq_len=s.seq_len, seq_id=s.seq_id, tier=Tier.HOT)
        return list(zip(results, outs))

    def _admit(self, req: Step, n: int, participants: list[str], now: float, plan: list, index: int, ids: IdPlacement):
        sid = req.session_id
        s, res = self._identify(sid, req.route_epoch)
        if res.status == STALE_EPOCH:
            return res
        warm = res.tier in (Tier.WARM, Tier.DISK)
        known = s is not None or warm
        held = s.seq_len if s is not None else (res.seq_len if warm else 0)
        if req.kind == StepKind.PREFILL:
            if not known and req.position > 0:
                return res
            start = held if req.position < 0 else req.position
            if start > held:
                return self._miss(
                    MissReason.SEQ_LEN_MISMATCH, f"start position {start} is past the cached length {held}"
                )
        else:
            if not known:
                return res
            retry = (
                s is not None
                and req.position >= 0
                and req.position == s.last_start
                and held == s.last_start + n
                and s.last_input == _input_bytes(req)
            )
            if req.position >= 0 and req.position != held and not retry:
                return self._miss(
                    MissReason.SEQ_LEN_MISMATCH, f"expected past length {req.position}, cached length is {held}"
                )
            start = req.position if retry else held  # a retry recomputes the applied step from its start

        def refuse(status, detail):
            if s is None:
                return StepResult(status=status, detail=detail)
            return StepResult(status=status, seq_len=s.seq_len, seq_id=s.seq_id, tier=Tier.HOT, detail=detail)

        new_len = start + n
        if new_len > self.context_tokens or new_len > self.budget_tokens:
            return refuse(
                BUDGET_EXCEEDED,
                f"the session would hold {new_len} tokens; context_tokens is "
                f"{self.context_tokens} and budget_tokens {self.budget_tokens}",
            )
        # never the requester or what the step admitted; the step's others only when they can go warm
        keep = [sid] + [p[3] for p in plan]
        if not self._warm.enabled:
            keep += participants
        grow = new_len - s.seq_len if s is not None else max(held, new_len)
        with self._warm.pin(sid if warm else None):
            room = self._make_room(grow, s is None, keep, participants)
        if not room:
            if self._warm.enabled and plan:  # it fits alone: it goes first in the next step
                return refuse(
                    BUSY, "the sessions this step admitted hold the memory this one needs; it runs in a later step"
                )
            if s is None and not self._free_ids:
                return refuse(BUDGET_EXCEEDED, f"all {self.max_sessions} sessions take part in this step")
            return refuse(BUDGET_EXCEEDED, f"the step's sessions together exceed budget_tokens {self.budget_tokens}")
        if warm:
            s = self._restore(sid, now, ids)
        elif s is None:
            s = self._create(sid, req.route_epoch, now, ids)
        if start < s.seq_len:
            self._reserved -= s.seq_len - start
            s.kv.truncate(start)
        self._touch(sid, s, now)
        self._reserved += n
        plan.append((index, s, start, sid))
        return None

    @serialised
    def truncate(self, session_id: str, epoch: int, length: int, now: float) -> StepResult:
        if length < 0:
            raise InvalidInputError(f"truncate length must be >= 0, got {length}")
        now = self._begin(session_id, epoch, now)
        s, res = self._identify(session_id, epoch)
        if res.tier in (Tier.WARM, Tier.DISK):
            if length > res.seq_len:  # refused before the warm session is moved
                raise InvalidInputError(f"cannot truncate a session of {res.seq_len} tokens to {length}")
            s, res = self._restore_alone(session_id, res.seq_len, now)
        if s is None:
            return self._counted(res)
        if length > s.seq_len:
            raise InvalidInputError(f"cannot truncate a session of {s.seq_len} tokens to {length}")
        if length < s.seq_len:
            self._reserved -= s.seq_len - length
            s.kv.truncate(length)
        self._touch(session_id, s, now)
        return StepResult(seq_len=s.seq_len, seq_id=s.seq_id, tier=Tier.HOT)

    @serialised
    def release(self, session_id: str, epoch: int, now: float) -> StepResult:
        self._begin(session_id, epoch, now)
        s = self._live.get(session_id)
        if s is not None:
            if epoch < s.epoch:
                return stale(epoch, s.epoch, "current")
            if epoch == s.epoch:
                self._drop(session_id, MissReason.RELEASED)
            else:  # a newer epoch supersedes the cached one, which is released with it
                self._drop(session_id, MissReason.SUPERSEDED_EPOCH, epoch)
                self._remember(session_id, epoch, MissReason.RELEASED)
            return StepResult(changed=True)
        w, _ = self._warm.find(session_id)
        if w is not None:
            if epoch < w.epoch:
                return stale(epoch, w.epoch, "current")
            if epoch == w.epoch:
                self._warm.drop(session_id, MissReason.RELEASED)
            else:
                self._warm.drop(session_id, MissReason.SUPERSEDED_EPOCH, epoch)
                self._remember(session_id, epoch, MissReason.RELEASED)
            return StepResult(changed=True)
        d = self._recent.get(session_id)
        if d is not None:
            if epoch < d.epoch:
                return stale(epoch, d.epoch, "last")
            if epoch > d.epoch:  # the route moved on: older epochs are stale from now on
                self._remember(session_id, epoch, MissReason.RELEASED)
        return StepResult()

    @serialised
    def resolve(self, session_id: str, epoch: int, now: float) -> StepResult:
        self._begin(session_id, epoch, now)
        s, res = self._identify(session_id, epoch, query=True)
        if s is None:
            return self._counted(res)  # a warm session is reported where it is; a newer epoch supersedes nothing
        return StepResult(seq_len=s.seq_len, seq_id=s.seq_id, tier=Tier.HOT)

    @serialised
    def sweep(self, now: float) -> int:
        return self._sweep(self._tick(now))

    # --- introspection ---------------------------------------------------------------------------

    @serialised
    def sessions(self) -> list[SessionRecord]:
        return (
            [SessionRecord(sid, s.epoch, s.seq_id, s.seq_len, s.last_used, Tier.HOT) for sid, s in self._live.items()]
            + [SessionRecord(sid, w.epoch, -1, w.seq_len, w.last_used, Tier.WARM) for sid, w in self._warm.host.items()]
            + [SessionRecord(sid, w.epoch, -1, w.seq_len, w.last_used, Tier.DISK) for sid, w in self._warm.disk.items()]
        )

    @serialised
    def session_kv(self, session_id: str) -> SequenceKv:
        """The per-layer K/V of a live session (reference only: the native cache lives in llama.cpp)."""
        return self._live[session_id].kv
