"""`llama-shard serve --mesh-members N` (a mesh's head) and `serve --join HEAD` (a member): the mesh's
parts (mesh/) put together with a worker's (node.py), from the same flags as any worker."""

from __future__ import annotations

import argparse
import dataclasses
import signal
import threading
from pathlib import Path

from ..engine.hot_kv import parse_size
from ..errors import InvalidInputError, WhyNot
from .common import model_path, status
from .serve import cmd_serve, head_options_of, serve_config, serve_security, worker_options_of

#: how long a mesh's head waits for its members unless told (--mesh-wait)
DEFAULT_MESH_WAIT_S = 120.0
#: where a joining node keeps its range files unless told (--mesh-cache)
DEFAULT_CACHE = Path.home() / ".cache" / "llama-shard" / "ranges"


def cmd_serve_or_mesh(args: argparse.Namespace) -> int:
    """`serve`: a mesh's head, a member, or a worker of the range its flags give."""
    check_mesh_flags(args)
    if args.join is not None:
        return serve_joined(args)
    if args.mesh_members is not None:
        return serve_mesh_head(args)
    return cmd_serve(args)


def check_mesh_flags(args: argparse.Namespace) -> None:
    """Refuses mesh flags that contradict each other or the worker's (nothing has started)."""
    head, member = args.mesh_members is not None, args.join is not None
    if head and member:
        raise InvalidInputError("--mesh-members (a mesh's head) and --join (a member): one or the other")
    if (head or member) and args.layers not in (None, "all"):
        raise InvalidInputError("a mesh's head plans every range: --layers goes without --mesh-members and --join")
    if (head or member) and args.kv_memory is not None:
        raise InvalidInputError("a mesh plans its members' memory (--mesh-memory): --kv-memory goes without it")
    if head and (args.peer or args.replica):
        raise InvalidInputError("a mesh's head takes its route from its members: --peer and --replica go without it")
    if member and (args.peer or args.replica or args.http_port is not None or args.draft_model is not None):
        raise InvalidInputError(
            "a member takes its peers and replicas from the head, and serves no generation: "
            "--peer, --replica, --http-port and --draft-model go without --join"
        )
    if not member and args.mesh_cache is not None:
        raise InvalidInputError("--mesh-cache is where a joining node keeps its ranges: give --join too")
    if args.mesh_announce and not head:
        raise InvalidInputError("--mesh-announce announces a mesh's head: give --mesh-members too")
    if args.mesh_wait is not None and not head:
        raise InvalidInputError("--mesh-wait is how long a mesh's head waits for its members: give --mesh-members too")
    args.mesh_wait = DEFAULT_MESH_WAIT_S if args.mesh_wait is None else args.mesh_wait
    if not (head or member) and args.mesh_memory is not None:
        raise InvalidInputError("--mesh-memory is what a mesh's member or head offers: give --join or --mesh-members")


def _memory(args: argparse.Namespace) -> int:
    from ..mesh.measure import available_memory

    return parse_size(args.mesh_memory) if args.mesh_memory is not None else available_memory()


def serve_mesh_head(args: argparse.Namespace) -> int:
    """Waits for the members, plans, serves its own range with the members as its route."""
    from ..engine.models import gguf_shape
    from ..engine.range_file import content_digest
    from ..head.planner import Member, ModelCosts
    from ..mesh.coordinator import HEAD, HEARTBEAT_S, Mesh
    from ..mesh.manifest import RangeSource
    from ..mesh.measure import time_one_layer
    from ..mesh.service import MeshServicer, mesh_server
    from ..node import ShardWorker
    from ..proto import shard_pb2_grpc as pb_grpc

    security, peer_security = serve_security(args)
    head_options = head_options_of(args)
    path = str(model_path(args.model))
    whole, _ = serve_config(args, None)  # the sessions and context every stage holds
    costs = ModelCosts.of(gguf_shape(path), whole.max_sessions, whole.context_tokens, args.batch)
    mesh = Mesh(RangeSource(path), content_digest(path), costs, whole.max_sessions, whole.context_tokens)
    mesh.source.manifest(mesh.probe_layer, mesh.probe_layer)  # what every member asks for first, made now
    servicer = MeshServicer(mesh, security)
    server, port = mesh_server(servicer, security, args.host, args.port)
    status(f"mesh head on {args.host}:{port}: waiting for {args.mesh_members} member(s), {args.mesh_wait:g} s at most")
    announcement = _announce(args, port, mesh.model_digest) if args.mesh_announce else None
    decode_s, prefill_s, backend = time_one_layer(path, mesh.probe_layer, args.threads, args.device)
    status(f"this head: {decode_s * 1e3:.3f} ms a token per layer on {backend} (prefill {prefill_s * 1e3:.3f} ms)")
    head = Member(HEAD, _memory(args), decode_s, prefill_s, backend=backend)
    plan = mesh.wait_planned(head, args.mesh_members, args.mesh_wait)
    if isinstance(plan, WhyNot):
        server.stop(None)
        raise InvalidInputError(f"no plan: {plan.text}")
    status("plan:\n" + mesh.describe())
    serving = mesh.wait_serving(args.mesh_wait)
    stopped = threading.Event()

    def tick():
        while not stopped.wait(HEARTBEAT_S):
            mesh.tick()

    threading.Thread(target=tick, name="mesh-tick", daemon=True).start()
    config, _ = serve_config(args, mesh.head_range)
    options = dataclasses.replace(worker_options_of(args, security, peer_security), port=port, peers=tuple(serving))
    head_options.mesh = mesh
    # the head worker binds the same port beside the mesh's server (both set SO_REUSEPORT, alone of
    # llama-shard's servers: server_port_options) and serves MeshService too; the mesh's server stops
    # once it serves: members never find the port closed
    worker = ShardWorker(
        path,
        mesh.head_range,
        config,
        options,
        head_options,
        services=(lambda s: pb_grpc.add_MeshServiceServicer_to_server(servicer, s),),
        share_port=True,
    )
    mesh.attach(worker.head.admit_member)
    worker.start()
    server.stop(60)  # new calls go to the worker's server; fetches in flight may finish
    try:
        return worker.serve_until_signal()
    finally:
        stopped.set()
        if announcement is not None:
            announcement.close()


def _announce(args: argparse.Namespace, port: int, model_digest: str):
    try:
        from ..mesh.discovery import Announcement
    except ImportError:
        raise InvalidInputError("--mesh-announce needs zeroconf: pip install 'llama-shard[mdns]'") from None
    announcement = Announcement(args.host, port, model_digest)
    status(f"announced on the local network as {announcement.info.name}")
    return announcement


def _head_address(args: argparse.Namespace, model_digest: str) -> str:
    """--join's head: as given, or (auto) the first one announced on the local network."""
    if args.join != "auto":
        return args.join
    try:
        from ..mesh.discovery import DISCOVER_S, discover
    except ImportError:
        raise InvalidInputError("--join auto needs zeroconf: pip install 'llama-shard[mdns]'") from None
    found = discover(model_digest)
    if found is None:
        raise InvalidInputError(
            f"--join auto: no mesh head announced itself on the local network within {DISCOVER_S:g} s "
            "(the head needs --mesh-announce; across networks give its HOST:PORT)"
        )
    status(f"found the mesh head {found} by mDNS")
    return found


class _ServingWorker:
    """A member's ShardWorker as mesh/member.py drives it."""

    def __init__(self, worker, advertised_host: str):
        self.worker = worker
        self.address = f"{advertised_host}:{worker.port}"

    def allow_peers(self, addresses: list[str]) -> None:
        self.worker.allow_peers(addresses)

    def stop(self, hand_to: tuple[str, ...]) -> None:
        self.worker.stop(hand_to)


def _advertised(host: str) -> str:
    """The host others reach this member at: its --host, or this machine's name's address where it
    binds every interface."""
    if host in ("0.0.0.0", "::", ""):
        import socket

        return socket.gethostbyname(socket.gethostname())
    return host


def serve_joined(args: argparse.Namespace) -> int:
    """Joins the head at --join and serves what it is given until SIGTERM/SIGINT."""
    from ..engine.hot_kv import HotKvStateConfig
    from ..engine.range_file import content_digest
    from ..head.options import HeadOptions
    from ..mesh.manifest import RangeCache
    from ..mesh.member import JoinedNode, MeshRefused
    from ..node import ShardWorker

    security, peer_security = serve_security(args)
    model = str(model_path(args.model)) if args.model is not None else None

    def start_worker(path: str, layers: tuple[int, int], max_sessions: int, context_tokens: int):
        config = HotKvStateConfig(max_sessions=max_sessions, context_tokens=context_tokens)
        worker = ShardWorker(path, layers, config, worker_options_of(args, security, peer_security), HeadOptions())
        return _ServingWorker(worker.start(), _advertised(args.host))

    digest = content_digest(model) if model is not None else ""
    node = JoinedNode(
        _head_address(args, digest),
        peer_security,
        start_worker,
        RangeCache(args.mesh_cache or DEFAULT_CACHE),
        _memory(args),
        args.threads,
        model,
        digest,
        args.device,
    )
    # the handler only records the signal (an Event set from it can deadlock the thread it interrupts)
    received: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: received.append(signum))
    stop, outcome = threading.Event(), []

    def run():
        try:
            outcome.append(node.run(stop))
        except Exception as e:  # noqa: BLE001 - reported by the main thread
            outcome.append(e)

    thread = threading.Thread(target=run, name="mesh-member", daemon=True)
    thread.start()
    while thread.is_alive() and not received:
        thread.join(0.1)
    stop.set()
    thread.join(60)  # (a fetch or a measurement in progress is not waited for longer)
    if not outcome:
        return 0
    if isinstance(outcome[0], MeshRefused):
        raise InvalidInputError(f"--join {args.join}: {outcome[0]}")
    if isinstance(outcome[0], Exception):
        raise outcome[0]
    return outcome[0]
