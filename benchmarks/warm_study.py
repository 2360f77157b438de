"""The warm tier and the memory plan, measured .

    python benchmarks/warm_study.py [--threads 2] [--model PATH] [--quick]


Every figure comes from one run of this module on one machine:
  - restoring a 1,024-token session from host memory and from disk (cold page cache) against
    re-prefilling it, on the same shard;
  - decode throughput with the warm tier on and nothing spilling, against the tier off;
  - 64 chat sessions with think time over 8 hot slots, with and without the warm tier;
  - the oversubscribed route: two workers, 8 sessions x (128 + 400) tokens, a 2,048-token hot budget
    with a warm tier against a budget that fits everything;
  - memory held to the plan: a worker with --kv-memory 256MiB --warm-memory 256MiB under a churn of
    sessions of random lengths (RSS sampled, counters checked);
  - KV types: sessions per GiB of hot memory (measured RSS) and greedy agreement with f16.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from common import log

from llama_shard import HotKvConfig, HotKvStateConfig, HotKvStateManager, KvBoundaryAdapter, ShardModel, Step
from llama_shard.engine.models import compute_balanced_cut, require_embedded_model
from llama_shard.engine.recipe import kv_bytes_per_token
from llama_shard.errors import InvalidInputError
from llama_shard.local_workers import start_worker, stop_worker, wait_serving
from llama_shard.route import LocalStage, RemoteStage, RouteClient
from llama_shard.testing.process import resident_bytes as rss

_WARM = 256 << 20
# prompts for the route study: slices of one text, so greedy decoding follows confident paths
_TEXT = (
    "A mesh of small computers can serve a language model that none of them could hold alone. Each node "
    "keeps a contiguous range of the model's layers and the attention cache of those layers for every "
    "conversation that passes through it. When a person types a message, the first node turns the words "
    "into vectors, runs its layers and hands the result to the next node, which does the same, until the "
    "last node picks the next word. The cache is what makes this fast: without it, every new word would "
    "cost a pass over the whole conversation on every node. The cache is also what fills the memory of a "
    "node, because it grows with every word of every conversation. Most conversations are idle most of "
    "the time, while their people read and think, so a node that keeps only the active ones in its fast "
    "memory and parks the others nearby can serve many more people than it has room for at once. Parking "
    "has to be exact: a conversation that comes back must continue as if it had never left, word for "
    "word, or the answers would change depending on how busy the node was. It also has to be cheap, a "
    "copy of a few megabytes rather than seconds of recomputation, and safe, so that a parked cache can "
    "never be mistaken for another conversation's or for a cache written by a different model. "
) * 3
_PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def add(a, b):",
    "The three primary colors are",
    "Water boils at",
    "My favourite book is",
    "import numpy as np\n",
    "The quick brown fox",
]


def _tokens(rng, vocab: int, n: int) -> list[int]:
    return rng.integers(0, vocab, n).tolist()


# ---------------------------------------------------------------------------------------------
# restore against re-prefill
# ---------------------------------------------------------------------------------------------


def _evict_cold(warm_dir: Path) -> None:
    """Drops the disk tier's files from the page cache, so a restore reads the disk."""
    for f in warm_dir.glob("*.kv"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def restore_vs_prefill(path: Path, threads: int, n_tokens: int = 1024, rounds: int = 5) -> dict:
    """On the head shard of the balanced split: seconds to re-prefill an n-token session, and to
    restore it (the engine's own restore timer) from host memory and from disk."""
    cut = compute_balanced_cut(path)
    model = ShardModel(str(path), (0, cut - 1), threads)
    vocab = model.info.n_vocab
    rng = np.random.default_rng(1)
    prompt = _tokens(rng, vocab, n_tokens)
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for tier in ("host", "disk"):
            cfg = HotKvStateConfig(
                max_sessions=1,
                context_tokens=n_tokens + 64,
                ttl_seconds=0,
                warm_bytes=_WARM if tier == "host" else 0,
                warm_dir=str(Path(tmp) / tier) if tier == "disk" else None,
                warm_disk_bytes=_WARM if tier == "disk" else 0,
            )
            mgr = HotKvStateManager(model, cfg)
            prefill, restore = [], []
            for r in range(rounds):
                t0 = time.perf_counter()
                mgr.step_batch([Step.prefill("long", r, prompt, start_pos=0)])  # a new epoch re-prefills from zero
                prefill.append(time.perf_counter() - t0)
                mgr.step_batch([Step.prefill("other", 0, prompt[:1], start_pos=0)])  # "long" leaves the only slot
                if tier == "disk":
                    _evict_cold(Path(tmp) / tier)
                before = mgr.stats()["restore_seconds"]
                res = mgr.step_batch([Step.decode("long", r, [1], expected_seq_len=n_tokens)])[0]
                assert res[0].seq_len == n_tokens + 1, res
                restore.append(mgr.stats()["restore_seconds"] - before)
                mgr.release("other", 0)
            st = mgr.stats()
            assert st["restores"] == rounds and sum(st["misses"].values()) == 0, st
            out["prefill_s"] = min(prefill + ([out["prefill_s"]] if "prefill_s" in out else []))
            out[f"{tier}_restore_s"] = min(restore)
            out["kv_bytes"] = n_tokens * st["kv_bytes_per_token"]
            mgr.close()
    return out


# ---------------------------------------------------------------------------------------------
# decode throughput with the tier on and nothing spilling
# ---------------------------------------------------------------------------------------------


def tier_overhead(path: Path, threads: int, sessions: int = 8, npp: int = 64, ntg: int = 64, rounds: int = 3) -> dict:
    model = ShardModel(str(path), None, threads)
    vocab = model.info.n_vocab
    best = {False: 0.0, True: 0.0}
    for _ in range(rounds):
        for warm in (False, True):
            cfg = HotKvStateConfig(max_sessions=sessions, context_tokens=npp + ntg + 8, warm_bytes=_WARM if warm else 0)
            mgr = HotKvStateManager(model, cfg)
            rng = np.random.default_rng(2)
            answers = mgr.step_batch(
                [Step.prefill(f"s{i}", 0, _tokens(rng, vocab, npp), start_pos=0) for i in range(sessions)]
            )
            last = [int(np.argmax(out)) for _, out in answers]
            t0 = time.perf_counter()
            for k in range(ntg):
                answers = mgr.step_batch(
                    [Step.decode(f"s{i}", 0, [last[i]], expected_seq_len=npp + k) for i in range(sessions)]
                )
                last = [int(np.argmax(out)) for _, out in answers]
            rate = sessions * ntg / (time.perf_counter() - t0)
            assert mgr.stats()["spills"] == 0
            best[warm] = max(best[warm], rate)
            mgr.close()
    return {"off_tok_s": best[False], "on_tok_s": best[True]}


# ---------------------------------------------------------------------------------------------
# chat sessions with think time over few hot slots
# ---------------------------------------------------------------------------------------------


def chat_sessions(
    path: Path,
    threads: int,
    n_sessions: int = 64,
    slots: int = 8,
    turns: int = 3,
    user_tokens: int = 24,
    reply_tokens: int = 16,
) -> dict:
    """Each session: a turn is the user's tokens (a prefill) and a reply (greedy decodes); the
    sessions take turns in a random order, so between two turns of one session the others run
    (its person reading and typing). Whole model on one shard; a miss re-prefills the history."""
    model = ShardModel(str(path), None, threads)
    vocab = model.info.n_vocab
    out = {}
    for warm in (False, True):
        cfg = HotKvStateConfig(
            max_sessions=slots,
            context_tokens=turns * (user_tokens + reply_tokens) + 64,
            warm_bytes=_WARM if warm else 0,
        )
        stage = LocalStage(model, cfg)
        client = RouteClient([stage], max_reprefills=3)
        rng = np.random.default_rng(3)
        sessions = [client.session(f"chat-{i}") for i in range(n_sessions)]
        order = [i for _ in range(turns) for i in rng.permutation(n_sessions)]
        last: dict[int, int] = {}
        new_tokens = generated = 0
        t0 = time.perf_counter()
        for i in order:
            feed = ([last[i]] if i in last else []) + _tokens(rng, vocab, user_tokens)
            reply = sessions[i].generate(feed, reply_tokens)
            new_tokens += len(feed) + len(reply) - 1
            generated += len(reply)
            last[i] = reply[-1]
        wall = time.perf_counter() - t0
        st = stage.manager.stats()
        out["warm" if warm else "no_warm"] = {
            "tok_s": generated / wall,
            "wall_s": wall,
            "reprefilled_tokens": st["tokens_computed"] - new_tokens,
            "reprefills": sum(s.reprefills for s in sessions),
            "restores": st["restores"],
        }
        stage.manager.close()
    return out


# ---------------------------------------------------------------------------------------------
# the oversubscribed route
# ---------------------------------------------------------------------------------------------


def oversubscribed_route(path: Path, n_sessions: int = 8, prompt: int = 128, new: int = 400) -> dict:
    """Two 1-thread workers split at the middle layer, 8 hot slots of 1,024 tokens; 8 sessions
    generate through RouteClient.generate_many. Budgets: 8,192 tokens (everything fits) and 2,048
    (a quarter) with a 256 MiB warm tier."""
    head = ShardModel(str(path), (0, 0), 1)
    n_layer = head.info.n_layer
    half = n_layer // 2
    try:
        text = head.tokenize(_TEXT)
        prompts = [text[17 * i : 17 * i + prompt] for i in range(n_sessions)]
    except InvalidInputError:  # no tokenizer (synthetic models)
        rng = np.random.default_rng(4)
        prompts = [_tokens(rng, head.info.n_vocab, prompt) for _ in range(n_sessions)]
    out: dict = {}
    for name, extra in (
        ("fits", ("--budget-tokens", "8192")),
        ("oversubscribed", ("--budget-tokens", "2048", "--warm-memory", "256MiB")),
    ):
        flags = ("--context-tokens", "1024", "--max-sessions", "8", *extra)
        procs = [start_worker(path, 0, half - 1, 1, extra=flags), start_worker(path, half, n_layer - 1, 1, extra=flags)]
        try:
            for proc, addr in procs:
                wait_serving(proc, addr)
            client = RouteClient([RemoteStage(addr) for _, addr in procs], chained=False)
            sessions = [client.session(f"s{i}") for i in range(n_sessions)]
            t0 = time.perf_counter()
            tokens = client.generate_many(sessions, prompts, new)
            wall = time.perf_counter() - t0
            infos = [s.stats() for s in client.stages]
            out[name] = {
                "wall_s": wall,
                "tokens": tokens,
                "reprefills": [s.reprefills for s in sessions],
                "restores": [i.restores for i in infos],
                "spills": [i.spills for i in infos],
            }
            client.close()
        finally:
            for proc, _ in procs:
                stop_worker(proc)
    # steps of different sizes sum in different orders (batched logits agree to about 1e-3, not to
    # the bit), so a near-tie may go the other way: count the sessions whose tokens are the same,
    # and where the others first differ
    pairs = list(zip(out["fits"]["tokens"], out["oversubscribed"]["tokens"]))
    out["same_sessions"] = sum(a == b for a, b in pairs)
    out["first_difference"] = [next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in pairs]
    for v in out.values():
        if isinstance(v, dict):
            v.pop("tokens")
    return out


# ---------------------------------------------------------------------------------------------
# memory held to the plan under churn
# ---------------------------------------------------------------------------------------------


def churn(path: Path, n_sessions: int = 10_000, max_len: int = 48, batch: int = 16) -> dict:
    """A head worker (balanced split) with --kv-memory 256MiB --warm-memory 256MiB; n sessions of
    random lengths (1..max_len) arrive in batches, most are never seen again, some continue; the
    worker's RSS is sampled throughout."""
    cut = compute_balanced_cut(path)
    flags = ("--kv-memory", "256MiB", "--warm-memory", "256MiB", "--context-tokens", "512")
    proc, addr = start_worker(path, 0, cut - 1, 2, extra=flags, defaults=())
    try:
        wait_serving(proc, addr)
        stage = RemoteStage(addr)
        rss0 = rss(proc.pid)
        rng = np.random.default_rng(6)
        vocab = ShardModel(str(path), (0, 0), 1).info.n_vocab
        peak, lengths = rss0, {}
        t0 = time.perf_counter()
        for start in range(0, n_sessions, batch):
            steps: dict[str, Step] = {}  # one step per session per message
            for i in range(start, min(start + batch, n_sessions)):
                if lengths and rng.random() < 0.2:  # a returning session continues where it was
                    sid = f"c{int(rng.choice(list(lengths)[-2000:]))}"
                    steps.setdefault(sid, Step.prefill(sid, 0, _tokens(rng, vocab, int(rng.integers(1, 8)))))
                else:
                    n = int(rng.integers(1, max_len + 1))
                    steps[f"c{i}"] = Step.prefill(f"c{i}", 0, _tokens(rng, vocab, n), start_pos=0)
                    lengths[i] = n
            stage.step_many(list(steps.values()))
            peak = max(peak, rss(proc.pid))
        wall = time.perf_counter() - t0
        info = stage.stats()
        stage.close()
    finally:
        stop_worker(proc)
    added = info.restores + info.warm_drops + info.warm_sessions
    return {
        "sessions": n_sessions,
        "wall_s": wall,
        "rss_start": rss0,
        "rss_peak": peak,
        "hot_bytes": info.max_sessions
        * HotKvConfig(context_tokens=info.context_tokens).slot_cells
        * info.kv_bytes_per_token,
        "spills": info.spills,
        "restores": info.restores,
        "warm_drops": info.warm_drops,
        "warm_sessions": info.warm_sessions,
        "warm_bytes": info.warm_bytes,
        "counters_add_up": info.spills == added,
    }


# ---------------------------------------------------------------------------------------------
# KV types
# ---------------------------------------------------------------------------------------------

_KV_RSS = """
import json, sys
import llama_shard as ls
from llama_shard.testing.process import resident_bytes as rss
m = ls.ShardModel(sys.argv[1], (0, int(sys.argv[3])), 1)
r0 = rss()
mgr = ls.HotKvStateManager(m, ls.HotKvStateConfig(max_sessions=16, context_tokens=2048, kv_type=sys.argv[2]))
ls.KvBoundaryAdapter(m, mgr).prefill("a", 0, token_ids=[1, 2, 3])
print(json.dumps({"kv_rss": rss() - r0}))
"""


def kv_types(path: Path, threads: int, n_prompts: int = 8, steps: int = 32) -> dict:
    """Per KV type: hot KV bytes of 16 slots x 2,048 tokens on the balanced head shard (measured
    RSS in a fresh process), sessions per GiB, and on the whole model, teacher-forced on f16's
    greedy tokens: how often the greedy token agrees with f16 and the largest logit deviation."""
    cut = compute_balanced_cut(path)
    model = ShardModel(str(path), None, threads)
    try:
        prompts = [model.tokenize(q) for q in _PROMPTS[:n_prompts]]
    except InvalidInputError:  # a model without a tokenizer (synthetic): random prompts
        rng = np.random.default_rng(7)
        prompts = [_tokens(rng, model.info.n_vocab, 12) for _ in range(n_prompts)]
    out: dict[str, dict] = {}
    reference: list[list[tuple[int, np.ndarray]]] = []
    for kv_type in ("f16", "q8_0", "q4_0"):
        try:
            kv_bytes_per_token(model.info.n_head_kv, model.info.head_dim, 1, kv_type)
        except InvalidInputError as e:  # heads too small to quantize (synthetic test models)
            log(f"{kv_type}: {e}")
            continue
        probe = subprocess.run(
            [sys.executable, "-c", _KV_RSS, str(path), kv_type, str(cut - 1)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        kv_rss = json.loads(probe.strip().splitlines()[-1])["kv_rss"]
        mgr = HotKvStateManager(model, HotKvStateConfig(max_sessions=1, context_tokens=256, kv_type=kv_type))
        ad = KvBoundaryAdapter(model, mgr)
        agree = total = 0
        worst = 0.0
        for p, prompt in enumerate(prompts):
            outs = [ad.prefill(f"p{p}", 0, token_ids=prompt, start_pos=0)]
            forced = None if kv_type == "f16" else [t for t, _ in reference[p]]
            for k in range(steps):
                token = forced[k] if forced else outs[-1].token_id
                outs.append(ad.decode(f"p{p}", 0, token_ids=[token]))
            run = [(o.token_id, o.logits) for o in outs]
            if kv_type == "f16":
                reference.append(run)
            else:
                for (t, logits), (t_ref, logits_ref) in zip(run, reference[p]):
                    agree += int(t == t_ref)
                    total += 1
                    worst = max(worst, float(np.abs(logits - logits_ref).max()))
            mgr.release(f"p{p}", 0)
        mgr.close()
        out[kv_type] = {
            "kv_rss_16x2048": kv_rss,
            "sessions_per_gib": 16 * (1 << 30) / kv_rss,
            "agreement": agree / total if total else 1.0,
            "max_logit_dev": worst,
        }
    return out


# ---------------------------------------------------------------------------------------------
# the report
# ---------------------------------------------------------------------------------------------


def warm_study(path: Path, threads: int, quick: bool = False) -> str:
    lines = [
        f"warm tier and memory plan: {path.name}, {threads} threads, {os.cpu_count()} CPUs; "
        f"command: `python benchmarks/warm_study.py`",
        "",
    ]

    r = restore_vs_prefill(path, threads, n_tokens=256 if quick else 1024, rounds=2 if quick else 5)
    n = 256 if quick else 1024
    lines += [
        f"restore a {n}-token session on the head shard ({r['kv_bytes'] / 2**20:.1f} MiB of KV) vs re-prefill it:",
        f"  re-prefill {r['prefill_s'] * 1e3:.1f} ms; restore from host memory {r['host_restore_s'] * 1e3:.2f} ms "
        f"({r['prefill_s'] / r['host_restore_s']:.0f}x faster); from disk, cold page cache "
        f"{r['disk_restore_s'] * 1e3:.2f} ms ({r['prefill_s'] / r['disk_restore_s']:.0f}x faster)",
    ]
    log(lines[-1])

    o = tier_overhead(path, threads, ntg=16 if quick else 64, rounds=1 if quick else 3)
    lines += [
        f"decode, 8 sessions, nothing spilling: tier off {o['off_tok_s']:.1f} tok/s, on {o['on_tok_s']:.1f} tok/s "
        f"(ratio {o['on_tok_s'] / o['off_tok_s']:.3f})"
    ]
    log(lines[-1])

    c = chat_sessions(path, threads, n_sessions=16 if quick else 64, slots=4 if quick else 8, turns=2 if quick else 3)
    lines += [f"{16 if quick else 64} chat sessions with think time over {4 if quick else 8} hot slots (whole model):"]
    for name in ("no_warm", "warm"):
        v = c[name]
        lines.append(
            f"  {'warm tier 256 MiB' if name == 'warm' else 'no warm tier     '}: {v['tok_s']:.1f} generated tok/s, "
            f"{v['reprefilled_tokens']} tokens re-prefilled ({v['reprefills']} re-prefills), {v['restores']} restores"
        )
    log("\n".join(lines[-3:]))

    if not quick:
        s = oversubscribed_route(path)
        f, o2 = s["fits"], s["oversubscribed"]
        lines += [
            "oversubscribed route: 2 workers x 1 thread, 8 slots x 1,024 tokens, 8 sessions x (128 + 400) tokens:",
            f"  budget fits everything (8,192): {f['wall_s']:.1f} s; 2,048-token budget + 256 MiB warm tier: "
            f"{o2['wall_s']:.1f} s ({o2['wall_s'] / f['wall_s']:.2f}x); re-prefills {sum(o2['reprefills'])}; "
            f"restores per worker {o2['restores']}; sessions with the same 400 tokens: {s['same_sessions']} of "
            f"{len(s['first_difference'])} (first difference at token "
            f"{[d for d in s['first_difference'] if d is not None] or 'none'})",
        ]
        log("\n".join(lines[-2:]))

    m = churn(path, n_sessions=500 if quick else 10_000)
    model_bytes = ShardModel(str(path), (0, compute_balanced_cut(path) - 1), 1).info.weight_bytes
    lines += [
        f"churn: {m['sessions']} sessions of 1-48 tokens through a worker with --kv-memory 256MiB --warm-memory 256MiB "
        f"in {m['wall_s']:.0f} s: RSS at start {m['rss_start'] / 2**20:.0f} MiB (weights {model_bytes / 2**20:.0f} MiB, "
        f"hot KV {m['hot_bytes'] / 2**20:.0f} MiB), peak {m['rss_peak'] / 2**20:.0f} MiB "
        f"(+{(m['rss_peak'] - m['rss_start']) / 2**20:.0f} MiB; warm tier holds {m['warm_bytes'] / 2**20:.0f} MiB); "
        f"spills {m['spills']} = restores {m['restores']} + drops {m['warm_drops']} + warm {m['warm_sessions']}: "
        f"{m['counters_add_up']}"
    ]
    log(lines[-1])

    k = kv_types(path, threads, n_prompts=2 if quick else 8, steps=8 if quick else 32)
    lines += [
        "KV types (hot KV of 16 slots x 2,048 tokens on the head shard, measured RSS; greedy agreement with f16, "
        "teacher-forced, whole model):"
    ]
    for kv_type, v in k.items():
        lines.append(
            f"  {kv_type:5s}: {v['kv_rss_16x2048'] / 2**20:6.1f} MiB, {v['sessions_per_gib']:5.1f} sessions/GiB "
            f"({v['sessions_per_gib'] / k['f16']['sessions_per_gib']:.2f}x f16); agreement {v['agreement']:.1%}, "
            f"largest logit deviation {v['max_logit_dev']:.3f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python benchmarks/warm_study.py", description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF file (default: the embedded SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="small shapes (for tests)")
    args = ap.parse_args(argv)
    print(warm_study(Path(args.model) if args.model else require_embedded_model(), args.threads, args.quick))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
