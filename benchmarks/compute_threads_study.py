"""Two engines of one process taking turns, as a head's draft model and its route model do: each
context keeps compute threads of its own between steps, and one about to compute puts the last
one's to sleep (native/src/shard_context.cpp, take_compute_turn), so that they do not spin on the
cores the other computes on.

Two `HotKvStateManager`s over the same model, each with `--threads` compute threads and one
session of 32 tokens; per round, first one engine alone (`--steps` one-token steps), then
`--draft-steps` one-token steps on the second engine before each step of the first. Prints steps/s
of each phase per round (docs/benchmarks.md, "Compute threads").

    python benchmarks/compute_threads_study.py [--rounds 3] [--steps 24] [--draft-steps 4] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from llama_shard import HotKvStateConfig, HotKvStateManager, ManualClock, ShardModel, Step
from llama_shard.engine.models import require_embedded_model


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF file (default: the embedded SmolLM2)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=24, help="steps of the first engine per phase")
    ap.add_argument("--draft-steps", type=int, default=4, help="steps of the second engine before each of the first's")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    path = args.model or str(require_embedded_model())
    config = HotKvStateConfig(max_sessions=1, context_tokens=512, budget_tokens=512, ttl_seconds=0)
    route, draft = (
        HotKvStateManager(
            ShardModel(path, None, args.threads), config, ManualClock(), n_batch=64, n_threads=args.threads
        )
        for _ in range(2)
    )
    vocab = route.model.info.n_vocab
    rng = np.random.default_rng(0)

    def reset() -> None:  # each phase from the same 32 cached tokens
        for m in (route, draft):
            m.release("s", 0)
            m.step_batch([Step.prefill("s", 0, rng.integers(0, vocab, 32).tolist(), start_pos=0)])

    def phase(draft_steps: int) -> float:
        reset()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            for _ in range(draft_steps):
                draft.step_batch([Step.decode("s", 0, [int(rng.integers(0, vocab))])])
            route.step_batch([Step.decode("s", 0, [int(rng.integers(0, vocab))])])
        return args.steps * (draft_steps + 1) / (time.perf_counter() - t0)

    print(f"| round | one engine alone, steps/s | two taking turns ({args.draft_steps} + 1), steps/s |")
    print("| ---: | ---: | ---: |")
    for k in range(args.rounds):
        print(f"| {k + 1} | {phase(0):.1f} | {phase(args.draft_steps):.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
