"""What one engine step and one sampled token cost, for the figures docs/benchmarks.md and the
closing notes quote (about a minute here):

    python benchmarks/step_cost_study.py [--threads 2]

- the tail's sampler on a row of the model's vocabulary: temperature 0 (the argmax path), the same
  chain forced over the whole row (min_p 1e-30 keeps every token), and temperature 0.8;
- a step of k tokens on top of 200 held (what a verification of k-1 drafts costs against a decode);
- a chat's next turn: 33 tokens on top of 899 held, against the 932 tokens cold;
each with flash attention on and off, on one HotKvStateManager as the README builds one.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from llama_shard import HotKvStateConfig, HotKvStateManager, ShardModel, Step
from llama_shard._native import SamplingParams, TokenSampler
from llama_shard.engine.models import require_embedded_model


def best_ms(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def sampler_us(n_vocab: int) -> dict[str, float]:
    logits = np.random.default_rng(0).standard_normal(n_vocab).astype(np.float32)
    out = {}
    for name, kw in (
        ("temperature 0", dict(temperature=0.0)),
        ("whole row", dict(temperature=0.0, min_p=1e-30)),
        ("temperature 0.8", dict(temperature=0.8)),
    ):
        params = SamplingParams(seed=1, penalty_last_n=64, **kw)

        def draws():
            s = TokenSampler(n_vocab, params, 4096, history=list(range(64)), draws=0)
            for _ in range(200):
                s.accept(s.sample(logits))

        out[name] = best_ms(draws, 3) / 200 * 1e3
    return out


def steps_ms(model: ShardModel, threads: int, flash_attn: bool) -> dict[str, float]:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, model.info.n_vocab, 932).tolist()
    mgr = HotKvStateManager(
        model,
        HotKvStateConfig(max_sessions=2, context_tokens=1024, ttl_seconds=0, flash_attn=flash_attn),
        n_threads=threads,
    )
    try:
        out = {}
        mgr.step_batch([Step.prefill("k", 0, tokens[:200], start_pos=0)])
        for k in (1, 2, 3, 5, 8):
            out[f"{k} on 200"] = best_ms(lambda: mgr.step_batch([Step.prefill("k", 0, tokens[:k], start_pos=200)]), 7)
        mgr.step_batch([Step.prefill("t", 0, tokens[:899], start_pos=0)])
        out["33 on 899"] = best_ms(lambda: mgr.step_batch([Step.prefill("t", 0, tokens[899:], start_pos=899)]), 3)
        out["932 cold"] = best_ms(lambda: mgr.step_batch([Step.prefill("t", 0, tokens, start_pos=0)]), 3)
        return out
    finally:
        mgr.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a GGUF (default: the embedded SmolLM2-135M)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    model = ShardModel(args.model or str(require_embedded_model()), None, args.threads)
    us = sampler_us(model.info.n_vocab)
    print(
        f"sampler, {model.info.n_vocab}-token row, us per token (best of 3 x 200 draws): "
        + ", ".join(f"{k} {v:.0f}" for k, v in us.items())
    )
    for flash_attn in (True, False):
        ms = steps_ms(model, args.threads, flash_attn)
        print(
            f"flash attention {'on' if flash_attn else 'off'}, {args.threads} threads, ms per step: "
            + ", ".join(f"{k} {v:.1f}" for k, v in ms.items())
        )


if __name__ == "__main__":
    main()
