"""A worker process (`llama-shard serve`): one shard loaded, its engine served over gRPC with the head
on it, the health service, metrics and the OpenAI endpoint; it shuts down gracefully.

- `ShardService` (proto/shard.proto), worker/servicer.py: every expected outcome is a typed reply; a
  gRPC status is used only for transport matters (deadline, size limit, shutting down).
- Standard gRPC health service (`grpc.health.v1`), SERVING once the model is loaded (a head with
  later stages: while each has a healthy replica).
- Prometheus metrics (`prometheus-client`) on --metrics-port: live sessions, reserved and budget
  tokens, evictions and misses by reason, step latency, batch size.
- Binds to loopback unless told otherwise; request size limits; SIGTERM/SIGINT: stop accepting,
  finish in-flight steps, release every session, report, exit 0.
"""

from __future__ import annotations

import signal
import socket
import sys
import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, start_http_server

from ._native import ShardModel
from .engine.hot_kv import HotKvStateConfig
from .engine.manager import HotKvStateManager
from .engine.verification_sizes import decide_verification_sizes
from .engine.verification_sizes import describe as describe_verification_sizes
from .errors import LlamaShardError
from .head.generation import max_generate_streams
from .head.options import HeadOptions
from .head.role import Head
from .proto import shard_pb2_grpc as pb_grpc
from .worker.admission import AdmitRequests
from .worker.metrics import EngineCollector
from .worker.options import WorkerOptions
from .worker.peers import SERVER_KEEPALIVE_OPTIONS, check_port_free, server_port_options
from .worker.servicer import ShardServicer

SERVICE_NAME = "llama_shard.v1.ShardService"


class ShardWorker:
    """Loads a shard, serves it, and shuts down gracefully."""

    def __init__(
        self,
        model_path: str,
        layers: tuple[int, int] | None,
        config: HotKvStateConfig,
        options: WorkerOptions | None = None,
        head_options: HeadOptions | None = None,
        services: tuple = (),
        share_port: bool = False,
    ):
        """`services`: functions that add a gRPC service beside ShardService (a mesh head's MeshService);
        `share_port`: bind beside the mesh head's own server on its port (server_port_options)."""
        options = options or WorkerOptions()  # a fresh one each: the options are mutable
        head_options = head_options or HeadOptions()
        self.options = options
        self.model = ShardModel(
            str(model_path), layers, options.threads, options.device, options.gpu_layers, options.cpu_moe_layers
        )
        self.manager = HotKvStateManager(
            self.model,
            config,
            n_batch=options.n_batch,
            n_threads=options.threads,
            max_step_sessions=options.max_step_sessions,
            prefill_chunk=options.prefill_chunk,
            gather_s=options.gather_s,
        )
        self.registry = CollectorRegistry()
        info = self.model.info
        self.registry.register(EngineCollector(self.manager, {"layers": f"{info.first}-{info.last}"}))
        head_options.check(info.first, info.last)  # before anything binds or serves
        self.servicer = ShardServicer(self.model, self.manager, self.registry, options)  # checks the options first
        self.head = Head(self.servicer, head_options, self.registry, options.threads)
        self.servicer.attach_head(self.head)
        _decide_verification_sizes(self.manager)
        self.health = health.HealthServicer()
        # past max_concurrent_rpcs gRPC itself answers RESOURCE_EXHAUSTED, before any handler runs (and the
        # HTTP endpoint 429, counting its requests in flight)
        self.max_concurrent_rpcs = options.max_concurrent_rpcs or max(64, 4 * config.max_sessions)
        self.admission = AdmitRequests(max_in_flight_bytes=self.servicer.bounds.in_flight)
        self.share_port = share_port  # a mesh head's worker binds beside its own mesh server
        self.server = self._grpc_server(config)
        for add_service in services:
            add_service(self.server)
        self.port = self._bind()
        self.metrics_port, self._metrics_server = None, None
        if options.metrics_port is not None:
            server, _ = start_http_server(options.metrics_port, addr=options.metrics_host, registry=self.registry)
            self.metrics_port, self._metrics_server = server.server_port, server
        self.http = self._http_endpoint(head_options)
        if self.http is not None:
            self.http.mesh = head_options.mesh
        self._stopped = threading.Event()

    def _grpc_server(self, config: HotKvStateConfig) -> grpc.Server:
        """The gRPC server with the shard service and the health service, not bound yet."""
        server = grpc.server(
            # a Generate stream holds a handler thread for its life: room for every stream beside the steps
            futures.ThreadPoolExecutor(
                max_workers=max(8, 2 * config.max_sessions)
                + max_generate_streams(config.max_sessions, config.warm_bytes),
                thread_name_prefix="shard-rpc",
            ),
            options=[
                ("grpc.max_receive_message_length", self.servicer.bounds.request),
                ("grpc.max_send_message_length", self.options.max_message_bytes),  # logits can outweigh any request
                *SERVER_KEEPALIVE_OPTIONS,
                *server_port_options(self.share_port),  # a port in use fails the bind (_bind)
            ],
            maximum_concurrent_rpcs=self.max_concurrent_rpcs,
            interceptors=[self.admission],
        )
        pb_grpc.add_ShardServiceServicer_to_server(self.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        return server

    def _bind(self) -> int:
        """The port bound (OSError when it cannot be); a step forwarded to it is a loop."""
        options = self.options
        credentials = options.security.server_credentials()
        if not self.share_port:
            check_port_free(options.host, options.port)
        try:
            address = f"{options.host}:{options.port}"
            port = (
                self.server.add_secure_port(address, credentials)
                if credentials is not None
                else self.server.add_insecure_port(address)
            )
        except RuntimeError as e:  # grpcio raises RuntimeError when the address cannot be bound
            raise OSError(f"cannot bind {options.host}:{options.port}: {e} (in use by another process?)") from None
        if port == 0:
            raise OSError(f"cannot bind {options.host}:{options.port} (in use by another process?)")
        self.servicer.steps.own_addresses = frozenset(
            f"{h}:{port}" for h in {options.host, "127.0.0.1", "localhost", "[::1]", socket.gethostname()}
        )
        return port

    def _http_endpoint(self, head_options: HeadOptions):
        """The OpenAI-compatible endpoint when --http-port asks for one (not started yet)."""
        if head_options.http_port is None:
            return None
        from .head.openai.endpoint import OpenAIEndpoint  # aiohttp and jinja2 load only where HTTP is served

        return OpenAIEndpoint(
            self.head.generation,
            self.model,
            self.options.security,
            self.options.host,
            head_options.http_port,
            self.max_concurrent_rpcs,
            head_options.http_limits,
            head_options.http_split_special_tokens,
            head_options.chat_template,
            self.registry,
        )

    @property
    def address(self) -> str:
        return f"{self.options.host}:{self.port}"

    def start(self) -> "ShardWorker":
        if self.http is not None:
            self.http.start()  # binds first: a port in use fails the start, not a request later
        self.server.start()
        self.servicer.on_draining = lambda: self._set_health(False, "draining: handing its sessions to a replica")
        self.head.start(self._set_health)
        replicas = self.head.replicas
        if self.http is not None:
            self.http.route_health = replicas.route_health if replicas is not None else None
        if self.options.sweep_s > 0:
            # TTLs apply on a quiet worker too: idle sessions move warm (or go) without a request
            threading.Thread(target=self._sweep_until_stopped, name="shard-ttl-sweep", daemon=True).start()
        return self

    def _set_health(self, ok: bool, detail: str) -> None:
        if self._stopped.is_set():
            return
        if ok and self.servicer.moves.draining:  # a draining worker takes no new session, whatever its route
            ok, detail = False, "draining: handing its sessions to a replica"
        status = health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
        self.health.set("", status)
        self.health.set(SERVICE_NAME, status)
        if not ok:
            print(f"llama-shard worker: NOT_SERVING: {detail}", file=sys.stderr, flush=True)
        elif self.head.replicas is not None:
            print("llama-shard worker: SERVING: every later stage has a healthy replica", file=sys.stderr, flush=True)

    def _sweep_until_stopped(self) -> None:
        while not self._stopped.wait(self.options.sweep_s):
            self.manager.sweep()

    def allow_peers(self, addresses) -> None:
        """Workers this one may forward to from now on, beside its --peer ones (a mesh's members)."""
        self.servicer.peers.allow(addresses)

    def stop(self, hand_to: tuple[str, ...] | None = None) -> dict:
        """With --replica workers (or `hand_to`, a mesh's replicas of this range): first hands every
        live session to one of them (the steps that come for a session afterwards are told where it
        went, for up to grace_s). Then stops accepting, finishes in-flight steps, writes every session
        left to the disk tier (with --warm-dir: a restarted worker resumes them) or releases it;
        returns a report."""
        if self._stopped.is_set():
            return {}
        handed = 0
        replicas = tuple(self.options.replicas if hand_to is None else hand_to)
        if hand_to is not None:
            self.servicer.peers.replicas = frozenset(hand_to)
        if replicas and not self.servicer.moves.draining:
            reply = self.servicer.drain(replicas)
            handed = reply.handed_over
            print(
                f"llama-shard worker: handed {reply.handed_over} session(s) to a replica in {reply.seconds:.2f} s"
                + (f", released {reply.released}: {reply.detail}" if reply.released else ""),
                file=sys.stderr,
                flush=True,
            )
        if self.servicer.moves.moved:  # the heads follow a moved session at its next step
            self.servicer.moves.wait_asked(self.options.grace_s)
        self._stopped.set()
        self.health.enter_graceful_shutdown()
        self.servicer.stopping.set()
        self.head.wait_idle(self.options.grace_s)
        if self.http is not None:
            self.http.stop(self.options.grace_s)
        self.server.stop(self.options.grace_s).wait()
        if self._metrics_server is not None:  # (a mesh's member that moves serves its port again)
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
        self.manager.close()
        self.head.close()
        self.servicer.peers.close()
        persisted = released = 0
        if self.manager.config.warm_dir is not None:
            persisted = self.manager.persist()
        else:
            keys = self.manager.session_keys()
            released = sum(1 for sid, ep in keys if self.manager.release(sid, ep))
        st = self.manager.stats()
        return {
            "released_sessions": released,
            "persisted_sessions": persisted,
            "handed_over_sessions": handed,
            "reserved_tokens_after": st["reserved_tokens"],
        }

    def _reload_credentials(self) -> None:
        """SIGHUP: the token file again (certificates are re-read when their files change)."""
        try:
            self.options.security.reload()
            print("llama-shard worker: credentials reloaded", file=sys.stderr, flush=True)
        except (OSError, ValueError) as e:
            print(f"llama-shard worker: credentials not reloaded, the old ones stay: {e}", file=sys.stderr, flush=True)

    def serve_until_signal(self) -> int:
        # the handler only records the signal: Event.set() from a handler can deadlock on the lock
        # the interrupted Event.wait() in this same thread holds
        received: list[int] = []
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, _frame: received.append(signum))
        reload: list[int] = []
        signal.signal(signal.SIGHUP, lambda signum, _frame: reload.append(signum))
        info = self.model.info
        print(
            f"llama-shard worker: layers {info.first}-{info.last} of {info.n_layer} ({info.architecture}) "
            f"serving on {self.address}"
            + (f", metrics on :{self.metrics_port}" if self.metrics_port else "")
            + (f", OpenAI API on {self.http.scheme}://{self.options.host}:{self.http.port}/v1" if self.http else ""),
            file=sys.stderr,
            flush=True,
        )
        while not received:
            time.sleep(0.1)
            if reload:
                reload.clear()
                self._reload_credentials()
        report = self.stop()
        kept = (
            f"wrote {report['persisted_sessions']} session(s) to {self.manager.config.warm_dir}, "
            if self.manager.config.warm_dir is not None
            else ""
        )
        print(
            f"llama-shard worker: shut down; {kept}released {report['released_sessions']} session(s), "
            f"{report['reserved_tokens_after']} tokens still reserved",
            file=sys.stderr,
            flush=True,
        )
        return 0


def _decide_verification_sizes(manager: HotKvStateManager) -> None:
    """Each verification size's one-time comparison (one call against row by row) now, not in a request."""
    try:
        verdicts, seconds = decide_verification_sizes(manager)
        if verdicts:
            print(f"llama-shard worker: {describe_verification_sizes(verdicts, seconds)}", file=sys.stderr, flush=True)
    except LlamaShardError as e:  # the first verification of each size decides it, as before
        print(
            f"llama-shard worker: verification sizes not decided at start-up ({e}); the first "
            f"verification of each size decides it",
            file=sys.stderr,
            flush=True,
        )
