"""What a verification step costs by its number of rows, and whether llama.cpp gives a step of
several rows the bytes of one-token steps (the ceiling and the exactness behind
`bench.py --sections speculation`):

    python benchmarks/verify_rows_study.py [--threads 1] [--gemma3]

The whole model in one engine (1 thread, as the bench's workers), flash attention on and off:
- cost: after a 200-token prompt, a step of k tokens with k rows of logits, computed together
  (`--verify batched`) and one token at a time (`--verify exact`, row_by_row), median of 7;
- exactness: after a 40-token text, k tokens as one step against k one-token steps: how many of
  the k rows of logits are byte-equal, and the largest difference.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from llama_shard import HotKvStateConfig, HotKvStateManager, KvBoundaryAdapter, ShardModel
from llama_shard.engine.models import gemma3_model_path, require_embedded_model

TEXT = (
    "Rewrite the following text exactly as it is written.\n\nText: To reset the router, unplug it from the "
    "wall, wait thirty seconds, and plug it back in. When the green light stops blinking, open the settings "
    "page and choose a new password.\n\nRewritten text: To reset the router, unplug it from the wall"
)
ROWS = (1, 2, 4, 6, 8, 16)


def study(path, flash_attn: bool, threads: int) -> list[str]:
    model = ShardModel(str(path), None, threads)
    config = HotKvStateConfig(max_sessions=4, context_tokens=512, budget_tokens=2048, flash_attn=flash_attn)
    mgr = HotKvStateManager(model, config, n_threads=threads)
    ad = KvBoundaryAdapter(model, mgr)
    try:
        ids = np.random.default_rng(0).integers(100, min(20000, model.info.n_vocab), 230).tolist()
        ad.prefill("cost", 0, ids[:200], start_pos=0)

        def median_ms(k: int, row_by_row: bool) -> float:
            times = []
            for _ in range(7):  # each at position 200: the prefill there cuts the last one's rows
                t = time.perf_counter()
                ad.prefill("cost", 0, ids[200 : 200 + k], start_pos=200, logit_rows=k, row_by_row=row_by_row)
                times.append(time.perf_counter() - t)
            return statistics.median(times) * 1e3

        cost = {k: (median_ms(k, False), median_ms(k, True)) for k in ROWS}
        text = model.tokenize(TEXT)
        equal = {}
        for k in ROWS[1:]:
            ad.prefill(f"one{k}", 0, text[:40], start_pos=0)
            ad.prefill(f"rows{k}", 0, text[:40], start_pos=0)
            singles = [ad.decode(f"one{k}", 0, [t]).logits.copy() for t in text[40 : 40 + k]]
            rows = ad.prefill(f"rows{k}", 0, text[40 : 40 + k], start_pos=40, logit_rows=k).rows
            same = sum(rows[i].tobytes() == singles[i].tobytes() for i in range(k))
            equal[k] = (same, max(float(np.abs(rows[i] - singles[i]).max()) for i in range(k)))
            mgr.release(f"one{k}", 0)
            mgr.release(f"rows{k}", 0)
    finally:
        mgr.close()
    name = f"{path.name}, flash attention {'on' if flash_attn else 'off'}"
    lines = []
    for k in ROWS:
        batched, exact = cost[k]
        same = f"{equal[k][0]}/{k} (largest difference {equal[k][1]:.3g})" if k in equal else "-"
        lines.append(f"| {name} | {k} | {batched:.1f} | {exact:.1f} | {batched / cost[1][0]:.2f} | {same} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--gemma3", action="store_true", help="Gemma 3 270M too (installed by scripts/install.sh)")
    args = ap.parse_args()
    paths = [require_embedded_model()] + ([gemma3_model_path()] if args.gemma3 else [])
    print(f"{args.threads} thread(s); a step of k tokens, k rows of logits, after 200 tokens (cost) or 40 (bytes)\n")
    print(
        "| model | k | batched ms | one at a time ms | batched / one row | batched rows byte-equal to one-token steps |"
    )
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for path in paths:
        for flash_attn in (True, False):
            print("\n".join(study(path, flash_attn, args.threads)), flush=True)


if __name__ == "__main__":
    main()
