"""The workers a worker forwards chained steps to (serve --peer), and the metadata a forwarded step
carries (the workers it passed through; the principal it is sent for, with the head's assertion)."""

from __future__ import annotations

import errno
import socket
import threading
import time

import grpc

from ..engine.hot_kv import StepKind
from ..proto import shard_pb2 as pb
from ..proto import shard_pb2_grpc as pb_grpc
from ..proto.credentials import ClientSecurity
from ..proto.wire import RECONNECT_OPTIONS, call_reconnecting
from .security import ANONYMOUS, ON_BEHALF_OF, ON_BEHALF_OF_SIG

#: the most hops a chained step may name after this worker, whatever the model (a route has no more
#: stages after a shard than layers after it, and fewer than this in any deployment we know of)
MAX_FORWARD_HOPS = 32
#: the workers a forwarded step has passed through (their random ids, comma-separated): a worker
#: that finds its own id there refuses the step, whatever address the loop went through
VISITED = "llama-shard-visited"
#: a connection to a peer is pinged every KEEPALIVE_MS and dropped when a ping is not answered in
#: KEEPALIVE_TIMEOUT_MS: a peer whose machine vanished (no reset ever comes) fails the step in
#: seconds, not at its deadline, and the head fails over
KEEPALIVE_MS, KEEPALIVE_TIMEOUT_MS = 2000, 2000
KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", KEEPALIVE_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
#: what a worker's server allows its callers' keepalive pings (gRPC's default refuses pings more
#: often than every 5 minutes, closing the connection); a caller pinging faster still gets strikes
SERVER_KEEPALIVE_OPTIONS = [
    ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
    ("grpc.keepalive_permit_without_calls", 1),
]


def server_port_options(share: bool = False) -> list[tuple[str, int]]:
    """A server's port of its own: gRPC sets SO_REUSEPORT on Linux unless told not to, and then a
    second server bound to a port in use does not fail but takes a share of its connections (two
    workers on one address, each caller reaching either). `share`: only a mesh head's two servers,
    which hand its port from one to the other (cli/serve_mesh.py); its first checks the port is free."""
    return [("grpc.so_reuseport", 1 if share else 0)]


def check_port_free(host: str, port: int) -> None:
    """OSError naming host:port when another process listens on an address it names. gRPC binds every
    address a name resolves to and starts where only some bind (`localhost` beside a worker on
    127.0.0.1 would take [::1] alone), so each is tried first here. An address this machine cannot
    bind at all (no IPv6) is gRPC's to skip; only one in use is refused."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host.strip("[]") or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError:
        return  # a name that does not resolve: gRPC's bind says so
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                # SO_REUSEADDR: a closed connection's TIME_WAIT is no listener
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(sockaddr)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise OSError(f"cannot bind {host}:{port}: {e.strerror} (in use by another process?)") from None


class Peers:
    """The workers this one may forward chained steps to (serve --peer), one channel each, opened
    on first use. Addresses are compared exactly as the operator wrote them. `sign`: this worker's
    assertion of a principal it authenticated itself (ServerSecurity.assertion)."""

    def __init__(
        self,
        allowed: tuple[str, ...],
        max_message_bytes: int,
        security: ClientSecurity = ClientSecurity(),
        sign=lambda principal: None,
    ):
        self.allowed = frozenset(allowed)
        self.replicas: frozenset[str] = frozenset()  # workers of this one's range it may hand sessions to
        self.security = security
        self.sign = sign
        self._options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            *RECONNECT_OPTIONS,
            *KEEPALIVE_OPTIONS,
        ]
        self._stubs: dict[str, pb_grpc.ShardServiceStub] = {}
        self._channels: list[grpc.Channel] = []
        self._lock = threading.Lock()

    def allow(self, addresses) -> None:
        """Adds workers this one may forward to (a mesh's members, as they come to serve)."""
        with self._lock:
            self.allowed = self.allowed | frozenset(addresses)

    def _stub(self, address: str) -> pb_grpc.ShardServiceStub:
        assert address in self.allowed or address in self.replicas
        with self._lock:
            stub = self._stubs.get(address)
            if stub is None:
                channel = self.security.channel(address, self._options)
                self._channels.append(channel)
                stub = self._stubs[address] = pb_grpc.ShardServiceStub(channel)
            return stub

    def call(
        self,
        address: str,
        steps: list[tuple],
        forward: list,
        timeout: float,
        batch: bool,
        principal: str = ANONYMOUS,
        visited: tuple[str, ...] = (),
        assertion: bytes | None = None,
    ) -> list:
        """One RPC to `address` with (kind, StepRequest) steps: Prefill/Decode for a lone step
        that came alone, else StepBatch, for `principal`, through the workers `visited`; raises
        grpc.RpcError when the peer fails. `assertion`: the one a forwarded step came with (passed
        on unchanged); None: this worker is the head and signs for the principal itself."""
        stub = self._stub(address)
        metadata = self._metadata(principal, visited, assertion)
        if not batch and len(steps) == 1:
            kind, req = steps[0]
            del req.forward[:]  # a retry sends the same hops once
            req.forward.extend(forward)
            method = stub.Prefill if kind == StepKind.PREFILL else stub.Decode
            return [method(req, timeout=timeout, metadata=metadata)]
        kinds = {StepKind.PREFILL: pb.STEP_KIND_PREFILL, StepKind.DECODE: pb.STEP_KIND_DECODE}
        request = pb.StepBatchRequest(steps=[pb.BatchedStep(kind=kinds[k], step=r) for k, r in steps], forward=forward)
        replies = list(stub.StepBatch(request, timeout=timeout, metadata=metadata).replies)
        if len(replies) != len(steps):
            detail = f"worker {address} answered {len(replies)} of {len(steps)} steps"
            return [pb.StepReply(outcome=pb.OUTCOME_INTERNAL, detail=detail) for _ in steps]
        return replies

    def _metadata(self, principal: str, visited: tuple[str, ...], assertion: bytes | None) -> list[tuple]:
        """A forwarded call's: the workers it passed through, the principal it is for (and the
        head's assertion of it)."""
        metadata = [(VISITED, ",".join(visited))]
        if principal != ANONYMOUS:  # -bin: a principal is any text (a certificate's CN), metadata is ASCII
            metadata.append((ON_BEHALF_OF, principal.encode("utf-8")))
            signed = assertion if assertion is not None else self.sign(principal)
            if signed is not None:
                metadata.append((ON_BEHALF_OF_SIG, signed))
        return metadata

    def receipt(
        self,
        address: str,
        request: pb.ReceiptRequest,
        timeout: float,
        principal: str = ANONYMOUS,
        visited: tuple[str, ...] = (),
        assertion: bytes | None = None,
    ) -> pb.ReceiptReply:
        """The receipts of `address` and the hops after it for one request (chained as steps are);
        raises grpc.RpcError when the peer fails."""
        return self._stub(address).Receipt(
            request, timeout=timeout, metadata=self._metadata(principal, visited, assertion)
        )

    def release(self, address: str, session_id: str, epoch: int, timeout: float) -> pb.SessionReply:
        """Releases a session this worker opened on `address` as itself (a head's spot check);
        raises grpc.RpcError when the peer fails."""
        return self._stub(address).Release(pb.SessionRequest(session_id=session_id, route_epoch=epoch), timeout=timeout)

    def info(self, address: str, timeout: float) -> pb.InfoReply:
        """The peer's Info (a probe); raises grpc.RpcError when it does not answer in time."""
        return self._stub(address).Info(pb.InfoRequest(), timeout=timeout)

    def handover(self, address: str, messages: list[pb.HandoverRequest], timeout: float) -> pb.SessionReply:
        """One session's KV (handover.handover_messages) to a replica of this worker's range
        (`address` among self.replicas or the allowed peers); raises grpc.RpcError when it cannot
        be reached."""
        stub = self._stub(address)
        deadline = time.monotonic() + timeout
        return call_reconnecting(
            lambda: stub.Handover(iter(messages), timeout=max(0.001, deadline - time.monotonic())), deadline
        )

    def close(self) -> None:
        for channel in self._channels:
            channel.close()
