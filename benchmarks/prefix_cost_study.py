"""What a session opened from a shared prefix costs on each shard, against the same prompt cold
(the ceiling of the time-to-first-token row of `bench.py --sections prefixes`):

    python benchmarks/prefix_cost_study.py [--prefix 512] [--own 32]

For each shard of the bench's two-worker split (1 thread each, as its workers), with flash
attention on and off: the prompt computed cold in the head's chunks of 256, against opening the
stored prefix and computing the session's own tokens, and the open alone; best of 5 each.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from llama_shard import HotKvStateConfig, HotKvStateManager, KvBoundaryAdapter, ShardModel
from llama_shard.engine.models import compute_balanced_cut, gguf_layer_count, require_embedded_model


def best_ms(fn, reps: int = 5) -> float:
    best = float("inf")
    for i in range(reps):
        t = time.perf_counter()
        fn(i)
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefix", type=int, default=512)
    ap.add_argument("--own", type=int, default=32)
    args = ap.parse_args()
    path = require_embedded_model()
    n, cut = gguf_layer_count(path), compute_balanced_cut(path)
    total = args.prefix + args.own
    for flash_attn in (True, False):
        cold_sum = warm_sum = 0.0
        for layers in ((0, cut - 1), (cut, n - 1)):
            model = ShardModel(str(path), layers, 1)
            config = HotKvStateConfig(
                max_sessions=4, context_tokens=total + 16, ttl_seconds=0, prefix_bytes=64 << 20, flash_attn=flash_attn
            )
            mgr = HotKvStateManager(model, config, n_threads=1)
            ad = KvBoundaryAdapter(model, mgr)
            rng = np.random.default_rng(0)
            if model.info.is_head:
                feed = lambda a, b: dict(token_ids=tokens[a:b])  # noqa: E731
                tokens = rng.integers(100, model.info.n_vocab, total).tolist()
            else:
                rows = rng.standard_normal((total, model.info.n_embd)).astype(np.float32)
                feed = lambda a, b: dict(boundary=rows[a:b])  # noqa: E731
            try:

                def cold(i):
                    for a in range(0, total, 256):
                        ad.prefill(f"c{i}", 0, start_pos=a, **feed(a, min(a + 256, total)))
                    mgr.release(f"c{i}", 0)

                cold_ms = best_ms(cold)
                for a in range(0, args.prefix, 256):
                    ad.prefill("src", 0, start_pos=a, **feed(a, min(a + 256, args.prefix)))
                mgr.store_prefix("src", 0, 1, args.prefix)

                def opened(i):
                    mgr.open_prefix(f"w{i}", 0, 1, args.prefix)
                    ad.prefill(f"w{i}", 0, start_pos=args.prefix, **feed(args.prefix, total))
                    mgr.release(f"w{i}", 0)

                warm_ms = best_ms(opened)

                def open_only(i):
                    mgr.open_prefix(f"o{i}", 0, 1, args.prefix)

                copy_ms = best_ms(open_only)
                for i in range(5):
                    mgr.release(f"o{i}", 0)
            finally:
                mgr.close()
            cold_sum, warm_sum = cold_sum + cold_ms, warm_sum + warm_ms
            print(
                f"flash attention {'on' if flash_attn else 'off'}, layers {layers[0]}-{layers[1]}: {total} tokens "
                f"cold {cold_ms:.0f} ms; the {args.prefix}-token prefix opened + {args.own} tokens {warm_ms:.1f} ms "
                f"({cold_ms / warm_ms:.1f}x; the open alone {copy_ms:.1f} ms)"
            )
        print(
            f"flash attention {'on' if flash_attn else 'off'}, both shards: cold {cold_sum:.0f} ms, opened "
            f"{warm_sum:.1f} ms ({cold_sum / warm_sum:.1f}x): the compute ceiling of the bench's ratio"
        )


if __name__ == "__main__":
    main()
