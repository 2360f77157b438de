"""The command line's parser: each command's flags, and which function runs it."""

from __future__ import annotations

import argparse

from .._native import CPU_DEVICE, MAX_SESSIONS
from ..engine.hot_kv import KV_TYPES
from ..proto.requests import MAX_DRAFTS, SAMPLING_PARAMETERS
from .common import DEFAULTS
from .demo import cmd_demo
from .extract import cmd_extract
from .generate import check_sampling_flags, cmd_generate
from .inspect import cmd_inspect
from .serve_flags import add_serve_flags, cpu_moe_flags
from .serve_mesh import cmd_serve_or_mesh
from .types import (
    CONTEXT_TOKENS,
    THREADS,
    count,
    deprecated_alias,
    finite,
    int32,
    port_number,
    size,
)
from .verify_receipt import cmd_verify_receipt


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
    add_serve_flags(sv)
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
    sv.set_defaults(func=cmd_serve_or_mesh)


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
    cpu_moe_flags(i)
    i.add_argument(
        "--plan",
        metavar="FILE",
        default=None,
        help="a dry run of the head's planner over members described in a JSON file (a list of {name, memory, "
        "layer_ms, rtt_ms}; the first is the head): the route, its replicas and one stream's tokens per "
        "second, beside the equal-layers split",
    )
    i.add_argument(
        "--sessions",
        type=count(1, MAX_SESSIONS),
        default=None,
        help="with --plan: sessions each stage holds (default 8)",
    )
    i.set_defaults(func=cmd_inspect)


def _extract_parser(sub) -> None:
    x = sub.add_parser("extract", help="write a layer range of a GGUF as a file of its own (what its worker loads)")
    x.add_argument("--model", help="the whole model's GGUF file (default: the embedded model)")
    x.add_argument("--layers", required=True, help="the range FIRST-LAST")
    x.add_argument("--out", required=True, metavar="FILE", help="the range's file (a GGUF)")
    x.set_defaults(func=cmd_extract)


def _verify_receipt_parser(sub) -> None:
    v = sub.add_parser("verify-receipt", help="check a route's signed receipt (GenerateFinal.receipt) offline")
    v.add_argument("file", metavar="FILE", help="the receipt: protobuf bytes, base64, or a saved JSON response")
    v.add_argument(
        "--key",
        action="append",
        default=[],
        metavar="HEX",
        help="the public key expected of each stage in order (InfoReply.receipt_key; '-': any), repeated",
    )
    v.set_defaults(func=cmd_verify_receipt)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="llama-shard", description="Run layer ranges of a GGUF model on a patched llama.cpp."
    )
    sub = ap.add_subparsers(dest="command", required=True)
    for add in (
        _generate_parser,
        _serve_parser,
        _demo_parser,
        _inspect_parser,
        _extract_parser,
        _verify_receipt_parser,
    ):
        add(sub)
    return ap
