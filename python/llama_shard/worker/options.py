"""What a worker is told at start: its address, threads and device, its step loop's knobs, its peers,
security and bounds (`serve`'s flags; a head's own are head/options.py)."""

from __future__ import annotations

import dataclasses

from .._native import CPU_DEVICE, DEFAULT_GATHER_S, DEFAULT_PREFILL_CHUNK, HotKvConfig
from ..proto.credentials import ClientSecurity
from ..receipts.keys import NodeKey
from . import DEFAULT_MAX_HOP_S
from .security import ServerSecurity


@dataclasses.dataclass
class WorkerOptions:
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port (see ShardWorker.port)
    metrics_port: int | None = None  # None: no metrics endpoint
    metrics_host: str = "127.0.0.1"  # plaintext and unauthenticated: loopback unless the operator says --insecure
    threads: int | None = None
    device: str = CPU_DEVICE  # where the owned layers run: cpu, auto or a device name (Vulkan0)
    gpu_layers: int = -1  # owned layers on the device, the first of the range (-1: all)
    cpu_moe_layers: int = 0  # of those, the first N keep their experts in host memory (-1: all)
    n_batch: int = HotKvConfig().n_batch
    gather_s: float = DEFAULT_GATHER_S  # longest wait for as many sessions as the last step had
    max_step_sessions: int | None = None  # None: up to max_sessions per engine step
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK  # most tokens of one prefill per step while others wait
    max_message_bytes: int = 64 * 2**20
    grace_s: float = 5.0
    peers: tuple[str, ...] = ()  # workers chained steps may be forwarded to (host:port)
    sweep_s: float = 10.0  # how often idle sessions are checked against the TTLs (0: only on requests)
    security: ServerSecurity = dataclasses.field(default_factory=ServerSecurity)  # TLS, authentication, admins
    peer_security: ClientSecurity = ClientSecurity()  # how this worker reaches its peers
    max_sessions_per_principal: int | None = None  # None: no cap beyond the engine's
    max_concurrent_rpcs: int | None = None  # None: 4 x max sessions, at least 64
    max_hop_s: float = DEFAULT_MAX_HOP_S  # the longest a chained step may hold this worker's handler
    share_prefixes: str = "principal"  # whose sessions share prefixes: each principal's own, or "all"
    replicas: tuple[str, ...] = ()  # workers of this one's range it hands its sessions to when drained
    wire_dtype: str = "f32"  # a head: its own route's hidden rows (WIRE_DTYPES) when a request names none
    receipt_key: NodeKey | None = None  # the key receipts are signed with (serve --receipt-key; None: one per process)
