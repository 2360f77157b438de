"""Drain: a worker that is going away hands its live sessions' KV to a replica of its own layers
instead of dropping them (SIGTERM, or an admin's `Drain`), and the receiving side (`Handover`).

The sender, for each live session in turn: waits for its step in flight, exports llama.cpp's
sequence state of the owned layers (what the warm tier keeps), sends it with the session's key,
owner, length, its recipe and model digest and a SHA-256 of the bytes, and releases its own copy
once the replica took it. From then on a step for that session is answered OUTCOME_UNAVAILABLE
with `moved_to` (nothing computed): the head sends the same step to that replica, and the caller
sees no re-prefill. A session no replica takes is released (its next step is a miss, as before).
While draining, the worker takes no new session.

The receiver checks everything before llama.cpp reads a byte: who calls (a trusted neighbour,
`--forwarder`, or an admin, on a worker with authentication), the recipe and the model digest, the
digest of the bytes, the owner's session cap, then the state's cells (the engine's kv_state_check:
positions 0..seq_len-1 of one sequence, sizes that add up), and opens the session at the same epoch;
or refuses with a clear outcome and nothing changed.

Invariants: a session is in at most one of `moving` and `moved`; a step for a session in `moving`
waits (never computes beside its export); a moved session's KV is on this worker no more.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import Counter as Tally
from collections import OrderedDict
from typing import NamedTuple

from ..engine.hot_kv import CacheMiss, Tier
from ..errors import (
    IncompatibleCacheRecipeError,
    InvalidInputError,
    KvBudgetExceededError,
    LlamaShardError,
    StaleRouteEpochError,
)
from ..proto import shard_pb2 as pb

#: the longest one session's hand-over may take (its export, the call, the replica's import)
HANDOVER_TIMEOUT_S = 30.0
#: the state travels in chunks of this size (far under any worker's bound on one message)
HANDOVER_CHUNK_BYTES = 256 * 1024


class Moved(NamedTuple):
    """SessionMoves.enter's answer for a step whose session left: the replica that holds it now,
    or None while its hand-over outlasted the step's deadline (it must not run beside the export)."""

    to: str | None


class SessionMoves:
    """Which sessions a draining worker is handing over, or has handed over, and to whom; the
    steps of a session wait while it moves. Thread-safe."""

    def __init__(self):
        self.cond = threading.Condition()
        self.draining = False
        self.moving: set[str] = set()
        self.moved: dict[str, str] = {}  # engine key -> the replica's address
        self.asked: set[str] = set()  # moved sessions a step has asked for since
        self._in_flight: Tally = Tally()  # engine key -> its steps being computed here

    def enter(self, key: str, deadline: float) -> Moved | None:
        """A step for `key` may run here (None; `leave` when computed), or where its session went
        (`Moved`). Waits while it is being handed over."""
        with self.cond:
            while key in self.moving:
                left = deadline - time.monotonic()
                if left <= 0:
                    return Moved(None)
                self.cond.wait(left)
            to = self.moved.get(key)
            if to is not None:
                self.asked.add(key)
                self.cond.notify_all()
                return Moved(to)
            self._in_flight[key] += 1
            return None

    def leave(self, key: str) -> None:
        with self.cond:
            self._in_flight[key] -= 1
            if self._in_flight[key] <= 0:
                del self._in_flight[key]
            self.cond.notify_all()

    def begin(self, key: str, timeout: float) -> bool:
        """The session starts moving once its step in flight is done; False if that took longer
        than `timeout` (it is moved anyway: its next step waits)."""
        end = time.monotonic() + timeout
        with self.cond:
            self.moving.add(key)
            while self._in_flight.get(key):
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(left)
            return True

    def done(self, key: str, to: str | None) -> None:
        with self.cond:
            self.moving.discard(key)
            if to is not None:
                self.moved[key] = to
            self.cond.notify_all()

    def wait_asked(self, timeout: float) -> int:
        """Waits until a step has asked for every moved session (its head has followed it), at most
        `timeout` seconds; returns how many were not asked (idle sessions: their head fails over)."""
        end = time.monotonic() + timeout
        with self.cond:
            while set(self.moved) - self.asked:
                left = end - time.monotonic()
                if left <= 0:
                    break
                self.cond.wait(left)
            return len(set(self.moved) - self.asked)


#: StepReply.miss_reason of a step whose handed_from names a hand-over this worker did not receive
NOT_HANDED_OVER = "NOT_HANDED_OVER"


class HandedIn:
    """The receiving side's record of sessions that arrived by hand-over and that no step has touched
    since: (engine key, epoch) -> the sender's instance id. A head whose record places an idle
    session on the drained sender names that instance in its next step (StepRequest.handed_from),
    and the session goes on here without a re-prefill; a step that names another instance, or a
    session stepped since, is a miss (its copy here may be older than the head's record). Bounded:
    the oldest marks go first (their sessions then re-prefill). Thread-safe."""

    def __init__(self, capacity: int):
        self.capacity = max(1, capacity)
        self._marks: OrderedDict[tuple[str, int], str] = OrderedDict()
        self._lock = threading.Lock()
        self.continued = 0  # steps that went on from a handed-in session

    def arrived(self, key: str, epoch: int, from_instance: str) -> None:
        with self._lock:
            self._marks.pop((key, epoch), None)
            if from_instance:
                self._marks[(key, epoch)] = from_instance
                while len(self._marks) > self.capacity:
                    self._marks.popitem(last=False)

    def step(self, key: str, epoch: int, handed_from: str) -> bool:
        """A step of the session: False when it names a hand-over (`handed_from`) this worker did not
        receive; a step that names none ends the session's mark (it is this worker's own now)."""
        with self._lock:
            mark = self._marks.get((key, epoch))
            if not handed_from:
                self._marks.pop((key, epoch), None)
                return True
            if mark != handed_from:
                return False
            self.continued += 1
            return True


def state_digest(state: bytes) -> bytes:
    return hashlib.sha256(state).digest()


def handover_messages(
    header: pb.HandoverRequest, state: bytes, chunk: int = HANDOVER_CHUNK_BYTES
) -> list[pb.HandoverRequest]:
    """One hand-over's stream: `header` (every field but the state) with the state's size, its
    SHA-256 and its first chunk, then the other chunks."""
    first = pb.HandoverRequest()
    first.CopyFrom(header)
    first.state, first.state_bytes, first.state_sha256 = state[:chunk], len(state), state_digest(state)
    return [first, *(pb.HandoverRequest(state=state[i : i + chunk]) for i in range(chunk, len(state), chunk))]


class Drainer:
    """The sending side: hands every live session of `manager` to one of `targets` (addresses a
    `Peers` may reach), in turn. `owner_of(key)` gives (the owner's principal, its session id)."""

    def __init__(
        self,
        manager,
        peers,
        moves: SessionMoves,
        owner_of,
        fingerprint: str,
        digest: str,
        on_moved=lambda n: None,
        sign=lambda owner: None,
        instance_id: str = "",
    ):
        self.manager, self.peers, self.moves = manager, peers, moves
        self.instance_id = instance_id  # this worker's, in each hand-over (the receiver marks the session)
        self.owner_of = owner_of
        self.fingerprint, self.digest = fingerprint, digest
        self.on_moved = on_moved
        self.sign = sign  # the route key's assertion of an owner (None: no route key, or anonymous)

    def drain(self, targets: tuple[str, ...], timeout: float = HANDOVER_TIMEOUT_S) -> pb.DrainReply:
        """Every session handed over within `timeout` in all, the most recently used first (idle ones
        too: their head continues them on the replica, StepRequest.handed_from); those left when the
        time is up are released here, each explicitly (its next step is a miss)."""
        t0 = time.monotonic()
        end = t0 + timeout
        self.moves.draining = True
        self._unreachable: set[str] = set()
        handed = released = 0
        errors: list[str] = []
        # a step let in just before the drain began may still open a session: a few rounds
        for _ in range(3):
            # the most recently used first: where the replica has room for only some, it takes those
            # being streamed, and an idle one there is pushed out before them (see Handover)
            records = sorted(
                (r for r in self.manager.sessions() if r.session_id not in self.moves.moved),
                key=lambda r: r.last_used,
                reverse=True,
            )
            if not records:
                break
            for r in records:
                left = end - time.monotonic()
                if left <= 0:
                    self._release(r.session_id, r.route_epoch)
                    released += 1
                    continue
                to = self._move(r.session_id, r.route_epoch, r.last_used, targets, left, errors)
                handed += to is not None
                released += to is None
            if time.monotonic() >= end:
                errors.append(f"the hand-over's {timeout:g} s ran out: the sessions left were released")
        detail = "; ".join(dict.fromkeys(errors))[:1000]
        return pb.DrainReply(handed_over=handed, released=released, seconds=time.monotonic() - t0, detail=detail)

    def _move(
        self, key: str, epoch: int, last_used: float, targets: tuple[str, ...], timeout: float, errors: list[str]
    ) -> str | None:
        """One session handed over (the replica's address) or released here (None)."""
        to = None
        try:
            if self.moves.begin(key, timeout):  # else its step never ended: not exported mid-step, released
                to = self._hand_over(key, epoch, last_used, targets, timeout, errors)
            else:
                errors.append("a step in flight outlasted the hand-over's wait")
        finally:
            self._release(key, epoch, to)
        if to is not None:
            self.on_moved(1)
        return to

    def _release(self, key: str, epoch: int, to: str | None = None) -> None:
        """The session's copy here is gone (handed to `to`, or released: None)."""
        self.moves.begin(key, 0.0)
        try:
            self.manager.release(key, epoch)
        except LlamaShardError:
            pass
        self.moves.done(key, to)

    def _hand_over(
        self, key: str, epoch: int, last_used: float, targets: tuple[str, ...], timeout: float, errors: list[str]
    ) -> str | None:
        """The replica that took the session, or None (errors says why)."""
        try:
            out = self.manager.export_session(key, epoch)
        except Exception as e:  # noqa: BLE001 - a session that cannot be exported is released, the drain goes on
            errors.append(f"export: {e}")
            return None
        if isinstance(out, CacheMiss):  # evicted meanwhile: nothing to hand over
            return None
        info, state = out
        idle = max(0.0, self.manager.clock() - last_used)
        owner, session_id = self.owner_of(key)
        if owner is None:
            errors.append("a session whose owner this worker cannot name stays here")
            return None
        messages = handover_messages(
            pb.HandoverRequest(
                session_id=session_id,
                route_epoch=epoch,
                owner=owner,
                seq_len=info.seq_len,
                idle_seconds=idle,
                recipe_fingerprint=self.fingerprint,
                model_digest=self.digest,
                owner_assertion=self.sign(owner) or b"",
                from_instance=self.instance_id,
            ),
            state,
        )
        for target in targets:
            if target in self._unreachable:
                continue
            try:
                reply = self.peers.handover(target, messages, timeout)
            except Exception as e:  # noqa: BLE001 - grpc.RpcError or a channel problem: the next replica
                errors.append(f"{target}: {e.details() if hasattr(e, 'details') else e}")
                self._unreachable.add(target)  # not tried again for this drain's other sessions
                continue
            if reply.outcome == pb.OUTCOME_OK:
                return target
            errors.append(f"{target}: {pb.Outcome.Name(reply.outcome)}: {reply.detail}")
        return None


class HandoverReceiver:
    """The receiving side of a hand-over (`Handover`): a sender's stream of chunks gathered within
    `max_bytes` (two gathered at once at most), its digest, recipe, model and owner checked, then
    opened as the session, hot, at its epoch. `on_arrived(key, epoch, from_instance)` runs for each
    session taken over."""

    def __init__(
        self,
        manager,
        security,
        owners,
        moves: SessionMoves,
        fingerprint: str,
        model_digest: str,
        max_bytes: int,
        on_arrived,
    ):
        self.manager, self.security, self.owners, self.moves = manager, security, owners, moves
        self.fingerprint, self.model_digest, self.max_bytes = fingerprint, model_digest, max_bytes
        self.on_arrived = on_arrived
        self._gathering = threading.BoundedSemaphore(2)

    def receive(self, caller: str, request_iterator, time_left, stopping: threading.Event) -> pb.SessionReply:
        """A hand-over's stream from `caller` (a trusted neighbour: the servicer checked), gathered,
        checked and opened here; every refusal names why and changes nothing. `time_left()`: the
        caller's seconds left (None: no deadline); `stopping`: set when the worker shuts down (both
        read once the first message is in)."""

        def refused(outcome: int, detail: str) -> pb.SessionReply:
            return pb.SessionReply(outcome=outcome, detail=f"hand-over refused: {detail}")

        request = next(request_iterator, None)
        if request is None:
            return refused(pb.OUTCOME_INVALID_ARGUMENT, "the stream carried no message")
        if stopping.is_set() or self.moves.draining:
            return refused(pb.OUTCOME_UNAVAILABLE, "this worker is draining too")
        if request.recipe_fingerprint != self.fingerprint:
            return refused(
                pb.OUTCOME_INCOMPATIBLE_RECIPE,
                "the sender's KV recipe is not this worker's (another layer range, K/V type or attention kernel)",
            )
        if request.model_digest != self.model_digest:
            return refused(pb.OUTCOME_INCOMPATIBLE_RECIPE, "the sender's model file is not this worker's")
        owner = request.owner
        if self.security.authenticated and (not owner.strip() or owner in self.security.admins):
            return refused(
                pb.OUTCOME_INVALID_ARGUMENT, "a session on this worker belongs to a named, non-admin principal"
            )
        if not self.security.authenticated and owner:
            return refused(pb.OUTCOME_INVALID_ARGUMENT, "this worker has no authentication: every session is anonymous")
        if (
            self.security.authenticated
            and caller not in self.security.admins
            and not self.security.assertion_valid(owner, request.owner_assertion)
        ):
            # a forwarder acts for a principal only with the route key's signature, as on a step
            return refused(
                pb.OUTCOME_INVALID_ARGUMENT,
                "a forwarder's hand-over needs the route key's assertion of its owner (owner_assertion)",
            )
        if not 0 < request.state_bytes <= self.max_bytes:
            return refused(
                pb.OUTCOME_INVALID_ARGUMENT,
                f"state_bytes {request.state_bytes}: a session's state on this "
                f"worker takes 1 to {self.max_bytes} bytes",
            )
        left = time_left()
        if not self._gathering.acquire(timeout=HANDOVER_TIMEOUT_S if left is None else max(0.0, left)):
            return refused(pb.OUTCOME_UNAVAILABLE, "other hand-overs are being received; try another replica")
        try:
            state = self._gather_state(request, request_iterator)
            if state is None:
                return refused(
                    pb.OUTCOME_INVALID_ARGUMENT,
                    f"the stream's chunks do not add up to state_bytes {request.state_bytes}",
                )
            if len(request.state_sha256) != 32 or state_digest(state) != request.state_sha256:
                return refused(pb.OUTCOME_INVALID_ARGUMENT, "the state's SHA-256 does not match its bytes")
            return self._take_over(request, state, owner, refused)
        finally:
            self._gathering.release()

    @staticmethod
    def _gather_state(first: pb.HandoverRequest, rest) -> bytes | None:
        """The whole state of a hand-over's stream, or None when its chunks pass or miss state_bytes
        (never more than state_bytes is held)."""
        state = bytearray(first.state)
        if len(state) > first.state_bytes:
            return None
        for message in rest:
            if len(state) + len(message.state) > first.state_bytes:
                return None
            state += message.state
        return bytes(state) if len(state) == first.state_bytes else None

    def _take_over(self, request: pb.HandoverRequest, state: bytes, owner: str, refused) -> pb.SessionReply:
        """Handover's last part: the checked state opened here as the session, hot, at its epoch."""
        try:
            key = self.security.engine_key(owner, request.session_id)
            held = self.manager.resolve(key, request.route_epoch)
            if not isinstance(held, CacheMiss):
                # it may be a newer copy (the session failed over here): never replaced by the sender's
                return refused(
                    pb.OUTCOME_INVALID_ARGUMENT,
                    "this worker already holds the session at that epoch; it is kept (the sender's copy may be older)",
                )
            self.owners.name(owner, self.security.tag(owner))
            cap = self.owners.admit(owner, [key])
            if cap is not None:
                return refused(pb.OUTCOME_BUDGET_EXCEEDED, cap.text)
            later = self._used_since(request.seq_len, request.idle_seconds)
            if later is not None:
                return refused(
                    pb.OUTCOME_BUDGET_EXCEEDED,
                    f"no room here but that of a session used {later:.2f} s ago, "
                    f"more recently than this one ({request.idle_seconds:.2f} s)",
                )
            self.manager.import_session(key, request.route_epoch, request.seq_len, state)
        except StaleRouteEpochError as e:
            return pb.SessionReply(
                outcome=pb.OUTCOME_STALE_EPOCH, detail=f"hand-over refused: {e}", current_epoch=e.current_epoch or 0
            )
        except KvBudgetExceededError as e:
            return refused(pb.OUTCOME_BUDGET_EXCEEDED, str(e))
        except IncompatibleCacheRecipeError as e:
            return refused(pb.OUTCOME_INCOMPATIBLE_RECIPE, str(e))
        except InvalidInputError as e:
            return refused(pb.OUTCOME_INVALID_ARGUMENT, str(e))
        except LlamaShardError as e:
            return refused(pb.OUTCOME_INTERNAL, str(e))
        self.on_arrived(key, request.route_epoch, request.from_instance)
        return pb.SessionReply(outcome=pb.OUTCOME_OK, seq_len=request.seq_len, tier="hot")

    def _used_since(self, seq_len: int, idle_seconds: float) -> float | None:
        """When opening a handed-over session of `seq_len` tokens would push a hot session out of
        this worker (no warm tier to keep it) and that one was used more recently than the handed
        one: how long ago (a stream between two steps must not lose its KV to an idle session)."""
        config, stats = self.manager.config, self.manager.stats()
        if config.warm_bytes > 0:  # what is pushed out is spilled, and restored at its next step
            return None
        if stats["live_sessions"] < config.max_sessions and stats["reserved_tokens"] + seq_len <= config.budget_tokens:
            return None
        hot = [r for r in self.manager.sessions() if r.tier == Tier.HOT]  # least recently used first
        since = self.manager.clock() - hot[0].last_used if hot else None
        return since if since is not None and since < idle_seconds else None
