"""How many drafts the head sends, replayed: the speculation benchmark's prompts, their greedy
tokens, and the route's step cost by size, without a route, so that drafting policies compare on the
same tokens (the bench's runs vary by several percent from one to the next):

    python benchmarks/draft_control_study.py [--link-ms 20] [--overhead-ms 7]

1. The whole model greedily continues each prompt of `routes.speculation_prompts` by 64 tokens.
2. The step cost by size: the bench's two 1-thread shards (its balanced cut), each step of n tokens a
   verification (row_by_row) after its first (which decides one call or row by row), median of 9;
   a route step of n tokens costs --link-ms (both ways) + --overhead-ms (gRPC, the head's loop: the
   bench's one-token step at +10 ms each way, 32 ms, less its links and compute) + both shards' time.
3. Each policy drafts with prompt lookup (NgramDrafter) along the greedy tokens; a step's drafts are
   accepted up to the first that is not the next greedy token. Printed: steps for 4 x 64 tokens and
   tokens/s against one token per step.

Policies: `DraftControl` (one rate for a step's first draft and one for a draft after an accepted
one, each request starting from the rates the one before it ended with, as a route loop does),
`per request` (the same, each request from the priors: the controller before), `one rate` (a
single acceptance rate for every draft, each request from the priors), and `always k` (every draft
the lookup has, up to k).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from routes import speculation_prompts

from llama_shard import HotKvStateConfig, HotKvStateManager, KvBoundaryAdapter, ShardModel
from llama_shard.engine.models import compute_balanced_cut, gguf_layer_count, require_embedded_model
from llama_shard.head.speculation import CARRIED_WEIGHT, DraftControl, NgramDrafter

TOKENS = 64
SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16)


class OneRateControl(DraftControl):
    """The controller before: a draft accepted with one rate a whatever came before it."""

    def k(self, cost, long=True, probe=True):
        a = min(self.rate(long), 0.999)
        best_k, best, e, ai = 0, 1.0, 1.0, 1.0
        for k in range(1, self.max_drafts + 1):
            ai *= a
            e += ai
            if e / cost[k] > best:
                best_k, best = k, e / cost[k]
        return best_k

    def _learn(self, drafted, accepted, long, in_run):
        counts, d = self._first[long], self.DECAY
        counts[0] = d * counts[0] + accepted
        counts[1] = d * counts[1] + (1 if accepted < drafted else 0)


def greedy(path) -> dict[str, list[tuple[list[int], list[int]]]]:
    model = ShardModel(str(path), None, 2)
    mgr = HotKvStateManager(model, HotKvStateConfig(max_sessions=2, context_tokens=512), n_threads=2)
    ad = KvBoundaryAdapter(model, mgr)
    out = {}
    try:
        for name, prompts in speculation_prompts(model).items():
            out[name] = []
            for prompt in prompts:
                tokens = [ad.prefill("g", 0, prompt, start_pos=0).token_id]
                while len(tokens) < TOKENS:
                    tokens.append(ad.decode("g", 0, [tokens[-1]]).token_id)
                out[name].append((prompt, tokens))
                mgr.release("g", 0)
    finally:
        mgr.close()
    return out


def shard_ms(path, layers: tuple[int, int]) -> dict[int, float]:
    """One shard's time for a step of n tokens after a 100-token prompt (a verification for n > 1)."""
    model = ShardModel(str(path), layers, 1)
    mgr = HotKvStateManager(model, HotKvStateConfig(max_sessions=1, context_tokens=256), n_threads=1)
    ad = KvBoundaryAdapter(model, mgr)
    info, rng = model.info, np.random.default_rng(1)

    def rows(n):
        if info.is_head:
            return {"token_ids": rng.integers(100, 20000, n).tolist()}
        return {"boundary": rng.standard_normal((n, info.n_embd)).astype(np.float32)}

    out = {}
    try:
        ad.prefill("s", 0, **rows(100), start_pos=0)
        for n in SIZES:
            more = rows(n)
            kw = {"row_by_row": n > 1, **({"logit_rows": n} if info.is_tail else {})}
            ad.prefill("s", 0, **more, start_pos=100, **kw)  # the first of its size: compared
            times = []
            for _ in range(9):
                t0 = time.perf_counter()
                ad.prefill("s", 0, **more, start_pos=100, **kw)
                times.append(time.perf_counter() - t0)
            out[n] = 1e3 * statistics.median(times)
        verdicts = mgr.engine.whole_rows_verdicts
    finally:
        mgr.close()
    print(
        f"  layers {layers[0]}-{layers[1]}: "
        + ", ".join(f"{n}: {ms:.1f} ms" for n, ms in out.items())
        + f"; verdicts {verdicts}"
    )
    return out


def replay(
    data, policy: str, max_drafts: int, cost_ms: list[float], carried: DraftControl | None = None
) -> tuple[int, float]:
    """Steps and milliseconds of the policy's drafting along the greedy tokens (a step of n tokens
    costs cost_ms[n]). `carried`: the route loop's rates before the first request (updated)."""
    cost = [c / cost_ms[1] for c in cost_ms[1:]]  # index k: a step of k + 1 tokens (StepCost.relative)
    steps, ms = 0, 0.0
    if carried is None:  # the route loop's rates: each request starts where the last one ended
        carried = DraftControl(0)
    for prompt, tokens in data:
        control = OneRateControl(max_drafts) if policy == "one rate" else DraftControl(max_drafts)
        if policy == "DraftControl":
            control.learn_rates_from(carried, CARRIED_WEIGHT)
        drafter, n = NgramDrafter(), 0
        while n < TOKENS:
            candidates, match = drafter.propose(prompt + tokens[:n], max_drafts)
            long = match >= 2
            room = TOKENS - n - 1
            if policy.startswith("always"):
                k = min(max_drafts, room)
            else:
                k = min(control.k(cost, long, probe=False), room) if candidates else 0
            drafts = candidates[:k]
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == tokens[n + accepted]:
                accepted += 1
            if candidates and not drafts:
                control.unsent(candidates[0] == tokens[n], long)
            control.update(len(drafts), accepted, long)
            steps += 1
            ms += cost_ms[len(drafts) + 1]
            n += accepted + 1
        carried.learn_rates_from(control)
    return steps, ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--link-ms", type=float, default=20.0, help="both ways of the route's links per step")
    ap.add_argument("--overhead-ms", type=float, default=7.0, help="gRPC and the head's loop per step")
    args = ap.parse_args()
    path = require_embedded_model()
    n_layer, cut = gguf_layer_count(path), compute_balanced_cut(path)
    print("step cost by tokens (1 thread each):")
    head, tail = shard_ms(path, (0, cut - 1)), shard_ms(path, (cut, n_layer - 1))
    # a route step of n tokens (n = 1 .. 16; sizes not timed: the largest timed one's slope)
    known = {n: args.link_ms + args.overhead_ms + head[n] + tail[n] for n in SIZES}
    slope = (known[SIZES[-1]] - known[SIZES[-2]]) / (SIZES[-1] - SIZES[-2])
    cost_ms = [0.0] + [known.get(n, known[SIZES[-1]] + slope * (n - SIZES[-1])) for n in range(1, 17)]
    print("route step ms: " + ", ".join(f"{n}: {cost_ms[n]:.1f}" for n in (1, 2, 3, 5, 9, 16)))
    data = greedy(path)
    for name, runs in data.items():
        base = len(runs) * TOKENS  # steps without drafts
        for policy, max_drafts in (
            ("DraftControl", 8),
            ("per request", 8),
            ("always k", 8),
            ("DraftControl", 15),
            ("per request", 15),
            ("one rate", 15),
            ("always k", 15),
        ):
            steps, ms = replay(runs, policy, max_drafts, cost_ms)
            print(
                f"{name:10s} {policy:12s} max {max_drafts:2d}: {steps} steps for {base} tokens, "
                f"{1e3 * base / ms:.1f} tok/s, {base * cost_ms[1] / ms:.2f}x one token per step"
            )
    # open questions right after the rewrites on the same route loop: the rates they start from are
    # the rewrites' (what CARRIED_WEIGHT keeps light)
    carried = DraftControl(0)
    replay(data["repetitive"], "DraftControl", 15, cost_ms, carried)
    base = len(data["open"]) * TOKENS
    steps, ms = replay(data["open"], "DraftControl", 15, cost_ms, carried)
    print(f"open after the rewrites, DraftControl max 15: {steps} steps, {base * cost_ms[1] / ms:.2f}x")


if __name__ == "__main__":
    main()
