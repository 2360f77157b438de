"""What checking a state's K/V values finite costs (kv_state_check.h), against its positions alone:
a 2,000-token state of SmolLM2's layers 0-14, f16 and q8_0, each check timed 30 times (median).
The figure docs/security.md quotes for hand-overs and warm files read back.

    python benchmarks/kv_value_check.py
"""

from __future__ import annotations

import statistics
import time

from llama_shard import HotKvStateConfig, HotKvStateManager, KvBoundaryAdapter, ShardModel
from llama_shard._native import kv_state_problem
from llama_shard.engine.hot_kv import ManualClock
from llama_shard.engine.models import embedded_model_path

TOKENS = 2000


def main() -> None:
    model = ShardModel(str(embedded_model_path()), (0, 14), 1)
    for kv_type in ("f16", "q8_0"):
        config = HotKvStateConfig(
            max_sessions=2, context_tokens=2048, budget_tokens=4096, ttl_seconds=0, kv_type=kv_type
        )
        manager = HotKvStateManager(model, config, ManualClock(), n_batch=512)
        KvBoundaryAdapter(model, manager).prefill(
            "s", 0, token_ids=[(i * 7) % 1000 + 5 for i in range(TOKENS)], start_pos=0
        )
        _, state = manager.engine.export_session("s", 0, 0.0)
        for values in (False, True):
            times = []
            for _ in range(30):
                t = time.perf_counter()
                assert kv_state_problem(state, TOKENS, values=values) == ""
                times.append(time.perf_counter() - t)
            print(
                f"{kv_type} {len(state) / 2**20:.1f} MiB, {'values' if values else 'positions'}: "
                f"median {statistics.median(times) * 1000:.2f} ms"
            )


if __name__ == "__main__":
    main()
