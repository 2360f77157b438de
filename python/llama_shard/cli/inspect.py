"""`llama-shard inspect`: a model's layers, suggested splits and memory plan."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..engine.models import compute_balanced_cut
from ..engine.pipeline import parse_split
from ..errors import InvalidInputError
from .common import cpu_kernels, device_memory_plan, devices_text, model_path


def cmd_inspect(args: argparse.Namespace) -> int:
    from .._native import certified_architectures, is_cpu_device
    from ..engine.hot_kv import parse_size
    from ..engine.memory import memory_plan
    from ..engine.models import gguf_shape

    if (not is_cpu_device(args.device) or args.gpu_layers is not None or args.cpu_moe_layers) and not args.kv_memory:
        raise InvalidInputError(
            "--device, --gpu-layers and --cpu-moe size the device's share of a memory plan: give --kv-memory too"
        )
    if args.sessions is not None and not args.plan:
        raise InvalidInputError("--sessions sizes a --plan's stages: give --plan too")
    path = model_path(args.path)
    shape = gguf_shape(path)
    n_layer, per_layer = shape.n_layer, shape.layer_bytes
    kv_layer = shape.kv_layer_bytes
    arch = shape.architecture
    print(f"file:          {path}")
    print(f"CPU kernels:   {cpu_kernels()}")
    print("devices:\n" + devices_text())
    certified = arch in certified_architectures()
    print(
        f"architecture:  {arch} ({'certified for shard execution' if certified else 'NOT certified: whole-model only'})"
    )
    print(f"kind:          {shape.kind}")
    print(
        f"layers:        {n_layer}; n_embd {shape.n_embd}; heads {shape.n_head} (kv {shape.n_head_kv}); head_dim {shape.head_dim}"
        + (
            f"; then {shape.n_nextn} MTP block(s) ({shape.mtp_bytes / 2**20:.1f} MiB) no shard loads"
            if shape.n_nextn
            else ""
        )
    )
    print(
        f"weights:       {sum(per_layer) / 2**20:.1f} MiB in layers, {shape.other_bytes / 2**20:.1f} MiB outside them (embedding, output)"
        + (f"; experts {sum(shape.expert_bytes) / 2**20:.1f} MiB" if shape.n_expert else "")
    )
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
        plan = memory_plan(
            shape.range_info(first, last), kv_memory, args.context_tokens, kv_type=args.kv_type, warm_bytes=warm
        )
        print(f"memory plan for layers {first}-{last} with {args.kv_memory} of KV memory:")
        print("  " + plan.describe().replace("\n", "\n  "))
        if not is_cpu_device(args.device):
            layers = None if args.layers in (None, "all") else (first, last)
            on_device = device_memory_plan(
                path,
                layers,
                args.device,
                -1 if args.gpu_layers is None else args.gpu_layers,
                plan.config().engine_config(),
                args.cpu_moe_layers,
            )
            print(f"  on the device (llama.cpp's dry run): {on_device or 'none: the CPU'}")
    if args.plan:
        print_plan(shape, args.plan, args.sessions or 8, args.context_tokens)
    return 0


def print_plan(shape, path: str, sessions: int, context_tokens: int) -> None:
    """The head's plan over the members a file describes (a dry run: nothing joins, nothing loads)."""
    import json

    from ..errors import WhyNot
    from ..head import planner

    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise InvalidInputError(f"--plan {path}: {e}") from None
    members = planner.members_from_json(data)
    if isinstance(members, WhyNot):
        raise InvalidInputError(f"--plan {path}: {members.text}")
    costs = planner.ModelCosts.of(shape, sessions, context_tokens)
    plan = planner.plan_route(costs, members, members[0].name)
    print(
        f"plan over {len(members)} members ({sessions} sessions of {context_tokens} tokens a stage, "
        f"{planner.HEADROOM:.0%} headroom; head {members[0].name}):"
    )
    if isinstance(plan, WhyNot):
        raise InvalidInputError(plan.text)
    print(plan.describe())
    naive = planner.equal_layers(costs, members, members[0].name)
    print(
        "  equal layers over every member, as listed: "
        + (f"{naive.tokens_per_s:.1f} tok/s" if naive else "does not fit their memory")
    )
