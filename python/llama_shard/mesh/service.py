"""`MeshService` on a mesh's head: who may call (a peer's credentials), then the coordinator's answer.

With authentication, only a trusted worker (`--forwarder`) or an admin may join or fetch, as only
they may hand sessions over: a caller without valid credentials is UNAUTHENTICATED, another
principal PERMISSION_DENIED. A fetch outside the member's ranges is PERMISSION_DENIED, naming why."""

from __future__ import annotations

import grpc

from ..errors import WhyNot
from ..proto import shard_pb2 as pb
from ..proto import shard_pb2_grpc as pb_grpc
from ..worker.peers import check_port_free, server_port_options
from ..worker.security import ServerSecurity
from .coordinator import Mesh


class MeshServicer(pb_grpc.MeshServiceServicer):
    def __init__(self, mesh: Mesh, security: ServerSecurity):
        self.mesh, self.security = mesh, security

    def _principal(self, context) -> str:
        caller = self.security.caller(context)
        if caller.principal is None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, caller.why)
        if self.security.authenticated and caller.principal not in (*self.security.forwarders, *self.security.admins):
            context.abort(
                grpc.StatusCode.PERMISSION_DENIED, "only a trusted worker (--forwarder) or an admin may join a mesh"
            )
        return caller.principal

    def Join(self, request: pb.JoinRequest, context) -> pb.JoinReply:
        return self.mesh.join(self._principal(context), request)

    def Fetch(self, request: pb.FetchRequest, context):
        chunks = self.mesh.fetch(self._principal(context), request)
        if isinstance(chunks, WhyNot):
            context.abort(grpc.StatusCode.PERMISSION_DENIED, chunks.text)
        for data in chunks:
            yield pb.FetchChunk(data=data)


def mesh_server(servicer: MeshServicer, security: ServerSecurity, host: str, port: int) -> tuple[grpc.Server, int]:
    """A server of MeshService alone, bound (a head before its own range is planned): (server, port)."""
    from concurrent import futures

    check_port_free(host, port)  # it shares its port with the head's worker (server_port_options): no one else may
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="mesh-rpc"), options=server_port_options(True)
    )
    pb_grpc.add_MeshServiceServicer_to_server(servicer, server)
    credentials = security.server_credentials()
    address = f"{host}:{port}"
    try:
        bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError as e:  # grpcio raises RuntimeError when the address cannot be bound
        raise OSError(f"cannot bind {address}: {e}") from None
    if bound == 0:
        raise OSError(f"cannot bind {address}")
    server.start()
    return server, bound
