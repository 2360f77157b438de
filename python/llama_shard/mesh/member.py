"""A node that joins a mesh (serve --join HEAD): it reports what it has, times itself on the head's
probe layer, and serves the range the head gives it, loaded from its own copy of the head's model
when it has one, else fetched tensor by tensor into its cache (mesh/manifest.py), where a restart
finds it. It reports every heartbeat; a new range (the head restored a stage with it) is served
after its sessions are handed to the other members of its old stage.

The worker itself is made by the caller (`start_worker`: cli/serve_mesh.py builds a ShardWorker), so this
module knows the mesh's wire and nothing of how a worker is put together."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import grpc

from ..errors import LlamaShardError
from ..proto import shard_pb2 as pb
from ..proto import shard_pb2_grpc as pb_grpc
from ..proto.credentials import ClientSecurity
from .manifest import FetchRefused, RangeCache
from .measure import time_one_layer

#: how long a member keeps trying to reach its head before it gives up (a head that restarts its
#: port for its own range is away for well under a second)
HEAD_AWAY_S = 60.0
#: a report's deadline (well under the head's DEAD_AFTER_S: a lost one is sent again), and one that
#: asks for a manifest (the head may still be hashing the range)
BEAT_TIMEOUT_S, MANIFEST_TIMEOUT_S = 2.0, 30.0
#: fetches of a range tried before the member gives up (a connection lost mid-fetch is tried again)
FETCH_TRIES = 3
#: the longest a fetch of one tensor may take
FETCH_TIMEOUT_S = 600.0


class MeshRefused(LlamaShardError):
    """The head refused this member (its reason is the message; `rejoin`: it may join again as a
    new member)."""

    def __init__(self, message: str, rejoin: bool = False):
        super().__init__(message)
        self.rejoin = rejoin


class Serving(Protocol):
    """A worker serving a range, as the member drives it."""

    address: str

    def allow_peers(self, addresses: list[str]) -> None: ...

    def stop(self, hand_to: tuple[str, ...]) -> None: ...


def _log(message: str) -> None:
    print(f"llama-shard member: {message}", file=sys.stderr, flush=True)


class JoinedNode:
    def __init__(
        self,
        head: str,
        security: ClientSecurity,
        start_worker: Callable[[str, tuple[int, int], int, int], Serving],
        cache: RangeCache,
        memory_bytes: int,
        threads: int | None,
        model_path: str | None = None,
        model_digest: str = "",
        device: str = "cpu",
    ):
        self.head, self.start_worker, self.cache = head, start_worker, cache
        self.memory_bytes, self.threads, self.device = memory_bytes, threads, device
        self.model_path, self.model_digest = model_path, model_digest
        self.channel = security.channel(head, [("grpc.max_receive_message_length", 256 << 20)])
        self.stub = pb_grpc.MeshServiceStub(self.channel)
        self.member_id = ""
        self.report = pb.MemberReport(memory_bytes=memory_bytes, backend="cpu")
        self.worker: Serving | None = None
        self.serving: tuple[int, int] | None = None
        self.started = time.monotonic()
        # the heartbeat's thread reports while this one measures, fetches and loads (a node busy for
        # longer than the head's DEAD_AFTER_S is not dead); its latest answer, or why it stopped
        self._state = threading.Condition()
        self._latest: pb.JoinReply | Exception | None = None
        self._last_reply: pb.JoinReply | None = None  # the last answer (never cleared): whom to hand over to

    # --- the head's answers ----------------------------------------------------------------------

    def _join(self, want_manifest: bool = False) -> pb.JoinReply:
        with self._state:
            request = pb.JoinRequest(
                member_id=self.member_id,
                report=self.report,
                model_digest=self.model_digest,
                has_model=self.model_path is not None,
                want_manifest=want_manifest,
            )
            if self.worker is not None and self.serving is not None:
                request.address, request.serving = self.worker.address, True
                request.serving_first, request.serving_last = self.serving
        deadline = time.monotonic() + HEAD_AWAY_S
        while True:
            t0 = time.perf_counter()
            try:
                reply = self.stub.Join(request, timeout=MANIFEST_TIMEOUT_S if want_manifest else BEAT_TIMEOUT_S)
            except grpc.RpcError as e:
                if e.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                    raise MeshRefused(f"the head refused this member: {e.details()}") from None
                if time.monotonic() > deadline:
                    raise MeshRefused(
                        f"the head {self.head} did not answer for {HEAD_AWAY_S:g} s: {e.details()}"
                    ) from None
                time.sleep(0.2)
                continue
            if not reply.admitted:
                raise MeshRefused(reply.refused, reply.rejoin)
            with self._state:
                if not want_manifest:  # (a reply with a manifest times its bytes, not the link)
                    rtt = time.perf_counter() - t0
                    self.report.rtt_s["head"] = min(self.report.rtt_s.get("head", rtt), rtt)
                self.member_id = reply.member_id
                self._last_reply = reply
            return reply

    def _fetch(self, manifest: pb.RangeManifest) -> Callable:
        def fetch(name: str, offset: int):
            request = pb.FetchRequest(
                member_id=self.member_id, first=manifest.first, last=manifest.last, tensor=name, offset=offset
            )
            try:
                for chunk in self.stub.Fetch(request, timeout=FETCH_TIMEOUT_S):
                    yield chunk.data
            except grpc.RpcError as e:
                raise FetchRefused(f"fetching {name}: {e.details()}", transport=True) from None

        return fetch

    def _file_for(self, reply: pb.JoinReply) -> str:
        """The file to load the reply's manifest's range from: this node's own copy of the head's
        model, else the range's file in the cache (fetched where it is missing or does not match)."""
        if self.model_path is not None:
            return self.model_path
        for attempt in range(FETCH_TRIES):
            try:
                fetch = self._fetch(reply.manifest)
                return str(self.cache.obtain(reply.model_digest, reply.manifest, reply.n_layer, fetch))
            except FetchRefused as e:
                if not e.transport or attempt == FETCH_TRIES - 1:
                    raise  # a tensor that does not match is not tried again
                _log(f"{e}: trying again")
                time.sleep(1.0)
        raise AssertionError("unreachable")

    # --- the node's life -------------------------------------------------------------------------

    def _beat(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                reply = self._join()
            except Exception as e:  # noqa: BLE001 - the main thread raises it (a refusal, or a bug)
                reply = e
            with self._state:
                self._latest = reply
                self._state.notify_all()
            if isinstance(reply, Exception):
                return
            stop.wait(reply.heartbeat_s or 1.0)

    def _next(self, stop: threading.Event) -> pb.JoinReply | None:
        """The heartbeat's next answer (None: stopped; MeshRefused: the head refused this member)."""
        with self._state:
            self._latest = None
            while self._latest is None and not stop.is_set():
                self._state.wait(0.5)
            latest = self._latest
        if isinstance(latest, Exception):
            raise latest
        return latest

    def run(self, stop: threading.Event) -> int:
        """Joins, times one layer (the head's probe layer) and reports it, then serves what the head
        says until `stop`. A member the head declared dead (a report lost for longer than its
        DEAD_AFTER_S) joins again as a new one, serving what it served meanwhile."""
        try:
            while True:
                try:
                    return self._life(stop)
                except MeshRefused as e:
                    if not e.rejoin or stop.is_set():
                        raise
                    _log(f"{e}: joining again")
                    with self._state:
                        self.member_id = ""
        finally:
            if self.worker is not None:
                self.worker.stop(tuple(self._last_reply.replicas) if self._last_reply is not None else ())

    def _life(self, stop: threading.Event) -> int:
        reply = self._join(want_manifest=self.model_path is None and self.report.layer_s == 0)
        beats = threading.Event()
        threading.Thread(target=self._beat, args=(beats,), name="mesh-heartbeat", daemon=True).start()
        try:
            if self.report.layer_s == 0:
                decode_s, prefill_s, backend = time_one_layer(
                    self._file_for(reply), reply.probe_layer, self.threads, self.device
                )
                with self._state:
                    self.report.layer_s, self.report.prefill_layer_s, self.report.backend = decode_s, prefill_s, backend
                _log(
                    f"joined {self.head} as {self.member_id}: {decode_s * 1e3:.3f} ms a token per layer "
                    f"(prefill {prefill_s * 1e3:.3f} ms), {self.memory_bytes / 2**30:.2f} GiB to use"
                )
            while (reply := self._next(stop)) is not None:
                if reply.assigned and (reply.first, reply.last) != self.serving:
                    self._serve(reply.replicas)
                if self.worker is not None:
                    self.worker.allow_peers(list(reply.peers))
        finally:
            beats.set()
        return 0

    def _serve(self, hand_to) -> None:
        """Serves the range the head assigns now (stopping the range served before, its sessions
        handed to `hand_to`, the other members that serve it)."""
        if self.worker is not None:
            _log(f"moving to another range: handing sessions to {', '.join(hand_to) or 'nobody'}")
            worker = self.worker
            with self._state:
                self.worker, self.serving = None, None
            worker.stop(tuple(hand_to))
        reply = self._join(want_manifest=self.model_path is None)  # the new range, and its manifest
        if not reply.assigned:
            return
        stage = (reply.first, reply.last)
        t0, fetched = time.monotonic(), self.cache.fetched_bytes
        path = self._file_for(reply)
        worker = self.start_worker(path, stage, reply.max_sessions, reply.context_tokens)
        worker.allow_peers(list(reply.peers))  # before the head may send it a step to forward
        with self._state:
            self.worker, self.serving = worker, stage
        size = Path(path).stat().st_size
        _log(
            f"serving layers {stage[0]}-{stage[1]} on {self.worker.address}, "
            f"{time.monotonic() - self.started:.1f} s after start; fetched "
            f"{(self.cache.fetched_bytes - fetched) / 2**20:.1f} MiB in {time.monotonic() - t0:.1f} s "
            f"(its file {size / 2**20:.1f} MiB)"
        )
