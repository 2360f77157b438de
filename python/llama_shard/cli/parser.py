"""The command line's parser: each command's flags, and which function runs it."""

from __future__ import annotations

import argparse
import os

from .._native import CPU_DEVICE, DEFAULT_GATHER_S, DEFAULT_PREFILL_CHUNK, MAX_SESSIONS
from ..engine.hot_kv import KV_TYPES
from ..head.openai.guard import HttpLimits
from ..head.speculation import DRAFT_SOURCES, VERIFY_MODES
from ..proto.requests import DEFAULT_MAX_DRAFTS, MAX_DRAFTS, MIN_BATCH_TOKENS, SAMPLING_PARAMETERS
from ..proto.wire import WIRE_DTYPES
from ..worker import DEFAULT_MAX_HOP_S
from .common import DEFAULTS
from .demo import cmd_demo
from .generate import check_sampling_flags, cmd_generate
from .inspect import cmd_inspect
from .serve import cmd_serve
from .types import (
    CONTEXT_TOKENS,
    THREADS,
    TOKENS,
    count,
    deprecated_alias,
    finite,
    int32,
    milliseconds_within_a_second,
    port_number,
    positive_seconds,
    seconds,
    size,
)


def _server_security_flags(sv: argparse.ArgumentParser) -> None:
    s = sv.add_argument_group("security (README: three set-ups)")
    s.add_argument("--tls-cert", metavar="PATH", help="this worker's certificate chain (PEM); re-read when it changes")
    s.add_argument("--tls-key", metavar="PATH", help="its private key (PEM)")
    s.add_argument(
        "--tls-client-ca",
        metavar="PATH",
        help="mutual TLS: clients must present a certificate this CA signed; the principal is its common name",
    )
    s.add_argument(
        "--auth-token-file",
        metavar="PATH",
        help="'principal:token' lines; clients send 'authorization: Bearer TOKEN'; re-read on SIGHUP",
    )
    s.add_argument(
        "--admin",
        action="append",
        default=[],
        metavar="PRINCIPAL",
        help="a principal that Info shows every session id to (repeatable)",
    )
    s.add_argument(
        "--forwarder",
        action="append",
        default=[],
        metavar="PRINCIPAL",
        help="a worker (its principal) trusted to forward steps on behalf of its callers (repeatable); "
        "needs --route-key-file",
    )
    s.add_argument(
        "--route-key-file",
        metavar="PATH",
        help="the route's secret (32+ bytes, mode 0600, the same file on every worker of a chained "
        "route): the head signs whom it forwards for, the next workers check it",
    )
    s.add_argument(
        "--insecure", action="store_true", help="serve a non-loopback address without TLS and authentication anyway"
    )
    s.add_argument(
        "--max-sessions-per-principal",
        type=count(1),
        default=None,
        metavar="N",
        help="sessions one caller may hold (RESOURCE_EXHAUSTED past it; default: no cap)",
    )
    s.add_argument(
        "--max-concurrent-rpcs",
        type=count(1, 1 << 20),
        default=None,
        metavar="N",
        help="RPCs in progress at once (RESOURCE_EXHAUSTED past it; default: 4 x max sessions, at least 64)",
    )


def _client_security_flags(p: argparse.ArgumentParser, prefix: str) -> None:
    who = "the peers" if prefix else "the workers"
    s = p.add_argument_group(f"how to reach {who} (TLS, authentication)")
    s.add_argument(f"--{prefix}tls-ca", metavar="PATH", help=f"trust {who}' certificates signed by this CA (PEM)")
    s.add_argument(f"--{prefix}tls-cert", metavar="PATH", help="a client certificate for mutual TLS (PEM)")
    s.add_argument(f"--{prefix}tls-key", metavar="PATH", help="its private key (PEM)")
    s.add_argument(f"--{prefix}token-file", metavar="PATH", help="a file holding the bearer token to send")


def _generate_parser(sub) -> None:
    g = sub.add_parser(
        "generate", help="generation through an in-process split of a model, or a route of workers (--route)"
    )
    g.add_argument("--model", help="GGUF file (default: the embedded SmolLM2-135M-Instruct Q4_1)")
    g.add_argument("--split", default="half", help="layer ranges, e.g. 0-14,15-29; 'half' (default) or 'whole'")
    g.add_argument("--prompt", default="The three primary colors are")
    g.add_argument("--max-tokens", type=count(0, 1 << 20), default=48)
    g.add_argument("--threads", type=THREADS, default=None)
    g.add_argument(
        "--device",
        default=CPU_DEVICE,
        metavar="cpu|auto|NAME",
        help="where an in-process split's layers run (default cpu; serve --device says more)",
    )
    g.add_argument("--context-tokens", type=CONTEXT_TOKENS, default=2048, help="KV cells per shard (serve's name)")
    deprecated_alias(g, "--ctx", "--context-tokens", type=CONTEXT_TOKENS)
    g.add_argument("--batch", type=count(1, 1 << 16), default=512, help="tokens per forward call")
    g.add_argument(
        "--compare-whole",
        action="store_true",
        help="also run the whole model and compare tokens and logits bit for bit",
    )
    deprecated_alias(g, "--verify", "--compare-whole", nargs=0)
    g.add_argument("--route", help="remote workers in order, e.g. 0-14@127.0.0.1:5001,15-29@127.0.0.1:5002")
    g.add_argument(
        "--chat",
        action="store_true",
        help="the prompt is a user's message, rendered by the GGUF's own chat template as the HTTP endpoint renders it",
    )
    g.add_argument(
        "--max-drafts",
        type=count(0, MAX_DRAFTS),
        default=None,
        metavar="K",
        help=f"with a chained --route: speculative decoding's most drafts per step (0: off, up to {MAX_DRAFTS}; "
        "default: the head's --max-drafts)",
    )
    sm = g.add_argument_group(
        "sampling (llama.cpp's chain: penalties, top-k, top-p, min-p, temperature, "
        "then a seeded draw; without these flags: greedy; an unset one is off)"
    )
    # the ranges are the native check's (SamplingParams.problem), asked as soon as the flags are parsed
    helps = {
        "temperature": "0: the largest logit; else 0.001..100",
        "top_k": "keep the k most likely tokens (0: off)",
        "top_p": "keep the most likely tokens up to this probability mass (0, 1]",
        "min_p": "drop tokens less likely than this fraction of the best [0, 1]",
        "penalty_last_n": "the window of tokens the penalties see (default 64)",
        "penalty_repeat": "divide repeated tokens' logits (1: off)",
        "penalty_freq": "subtract per repetition (0: off)",
        "penalty_present": "subtract once per repeated token (0: off)",
    }
    for p in SAMPLING_PARAMETERS:
        sm.add_argument(p.flag, type=int32 if p.integer else finite, help=helps[p.native])
    sm.add_argument("--seed", type=count(0, 0xFFFFFFFE), help="the sampler's seed (default: a random one, printed)")
    _client_security_flags(g, "")
    g.set_defaults(func=cmd_generate, check=check_sampling_flags)


def _serve_parser(sub) -> None:
    sv = sub.add_parser("serve", help="serve a layer range over gRPC")
    sv.add_argument("--model", help="GGUF file (default: the embedded model)")
    sv.add_argument("--layers", help="owned layers FIRST-LAST (default: all)")
    sv.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    sv.add_argument("--port", type=port_number, default=50551)
    sv.add_argument(
        "--http-port",
        type=port_number,
        default=None,
        help="serve the OpenAI-compatible API (/v1/chat/completions, /v1/completions) on this port, same "
        "host, TLS and tokens as gRPC; the route is this worker then its --peer workers in order",
    )
    _http_flags(sv)
    _device_flags(sv)
    _engine_flags(sv)
    _speculation_flags(sv)
    sv.add_argument(
        "--kv-type",
        choices=KV_TYPES,
        default=None,
        help="K/V element type (default: LLAMA_SHARD_KV_TYPE or f16); every shard of a route must agree",
    )
    sv.add_argument(
        "--flash-attn",
        choices=("on", "off"),
        default=None,
        help="llama.cpp's flash attention (default: LLAMA_SHARD_FLASH_ATTN or on, llama.cpp's CPU "
        "default); off is f16 only and, on some CPUs, much faster for sessions holding hundreds of "
        "tokens (docs/benchmarks.md); the logits round differently, so every shard of a route "
        "should agree; part of the cache layout: a restart with the other setting deletes the "
        "--warm-dir files",
    )
    _server_security_flags(sv)
    _client_security_flags(sv, "peer-")
    sv.set_defaults(func=cmd_serve)


def _http_flags(sv: argparse.ArgumentParser) -> None:
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
    _cpu_moe_flags(sv)


def _cpu_moe_flags(parser: argparse.ArgumentParser) -> None:
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


def _engine_flags(sv: argparse.ArgumentParser) -> None:
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


def _demo_parser(sub) -> None:
    d = sub.add_parser("demo", help="two workers on loopback split the model; four chat sessions run through them")
    d.add_argument("--model", help="GGUF file (default: the embedded SmolLM2)")
    d.add_argument("--threads", type=THREADS, default=1, help="threads per worker")
    d.add_argument("--max-tokens", type=count(0, 1 << 20), default=48)
    d.set_defaults(func=cmd_demo)


def _inspect_parser(sub) -> None:
    i = sub.add_parser("inspect", help="architecture, bytes per layer, KV bytes per token, suggested splits")
    i.add_argument("path", nargs="?", help="GGUF file (default: the embedded model)")
    i.add_argument(
        "--kv-memory",
        type=size,
        metavar="SIZE",
        help="also print the memory plan for this much hot KV memory (serve's name)",
    )
    deprecated_alias(i, "--memory", "--kv-memory", type=size)
    i.add_argument("--layers", help="the shard's layers for the plan (default: all)")
    i.add_argument("--context-tokens", type=CONTEXT_TOKENS, default=DEFAULTS.context_tokens)
    i.add_argument("--kv-type", choices=KV_TYPES, default="f16")
    i.add_argument("--warm-memory", type=size, metavar="SIZE", default=None)
    i.add_argument(
        "--device",
        default=CPU_DEVICE,
        metavar="auto|NAME",
        help="with --kv-memory: also the device's share of the plan (weights, KV, compute buffers) against "
        "its free memory",
    )
    i.add_argument(
        "--gpu-layers",
        type=count(0, 1 << 16),
        default=None,
        metavar="N",
        help="with --device: owned layers on the device (default: all)",
    )
    _cpu_moe_flags(i)
    i.set_defaults(func=cmd_inspect)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="llama-shard", description="Run layer ranges of a GGUF model on a patched llama.cpp."
    )
    sub = ap.add_subparsers(dest="command", required=True)
    for add in (_generate_parser, _serve_parser, _demo_parser, _inspect_parser):
        add(sub)
    return ap
