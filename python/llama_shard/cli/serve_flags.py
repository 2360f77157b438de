"""`llama-shard serve`'s flags, by group (the order of the groups is the order of its help)."""

from __future__ import annotations

import argparse
import os

from .._native import DEFAULT_GATHER_S, DEFAULT_PREFILL_CHUNK, MAX_SESSIONS
from ..head.openai.guard import HttpLimits
from ..head.planner import MAX_MEMBERS
from ..head.speculation import DRAFT_SOURCES, VERIFY_MODES
from ..proto.requests import DEFAULT_MAX_DRAFTS, MAX_DRAFTS, MIN_BATCH_TOKENS
from ..proto.wire import WIRE_DTYPES
from ..worker import DEFAULT_MAX_HOP_S
from .common import DEFAULTS
from .types import (
    CONTEXT_TOKENS,
    THREADS,
    TOKENS,
    count,
    deprecated_alias,
    milliseconds_within_a_second,
    port_number,
    positive_seconds,
    seconds,
    share,
    size,
)


def add_serve_flags(sv: argparse.ArgumentParser) -> None:
    for flags in (
        _http_flags,
        _http_limit_flags,
        _http_browser_flags,
        _chat_flags,
        _metrics_flags,
        _device_flags,
        _route_flags,
        _mesh_flags,
        _step_flags,
        _kv_flags,
        _tier_flags,
        _speculation_flags,
        _proof_flags,
    ):
        flags(sv)


def _http_flags(sv: argparse.ArgumentParser) -> None:
    """The HTTP port's timeouts."""
    lim = HttpLimits()
    sv.add_argument(
        "--http-header-timeout",
        type=positive_seconds,
        default=lim.header_timeout_s,
        metavar="S",
        help="a connection's TLS handshake and request headers must arrive within S seconds (from accept; "
        f"on a kept-alive connection from the request's first byte) (default {lim.header_timeout_s:g})",
    )
    sv.add_argument(
        "--http-body-timeout",
        type=positive_seconds,
        default=lim.body_timeout_s,
        metavar="S",
        help=f"a request's whole body must arrive within S seconds of its headers (default {lim.body_timeout_s:g})",
    )
    sv.add_argument(
        "--http-idle-timeout",
        type=positive_seconds,
        default=lim.idle_timeout_s,
        metavar="S",
        help=f"a kept-alive connection is closed after S idle seconds (default {lim.idle_timeout_s:g})",
    )
    sv.add_argument(
        "--http-write-timeout",
        type=positive_seconds,
        default=lim.write_timeout_s,
        metavar="S",
        help="a client that reads nothing of its response for S seconds is dropped and its stream stopped "
        f"(default {lim.write_timeout_s:g})",
    )


def _http_limit_flags(sv: argparse.ArgumentParser) -> None:
    """The HTTP port's caps: connections, requests per caller, bodies per address and in memory."""
    lim = HttpLimits()
    sv.add_argument(
        "--http-max-connections",
        type=count(1, 1 << 20),
        default=None,
        metavar="N",
        help="open HTTP connections at most; at the cap a new one replaces the oldest without a request "
        "running (default: a quarter of the open-file limit, at most 512)",
    )
    sv.add_argument(
        "--http-max-requests-per-principal",
        type=count(1, 1 << 20),
        default=None,
        metavar="N",
        help="HTTP requests in flight per caller (default: all of --max-concurrent-rpcs without "
        "authentication, half of them with)",
    )
    sv.add_argument(
        "--http-max-bodies-per-address",
        type=count(1, 1 << 20),
        default=lim.max_bodies_per_address,
        metavar="N",
        help="request bodies one address may have arriving at once on a worker without "
        f"authentication (429 past it; default {lim.max_bodies_per_address}): a slow sender holds no "
        "generation slot, and only this many places of its own",
    )
    sv.add_argument(
        "--http-body-memory",
        type=size,
        default=None,
        metavar="SIZE",
        help="memory for request bodies being read at once, each reserving its declared length "
        f"(503 past it; default {lim.body_memory_bytes // 2**20}MiB)",
    )


def _http_browser_flags(sv: argparse.ArgumentParser) -> None:
    """What a web page may do with the HTTP port: Host names, CORS origins."""
    sv.add_argument(
        "--http-allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a Host name a plaintext HTTP port answers besides IP literals and localhost (repeatable; "
        "a page's own name is refused: DNS rebinding)",
    )
    sv.add_argument(
        "--http-cors-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="a web page origin (scheme://host[:port]) allowed to call the HTTP endpoint from a browser "
        "(CORS; repeatable; '*': any page, which on a port without authentication lets any page "
        "drive the worker; default: none)",
    )


def _chat_flags(sv: argparse.ArgumentParser) -> None:
    """How the HTTP endpoint reads chats: special tokens in messages, the chat template."""
    sv.add_argument(
        "--http-split-special-tokens",
        action="store_true",
        help="tokenize the text of chat messages as plain text, so a caller's '<|im_end|>' is those "
        "characters, not the model's turn marker (transformers' split_special_tokens; default: parsed "
        "as llama-server parses it)",
    )
    sv.add_argument(
        "--chat-template-file",
        default=None,
        metavar="FILE",
        help="a Jinja chat template that replaces the GGUF's for the HTTP endpoint (for example one that "
        "renders tools as <tool_call> blocks); at most 1 MiB of UTF-8",
    )


def _metrics_flags(sv: argparse.ArgumentParser) -> None:
    """The Prometheus endpoint."""
    sv.add_argument("--metrics-port", type=port_number, default=None, help="Prometheus metrics port (default: off)")
    sv.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="metrics bind address (default: loopback; the endpoint is plaintext and unauthenticated, "
        "so another address needs --insecure)",
    )


def _device_flags(sv: argparse.ArgumentParser) -> None:
    sv.add_argument("--threads", type=THREADS, default=None)
    sv.add_argument(
        "--device",
        default=os.environ.get("LLAMA_SHARD_DEVICE") or "auto",
        metavar="auto|cpu|NAME|list",
        help="where the owned layers and their KV run (default: LLAMA_SHARD_DEVICE or auto): 'auto': the "
        "first GPU ggml lists that "
        "passes a start-up self-check, else the CPU; 'cpu'; a device by ggml's name (Vulkan0, "
        "CUDA0), which must pass its self-check; 'list': print the devices and exit",
    )
    sv.add_argument(
        "--gpu-layers",
        type=count(0, 1 << 16),
        default=None,
        metavar="N",
        help="owned layers on the device, the first N of the range (default: all of them, and a tail's "
        "output layer with them; 0: the CPU)",
    )
    cpu_moe_flags(sv)


def _route_flags(sv: argparse.ArgumentParser) -> None:
    """The worker's place in a route: its peers, replicas, the rows' wire type, a hop's longest hold."""
    sv.add_argument(
        "--peer",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="a worker this one may forward chained steps to (repeatable; no other address is contacted). "
        "On the head: every later worker; several of one layer range are replicas of a stage "
        "(sessions are spread over them and fail over between them)",
    )
    sv.add_argument(
        "--replica",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="a worker of this one's layer range that takes its live sessions' KV when it is stopped "
        "(SIGTERM) or drained (repeatable, tried in order; without one, sessions are released)",
    )
    sv.add_argument(
        "--wire-dtype",
        choices=tuple(WIRE_DTYPES),
        default="f32",
        help="a head: how its own route's hidden rows travel between the workers when a request names "
        "no wire_dtype; 'f32' (default): exact, the tokens of the whole model on one worker; 'f16': "
        "half the bytes; 'q8_0': 0.27 of them (llama.cpp's 8-bit blocks). Both round the rows, so "
        "a near-tie may go another way (docs/benchmarks.md measures how often). Every --peer must "
        "read the type, or the head refuses to start",
    )
    sv.add_argument(
        "--max-hop-seconds",
        type=positive_seconds,
        default=DEFAULT_MAX_HOP_S,
        metavar="S",
        help="the longest a chained step may hold this worker, whatever the caller's deadline "
        f"(default {DEFAULT_MAX_HOP_S:g})",
    )


def _mesh_flags(sv: argparse.ArgumentParser) -> None:
    """A mesh: a head that plans (--mesh-members), a node that joins it (--join), what each may use."""
    g = sv.add_argument_group("a mesh (the head plans the layers; members join it)")
    g.add_argument(
        "--mesh-members",
        type=count(1, MAX_MEMBERS - 1),
        metavar="N",
        help="be a mesh's head: wait for N members to join (--mesh-wait at most), plan every range "
        "(this worker's included: no --layers), then serve; later members become replicas, and a stage "
        "whose member dies is given to another one",
    )
    g.add_argument(
        "--mesh-wait",
        type=positive_seconds,
        default=None,
        metavar="S",
        help="how long a mesh's head waits for its members before it plans with those it has (default 120)",
    )
    g.add_argument(
        "--mesh-announce",
        action="store_true",
        help="a mesh's head: announce it on the local network by mDNS, so that `--join auto` finds it "
        "(needs zeroconf: pip install 'llama-shard[mdns]')",
    )
    g.add_argument(
        "--join",
        metavar="HOST:PORT|auto",
        help="join the mesh whose head serves there (auto: the first head announced on the local network "
        "by mDNS, of this node's model when --model is given): report, take the range the head gives (no "
        "--layers), fetching only its tensors where --model is not given (peer credentials: "
        "--peer-token-file or --peer-tls-cert; the head lists this node's principal in --forwarder)",
    )
    g.add_argument(
        "--mesh-memory",
        type=size,
        metavar="SIZE",
        help="a mesh member's (or head's) memory for this model: weights, KV, buffers (default: what the "
        "machine has available now)",
    )
    g.add_argument(
        "--mesh-cache",
        metavar="DIR",
        help="where a joining node keeps the range files it fetched (a restart loads them; default "
        "~/.cache/llama-shard/ranges)",
    )


def _step_flags(sv: argparse.ArgumentParser) -> None:
    """The engine's steps: tokens per llama_decode, gathering, sessions and prompt tokens per step."""
    sv.add_argument(
        "--batch",
        type=count(MIN_BATCH_TOKENS, 1 << 16),
        default=DEFAULTS.engine_config().n_batch,
        help=f"most tokens per llama_decode (at least {MIN_BATCH_TOKENS}: a verification of {MAX_DRAFTS} drafts)",
    )
    sv.add_argument(
        "--gather-ms",
        type=milliseconds_within_a_second,
        default=DEFAULT_GATHER_S * 1000.0,
        help="after a step, the longest wait for as many sessions as it had to send their next step (0: never wait)",
    )
    sv.add_argument(
        "--max-step-sessions",
        type=count(1, MAX_SESSIONS),
        default=None,
        help="most sessions per engine step (default: max sessions)",
    )
    sv.add_argument(
        "--prefill-chunk",
        type=count(1, 1 << 16),
        default=DEFAULT_PREFILL_CHUNK,
        help="most tokens of one prompt per engine step while other sessions wait",
    )


def _kv_flags(sv: argparse.ArgumentParser) -> None:
    """The hot KV: its memory or slots, context and budget, TTL."""
    sv.add_argument(
        "--kv-memory",
        type=size,
        metavar="SIZE",
        default=None,
        help="hot KV memory, e.g. 512MiB or 2GiB: sizes the hot slots (instead of --max-sessions)",
    )
    sv.add_argument(
        "--max-sessions",
        type=count(1, MAX_SESSIONS),
        default=None,
        help=f"hot slots; default: LLAMA_SHARD_MAX_SESSIONS or {DEFAULTS.max_sessions}",
    )
    sv.add_argument(
        "--context-tokens",
        type=CONTEXT_TOKENS,
        default=None,
        help=f"default: LLAMA_SHARD_CONTEXT_TOKENS or {DEFAULTS.context_tokens}",
    )
    sv.add_argument(
        "--budget-tokens",
        type=TOKENS,
        default=None,
        help="cap on tokens held hot; default: LLAMA_SHARD_BUDGET_TOKENS or slots x context",
    )
    sv.add_argument(
        "--ttl",
        type=seconds,
        default=None,
        help=f"seconds; default: LLAMA_SHARD_TTL_SECONDS or {DEFAULTS.ttl_seconds:g}",
    )
    sv.add_argument(
        "--sweep-seconds",
        type=seconds,
        default=10.0,
        help="how often idle sessions are checked against --ttl and --warm-ttl (0: only when requests arrive)",
    )


def _tier_flags(sv: argparse.ArgumentParser) -> None:
    """The warm and disk tiers, and shared prefixes."""
    sv.add_argument(
        "--warm-memory",
        type=size,
        metavar="SIZE",
        default=None,
        help="host memory for evicted sessions' KV (default: LLAMA_SHARD_WARM_BYTES or 0, off)",
    )
    sv.add_argument(
        "--warm-dir",
        metavar="PATH",
        default=None,
        help="the disk tier: sessions that fall out of --warm-memory go to files here, and a restarted "
        "worker resumes them (default: LLAMA_SHARD_WARM_DIR or none); one worker per directory",
    )
    sv.add_argument(
        "--warm-disk",
        type=size,
        metavar="SIZE",
        default=None,
        help="bound of the disk tier (default: LLAMA_SHARD_WARM_DISK_BYTES; required with --warm-dir)",
    )
    sv.add_argument(
        "--warm-ttl",
        type=seconds,
        default=None,
        help="seconds a warm session stays after its last use; default: LLAMA_SHARD_WARM_TTL_SECONDS or "
        f"{DEFAULTS.warm_ttl_seconds:g}",
    )
    sv.add_argument(
        "--prefix-memory",
        type=size,
        metavar="SIZE",
        default=None,
        help="host memory for shared prefixes: sessions that begin alike (a system prompt) open from a "
        "stored copy of that start instead of computing it (default: LLAMA_SHARD_PREFIX_BYTES or "
        "0, off); every worker of a route needs one for the route to share",
    )
    sv.add_argument(
        "--share-prefixes",
        choices=("principal", "all"),
        default="principal",
        help="whose sessions share prefixes: each caller's own (default), or every caller's; with "
        "'all', a caller's first token comes sooner when another caller sent the same start "
        "before, which tells it that someone did (README: shared prefixes)",
    )


def _speculation_flags(sv: argparse.ArgumentParser) -> None:
    sv.add_argument(
        "--draft",
        choices=DRAFT_SOURCES,
        default="ngram",
        help="speculative decoding on a head's Generate streams: where drafts come from; 'ngram' "
        "(default): the session's own earlier tokens (prompt lookup); 'off': none. The tail "
        "verifies them in one route step; the output is the tokens generation gives without them",
    )
    sv.add_argument(
        "--draft-model",
        metavar="GGUF",
        default=None,
        help="a head's drafts come from this small model (loaded whole; its tokenizer must be the "
        "model's, or the worker refuses to start) instead of prompt lookup",
    )
    sv.add_argument(
        "--draft-verify",
        choices=VERIFY_MODES,
        default="exact",
        help="how the route computes a step of drafts: 'exact' (default): every token as a one-token "
        "step would, to the bit, so the output is, token for token, generation's without drafts (in "
        "one computation where a worker has shown it gives the same bytes, else one at a time); "
        "'batched': in one computation always, cheaper where that is not shown, but llama.cpp may "
        "round by a computation's shape and a near-tie may go the other way",
    )
    deprecated_alias(sv, "--verify", "--draft-verify", choices=VERIFY_MODES)
    sv.add_argument(
        "--max-drafts",
        type=count(0, MAX_DRAFTS),
        default=DEFAULT_MAX_DRAFTS,
        metavar="K",
        help=f"the most drafts per step a request gets unless it sets max_drafts (0..{MAX_DRAFTS}, "
        f"default {DEFAULT_MAX_DRAFTS}); the head uses fewer, or none, where they do not pay",
    )


def _proof_flags(sv: argparse.ArgumentParser) -> None:
    g = sv.add_argument_group("receipts and spot checks (docs/security.md)")
    g.add_argument(
        "--receipt-key",
        metavar="FILE",
        default=None,
        help="the Ed25519 key (PEM) this worker signs its receipts with, made there on first use "
        "(mode 0600; read only when it is this user's and closed to group and others); default: a new "
        "key per process (shown in Info as receipt_key)",
    )
    g.add_argument(
        "--no-receipts",
        dest="receipts",
        action="store_false",
        help="a head: its requests carry no nonce, so no worker commits to their bytes and no receipt "
        "is collected (what receipts cost is measured against this: benchmarks/bench.py --sections proofs)",
    )
    g.add_argument(
        "--spot-check-rate",
        type=share,
        default=0.0,
        metavar="R",
        help="a head: replay this share of requests (0..1, default 0) on other replicas of each stage "
        "that compute the same bytes, and take a worker whose bytes differ out of routes",
    )


def cpu_moe_flags(parser: argparse.ArgumentParser) -> None:
    """llama.cpp's --cpu-moe / --n-cpu-moe: a mixture of experts on one consumer GPU keeps its expert
    tensors in host memory and the rest of each layer on the device."""
    moe = parser.add_mutually_exclusive_group()
    moe.add_argument(
        "--cpu-moe",
        dest="cpu_moe_layers",
        action="store_const",
        const=-1,
        default=0,
        help="on a device: every owned layer's expert tensors in host memory, the rest on the device "
        "(a mixture of experts; nothing changes on the CPU or for a dense model)",
    )
    moe.add_argument(
        "--n-cpu-moe",
        dest="cpu_moe_layers",
        type=count(0, 1 << 16),
        metavar="N",
        help="on a device: the expert tensors of the first N owned layers in host memory",
    )
