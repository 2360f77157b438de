"""Whether llama.cpp's logits depend on how a prompt is cut into steps (why shared prefixes are
whole blocks of 256 tokens, worker/prefixes.py; the figures docs/benchmarks.md quotes):

    python benchmarks/chunking_study.py [--threads 2]

One HotKvStateManager on the whole embedded model prefills the same random 544-token prompt in
different cuts and compares the last token's logits, byte for byte, with one cut at 512 (the
generation loop's chunks of 256 give the same), with flash attention on and off.
"""

from __future__ import annotations

import argparse

import numpy as np

from llama_shard import HotKvStateConfig, HotKvStateManager, ShardModel, Step
from llama_shard.engine.models import require_embedded_model

CUTS = {
    "512 + 32": [512],
    "256 + 256 + 32": [256, 512],
    "128 x 4 + 32": [128, 256, 384, 512],
    "64 x 8 + 32": list(range(64, 513, 64)),
    "544 at once": [],
    "448 + 96": [448],
    "480 + 64": [480],
    "500 + 44": [500],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    model = ShardModel(str(require_embedded_model()), None, args.threads)
    tokens = np.random.default_rng(1).integers(0, model.info.n_vocab, 544).tolist()
    for flash_attn in (True, False):
        mgr = HotKvStateManager(
            model,
            HotKvStateConfig(max_sessions=2, context_tokens=1024, ttl_seconds=0, flash_attn=flash_attn),
            n_threads=args.threads,
        )
        logits = {}
        try:
            for name, cuts in CUTS.items():
                bounds = [0, *cuts, len(tokens)]
                for a, b in zip(bounds, bounds[1:]):
                    ((result, out),) = mgr.step_batch([Step.prefill(name, 0, tokens[a:b], start_pos=a)])
                logits[name] = np.asarray(out).tobytes()
                mgr.release(name, 0)
        finally:
            mgr.close()
        base = logits["512 + 32"]
        same = ", ".join(f"{name}: {'same' if v == base else 'differs'}" for name, v in logits.items())
        print(f"flash attention {'on' if flash_attn else 'off'} (against 512 + 32): {same}")


if __name__ == "__main__":
    main()
