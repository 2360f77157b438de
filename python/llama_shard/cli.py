"""The `llama-shard` command line.

    llama-shard serve --model PATH --layers A-B [--host --port --threads --max-sessions --context-tokens
                      --budget-tokens --ttl --metrics-port]
    llama-shard generate (--route A-B@host:port,C-D@host:port | [--model PATH] [--split 0-14,15-29])
                         --prompt TEXT [--chat] [--max-tokens N] [--compare-whole]
    llama-shard inspect [PATH] [--kv-memory SIZE]
    llama-shard demo [--model PATH]

Generated text goes to stdout as it is produced; status and figures go to stderr.
Every numeric flag is checked where it is parsed (its argparse type; the sampling flags by the
native check right after parsing, before anything loads). Renamed flags keep their old spelling for
one release, with a warning: generate --ctx (--context-tokens), --verify (--compare-whole); serve
--verify (--draft-verify); inspect --memory (--kv-memory).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import secrets
import sys
import time
from pathlib import Path

import numpy as np

from ._native import DEFAULT_GATHER_S, DEFAULT_PREFILL_CHUNK, MAX_BUDGET_TOKENS, MAX_CONTEXT_TOKENS, MAX_SESSIONS
from .engine.hot_kv import KV_TYPES, HotKvStateConfig, parse_size
from .engine.models import compute_balanced_cut, gguf_layer_count, regular_model_file, require_embedded_model
from .engine.pipeline import LocalPipeline, parse_split
from .errors import InvalidInputError, LlamaShardError
from .head.openai.bodies import MAX_BODY_BYTES
from .head.openai.guard import HttpLimits, raise_open_file_limit
from .head.speculation import DRAFT_SOURCES, VERIFY_MODES
from .proto.requests import DEFAULT_MAX_DRAFTS, MAX_DRAFTS, MIN_BATCH_TOKENS, SAMPLING_PARAMETERS, sampling_problem
from .proto.wire import WIRE_DTYPES
from .worker import DEFAULT_MAX_HOP_S

#: the configuration's defaults, as the help texts state them
_DEFAULTS = HotKvStateConfig()




def cors_origin(value: str) -> str:
    """An --http-cors-origin: '*' or scheme://host[:port], lower-cased, no path."""
    origin = value.strip().rstrip("/").lower()
    if origin == "*":
        return origin
    scheme, sep, rest = origin.partition("://")
    if scheme not in ("http", "https") or not sep or not rest or any(c in rest for c in "/?#@ "):
        raise InvalidInputError(f"--http-cors-origin {value!r}: an origin is '*' or scheme://host[:port] "
                                "(http or https, no path)")
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

    from .head.openai.template_sandbox import BoundedSandbox
    try:
        BoundedSandbox(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except TemplateError as e:
        raise InvalidInputError(f"--chat-template-file: not a template jinja2 reads: {e}") from None
    return text

def _status(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _model_path(arg: str | None) -> Path:
    return regular_model_file(arg, "--model") if arg else require_embedded_model()


def _prompt_ids(model, text: str, chat: bool) -> list[int]:
    if chat:  # rendered as the HTTP endpoint and the demo render it (the model's own template)
        from .head.openai.chat_template import ModelChat
        return ModelChat(model).tokens([{"role": "user", "content": text}])
    return model.tokenize(text)


def _parse_route(text: str) -> list[str]:
    """'0-14@127.0.0.1:5001,15-29@127.0.0.1:5002' -> addresses in order (ranges checked against Info)."""
    addresses = []
    for part in text.split(","):
        rng, sep, addr = part.strip().partition("@")
        if not sep or not addr:
            raise InvalidInputError(f"bad route entry {part!r}: use FIRST-LAST@HOST:PORT")
        addresses.append((parse_split(rng)[0], addr))
    return addresses


def cmd_generate_route(args: argparse.Namespace) -> int:
    from .proto.credentials import ClientSecurity
    from .route import RemoteStage, RouteClient

    entries = _parse_route(args.route)
    security = ClientSecurity(args.tls_ca, args.tls_cert, args.tls_key, args.token_file)
    stages = [RemoteStage(addr, security=security) for _, addr in entries]
    for (rng, addr), st in zip(entries, stages):
        if (st.info.first, st.info.last) != rng:
            raise InvalidInputError(f"{addr} serves layers {st.info.first}-{st.info.last}, not {rng[0]}-{rng[1]}")
    client = RouteClient(stages)
    sampling = _sampling(args)
    if args.max_drafts is not None and not (client.chained and client.route_loop):
        raise InvalidInputError("--max-drafts needs a chained route (a head started with --peer runs the loop)")
    if sampling is not None and not client.chained:
        stages[-1].return_logits = True  # this client samples from the tail's logits
    # the tokenizer runs on the head side, from the same GGUF the workers serve
    path = _model_path(args.model)
    from ._native import ShardModel
    vocab = ShardModel(str(path), (0, 0), 1)
    prompt = _prompt_ids(vocab, args.prompt, args.chat)
    session = client.session()
    tokens: list[int] = []
    printed = ""
    t0 = time.perf_counter()
    for token in session.stream(prompt, args.max_tokens, stop=(vocab.token_eos,), sampling=sampling,
                                max_drafts=args.max_drafts):
        if token == vocab.token_eos:
            break
        tokens.append(token)
        text = vocab.detokenize(tokens)
        if text.startswith(printed):
            sys.stdout.write(text[len(printed):])
            sys.stdout.flush()
            printed = text
    sys.stdout.write("\n")
    dt = time.perf_counter() - t0
    final = session.last_final
    where = "the route's loop (Generate)" if final is not None else "this client's loop"
    ttft = f", first token after {final.time_to_first_token_s * 1000:.0f} ms" if final is not None else ""
    drafts = (f"; {final.accepted_tokens} of {final.drafted_tokens} drafts accepted"
              if final is not None and final.drafted_tokens else "")
    _status(f"{len(tokens)} tokens in {dt:.2f}s through {len(stages)} workers, driven by {where}{ttft}; "
            f"{session.reprefills} re-prefill(s){drafts}")
    session.release()
    client.close()
    return 0


def _sampling(args: argparse.Namespace, announce: bool = True):
    """SamplingParams from the sampling flags (None: greedy, no flag given); a sampler without
    --seed gets a random one, printed so the run can be repeated."""
    given = {p.native: _flag_value(args, p.flag) for p in SAMPLING_PARAMETERS if _flag_value(args, p.flag) is not None}
    if not given and args.seed is None:
        return None
    from ._native import SamplingParams
    seed = args.seed if args.seed is not None else secrets.randbelow(0xFFFFFFFF)
    if args.seed is None and announce:
        _status(f"sampling with seed {seed} (--seed {seed} repeats this run)")
    return SamplingParams(seed=seed, **given)


def cmd_generate(args: argparse.Namespace) -> int:
    if args.route:
        if args.device != "cpu":
            raise InvalidInputError("--device places an in-process split; a route's devices are its workers' "
                                    "(serve --device)")
        return cmd_generate_route(args)
    if args.max_drafts is not None:
        raise InvalidInputError("--max-drafts needs --route: drafts are a route's (its head's speculative decoding)")
    path = _model_path(args.model)
    _status(f"model: {path}")
    t0 = time.perf_counter()
    whole_layers = None
    if args.split == "half":
        n_layer = gguf_layer_count(path)
        whole_layers = n_layer
        split = [(0, n_layer // 2 - 1), (n_layer // 2, n_layer - 1)] if n_layer > 1 else None
    elif args.split in ("none", "whole"):
        split = None
    else:
        split = parse_split(args.split)
    pipe = LocalPipeline(path, split, n_ctx=args.context_tokens, n_seq_max=1, n_batch=args.batch, n_threads=args.threads,
                         device=args.device)
    desc = ",".join(f"{m.info.first}-{m.info.last}" for m in pipe.models)
    _status(f"shards: {desc} of {whole_layers or pipe.head.info.n_layer} layers, loaded in {time.perf_counter() - t0:.2f}s; "
            + ", ".join(f"{m.info.first}-{m.info.last}: {m.info.weight_bytes / 2**20:.1f} MiB" for m in pipe.models))

    prompt = _prompt_ids(pipe.head, args.prompt, args.chat)
    if not prompt:
        _status("the prompt tokenizes to nothing")
        return 2
    eos = pipe.head.token_eos
    tokens: list[int] = []
    logits_seen: list[np.ndarray] = []
    printed = ""
    t1 = time.perf_counter()
    sampling = _sampling(args)
    sampler = None
    if sampling is not None:
        from ._native import TokenSampler
        window = sampling.penalty_last_n
        sampler = TokenSampler(pipe.head.info.n_vocab, sampling, args.context_tokens, history=prompt[-window:] if window else [])
    for token, logits in pipe.generate(prompt, args.max_tokens, stop=(eos,) if eos >= 0 else (), sampler=sampler):
        if token == eos:
            break
        tokens.append(token)
        if args.compare_whole:
            logits_seen.append(logits)
        text = pipe.head.detokenize(tokens)
        if text.startswith(printed):  # print only complete characters
            sys.stdout.write(text[len(printed):])
            sys.stdout.flush()
            printed = text
    dt = time.perf_counter() - t1
    sys.stdout.write("\n")
    _status(f"{len(tokens)} tokens in {dt:.2f}s ({len(tokens) / dt if dt > 0 else 0:.1f} tokens/s, prompt {len(prompt)} tokens)")

    if args.compare_whole:
        whole = LocalPipeline(path, None, n_ctx=args.context_tokens, n_seq_max=1, n_batch=args.batch, n_threads=args.threads,
                              device=args.device)  # the same backend: split = whole to the bit
        ref = list(whole.generate(prompt, len(tokens)))
        same_tokens = [t for t, _ in ref] == tokens
        same_bits = all(a.tobytes() == b.tobytes() for (_, a), b in zip(ref, logits_seen))
        _status(f"verify against the whole model: tokens identical: {same_tokens}; logits bit-identical: {same_bits}")
        return 0 if same_tokens and same_bits else 1
    return 0


def _cpu_kernels() -> str:
    """Which CPU kernels this process runs, their instruction sets, and what the self-check found."""
    from ._native import cpu_backend

    c = cpu_backend()
    shipped = f"; shipped: {', '.join(c['available'])}" if c["available"] else ""
    amx = "; AMX in use" if c["amx"] else ("; AMX off" if "AMX_INT8" in c["features"] else "")
    return f"{c['variant']} ({' '.join(c['features'])}){amx}{shipped}; self-check {c['self_check']}"


def _devices_text() -> str:
    """The GPU devices this process can use, one per line, with each GPU module's state."""
    from ._native import devices, gpu_backends

    found = devices()
    lines = [f"  {d['name']}: {d['description']} ({d['backend']}, {d['type']}, "
             f"{d['memory_free'] / 2**30:.1f} of {d['memory_total'] / 2**30:.1f} GiB free)" for d in found]
    modules = gpu_backends()
    lines.append("  GPU backends: " + ("; ".join(modules) if modules else "none in this build"))
    if not found:
        lines.append("  (a CPU Vulkan driver such as lavapipe is listed only when GGML_VK_VISIBLE_DEVICES names it)")
    return "\n".join(lines)


def _device_text(info) -> str:
    """Where a loaded shard's layers run, in one line."""
    if info.device == "cpu":
        return "cpu" + (f" ({info.device_note})" if info.device_note else "")
    output = "; the output layer too" if info.output_on_device else ""
    experts = (f"; the experts of {info.cpu_moe_layers} of them in host memory (--cpu-moe)"
               if info.cpu_moe_layers else "")
    return (f"{info.device} ({info.device_description}): {info.gpu_layers} of {info.n_owned_layers} owned "
            f"layers and their KV{output}{experts}")


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def device_memory_plan(model: Path, layers: tuple[int, int] | None, device: str, gpu_layers: int, engine_config,
                       cpu_moe_layers: int = 0) -> str:
    """The device's share of a shard and its engine, from llama.cpp's dry run (nothing allocated),
    against the device's free memory: one line, or InvalidInputError naming the device and the
    numbers when it does not fit. "" on the CPU."""
    from ._native import plan_memory

    if device.lower() == "cpu" or gpu_layers == 0:
        return ""
    mem = plan_memory(str(model), layers, device, gpu_layers, engine_config, cpu_moe_layers)
    if mem["device"] == "cpu":
        return ""
    need = mem["device_model"] + mem["device_context"] + mem["device_compute"]
    parts = (f"weights {_mib(mem['device_model'])}, KV {_mib(mem['device_context'])}, "
             f"compute buffers {_mib(mem['device_compute'])}")
    if need > mem["device_free"]:
        raise InvalidInputError(
            f"the plan does not fit {mem['device']}: it needs {_mib(need)} there ({parts}) and {_mib(mem['device_free'])} "
            f"of {_mib(mem['device_total'])} are free; give fewer --gpu-layers, --cpu-moe or --n-cpu-moe on a "
            f"mixture of experts, fewer --max-sessions (or less "
            f"--kv-memory) or fewer --context-tokens")
    return (f"{mem['device']}: {_mib(need)} ({parts}) of {_mib(mem['device_free'])} free; "
            f"host: {_mib(mem['host_model'] + mem['host_context'] + mem['host_compute'])}")


def cmd_inspect(args: argparse.Namespace) -> int:
    from ._native import certified_architectures
    from .engine.hot_kv import parse_size
    from .engine.memory import memory_plan
    from .engine.models import gguf_shape

    if (args.device != "cpu" or args.gpu_layers is not None or args.cpu_moe_layers) and not args.kv_memory:
        raise InvalidInputError("--device, --gpu-layers and --cpu-moe size the device's share of a memory plan: give "
                                "--kv-memory too")
    path = _model_path(args.path)
    shape = gguf_shape(path)
    n_layer, per_layer = shape.n_layer, shape.layer_bytes
    kv_layer = shape.kv_layer_bytes
    arch = shape.architecture
    print(f"file:          {path}")
    print(f"CPU kernels:   {_cpu_kernels()}")
    print("devices:\n" + _devices_text())
    certified = arch in certified_architectures()
    print(f"architecture:  {arch} ({'certified for shard execution' if certified else 'NOT certified: whole-model only'})")
    print(f"kind:          {shape.kind}")
    print(f"layers:        {n_layer}; n_embd {shape.n_embd}; heads {shape.n_head} (kv {shape.n_head_kv}); head_dim {shape.head_dim}"
          + (f"; then {shape.n_nextn} MTP block(s) ({shape.mtp_bytes / 2**20:.1f} MiB) no shard loads" if shape.n_nextn else ""))
    print(f"weights:       {sum(per_layer) / 2**20:.1f} MiB in layers, {shape.other_bytes / 2**20:.1f} MiB outside them (embedding, output)"
          + (f"; experts {sum(shape.expert_bytes) / 2**20:.1f} MiB" if shape.n_expert else ""))
    if len(set(kv_layer)) == 1:
        print(f"KV bytes/token (f16): {kv_layer[0]} per layer, {sum(kv_layer)} for the whole model")
    else:
        print(f"KV bytes/token (f16): {min(kv_layer)}-{max(kv_layer)} per layer, {sum(kv_layer)} for the whole model")
    print("bytes per layer:" + (" (of which experts)" if shape.n_expert else ""))
    for il in range(n_layer):
        experts = f"  ({shape.expert_bytes[il] / 2**20:.2f} MiB experts)" if shape.n_expert else ""
        recurrent = "  recurrent" if il in shape.recurrent_layers else ""
        print(f"  {il:3d}: {per_layer[il] / 2**20:8.2f} MiB{experts}{recurrent}")
    for n_shards in (2, 3, 4):
        if n_shards > n_layer:
            break
        bounds = shape.byte_weighted_splits(n_shards)
        print(f"suggested {n_shards}-shard split (by bytes): " + ",".join(f"{a}-{b}" for a, b in bounds))
    cut = compute_balanced_cut(path)
    print(f"compute-balanced 2-shard split (the tail also runs the LM head): 0-{cut - 1},{cut}-{n_layer - 1}")
    if args.kv_memory:
        first, last = (0, n_layer - 1) if args.layers in (None, "all") else parse_split(args.layers)[0]
        try:
            kv_memory, warm = parse_size(args.kv_memory), parse_size(args.warm_memory or 0)
        except ValueError as e:
            raise InvalidInputError(str(e)) from None
        plan = memory_plan(shape.range_info(first, last), kv_memory, args.context_tokens, kv_type=args.kv_type,
                           warm_bytes=warm)
        print(f"memory plan for layers {first}-{last} with {args.kv_memory} of KV memory:")
        print("  " + plan.describe().replace("\n", "\n  "))
        if args.device != "cpu":
            layers = None if args.layers in (None, "all") else (first, last)
            on_device = device_memory_plan(path, layers, args.device, -1 if args.gpu_layers is None else args.gpu_layers,
                                           plan.config().engine_config(), args.cpu_moe_layers)
            print(f"  on the device (llama.cpp's dry run): {on_device or 'none: the CPU'}")
    return 0


def serve_config(args: argparse.Namespace, layers: tuple[int, int] | None):
    """The HotKvStateConfig and memory plan of `serve`: flags over LLAMA_SHARD_* over defaults;
    --kv-memory sizes max_sessions."""
    from .engine.hot_kv import HotKvStateConfig, parse_size
    from .engine.memory import draft_model_plan, memory_plan
    from .engine.models import gguf_shape

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
    shape = gguf_shape(_model_path(args.model))
    first, last = layers if layers is not None else (0, shape.n_layer - 1)
    context = pick(args.context_tokens, env.context_tokens)
    kv_type = pick(args.kv_type, env.kv_type)
    budget = pick(args.budget_tokens, env_set.get("budget_tokens"))
    if kv_memory is not None and args.max_sessions is not None:
        raise InvalidInputError("llama-shard serve: give --kv-memory or --max-sessions, not both")
    warm_dir = pick(args.warm_dir, env.warm_dir)
    plan = memory_plan(shape.range_info(first, last), kv_memory, context, args.batch, kv_type, warm, budget,
                       warm_disk_bytes=disk if warm_dir else 0, max_sessions=pick(args.max_sessions, env.max_sessions),
                       prefix_bytes=prefixes)
    if args.draft_model is not None and first == 0:  # (a worker of later layers refuses a draft model)
        from .head.generation import max_generate_streams

        hot = plan.config()
        plan = dataclasses.replace(plan, draft=draft_model_plan(args.draft_model, context,
                                                                max_generate_streams(hot.max_sessions, hot.warm_bytes)))
    flash_attn = env.flash_attn if args.flash_attn is None else args.flash_attn == "on"
    config = plan.config(flash_attn=flash_attn, ttl_seconds=pick(args.ttl, env.ttl_seconds),
                         warm_ttl_seconds=pick(args.warm_ttl, env.warm_ttl_seconds), warm_dir=warm_dir)
    return config, plan


def serve_security(args: argparse.Namespace):
    """The worker's TLS, authentication and peer credentials from its flags; refuses (exit 2) an
    exposed address without TLS and authentication, and peers it could not authenticate."""
    from .proto.credentials import ClientSecurity
    from .worker.security import ServerSecurity

    security = ServerSecurity(args.tls_cert, args.tls_key, args.tls_client_ca, args.auth_token_file,
                              tuple(args.admin), args.insecure, tuple(args.forwarder), args.route_key_file)
    security.check_exposure(args.host)
    if args.metrics_port is not None:
        security.check_metrics_exposure(args.metrics_host)
    peer_security = ClientSecurity(args.peer_tls_ca, args.peer_tls_cert, args.peer_tls_key, args.peer_token_file)
    for peer in (*args.peer, *args.replica):
        host, _, port = peer.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidInputError(f"--peer and --replica take HOST:PORT, got {peer!r}")
    if (args.peer or args.replica) and security.tls_cert and not peer_security.secure and not args.insecure:
        raise InvalidInputError("this worker uses TLS: it forwards only to peers it can authenticate; give "
                                "--peer-tls-ca (and --peer-token-file or --peer-tls-cert/--peer-tls-key)")
    return security, peer_security


def cmd_serve(args: argparse.Namespace) -> int:
    from .head.options import HeadOptions
    from .node import ShardWorker
    from .worker.options import WorkerOptions

    if args.device == "list":
        print("devices (serve --device NAME; auto: the first that passes its self-check; cpu):\n" + _devices_text())
        return 0
    layers = None if args.layers in (None, "all") else parse_split(args.layers)[0]
    security, peer_security = serve_security(args)  # before the model loads: a refusal costs nothing
    if args.draft_model is not None:
        regular_model_file(args.draft_model, "--draft-model")
    http_limits = HttpLimits(args.http_header_timeout, args.http_body_timeout, args.http_idle_timeout,
                             args.http_write_timeout, args.http_max_connections, args.http_max_requests_per_principal,
                             tuple(h.strip().lower() for h in args.http_allowed_host),
                             tuple(cors_origin(o) for o in args.http_cors_origin),
                             parse_size(args.http_body_memory) if args.http_body_memory is not None
                             else HttpLimits.body_memory_bytes, args.http_max_bodies_per_address)
    if http_limits.body_memory_bytes < 4 * MAX_BODY_BYTES:
        raise InvalidInputError(f"--http-body-memory {args.http_body_memory}: at least "
                                f"{4 * MAX_BODY_BYTES // 2**20}MiB (a caller may hold a quarter of it, and a request "
                                f"body may be up to {MAX_BODY_BYTES // 2**20}MiB)")
    chat_template = read_chat_template(args.chat_template_file) if args.chat_template_file else None
    if args.http_port is None and (http_limits != HttpLimits() or args.http_split_special_tokens or chat_template):
        raise InvalidInputError("the --http-* flags set the OpenAI-compatible endpoint: give --http-port too")
    soft, hard = raise_open_file_limit()  # every connection on either port costs a descriptor
    _status(f"open files: at most {soft} (hard limit {hard})" + (
        f"; HTTP connections: at most {http_limits.connection_cap()}" if args.http_port is not None else ""))
    config, plan = serve_config(args, layers)
    gpu_layers = -1 if args.gpu_layers is None else args.gpu_layers
    device_plan = device_memory_plan(_model_path(args.model), layers, args.device, gpu_layers,
                                     config.engine_config(n_batch=args.batch),
                                     args.cpu_moe_layers)  # refuses before loading
    _status(f"loading {_model_path(args.model)} layers {args.layers or 'all'} ...")
    _status("memory plan:\n  " + plan.describe().replace("\n", "\n  ") +
            (f"\n  on the device (llama.cpp's dry run): {device_plan}" if device_plan else ""))
    _status(f"CPU kernels: {_cpu_kernels()}; flash attention {'on' if config.flash_attn else 'off'}")
    worker = ShardWorker(str(_model_path(args.model)), layers, config,
                         WorkerOptions(host=args.host, port=args.port, metrics_port=args.metrics_port,
                                       metrics_host=args.metrics_host,
                                       threads=args.threads, n_batch=args.batch, device=args.device,
                                       gpu_layers=gpu_layers, cpu_moe_layers=args.cpu_moe_layers,
                                       gather_s=args.gather_ms / 1000.0,
                                       max_step_sessions=args.max_step_sessions,
                                       prefill_chunk=args.prefill_chunk, peers=tuple(args.peer),
                                       sweep_s=args.sweep_seconds, security=security, peer_security=peer_security,
                                       max_sessions_per_principal=args.max_sessions_per_principal,
                                       max_concurrent_rpcs=args.max_concurrent_rpcs,
                                       max_hop_s=args.max_hop_seconds, share_prefixes=args.share_prefixes,
                                       replicas=tuple(args.replica), wire_dtype=args.wire_dtype),
                         HeadOptions(http_port=args.http_port, http_limits=http_limits,
                                     http_split_special_tokens=args.http_split_special_tokens,
                                     chat_template=chat_template, draft=args.draft, max_drafts=args.max_drafts,
                                     draft_model=args.draft_model, verify=args.draft_verify))
    _status(f"device: {_device_text(worker.model.info)}")
    worker.start()
    return worker.serve_until_signal()


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(_model_path(args.model), threads=args.threads, max_tokens=args.max_tokens)


# --- numeric flags: every one range-checked by argparse (exit 2, naming the flag) ------------------

def _port(text: str) -> int:
    """A TCP port: 0 (any free one) to 65535."""
    return _count(0, 65535)(text)


def _count(lo: int, hi: int = MAX_BUDGET_TOKENS):
    """An integer in [lo, hi]."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be in [{lo}, {hi}], got {value}")
        return value
    parse.__name__ = "integer"  # argparse names the type in its message
    return parse


def _seconds(text: str) -> float:
    """A finite, non-negative number of seconds (or milliseconds), at most a year."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= value <= 365 * 86400:  # also refuses nan and inf
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _milliseconds_within_a_second(text: str) -> float:
    """0 to 1000 ms (the step loop's bound on its wait, HotKvStateManager's gather_s <= 1 s)."""
    value = _seconds(text)
    if value > 1000:
        raise argparse.ArgumentTypeError(f"must be at most 1000 ms, got {text}")
    return value


def _positive_seconds(text: str) -> float:
    """Seconds > 0 (at most a year)."""
    value = _seconds(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


THREADS = _count(1, 1024)
TOKENS = _count(1)
CONTEXT_TOKENS = _count(1, MAX_CONTEXT_TOKENS)  # one session's tokens


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"not a finite number: {text!r}")
    return value


def _size(text: str) -> str:
    """A byte size (512MiB, 2GiB or bytes), checked as it is parsed; kept as written (parse_size reads it)."""
    try:
        parse_size(text)
    except (InvalidInputError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _int32(text: str) -> int:
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not -(1 << 31) <= value < 1 << 31:
        raise argparse.ArgumentTypeError(f"{value} does not fit a 32-bit integer")
    return value


def _flag_value(args: argparse.Namespace, flag: str):
    return getattr(args, flag.lstrip("-").replace("-", "_"))


def _check_sampling_flags(args: argparse.Namespace) -> None:
    """The sampling flags against the native check (its ranges, the only ones), before a model loads;
    the vocabulary's bound on --top-k is checked again once the model is known."""
    params = _sampling(args, announce=False)
    if params is None:
        return
    problem = sampling_problem(params, 1 << 30, MAX_CONTEXT_TOKENS)
    if problem is not None:
        raise InvalidInputError(f"{problem[0].flag}: {problem[1]}")


class _DeprecatedAlias(argparse.Action):
    """An old spelling of a flag, kept for one release: it sets the new flag's value and says so."""

    def __init__(self, option_strings, dest, new: str, **kwargs):
        self.new = new
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        _status(f"llama-shard: {option_string} is deprecated; use {self.new}")
        setattr(namespace, self.dest, True if self.nargs == 0 else values)


def _deprecated_alias(parser: argparse.ArgumentParser, old: str, new: str, **kwargs) -> None:
    parser.add_argument(old, dest=new.lstrip("-").replace("-", "_"), action=_DeprecatedAlias, new=new,
                        default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs)


def _server_security_flags(sv: argparse.ArgumentParser) -> None:
    s = sv.add_argument_group("security (README: three set-ups)")
    s.add_argument("--tls-cert", metavar="PATH", help="this worker's certificate chain (PEM); re-read when it changes")
    s.add_argument("--tls-key", metavar="PATH", help="its private key (PEM)")
    s.add_argument("--tls-client-ca", metavar="PATH",
                   help="mutual TLS: clients must present a certificate this CA signed; the principal is its common name")
    s.add_argument("--auth-token-file", metavar="PATH",
                   help="'principal:token' lines; clients send 'authorization: Bearer TOKEN'; re-read on SIGHUP")
    s.add_argument("--admin", action="append", default=[], metavar="PRINCIPAL",
                   help="a principal that Info shows every session id to (repeatable)")
    s.add_argument("--forwarder", action="append", default=[], metavar="PRINCIPAL",
                   help="a worker (its principal) trusted to forward steps on behalf of its callers (repeatable); "
                        "needs --route-key-file")
    s.add_argument("--route-key-file", metavar="PATH",
                   help="the route's secret (32+ bytes, mode 0600, the same file on every worker of a chained "
                        "route): the head signs whom it forwards for, the next workers check it")
    s.add_argument("--insecure", action="store_true",
                   help="serve a non-loopback address without TLS and authentication anyway")
    s.add_argument("--max-sessions-per-principal", type=_count(1), default=None, metavar="N",
                   help="sessions one caller may hold (RESOURCE_EXHAUSTED past it; default: no cap)")
    s.add_argument("--max-concurrent-rpcs", type=_count(1, 1 << 20), default=None, metavar="N",
                   help="RPCs in progress at once (RESOURCE_EXHAUSTED past it; default: 4 x max sessions, at least 64)")


def _client_security_flags(p: argparse.ArgumentParser, prefix: str) -> None:
    who = "the peers" if prefix else "the workers"
    s = p.add_argument_group(f"how to reach {who} (TLS, authentication)")
    s.add_argument(f"--{prefix}tls-ca", metavar="PATH", help=f"trust {who}' certificates signed by this CA (PEM)")
    s.add_argument(f"--{prefix}tls-cert", metavar="PATH", help="a client certificate for mutual TLS (PEM)")
    s.add_argument(f"--{prefix}tls-key", metavar="PATH", help="its private key (PEM)")
    s.add_argument(f"--{prefix}token-file", metavar="PATH", help="a file holding the bearer token to send")


def _generate_parser(sub) -> None:
    g = sub.add_parser("generate", help="generation through an in-process split of a model, or a route of workers (--route)")
    g.add_argument("--model", help="GGUF file (default: the embedded SmolLM2-135M-Instruct Q4_1)")
    g.add_argument("--split", default="half", help="layer ranges, e.g. 0-14,15-29; 'half' (default) or 'whole'")
    g.add_argument("--prompt", default="The three primary colors are")
    g.add_argument("--max-tokens", type=_count(0, 1 << 20), default=48)
    g.add_argument("--threads", type=THREADS, default=None)
    g.add_argument("--device", default="cpu", metavar="cpu|auto|NAME",
                   help="where an in-process split's layers run (default cpu; serve --device says more)")
    g.add_argument("--context-tokens", type=CONTEXT_TOKENS, default=2048, help="KV cells per shard (serve's name)")
    _deprecated_alias(g, "--ctx", "--context-tokens", type=CONTEXT_TOKENS)
    g.add_argument("--batch", type=_count(1, 1 << 16), default=512, help="tokens per forward call")
    g.add_argument("--compare-whole", action="store_true",
                   help="also run the whole model and compare tokens and logits bit for bit")
    _deprecated_alias(g, "--verify", "--compare-whole", nargs=0)
    g.add_argument("--route", help="remote workers in order, e.g. 0-14@127.0.0.1:5001,15-29@127.0.0.1:5002")
    g.add_argument("--chat", action="store_true", help="the prompt is a user's message, rendered by the GGUF's own "
                   "chat template as the HTTP endpoint renders it")
    g.add_argument("--max-drafts", type=_count(0, MAX_DRAFTS), default=None, metavar="K",
                   help=f"with a chained --route: speculative decoding's most drafts per step (0: off, up to {MAX_DRAFTS}; "
                        "default: the head's --max-drafts)")
    sm = g.add_argument_group("sampling (llama.cpp's chain: penalties, top-k, top-p, min-p, temperature, "
                              "then a seeded draw; without these flags: greedy; an unset one is off)")
    # the ranges are the native check's (SamplingParams.problem), asked as soon as the flags are parsed
    helps = {"temperature": "0: the largest logit; else 0.001..100", "top_k": "keep the k most likely tokens (0: off)",
             "top_p": "keep the most likely tokens up to this probability mass (0, 1]",
             "min_p": "drop tokens less likely than this fraction of the best [0, 1]",
             "penalty_last_n": "the window of tokens the penalties see (default 64)",
             "penalty_repeat": "divide repeated tokens' logits (1: off)",
             "penalty_freq": "subtract per repetition (0: off)", "penalty_present": "subtract once per repeated token (0: off)"}
    for p in SAMPLING_PARAMETERS:
        sm.add_argument(p.flag, type=_int32 if p.integer else _finite, help=helps[p.native])
    sm.add_argument("--seed", type=_count(0, 0xFFFFFFFE), help="the sampler's seed (default: a random one, printed)")
    _client_security_flags(g, "")
    g.set_defaults(func=cmd_generate, check=_check_sampling_flags)


def _serve_parser(sub) -> None:
    sv = sub.add_parser("serve", help="serve a layer range over gRPC")
    sv.add_argument("--model", help="GGUF file (default: the embedded model)")
    sv.add_argument("--layers", help="owned layers FIRST-LAST (default: all)")
    sv.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    sv.add_argument("--port", type=_port, default=50551)
    sv.add_argument("--http-port", type=_port, default=None,
                    help="serve the OpenAI-compatible API (/v1/chat/completions, /v1/completions) on this port, same "
                         "host, TLS and tokens as gRPC; the route is this worker then its --peer workers in order")
    _http_flags(sv)
    _device_flags(sv)
    _engine_flags(sv)
    _speculation_flags(sv)
    sv.add_argument("--kv-type", choices=KV_TYPES, default=None,
                    help="K/V element type (default: LLAMA_SHARD_KV_TYPE or f16); every shard of a route must agree")
    sv.add_argument("--flash-attn", choices=("on", "off"), default=None,
                    help="llama.cpp's flash attention (default: LLAMA_SHARD_FLASH_ATTN or on, llama.cpp's CPU "
                         "default); off is f16 only and, on some CPUs, much faster for sessions holding hundreds of "
                         "tokens (docs/benchmarks.md); the logits round differently, so every shard of a route "
                         "should agree; part of the cache layout: a restart with the other setting deletes the "
                         "--warm-dir files")
    _server_security_flags(sv)
    _client_security_flags(sv, "peer-")
    sv.set_defaults(func=cmd_serve)


def _http_flags(sv: argparse.ArgumentParser) -> None:
    lim = HttpLimits()
    sv.add_argument("--http-header-timeout", type=_positive_seconds, default=lim.header_timeout_s, metavar="S",
                    help="a connection's TLS handshake and request headers must arrive within S seconds (from accept; "
                         f"on a kept-alive connection from the request's first byte) (default {lim.header_timeout_s:g})")
    sv.add_argument("--http-body-timeout", type=_positive_seconds, default=lim.body_timeout_s, metavar="S",
                    help=f"a request's whole body must arrive within S seconds of its headers (default {lim.body_timeout_s:g})")
    sv.add_argument("--http-idle-timeout", type=_positive_seconds, default=lim.idle_timeout_s, metavar="S",
                    help=f"a kept-alive connection is closed after S idle seconds (default {lim.idle_timeout_s:g})")
    sv.add_argument("--http-write-timeout", type=_positive_seconds, default=lim.write_timeout_s, metavar="S",
                    help="a client that reads nothing of its response for S seconds is dropped and its stream stopped "
                         f"(default {lim.write_timeout_s:g})")
    sv.add_argument("--http-max-connections", type=_count(1, 1 << 20), default=None, metavar="N",
                    help="open HTTP connections at most; at the cap a new one replaces the oldest without a request "
                         "running (default: a quarter of the open-file limit, at most 512)")
    sv.add_argument("--http-max-requests-per-principal", type=_count(1, 1 << 20), default=None, metavar="N",
                    help="HTTP requests in flight per caller (default: all of --max-concurrent-rpcs without "
                         "authentication, half of them with)")
    sv.add_argument("--http-max-bodies-per-address", type=_count(1, 1 << 20), default=lim.max_bodies_per_address,
                    metavar="N", help="request bodies one address may have arriving at once on a worker without "
                    f"authentication (429 past it; default {lim.max_bodies_per_address}): a slow sender holds no "
                    "generation slot, and only this many places of its own")
    sv.add_argument("--http-body-memory", type=_size, default=None, metavar="SIZE",
                    help="memory for request bodies being read at once, each reserving its declared length "
                         f"(503 past it; default {lim.body_memory_bytes // 2**20}MiB)")
    sv.add_argument("--http-allowed-host", action="append", default=[], metavar="NAME",
                    help="a Host name a plaintext HTTP port answers besides IP literals and localhost (repeatable; "
                         "a page's own name is refused: DNS rebinding)")
    sv.add_argument("--http-cors-origin", action="append", default=[], metavar="ORIGIN",
                    help="a web page origin (scheme://host[:port]) allowed to call the HTTP endpoint from a browser "
                         "(CORS; repeatable; '*': any page, which on a port without authentication lets any page "
                         "drive the worker; default: none)")
    sv.add_argument("--http-split-special-tokens", action="store_true",
                    help="tokenize the text of chat messages as plain text, so a caller's '<|im_end|>' is those "
                         "characters, not the model's turn marker (transformers' split_special_tokens; default: parsed "
                         "as llama-server parses it)")
    sv.add_argument("--chat-template-file", default=None, metavar="FILE",
                    help="a Jinja chat template that replaces the GGUF's for the HTTP endpoint (for example one that "
                         "renders tools as <tool_call> blocks); at most 1 MiB of UTF-8")
    sv.add_argument("--metrics-port", type=_port, default=None, help="Prometheus metrics port (default: off)")
    sv.add_argument("--metrics-host", default="127.0.0.1",
                    help="metrics bind address (default: loopback; the endpoint is plaintext and unauthenticated, "
                         "so another address needs --insecure)")


def _device_flags(sv: argparse.ArgumentParser) -> None:
    sv.add_argument("--threads", type=THREADS, default=None)
    sv.add_argument("--device", default=os.environ.get("LLAMA_SHARD_DEVICE") or "auto", metavar="auto|cpu|NAME|list",
                    help="where the owned layers and their KV run (default: LLAMA_SHARD_DEVICE or auto): 'auto': the "
                         "first GPU ggml lists that "
                         "passes a start-up self-check, else the CPU; 'cpu'; a device by ggml's name (Vulkan0, "
                         "CUDA0), which must pass its self-check; 'list': print the devices and exit")
    sv.add_argument("--gpu-layers", type=_count(0, 1 << 16), default=None, metavar="N",
                    help="owned layers on the device, the first N of the range (default: all of them, and a tail's "
                         "output layer with them; 0: the CPU)")
    _cpu_moe_flags(sv)


def _cpu_moe_flags(parser: argparse.ArgumentParser) -> None:
    """llama.cpp's --cpu-moe / --n-cpu-moe: a mixture of experts on one consumer GPU keeps its expert
    tensors in host memory and the rest of each layer on the device."""
    moe = parser.add_mutually_exclusive_group()
    moe.add_argument("--cpu-moe", dest="cpu_moe_layers", action="store_const", const=-1, default=0,
                     help="on a device: every owned layer's expert tensors in host memory, the rest on the device "
                          "(a mixture of experts; nothing changes on the CPU or for a dense model)")
    moe.add_argument("--n-cpu-moe", dest="cpu_moe_layers", type=_count(0, 1 << 16), metavar="N",
                     help="on a device: the expert tensors of the first N owned layers in host memory")


def _engine_flags(sv: argparse.ArgumentParser) -> None:
    sv.add_argument("--peer", action="append", default=[], metavar="HOST:PORT",
                    help="a worker this one may forward chained steps to (repeatable; no other address is contacted). "
                         "On the head: every later worker; several of one layer range are replicas of a stage "
                         "(sessions are spread over them and fail over between them)")
    sv.add_argument("--replica", action="append", default=[], metavar="HOST:PORT",
                    help="a worker of this one's layer range that takes its live sessions' KV when it is stopped "
                         "(SIGTERM) or drained (repeatable, tried in order; without one, sessions are released)")
    sv.add_argument("--wire-dtype", choices=tuple(WIRE_DTYPES), default="f32",
                    help="a head: how its own route's hidden rows travel between the workers when a request names "
                         "no wire_dtype; 'f32' (default): exact, the tokens of the whole model on one worker; 'f16': "
                         "half the bytes; 'q8_0': 0.27 of them (llama.cpp's 8-bit blocks). Both round the rows, so "
                         "a near-tie may go another way (docs/benchmarks.md measures how often). Every --peer must "
                         "read the type, or the head refuses to start")
    sv.add_argument("--max-hop-seconds", type=_positive_seconds, default=DEFAULT_MAX_HOP_S, metavar="S",
                    help="the longest a chained step may hold this worker, whatever the caller's deadline "
                         f"(default {DEFAULT_MAX_HOP_S:g})")
    sv.add_argument("--batch", type=_count(MIN_BATCH_TOKENS, 1 << 16), default=_DEFAULTS.engine_config().n_batch,
                    help=f"most tokens per llama_decode (at least {MIN_BATCH_TOKENS}: a verification of {MAX_DRAFTS} drafts)")
    sv.add_argument("--gather-ms", type=_milliseconds_within_a_second, default=DEFAULT_GATHER_S * 1000.0,
                    help="after a step, the longest wait for as many sessions as it had to send their next step (0: never wait)")
    sv.add_argument("--max-step-sessions", type=_count(1, MAX_SESSIONS), default=None,
                    help="most sessions per engine step (default: max sessions)")
    sv.add_argument("--prefill-chunk", type=_count(1, 1 << 16), default=DEFAULT_PREFILL_CHUNK,
                    help="most tokens of one prompt per engine step while other sessions wait")
    sv.add_argument("--kv-memory", type=_size, metavar="SIZE", default=None,
                    help="hot KV memory, e.g. 512MiB or 2GiB: sizes the hot slots (instead of --max-sessions)")
    sv.add_argument("--max-sessions", type=_count(1, MAX_SESSIONS), default=None, help=f"hot slots; default: LLAMA_SHARD_MAX_SESSIONS or {_DEFAULTS.max_sessions}")
    sv.add_argument("--context-tokens", type=CONTEXT_TOKENS, default=None, help=f"default: LLAMA_SHARD_CONTEXT_TOKENS or {_DEFAULTS.context_tokens}")
    sv.add_argument("--budget-tokens", type=TOKENS, default=None,
                    help="cap on tokens held hot; default: LLAMA_SHARD_BUDGET_TOKENS or slots x context")
    sv.add_argument("--ttl", type=_seconds, default=None, help=f"seconds; default: LLAMA_SHARD_TTL_SECONDS or {_DEFAULTS.ttl_seconds:g}")
    sv.add_argument("--sweep-seconds", type=_seconds, default=10.0,
                    help="how often idle sessions are checked against --ttl and --warm-ttl (0: only when requests arrive)")
    sv.add_argument("--warm-memory", type=_size, metavar="SIZE", default=None,
                    help="host memory for evicted sessions' KV (default: LLAMA_SHARD_WARM_BYTES or 0, off)")
    sv.add_argument("--warm-dir", metavar="PATH", default=None,
                    help="the disk tier: sessions that fall out of --warm-memory go to files here, and a restarted "
                         "worker resumes them (default: LLAMA_SHARD_WARM_DIR or none); one worker per directory")
    sv.add_argument("--warm-disk", type=_size, metavar="SIZE", default=None,
                    help="bound of the disk tier (default: LLAMA_SHARD_WARM_DISK_BYTES; required with --warm-dir)")
    sv.add_argument("--warm-ttl", type=_seconds, default=None,
                    help="seconds a warm session stays after its last use; default: LLAMA_SHARD_WARM_TTL_SECONDS or "
                         f"{_DEFAULTS.warm_ttl_seconds:g}")
    sv.add_argument("--prefix-memory", type=_size, metavar="SIZE", default=None,
                    help="host memory for shared prefixes: sessions that begin alike (a system prompt) open from a "
                         "stored copy of that start instead of computing it (default: LLAMA_SHARD_PREFIX_BYTES or "
                         "0, off); every worker of a route needs one for the route to share")
    sv.add_argument("--share-prefixes", choices=("principal", "all"), default="principal",
                    help="whose sessions share prefixes: each caller's own (default), or every caller's; with "
                         "'all', a caller's first token comes sooner when another caller sent the same start "
                         "before, which tells it that someone did (README: shared prefixes)")


def _speculation_flags(sv: argparse.ArgumentParser) -> None:
    sv.add_argument("--draft", choices=DRAFT_SOURCES, default="ngram",
                    help="speculative decoding on a head's Generate streams: where drafts come from; 'ngram' "
                         "(default): the session's own earlier tokens (prompt lookup); 'off': none. The tail "
                         "verifies them in one route step; the output is the tokens generation gives without them")
    sv.add_argument("--draft-model", metavar="GGUF", default=None,
                    help="a head's drafts come from this small model (loaded whole; its tokenizer must be the "
                         "model's, or the worker refuses to start) instead of prompt lookup")
    sv.add_argument("--draft-verify", choices=VERIFY_MODES, default="exact",
                    help="how the route computes a step of drafts: 'exact' (default): every token as a one-token "
                         "step would, to the bit, so the output is, token for token, generation's without drafts (in "
                         "one computation where a worker has shown it gives the same bytes, else one at a time); "
                         "'batched': in one computation always, cheaper where that is not shown, but llama.cpp may "
                         "round by a computation's shape and a near-tie may go the other way")
    _deprecated_alias(sv, "--verify", "--draft-verify", choices=VERIFY_MODES)
    sv.add_argument("--max-drafts", type=_count(0, MAX_DRAFTS), default=DEFAULT_MAX_DRAFTS, metavar="K",
                    help=f"the most drafts per step a request gets unless it sets max_drafts (0..{MAX_DRAFTS}, "
                         f"default {DEFAULT_MAX_DRAFTS}); the head uses fewer, or none, where they do not pay")


def _demo_parser(sub) -> None:
    d = sub.add_parser("demo", help="two workers on loopback split the model; four chat sessions run through them")
    d.add_argument("--model", help="GGUF file (default: the embedded SmolLM2)")
    d.add_argument("--threads", type=THREADS, default=1, help="threads per worker")
    d.add_argument("--max-tokens", type=_count(0, 1 << 20), default=48)
    d.set_defaults(func=cmd_demo)


def _inspect_parser(sub) -> None:
    i = sub.add_parser("inspect", help="architecture, bytes per layer, KV bytes per token, suggested splits")
    i.add_argument("path", nargs="?", help="GGUF file (default: the embedded model)")
    i.add_argument("--kv-memory", type=_size, metavar="SIZE", help="also print the memory plan for this much hot KV memory "
                   "(serve's name)")
    _deprecated_alias(i, "--memory", "--kv-memory", type=_size)
    i.add_argument("--layers", help="the shard's layers for the plan (default: all)")
    i.add_argument("--context-tokens", type=CONTEXT_TOKENS, default=_DEFAULTS.context_tokens)
    i.add_argument("--kv-type", choices=KV_TYPES, default="f16")
    i.add_argument("--warm-memory", type=_size, metavar="SIZE", default=None)
    i.add_argument("--device", default="cpu", metavar="auto|NAME",
                   help="with --kv-memory: also the device's share of the plan (weights, KV, compute buffers) against "
                        "its free memory")
    i.add_argument("--gpu-layers", type=_count(0, 1 << 16), default=None, metavar="N",
                   help="with --device: owned layers on the device (default: all)")
    _cpu_moe_flags(i)
    i.set_defaults(func=cmd_inspect)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="llama-shard", description="Run layer ranges of a GGUF model on a patched llama.cpp.")
    sub = ap.add_subparsers(dest="command", required=True)
    for add in (_generate_parser, _serve_parser, _demo_parser, _inspect_parser):
        add(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check = getattr(args, "check", None)
    if check is not None:  # what one flag's type cannot check alone, before anything loads
        try:
            check(args)
        except InvalidInputError as e:
            parser.error(str(e))
    try:
        return args.func(args)
    except (LlamaShardError, OSError) as e:
        _status(f"error: {e}")
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
