"""A hybrid's next turn with recurrent checkpoints against a full re-prefill: time to first token.

A chat's next turn often re-renders the end of the last answer (a template's end-of-turn marker, a
stripped thought): the prompt shares all but the last few tokens the session holds. A hybrid
model's recurrent state cannot be cut back by llama.cpp; with checkpoints the session goes back to
the cut (restore, compute the few recorded inputs again) and prefills only the new tokens. Without
them the head would re-prefill the whole conversation. Both are timed here on a 2-shard route of a
synthetic nemotron_h (Mamba-2, attention and FFN layers) through the Hot KV engine, in one process:

    python benchmarks/checkpoint_study.py [--history 1024 --back 3 --new 20 --rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from llama_shard import HotKvStateConfig, HotKvStateManager, KvBoundaryAdapter, ShardModel
from llama_shard.engine.hot_kv import ManualClock
from llama_shard.testing.synthetic_families import MoeSpec, write_moe_gguf


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--history", type=int, default=1024, help="tokens the session holds before the next turn")
    ap.add_argument("--back", type=int, default=3, help="tokens of the last answer the next turn re-renders")
    ap.add_argument("--new", type=int, default=20, help="the next turn's new tokens")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)

    spec = MoeSpec(
        family="nemotron_h",
        n_layer=16,
        n_embd=512,
        n_head=8,
        n_head_kv=2,
        head_dim=64,
        n_ff=1536,
        n_expert=0,
        n_expert_used=0,
        layer_kinds="MMAFMMAFMMAFMMAF",
        ssm_heads=8,
        ssm_groups=2,
        ssm_state=64,
        n_vocab=4096,
        seed=7,
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = write_moe_gguf(Path(tmp) / "nemotron_h.gguf", spec)
        layout = [(0, 7), (8, 15)]
        config = HotKvStateConfig(max_sessions=2, context_tokens=a.history + a.new + 64, ttl_seconds=0)
        models = [ShardModel(str(path), r, a.threads) for r in layout]
        managers = [HotKvStateManager(m, config, ManualClock(), n_batch=256) for m in models]
        head, tail = (KvBoundaryAdapter(m, mgr) for m, mgr in zip(models, managers))

        def prefill(sid, tokens, start):
            return tail.prefill(
                sid, 0, boundary=head.prefill(sid, 0, token_ids=tokens, start_pos=start), start_pos=start
            )

        def decode(sid, token):
            return tail.decode(sid, 0, boundary=head.decode(sid, 0, token_ids=[token]))

        prompt = [(i * 7919) % spec.n_vocab for i in range(a.history - 64)]
        new = [(i * 104729) % spec.n_vocab for i in range(a.new)]
        with_cp, full = [], []
        for r in range(a.rounds):
            sid = f"chat-{r}"
            out = prefill(sid, prompt, 0)
            held = list(prompt)
            for _ in range(64):  # the last answer
                held.append(out.token_id)
                out = decode(sid, out.token_id)
            cut = len(held) - a.back
            next_turn = held[:cut] + new
            t0 = time.perf_counter()
            prefill(sid, next_turn[cut:], cut)  # checkpoints: back to the cut, then the new tokens
            with_cp.append(time.perf_counter() - t0)
            for m in managers:
                m.release(sid, 0)
            t0 = time.perf_counter()
            prefill(sid, next_turn, 0)  # what the head does without them
            full.append(time.perf_counter() - t0)
            for m in managers:
                m.release(sid, 0)
        restores = sum(m.stats()["checkpoint_restores"] for m in managers)
        for m in managers:
            m.close()
    a_ms, b_ms = statistics.median(with_cp) * 1e3, statistics.median(full) * 1e3
    print(
        f"nemotron_h synthetic, 16 layers, n_embd 512, 2 shards, {a.threads} threads; history {a.history} tokens, "
        f"the next turn re-renders the last {a.back} and adds {a.new}; median of {a.rounds}"
    )
    print("| next turn | time to first token | |\n| --- | --- | --- |")
    print(f"| with checkpoints | {a_ms:.1f} ms | restores: {restores} |")
    print(f"| full re-prefill ({len(next_turn)} tokens) | {b_ms:.1f} ms | |")
    print(f"| ratio | {b_ms / a_ms:.1f}x faster | |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
