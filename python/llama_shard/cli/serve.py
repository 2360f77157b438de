"""`llama-shard serve`: a worker's configuration, security and HTTP limits from its flags, then the worker."""

from __future__ import annotations

import argparse
import dataclasses

from ..engine.hot_kv import parse_size
from ..engine.models import regular_model_file
from ..engine.pipeline import parse_split
from ..errors import InvalidInputError
from ..head.openai.bodies import MAX_BODY_BYTES
from ..head.openai.guard import HttpLimits, raise_open_file_limit
from .common import cpu_kernels, device_memory_plan, device_text, devices_text, model_path, status


def cors_origin(value: str) -> str:
    """An --http-cors-origin: '*' or scheme://host[:port], lower-cased, no path."""
    origin = value.strip().rstrip("/").lower()
    if origin == "*":
        return origin
    scheme, sep, rest = origin.partition("://")
    if scheme not in ("http", "https") or not sep or not rest or any(c in rest for c in "/?#@ "):
        raise InvalidInputError(
            f"--http-cors-origin {value!r}: an origin is '*' or scheme://host[:port] (http or https, no path)"
        )
    return origin


#: the largest chat template file `--chat-template-file` reads
MAX_CHAT_TEMPLATE_BYTES = 1 << 20


def read_chat_template(path: str) -> str:
    """A chat template file's text (InvalidInputError: missing, not a file, over 1 MiB, not UTF-8, or
    not a template jinja2 parses)."""
    regular_model_file(path, "--chat-template-file")
    with open(path, "rb") as f:
        data = f.read(MAX_CHAT_TEMPLATE_BYTES + 1)
    if len(data) > MAX_CHAT_TEMPLATE_BYTES:
        raise InvalidInputError(f"--chat-template-file: over {MAX_CHAT_TEMPLATE_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidInputError("--chat-template-file: not UTF-8") from None
    from jinja2 import TemplateError

    from ..head.openai.template_sandbox import BoundedSandbox

    try:
        BoundedSandbox(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except TemplateError as e:
        raise InvalidInputError(f"--chat-template-file: not a template jinja2 reads: {e}") from None
    return text


def serve_config(args: argparse.Namespace, layers: tuple[int, int] | None):
    """The HotKvStateConfig and memory plan of `serve`: flags over LLAMA_SHARD_* over defaults;
    --kv-memory sizes max_sessions."""
    from ..engine.hot_kv import HotKvStateConfig, parse_size
    from ..engine.memory import draft_model_plan, memory_plan
    from ..engine.models import gguf_shape

    env_set = HotKvStateConfig.env_values()  # LLAMA_SHARD_* are the defaults; flags override them
    env = HotKvStateConfig.from_env_values(env_set)  # ... and must make a valid configuration on their own
    pick = lambda flag, default: flag if flag is not None else default  # noqa: E731
    try:
        warm = parse_size(args.warm_memory) if args.warm_memory is not None else env.warm_bytes
        disk = parse_size(args.warm_disk) if args.warm_disk is not None else env.warm_disk_bytes
        prefixes = parse_size(args.prefix_memory) if args.prefix_memory is not None else env.prefix_bytes
        kv_memory = parse_size(args.kv_memory) if args.kv_memory is not None else None
    except ValueError as e:
        raise InvalidInputError(f"llama-shard serve: {e}") from None
    shape = gguf_shape(model_path(args.model))
    first, last = layers if layers is not None else (0, shape.n_layer - 1)
    context = pick(args.context_tokens, env.context_tokens)
    kv_type = pick(args.kv_type, env.kv_type)
    budget = pick(args.budget_tokens, env_set.get("budget_tokens"))
    if kv_memory is not None and args.max_sessions is not None:
        raise InvalidInputError("llama-shard serve: give --kv-memory or --max-sessions, not both")
    warm_dir = pick(args.warm_dir, env.warm_dir)
    plan = memory_plan(
        shape.range_info(first, last),
        kv_memory,
        context,
        args.batch,
        kv_type,
        warm,
        budget,
        warm_disk_bytes=disk if warm_dir else 0,
        max_sessions=pick(args.max_sessions, env.max_sessions),
        prefix_bytes=prefixes,
    )
    if args.draft_model is not None and first == 0:  # (a worker of later layers refuses a draft model)
        from ..head.generation import max_generate_streams

        hot = plan.config()
        plan = dataclasses.replace(
            plan,
            draft=draft_model_plan(args.draft_model, context, max_generate_streams(hot.max_sessions, hot.warm_bytes)),
        )
    flash_attn = env.flash_attn if args.flash_attn is None else args.flash_attn == "on"
    config = plan.config(
        flash_attn=flash_attn,
        ttl_seconds=pick(args.ttl, env.ttl_seconds),
        warm_ttl_seconds=pick(args.warm_ttl, env.warm_ttl_seconds),
        warm_dir=warm_dir,
    )
    return config, plan


def serve_security(args: argparse.Namespace):
    """The worker's TLS, authentication and peer credentials from its flags; refuses (exit 2) an
    exposed address without TLS and authentication, and peers it could not authenticate."""
    from ..proto.credentials import ClientSecurity
    from ..worker.security import ServerSecurity

    security = ServerSecurity(
        args.tls_cert,
        args.tls_key,
        args.tls_client_ca,
        args.auth_token_file,
        tuple(args.admin),
        args.insecure,
        tuple(args.forwarder),
        args.route_key_file,
    )
    security.check_exposure(args.host)
    if args.metrics_port is not None:
        security.check_metrics_exposure(args.metrics_host)
    peer_security = ClientSecurity(args.peer_tls_ca, args.peer_tls_cert, args.peer_tls_key, args.peer_token_file)
    for peer in (*args.peer, *args.replica):
        host, _, port = peer.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidInputError(f"--peer and --replica take HOST:PORT, got {peer!r}")
    if (args.peer or args.replica) and security.tls_cert and not peer_security.secure and not args.insecure:
        raise InvalidInputError(
            "this worker uses TLS: it forwards only to peers it can authenticate; give "
            "--peer-tls-ca (and --peer-token-file or --peer-tls-cert/--peer-tls-key)"
        )
    return security, peer_security


def http_limits_of(args: argparse.Namespace) -> HttpLimits:
    """The HTTP port's limits from its flags (refused: a flag for an endpoint not asked for)."""
    http_limits = HttpLimits(
        args.http_header_timeout,
        args.http_body_timeout,
        args.http_idle_timeout,
        args.http_write_timeout,
        args.http_max_connections,
        args.http_max_requests_per_principal,
        tuple(h.strip().lower() for h in args.http_allowed_host),
        tuple(cors_origin(o) for o in args.http_cors_origin),
        parse_size(args.http_body_memory) if args.http_body_memory is not None else HttpLimits.body_memory_bytes,
        args.http_max_bodies_per_address,
    )
    if http_limits.body_memory_bytes < 4 * MAX_BODY_BYTES:
        raise InvalidInputError(
            f"--http-body-memory {args.http_body_memory}: at least "
            f"{4 * MAX_BODY_BYTES // 2**20}MiB (a caller may hold a quarter of it, and a request "
            f"body may be up to {MAX_BODY_BYTES // 2**20}MiB)"
        )
    return http_limits


def head_options_of(args: argparse.Namespace):
    """A head's options from the flags: its HTTP endpoint, drafts and verification."""
    from ..head.options import HeadOptions

    if args.draft_model is not None:
        regular_model_file(args.draft_model, "--draft-model")
    http_limits = http_limits_of(args)
    chat_template = read_chat_template(args.chat_template_file) if args.chat_template_file else None
    if args.http_port is None and (http_limits != HttpLimits() or args.http_split_special_tokens or chat_template):
        raise InvalidInputError("the --http-* flags set the OpenAI-compatible endpoint: give --http-port too")
    return HeadOptions(
        http_port=args.http_port,
        http_limits=http_limits,
        http_split_special_tokens=args.http_split_special_tokens,
        chat_template=chat_template,
        draft=args.draft,
        max_drafts=args.max_drafts,
        draft_model=args.draft_model,
        verify=args.draft_verify,
        receipts=args.receipts,
        spot_check_rate=args.spot_check_rate,
    )


def worker_options_of(args: argparse.Namespace, security, peer_security):
    """A worker's options from the flags."""
    from ..worker.options import WorkerOptions
    from ..worker.receipts import load_receipt_key

    receipt_key = load_receipt_key(args.receipt_key) if args.receipt_key is not None else None  # before the model

    return WorkerOptions(
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        threads=args.threads,
        n_batch=args.batch,
        device=args.device,
        gpu_layers=-1 if args.gpu_layers is None else args.gpu_layers,
        cpu_moe_layers=args.cpu_moe_layers,
        gather_s=args.gather_ms / 1000.0,
        max_step_sessions=args.max_step_sessions,
        prefill_chunk=args.prefill_chunk,
        peers=tuple(args.peer),
        sweep_s=args.sweep_seconds,
        security=security,
        peer_security=peer_security,
        max_sessions_per_principal=args.max_sessions_per_principal,
        max_concurrent_rpcs=args.max_concurrent_rpcs,
        max_hop_s=args.max_hop_seconds,
        share_prefixes=args.share_prefixes,
        replicas=tuple(args.replica),
        wire_dtype=args.wire_dtype,
        receipt_key=receipt_key,
    )


def cmd_serve(args: argparse.Namespace) -> int:
    from ..node import ShardWorker

    if args.device == "list":
        print("devices (serve --device NAME; auto: the first that passes its self-check; cpu):\n" + devices_text())
        return 0
    layers = None if args.layers in (None, "all") else parse_split(args.layers)[0]
    security, peer_security = serve_security(args)  # before the model loads: a refusal costs nothing
    head_options = head_options_of(args)
    soft, hard = raise_open_file_limit()  # every connection on either port costs a descriptor
    status(
        f"open files: at most {soft} (hard limit {hard})"
        + (
            f"; HTTP connections: at most {head_options.http_limits.connection_cap()}"
            if args.http_port is not None
            else ""
        )
    )
    config, plan = serve_config(args, layers)
    options = worker_options_of(args, security, peer_security)
    device_plan = device_memory_plan(
        model_path(args.model),
        layers,
        args.device,
        options.gpu_layers,
        config.engine_config(n_batch=args.batch),
        args.cpu_moe_layers,
    )  # refuses before loading
    status(f"loading {model_path(args.model)} layers {args.layers or 'all'} ...")
    status(
        "memory plan:\n  "
        + plan.describe().replace("\n", "\n  ")
        + (f"\n  on the device (llama.cpp's dry run): {device_plan}" if device_plan else "")
    )
    status(f"CPU kernels: {cpu_kernels()}; flash attention {'on' if config.flash_attn else 'off'}")
    worker = ShardWorker(str(model_path(args.model)), layers, config, options, head_options)
    status(f"device: {device_text(worker.model.info)}")
    worker.start()
    return worker.serve_until_signal()
