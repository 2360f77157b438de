"""What the commands share: status lines, the model's path, the CPU kernels and devices, the device's memory plan."""

from __future__ import annotations

import sys
from pathlib import Path

from .._native import CPU_DEVICE, is_cpu_device
from ..engine.hot_kv import HotKvStateConfig
from ..engine.models import regular_model_file, require_embedded_model
from ..errors import InvalidInputError

#: the configuration's defaults, as the help texts state them
DEFAULTS = HotKvStateConfig()


def status(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def model_path(arg: str | None) -> Path:
    return regular_model_file(arg, "--model") if arg else require_embedded_model()


def cpu_kernels() -> str:
    """Which CPU kernels this process runs, their instruction sets, and what the self-check found."""
    from .._native import cpu_backend

    c = cpu_backend()
    shipped = f"; shipped: {', '.join(c['available'])}" if c["available"] else ""
    amx = "; AMX in use" if c["amx"] else ("; AMX off" if "AMX_INT8" in c["features"] else "")
    return f"{c['variant']} ({' '.join(c['features'])}){amx}{shipped}; self-check {c['self_check']}"


def devices_text() -> str:
    """The GPU devices this process can use, one per line, with each GPU module's state."""
    from .._native import devices, gpu_backends

    found = devices()
    lines = [
        f"  {d['name']}: {d['description']} ({d['backend']}, {d['type']}, "
        f"{d['memory_free'] / 2**30:.1f} of {d['memory_total'] / 2**30:.1f} GiB free)"
        for d in found
    ]
    modules = gpu_backends()
    lines.append("  GPU backends: " + ("; ".join(modules) if modules else "none in this build"))
    if not found:
        lines.append("  (a CPU Vulkan driver such as lavapipe is listed only when GGML_VK_VISIBLE_DEVICES names it)")
    return "\n".join(lines)


def device_text(info) -> str:
    """Where a loaded shard's layers run, in one line."""
    if is_cpu_device(info.device):
        return CPU_DEVICE + (f" ({info.device_note})" if info.device_note else "")
    output = "; the output layer too" if info.output_on_device else ""
    experts = (
        f"; the experts of {info.cpu_moe_layers} of them in host memory (--cpu-moe)" if info.cpu_moe_layers else ""
    )
    return (
        f"{info.device} ({info.device_description}): {info.gpu_layers} of {info.n_owned_layers} owned "
        f"layers and their KV{output}{experts}"
    )


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def device_memory_plan(
    model: Path, layers: tuple[int, int] | None, device: str, gpu_layers: int, engine_config, cpu_moe_layers: int = 0
) -> str:
    """The device's share of a shard and its engine, from llama.cpp's dry run (nothing allocated),
    against the device's free memory: one line, or InvalidInputError naming the device and the
    numbers when it does not fit. "" on the CPU."""
    from .._native import plan_memory

    if is_cpu_device(device) or gpu_layers == 0:
        return ""
    mem = plan_memory(str(model), layers, device, gpu_layers, engine_config, cpu_moe_layers)
    if is_cpu_device(mem["device"]):
        return ""
    need = mem["device_model"] + mem["device_context"] + mem["device_compute"]
    parts = (
        f"weights {_mib(mem['device_model'])}, KV {_mib(mem['device_context'])}, "
        f"compute buffers {_mib(mem['device_compute'])}"
    )
    if need > mem["device_free"]:
        raise InvalidInputError(
            f"the plan does not fit {mem['device']}: it needs {_mib(need)} there ({parts}) and {_mib(mem['device_free'])} "
            f"of {_mib(mem['device_total'])} are free; give fewer --gpu-layers, --cpu-moe or --n-cpu-moe on a "
            f"mixture of experts, fewer --max-sessions (or less "
            f"--kv-memory) or fewer --context-tokens"
        )
    return (
        f"{mem['device']}: {_mib(need)} ({parts}) of {_mib(mem['device_free'])} free; "
        f"host: {_mib(mem['host_model'] + mem['host_context'] + mem['host_compute'])}"
    )
