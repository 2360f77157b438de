"""What a member reports of itself, measured where it runs: the memory it may use, and the time one
token takes through one of this model's layers (decode and prefill), timed on a range of one layer
(the probe layer the head names: a member without the model fetches only that layer to time it)."""

from __future__ import annotations

import time

import numpy as np

#: decode steps timed (the median is reported) and prompt tokens of the timed prefill
DECODE_STEPS = 16
PREFILL_TOKENS = 64


def available_memory() -> int:
    """The memory this machine has available now (Linux's MemAvailable; the physical size elsewhere)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def time_one_layer(path: str, layer: int, threads: int | None, device: str = "cpu") -> tuple[float, float, str]:
    """(decode, prefill) seconds per token through layer `layer` of the model at `path` (a whole file
    or a range file that holds it), measured on one session of hidden rows on `device` (serve's
    --device: auto, cpu or a name), and the device it ran on."""
    from .._native import ShardModel
    from ..engine.hot_kv import HotKvStateConfig, Step
    from ..engine.manager import HotKvStateManager

    model = ShardModel(str(path), (layer, layer), threads, device)
    manager = HotKvStateManager(model, HotKvStateConfig(max_sessions=1, context_tokens=256, budget_tokens=256))
    try:
        n_embd = model.info.n_embd
        rows = np.random.default_rng(0).standard_normal((PREFILL_TOKENS + DECODE_STEPS, n_embd)).astype(np.float32)
        if layer == 0:  # the head's layer takes tokens
            prompt = dict(token_ids=list(range(1, PREFILL_TOKENS + 1)))
            one = lambda i: dict(token_ids=[1 + i % 50])  # noqa: E731
        else:
            prompt = dict(hidden=rows[:PREFILL_TOKENS])
            one = lambda i: dict(hidden=rows[PREFILL_TOKENS + i : PREFILL_TOKENS + i + 1])  # noqa: E731
        t0 = time.perf_counter()
        manager.step_batch([Step.prefill("probe", 0, start_pos=0, **prompt)])
        prefill_s = (time.perf_counter() - t0) / PREFILL_TOKENS
        times = []
        for i in range(DECODE_STEPS):
            t0 = time.perf_counter()
            manager.step_batch([Step.decode("probe", 0, expected_seq_len=PREFILL_TOKENS + i, **one(i))])
            times.append(time.perf_counter() - t0)
        times.sort()
        return times[len(times) // 2], prefill_s, model.info.device
    finally:
        manager.close()
