"""Side-by-side benchmark against stock llama.cpp from the same pin, in one run.

    python benchmarks/bench.py [--model PATH] [--threads 2] [--repeat 2] [--no-stock] [--json OUT]

Stock `llama-bench` and `llama-batched-bench` (and an RPC build for the split rows) are built
from the pinned source in build/stock-bench (see common.find_stock_tools). Every figure is
measured in this run on the same model, threads and shapes, and reported with its ratio to the
peer (docs/benchmarks.md says how to read them). The default model is the embedded SmolLM2.
The studies have entry points of their own: pipeline_study.py, hot_path_study.py, warm_study.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from common import (
    NO_AMX_FLAGS,
    Row,
    alternate,
    bench_manager,
    find_stock_tools,
    format_table,
    log,
    model_and_vocab,
    pin_label,
    stock_batched_bench,
    stock_llama_bench,
    stock_rpc_split,
    stock_server_streams,
    user_manager,
)
from routes import (
    LINKS,
    ours_chat_reuse,
    ours_generate_streams,
    ours_long_prompt_ttft,
    ours_shared_prefix,
    ours_speculation,
    ours_two_stages,
    ours_worker_clients,
    wire_agreement,
)

from llama_shard import KvBoundaryAdapter, ShardContext, ShardModel, Step, StepKind
from llama_shard._native import grammar_problem
from llama_shard.engine.models import compute_balanced_cut, gemma3_model_path, gguf_shape, require_embedded_model
from llama_shard.head.openai.requests import sampling_from
from llama_shard.proto import shard_pb2 as pb

# ---------------------------------------------------------------------------------------------
# llama-shard in this process, the peer's shapes
# ---------------------------------------------------------------------------------------------


def ours_prefill_and_tg(path: Path, threads: int, n_prompt: int, n_gen: int, reps: int, vocab: int) -> dict:
    """llama-bench's shapes: a fresh n_prompt-token prompt; n_gen single-token decodes from empty."""
    model = ShardModel(str(path), None, threads)
    mgr = bench_manager(model, 1, max(n_prompt, n_gen) + 8, threads)
    rng = np.random.default_rng(0)
    pp_times, tg_times = [], []
    for r in range(reps + 1):  # the first round warms up, as llama-bench does
        prompt = rng.integers(0, vocab, n_prompt).tolist()
        t0 = time.perf_counter()
        mgr.step_batch([Step.prefill("pp", 0, prompt, start_pos=0)])
        t1 = time.perf_counter()
        mgr.release("pp", 0)
        tok = int(rng.integers(0, vocab))
        t2 = time.perf_counter()
        mgr.step_batch([Step.prefill("tg", 0, [tok], start_pos=0)])
        for _ in range(n_gen - 1):
            mgr.step_batch([Step.decode("tg", 0, [tok])])
        t3 = time.perf_counter()
        mgr.release("tg", 0)
        if r:
            pp_times.append(t1 - t0)
            tg_times.append(t3 - t2)
    return {"pp": n_prompt / float(np.mean(pp_times)), "tg": n_gen / float(np.mean(tg_times))}


def ours_batched(path: Path, threads: int, npp: int, ntg: int, npl: list[int], vocab: int) -> dict[int, dict]:
    """llama-batched-bench's shapes: npl separate prompts of npp tokens, then ntg steps of npl tokens."""
    model = ShardModel(str(path), None, threads)
    res = {}
    rng = np.random.default_rng(1)
    for pl in npl:
        mgr = bench_manager(model, pl, npp + ntg, threads)
        prompts = [rng.integers(0, vocab, npp).tolist() for _ in range(pl)]
        t0 = time.perf_counter()
        mgr.step_batch([Step.prefill(f"s{j}", 0, prompts[j], start_pos=0) for j in range(pl)])
        t1 = time.perf_counter()
        for _ in range(ntg):
            mgr.step_batch([Step.decode(f"s{j}", 0, [int(rng.integers(0, vocab))]) for j in range(pl)])
        t2 = time.perf_counter()
        res[pl] = {"pp": pl * npp / (t1 - t0), "tg": pl * ntg / (t2 - t1)}
        del mgr
    return res


def ours_adapter_callers(
    path: Path, threads: int, npp: int, ntg: int, npl: list[int], vocab: int, use_async: bool = False
) -> dict[int, float]:
    """What a user gets: `pl` threads (or asyncio tasks), each driving its own session through
    `KvBoundaryAdapter(model, manager)` exactly as the README constructs it. Prompts are prefilled
    first; the decode phase is timed (llama-batched-bench's speed_tg)."""
    import asyncio
    import threading

    model = ShardModel(str(path), None, threads)
    rng = np.random.default_rng(6)
    res = {}
    for pl in npl:
        manager = user_manager(model, pl, npp + ntg + 8)
        adapter = KvBoundaryAdapter(model, manager)
        prompts = [rng.integers(0, vocab, npp).tolist() for _ in range(pl)]
        if use_async:

            async def main() -> float:
                outs = await asyncio.gather(
                    *(adapter.prefill_async(f"u{j}", 0, token_ids=prompts[j]) for j in range(pl))
                )

                async def drive(j: int, tok: int) -> None:
                    for _ in range(ntg):
                        tok = (await adapter.decode_async(f"u{j}", 0, token_ids=[tok])).token_id

                t0 = time.perf_counter()
                await asyncio.gather(*(drive(j, o.token_id) for j, o in enumerate(outs)))
                return time.perf_counter() - t0

            wall = asyncio.run(main())
        else:
            ready = threading.Barrier(pl + 1)

            def drive(j: int) -> None:
                tok = adapter.prefill(f"u{j}", 0, token_ids=prompts[j]).token_id
                ready.wait()
                for _ in range(ntg):
                    tok = adapter.decode(f"u{j}", 0, token_ids=[tok]).token_id

            callers = [threading.Thread(target=drive, args=(j,)) for j in range(pl)]
            for t in callers:
                t.start()
            ready.wait()
            t0 = time.perf_counter()
            for t in callers:
                t.join()
            wall = time.perf_counter() - t0
        res[pl] = pl * ntg / wall
        st = manager.loop_stats()
        log(
            f"{'asyncio tasks' if use_async else 'threads'} x {pl}: {res[pl]:.1f} tok/s; engine {st['steps']} steps "
            f"for {st['requests']} requests, busy {st['busy_seconds'] / max(st['steps'], 1) * 1e3:.1f} ms per step"
        )
        manager.close()
    return res


def ours_pipeline(path: Path, threads: int, split: list[tuple[int, int]], npp: int, ntg: int, vocab: int) -> float:
    """Decode tokens/s of one session through in-process shards, one after the other."""
    shards = [ShardModel(str(path), r, threads) for r in split] if split else [ShardModel(str(path), None, threads)]
    mgrs = [bench_manager(m, 1, npp + ntg + 8, threads) for m in shards]
    rng = np.random.default_rng(2)

    def step(kind, tokens):
        ((r, out),) = mgrs[0].step_batch([Step(kind, "p", 0, tokens)])
        for m in mgrs[1:]:
            ((r, out),) = m.step_batch([Step(kind, "p", 0, hidden=out)])
        return out

    step(StepKind.PREFILL, rng.integers(0, vocab, npp).tolist())
    t0 = time.perf_counter()
    for _ in range(ntg):
        step(StepKind.DECODE, [int(rng.integers(0, vocab))])
    return ntg / (time.perf_counter() - t0)


def kv_layout_comparison(path: Path, threads: int, lengths: list[int], ntg: int, vocab: int) -> dict[bool, float]:
    """Aggregate decode tokens/s of sessions with different cached lengths, one llama_decode per step,
    in one pool of cells shared by all sequences (kv_unified) vs one stream per sequence."""
    model = ShardModel(str(path), None, threads)
    rng = np.random.default_rng(4)
    res = {}
    for unified in (True, False):
        n = len(lengths)
        per_seq = max(lengths) + ntg + 8
        n_ctx = (sum(lengths) + n * (ntg + 8)) if unified else per_seq * n
        n_batch = min(512, n_ctx)
        ctx = ShardContext(model, n_ctx=n_ctx, n_seq_max=n, n_batch=n_batch, n_threads=threads, kv_unified=unified)
        for s, length in enumerate(lengths):
            for start in range(0, length, n_batch):
                chunk = rng.integers(0, vocab, min(n_batch, length - start)).tolist()
                ctx.forward(s, start, tokens=chunk)
        t0 = time.perf_counter()
        for i in range(ntg):
            ctx.forward_batch([(s, lengths[s] + i, [int(rng.integers(0, vocab))], None) for s in range(n)])
        res[unified] = n * ntg / (time.perf_counter() - t0)
        del ctx
    return res


_RSS_PROBE = """
import json, sys
import llama_shard as ls
from llama_shard.testing.process import resident_bytes as rss
layers = json.loads(sys.argv[2])
r0 = rss()
m = ls.ShardModel(sys.argv[1], tuple(layers) if layers else None, 1)
print(json.dumps({"rss": rss() - r0, "weights": m.info.weight_bytes, "kv": m.info.kv_bytes_per_token}))
"""


def ours_memory(path: Path, layers) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _RSS_PROBE, str(path), json.dumps(layers)], capture_output=True, text=True, check=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


_SWA_PROBE = """
import json, sys
import llama_shard as ls
from llama_shard.testing.process import resident_bytes as rss
m = ls.ShardModel(sys.argv[1], (0, int(sys.argv[2])), 1)
r0 = rss()
ctx = ls.ShardContext(m, n_ctx=8 * 2048, n_seq_max=8, n_batch=512, kv_unified=False, swa_full=sys.argv[3] == "1")
for s in range(8):  # touch every sequence's cells
    ctx.forward(s, 0, tokens=list(range(1, 300)))
print(json.dumps({"kv_rss": rss() - r0}))
"""


def sliding_window_memory(path: Path, last: int) -> dict[bool, int]:
    """Resident bytes of a head shard's context (8 sessions x 2,048 cells, each prefilled past the
    window) with every sliding-window cell kept (swa_full, what the engine uses) and with the
    window only, each in a fresh process."""
    out = {}
    for full in (True, False):
        res = subprocess.run(
            [sys.executable, "-c", _SWA_PROBE, str(path), str(last), "1" if full else "0"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        out[full] = json.loads(res.strip().splitlines()[-1])["kv_rss"]
    return out


def ours_session_ops(
    path: Path, threads: int, live_counts: list[int], vocab: int, cycles: int = 200
) -> dict[int, float]:
    """Microseconds per open + 1-token prefill + release with `n` other sessions live (one-layer head shard)."""
    model = ShardModel(str(path), (0, 0), threads)
    res = {}
    for n in live_counts:
        mgr = bench_manager(model, n + 1, 16, threads, n_batch=16)
        for i in range(n):
            mgr.step_batch([Step.prefill(f"live-{i}", 0, [i % vocab], start_pos=0)])
        t0 = time.perf_counter()
        for c in range(cycles):
            sid = f"cycle-{c}"
            mgr.open(sid, 0)
            mgr.step_batch([Step.prefill(sid, 0, [c % vocab], start_pos=0)])
            mgr.release(sid, 0)
        res[n] = (time.perf_counter() - t0) / cycles * 1e6
        mgr.check_invariants()
        del mgr
    return res


# ---------------------------------------------------------------------------------------------
# the table: one section of rows per question
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Shapes:
    path: Path
    threads: int
    stock: dict | None
    rpc_tools: dict | None
    quick: bool
    repeat: int
    build_stock: bool = True

    def __post_init__(self):
        self.n_layer, self.vocab = model_and_vocab(self.path)
        self.npp, self.ntg, self.reps = (16, 8, 1) if self.quick else (128, 64, 3)
        self.npl = [1, 4] if self.quick else [1, 4, 8, 16]


def single_session_rows(s: Shapes) -> list[Row]:
    log("llama-shard: prefill and single-session decode")
    stock = s.stock
    ours, peer = alternate(
        s.repeat,
        lambda: ours_prefill_and_tg(s.path, s.threads, s.npp, s.ntg, s.reps, s.vocab),
        stock and (lambda: stock_llama_bench(stock["llama-bench"], s.path, s.threads, s.npp, s.ntg, s.reps)),
    )
    return [
        Row(f"prefill pp{s.npp} (llama-bench)", ours["pp"], peer.get("pp"), "tok/s", ">= 0.95"),
        Row(f"decode tg{s.ntg}, 1 session (llama-bench)", ours["tg"], peer.get("tg"), "tok/s", ">= 0.95"),
    ]


def concurrent_rows(s: Shapes) -> list[Row]:
    log("llama-shard: concurrent sessions (the engine, and what users run around it)")
    stock, user_npl, n_clients = s.stock, [pl for pl in s.npl if pl > 1], 4 if s.quick else 8
    engine, peer, threads, tasks, worker = alternate(
        s.repeat,
        lambda: ours_batched(s.path, s.threads, s.npp, s.ntg, s.npl, s.vocab),
        stock and (lambda: stock_batched_bench(stock["llama-batched-bench"], s.path, s.threads, s.npp, s.ntg, s.npl)),
        lambda: ours_adapter_callers(s.path, s.threads, s.npp, s.ntg, user_npl, s.vocab),
        lambda: ours_adapter_callers(s.path, s.threads, s.npp, s.ntg, user_npl, s.vocab, use_async=True),
        lambda: {n_clients: ours_worker_clients(s.path, s.threads, s.npp, s.ntg, n_clients, s.vocab)},
    )

    def peer_tg(pl: int) -> float | None:
        return peer.get(pl, {}).get("tg")

    rows = [
        Row(
            f"aggregate decode, {pl} session{'s' if pl > 1 else ''} (batched-bench)",
            engine[pl]["tg"],
            peer_tg(pl),
            "tok/s",
            ">= 0.95" if pl in (1, 4, 8) else "",
        )
        for pl in s.npl
    ]
    for name, got in (("threads", threads), ("asyncio tasks", tasks)):
        rows += [
            Row(
                f"{pl} {name}, each a session through KvBoundaryAdapter(model, manager)",
                got[pl],
                peer_tg(pl),
                "tok/s",
                ">= 0.95",
                "peer: batched-bench, same sessions",
            )
            for pl in user_npl
        ]
    rows.append(
        Row(
            f"1 worker ({s.threads} threads), {n_clients} gRPC clients each sending Decode",
            worker[n_clients],
            peer_tg(n_clients),
            "tok/s",
            ">= 0.95",
            "clients in the benchmark process; peer: batched-bench",
        )
    )
    return rows


def split_rows(s: Shapes) -> list[Row]:
    log("llama-shard: 2-shard in-process pipeline")
    n = s.n_layer
    half = [(0, n // 2 - 1), (n // 2, n - 1)]
    whole_tg = max(ours_pipeline(s.path, s.threads, [], s.npp, s.ntg, s.vocab) for _ in range(s.repeat))
    split_tg = max(ours_pipeline(s.path, s.threads, half, s.npp, s.ntg, s.vocab) for _ in range(s.repeat))
    return [
        Row(
            f"decode through 2 shards {half[0][0]}-{half[0][1]},{half[1][0]}-{half[1][1]} vs whole",
            split_tg,
            whole_tg,
            "tok/s",
            ">= 0.90",
            "peer: the whole model in llama-shard",
        )
    ]


def route_rows(s: Shapes) -> list[Row]:
    log("two worker processes on loopback vs llama.cpp's RPC split")
    npl, n, rpc_tools = ([1, 2] if s.quick else [1, 8]), s.n_layer, s.rpc_tools
    chained, tls, relayed, local, peer = alternate(
        s.repeat,
        lambda: ours_two_stages(s.path, n, s.npp, s.ntg, npl, s.vocab, topology="chained"),
        lambda: ours_two_stages(s.path, n, s.npp, s.ntg, npl, s.vocab, topology="chained", tls=True),
        lambda: ours_two_stages(s.path, n, s.npp, s.ntg, npl[-1:], s.vocab, topology="two workers"),
        lambda: ours_two_stages(s.path, n, s.npp, s.ntg, npl[-1:], s.vocab, topology="local head"),
        rpc_tools and (lambda: stock_rpc_split(rpc_tools, s.path, n, s.npp, s.ntg, npl)),
    )
    cut = compute_balanced_cut(s.path)
    note = f"peer: ggml-rpc-server with layers {n - n // 2}-{n - 1} + llama-batched-bench, 1 thread each"
    rows = [
        Row(
            f"2 workers x 1 thread on loopback (0-{cut - 1},{cut}-{n - 1}), chained, {pl} session"
            f"{'s' if pl > 1 else ''} (vs RPC split)",
            chained[pl],
            peer.get(pl, {}).get("tg"),
            "tok/s",
            ">= 1.6" if pl > 1 else ">= 1.0",
            note,
        )
        for pl in npl
    ]
    rows += [
        Row(
            f"the same, chained, {pl} session{'s' if pl > 1 else ''}, token over TLS (vs plaintext)",
            tls[pl],
            chained[pl],
            "tok/s",
            "",
            "peer: the plaintext chain in this run",
        )
        for pl in npl
    ]
    pl = npl[-1]
    rows.append(
        Row(
            f"2 workers x 1 thread on loopback, client-relayed, {pl} sessions (vs RPC split)",
            relayed[pl],
            peer.get(pl, {}).get("tg"),
            "tok/s",
            "",
            note,
        )
    )
    rows.append(
        Row(
            f"head 0-{cut - 1} in the client process + 1 worker {cut}-{n - 1} on loopback, 1 thread each, "
            f"{pl} sessions (vs RPC split: the same topology)",
            local[pl],
            peer.get(pl, {}).get("tg"),
            "tok/s",
            ">= 1.6",
            note,
        )
    )
    return rows


def generate_rows(s: Shapes) -> list[Row]:
    log("generation in the route: Generate streams against stock doing the same work")
    n, stock, rpc_tools = s.n_layer, s.stock, s.rpc_tools
    n_streams = 4 if s.quick else 8
    cut = compute_balanced_cut(s.path)
    split = [(0, cut - 1), (cut, n - 1)]
    server = stock and find_stock_tools(build=s.build_stock, server=True)
    if stock and not server:
        log("stock llama-server: not found and not built; its peer column is n/a")
    whole, chained, single, peer, http, one_thread, rpc, plain, plain_peer = alternate(
        s.repeat,
        lambda: {n_streams: ours_generate_streams(s.path, [(0, n - 1)], s.threads, s.npp, s.ntg, n_streams, s.vocab)},
        lambda: {n_streams: ours_generate_streams(s.path, split, 1, s.npp, s.ntg, n_streams, s.vocab)},
        lambda: {1: ours_generate_streams(s.path, split, 1, s.npp, s.ntg, 1, s.vocab)},
        stock
        and (lambda: stock_batched_bench(stock["llama-batched-bench"], s.path, s.threads, s.npp, s.ntg, [n_streams])),
        server
        and (
            lambda: {
                n_streams: stock_server_streams(
                    server["llama-server"], s.path, s.threads, s.npp, s.ntg, n_streams, s.vocab
                )
            }
        ),
        stock
        and (lambda: stock_batched_bench(stock["llama-batched-bench"], s.path, 1, s.npp, s.ntg, [n_streams // 2])),
        rpc_tools and (lambda: stock_rpc_split(rpc_tools, s.path, n, s.npp, s.ntg, [1, n_streams])),
        lambda: {
            n_streams: ours_generate_streams(
                s.path, [(0, n - 1)], s.threads, s.npp, s.ntg, n_streams, s.vocab, worker_flags=("--flash-attn", "off")
            )
        },
        stock
        and (
            lambda: stock_batched_bench(
                stock["llama-batched-bench"], s.path, s.threads, s.npp, s.ntg, [n_streams], extra=("-fa", "off")
            )
        ),
    )
    note = f"peer: ggml-rpc-server with layers {n - n // 2}-{n - 1} + llama-batched-bench, 1 thread each"
    half_rate = one_thread.get(n_streams // 2, {}).get("tg")
    return [
        Row(
            f"1 worker ({s.threads} threads), {n_streams} Generate streams of {s.ntg} tokens (vs batched-bench)",
            whole[n_streams],
            peer.get(n_streams, {}).get("tg"),
            "tok/s",
            ">= 0.95",
            "decode phase; streams opened at once over gRPC",
        ),
        Row(
            "the same, --flash-attn off (vs batched-bench -fa off)",
            plain[n_streams],
            plain_peer.get(n_streams, {}).get("tg"),
            "tok/s",
            ">= 0.95",
            "llama.cpp's plain attention kernels on both sides",
        ),
        Row(
            f"the same (vs llama-server -np {n_streams} -t {s.threads}, {n_streams} HTTP clients streaming "
            f"{s.ntg} tokens)",
            whole[n_streams],
            http.get(n_streams),
            "tok/s",
            ">= 1.0",
            "the peer's decode phase timed the same way; llama-server built without its web page",
        ),
        Row(
            f"2 workers x 1 thread chained (0-{cut - 1},{cut}-{n - 1}), {n_streams} Generate streams (vs RPC split)",
            chained[n_streams],
            rpc.get(n_streams, {}).get("tg"),
            "tok/s",
            ">= 1.7",
            note,
        ),
        Row(
            f"the same (vs the ceiling: twice stock's 1-thread rate at {n_streams // 2} sessions)",
            chained[n_streams],
            2 * half_rate if half_rate else None,
            "tok/s",
            ">= 0.9",
            f"each worker computes one of 2 groups of {n_streams // 2} at a time, while the other is on the "
            "other worker",
        ),
        Row("the same, 1 Generate stream (vs RPC split)", single[1], rpc.get(1, {}).get("tg"), "tok/s", ">= 1.0", note),
    ]


def http_temperature_0(context_tokens: int) -> pb.Sampling:
    """What the endpoint asks the tail for on a request with "temperature": 0 (its own
    sampling_from, with a seed), given to the Generate streams the endpoint is compared with."""
    return sampling_from({"temperature": 0, "seed": 1}, context_tokens)


def openai_rows(s: Shapes) -> list[Row]:
    log("the OpenAI-compatible endpoint: streamed HTTP against Generate streams, and a long chat's reuse")
    n, n_streams = s.n_layer, 4 if s.quick else 8
    turns, answer = (3, 4) if s.quick else (20, 16)
    has_template = bool(ShardModel(str(s.path), (0, 0), 1).chat_template)
    http, streams, chat, chat_plain = alternate(
        s.repeat,
        lambda: {
            n_streams: ours_generate_streams(
                s.path, [(0, n - 1)], s.threads, s.npp, s.ntg, n_streams, s.vocab, http=True
            )
        },
        lambda: {
            n_streams: ours_generate_streams(
                s.path,
                [(0, n - 1)],
                s.threads,
                s.npp,
                s.ntg,
                n_streams,
                s.vocab,
                sampling=http_temperature_0(s.npp + s.ntg + 8),
            )
        },
        has_template and (lambda: ours_chat_reuse(s.path, s.threads, turns, answer)),
        has_template and (lambda: ours_chat_reuse(s.path, s.threads, turns, answer, flash_attn=False)),
    )
    rows = [
        Row(
            f"1 worker ({s.threads} threads), {n_streams} streamed /v1/completions of {s.ntg} tokens (vs "
            f"{n_streams} Generate streams)",
            http[n_streams],
            streams[n_streams],
            "tok/s",
            ">= 0.9",
            "the same prompts at once; peer: Generate over gRPC in this run, the sampling the endpoint "
            "sets for temperature 0 (penalty window 64, a seed)",
        )
    ]
    if has_template:
        for attention, got in (("flash attention on (the default)", chat), ("--flash-attn off", chat_plain)):
            rows.append(
                Row(
                    f"a {turns}-turn chat through /v1/chat/completions, {attention}: 1 / time to first "
                    f"token of turn {turns} (vs the same request cold)",
                    got["warm"],
                    got["cold"],
                    "1/s",
                    ">= 10",
                    "every request the whole conversation; cold: a new session (X-Session-Id)",
                )
            )
    return rows


#: a JSON Schema no answer of ntg tokens completes (at least 100 numbers): every token is sampled
#: under the grammar, and where the model's argmax is not what it allows, the row is masked whole
ENDLESS_NUMBERS = {
    "type": "json_schema",
    "json_schema": {
        "name": "numbers",
        "schema": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 100},
    },
}


def structured_rows(s: Shapes) -> list[Row]:
    log("structured output: streamed /v1/completions under a JSON Schema against the same without")
    why = grammar_problem(ShardModel(str(s.path), (0, 0), 1), 'root ::= "a"')
    if why is not None:  # a synthetic model without a tokenizer
        log(f"  skipped: {why}")
        return []
    n, n_streams = s.n_layer, 4 if s.quick else 8
    rows = []
    for sampling, how in (
        ({}, "temperature 0: the argmax is tried first, the row masked where the grammar refuses it"),
        ({"temperature": 0.8, "seed": 1}, "temperature 0.8, seeded: every row masked whole"),
    ):

        def streams(extra: dict) -> dict:
            return {
                n_streams: ours_generate_streams(
                    s.path,
                    [(0, n - 1)],
                    s.threads,
                    s.npp,
                    s.ntg,
                    n_streams,
                    s.vocab,
                    http=True,
                    http_extra=sampling | extra,
                )
            }

        with_schema, without = alternate(
            s.repeat, lambda: streams({"response_format": ENDLESS_NUMBERS}), lambda: streams({})
        )
        rows.append(
            Row(
                f"1 worker ({s.threads} threads), {n_streams} streamed /v1/completions of {s.ntg} tokens under "
                f"a JSON Schema at temperature {sampling.get('temperature', 0)} (vs the same {n_streams} "
                "without)",
                with_schema[n_streams],
                without[n_streams],
                "tok/s",
                ">= 0.5",
                f"{how}; the schema: at least 100 integers, so every token is constrained; the cost is "
                "llama.cpp's grammar matching the vocabulary's tokens",
            )
        )
    return rows


def prefixes_rows(s: Shapes) -> list[Row]:
    log("shared prefixes: 64 sessions with one 512-token system prompt on a two-worker route, against today's route")
    n = s.n_layer
    cut = compute_balanced_cut(s.path)
    split = [(0, cut - 1), (cut, n - 1)]
    sessions = 8 if s.quick else 64
    rows = []
    for flags, label in (((), "flash attention on (the default)"), (("--flash-attn", "off"), "--flash-attn off")):
        shared, today = alternate(
            s.repeat,
            lambda: ours_shared_prefix(s.path, split, sessions, worker_flags=flags),
            lambda: ours_shared_prefix(s.path, split, sessions, prefix_memory=None, worker_flags=flags),
        )
        note = (
            f"2 workers x 1 thread ({split[0][0]}-{split[0][1]},{split[1][0]}-{split[1][1]}); each prompt the "
            f"system prompt (keep_prefix) + 32 tokens of its own, 8 generated; one session at a time"
        )
        rows += [
            Row(
                f"{label}: tokens computed per worker, {sessions} sessions (vs today's route)",
                shared["computed"],
                today["computed"],
                "tokens",
                "<= 0.125",
                note,
            ),
            Row(
                f"{label}: 1 / mean time to first token of sessions 2..{sessions} (vs session 1's)",
                shared["others_rate"],
                shared["first_rate"],
                "1/s",
                ">= 10",
                f"session 1 computes and stores the prefix; the others open from it (the slowest: "
                f"{1e3 / shared['others_max_rate']:.0f} ms)",
            ),
            Row(
                f"{label}: generated tokens/s of the whole run (vs today's route)",
                shared["tok_s"],
                today["tok_s"],
                "tok/s",
                "",
                "wall time of all sessions, one after another",
            ),
        ]
    return rows


def speculation_rows(s: Shapes) -> list[Row]:
    log("speculative decoding: one Generate stream on two chained workers, with and without drafts")
    n = s.n_layer
    cut = compute_balanced_cut(s.path)
    split = [(0, cut - 1), (cut, n - 1)]
    rows = []
    d10, d50 = "head-tail link +10 ms each way", "head-tail link +50 ms each way"
    none = {"repetitive": "", "open": ""}
    configs = (
        (10.0, d10, {"repetitive": ">= 2.0", "open": ">= 0.95"}, ()),
        (50.0, d50, {"repetitive": ">= 2.5", "open": ">= 0.95"}, ()),
        (0.0, "loopback", {"repetitive": ">= 1.0", "open": ">= 0.95"}, ()),
        (10.0, d10 + ", --draft-verify batched", none, ("--draft-verify", "batched")),
        (0.0, "loopback, --draft-verify batched", none, ("--draft-verify", "batched")),
    )
    for delay, label, targets, flags in configs[:1] if s.quick else configs:  # --quick: the shape only
        out = ours_speculation(
            s.path,
            split,
            delay,
            tokens=8 if s.quick else 64,
            repeat=s.repeat,
            worker_flags=flags,
            prompts_per_set=1 if s.quick else None,
        )
        for name, what in (("repetitive", "rewrite or quote a text"), ("open", "open questions")):
            r = out[name]
            same = "same tokens" if not r["differed"] else f"{r['differed']} of {r['prompts']} prompts' tokens differed"
            rows.append(
                Row(
                    f"speculative decoding, {label}, {name} prompts ({what}): tokens/s of one stream "
                    f"(vs without drafts)",
                    r["on"],
                    r["off"],
                    "tok/s",
                    targets[name],
                    f"greedy, {same}; {r['accepted']}/{r['drafted']} drafts accepted "
                    f"({100 * r['rate']:.0f}%); {r['windows']:.0f} windows sent while another was in flight, "
                    f"{r['kept']:.0f} kept; 2 workers x 1 thread ({split[0][0]}-{split[0][1]},"
                    f"{split[1][0]}-{split[1][1]})",
                )
            )
    return rows


def wire_rows(s: Shapes) -> list[Row]:
    log("the wire's bytes: hidden rows as f32, f16 and q8_0 between two workers; a long prompt over slower links")
    n = s.n_layer
    cut = compute_balanced_cut(s.path)
    split = [(0, cut - 1), (cut, n - 1)]
    where = f"2 workers x 1 thread ({split[0][0]}-{split[0][1]},{split[1][0]}-{split[1][1]})"
    prompts, generate = (4, 8) if s.quick else (50, 32)
    agree = wire_agreement(s.path, split, n_prompts=prompts, generate=generate)
    rows = []
    for name in ("f16", "q8_0"):
        a = agree[name]
        rows += [
            Row(
                f"wire {name}: bytes of a one-token step's request (vs f32)",
                a["token_bytes"],
                agree["f32"]["token_bytes"],
                "B",
                "",
                "serialized StepRequest",
            ),
            Row(
                f"wire {name}: bytes of a 2,048-token prefill's rows (vs f32)",
                a["prefill_bytes"],
                agree["f32"]["prefill_bytes"],
                "B",
                "",
                "serialized StepRequest",
            ),
            Row(
                f"wire {name}: greedy tokens equal to f32's, teacher-forced positions (of all)",
                a["same_positions"],
                a["positions"],
                "positions",
                "",
                f"{a['same_prompts']} of {a['prompts']} prompts' {generate} greedy tokens all equal f32's; mean "
                f"KL(f32 || {name}) {a['mean_kl']:.2g} nats; {a['prompts']} windows of 64 tokens of docs/design.md, "
                f"in process, 2 shards ({split[0][0]}-{split[0][1]},{split[1][0]}-{split[1][1]}) x 2 threads",
            ),
        ]
    prompt_tokens = 256 if s.quick else 2048
    links = LINKS[:1] if s.quick else LINKS
    ttft = ours_long_prompt_ttft(s.path, split, prompt_tokens, repeat=s.repeat, links=links)
    for label, _, _ in links:
        for name in ("f32", "f16", "q8_0"):
            rows.append(
                Row(
                    f"a {prompt_tokens:,}-token prompt through 2 workers, {label}, {name} rows: prompt tokens / "
                    f"time to first token (vs the whole model on 1 worker x 2 threads)",
                    prompt_tokens / ttft[(label, name)],
                    prompt_tokens / ttft["whole"],
                    "tok/s",
                    "",
                    f"{ttft[(label, name)]:.3f} s against {ttft['whole']:.3f} s; {where}; the head sends "
                    f"the prompt in chunks of 256 tokens, up to 3 in flight",
                )
            )
    return rows


def memory_rows(s: Shapes) -> list[Row]:
    log("memory")
    whole = ours_memory(s.path, None)
    rows = gemma3_rows() if not s.quick else []
    for r in [(0, s.n_layer // 2 - 1), (s.n_layer // 2, s.n_layer - 1)]:
        m = ours_memory(s.path, list(r))
        rows.append(
            Row(
                f"resident memory of shard {r[0]}-{r[1]} vs whole",
                m["rss"] / 2**20,
                whole["rss"] / 2**20,
                "MiB",
                "<= 0.60",
                f"weights {m['weights'] / 2**20:.1f} of {whole['weights'] / 2**20:.1f} MiB",
            )
        )
        rows.append(
            Row(f"KV bytes/token of shard {r[0]}-{r[1]} vs whole", m["kv"], whole["kv"], "B", "", "owned layers only")
        )
    return rows


def gemma3_rows() -> list[Row]:
    """A half shard of the real Gemma 3 270M (when its packages are installed): memory, KV bytes
    per token, and what keeping every sliding-window cell costs."""
    path = gemma3_model_path()
    if path is None:
        log("Gemma 3 270M is not installed: its rows are left out")
        return []
    whole, half = ours_memory(path, None), ours_memory(path, [0, 8])
    swa = sliding_window_memory(path, 8)
    return [
        Row(
            "resident memory of Gemma 3 270M shard 0-8 vs whole",
            half["rss"] / 2**20,
            whole["rss"] / 2**20,
            "MiB",
            "",
            f"weights {half['weights'] / 2**20:.1f} of {whole['weights'] / 2**20:.1f} MiB; the head holds the "
            "262,144-token embedding",
        ),
        Row("KV bytes/token of Gemma 3 270M shard 0-8 vs whole", half["kv"], whole["kv"], "B", "", "owned layers only"),
        Row(
            "Gemma 3 270M shard 0-8, 8 sessions x 2,048 cells: every sliding-window cell kept vs the window only",
            swa[True] / 2**20,
            swa[False] / 2**20,
            "MiB",
            "cost",
            "the engine keeps every cell: exact truncation",
        ),
    ]


def engine_choice_rows(s: Shapes) -> list[Row]:
    log("KV layout: one shared pool vs one stream per session")
    lengths = [16, 32, 48, 64] if s.quick else [64, 128, 256, 384, 512, 768, 1024, 1536]
    layout = kv_layout_comparison(s.path, s.threads, lengths, s.ntg, s.vocab)
    rows = [
        Row(
            f"decode, {len(lengths)} sessions of {lengths[0]}-{lengths[-1]} cached tokens: per-session streams vs "
            "shared pool",
            layout[False],
            layout[True],
            "tok/s",
            "choice",
            "peer: kv_unified=true in llama-shard",
        )
    ]
    log("session operations")
    live = [10, 50] if s.quick else [10, 100, 250]
    ops = ours_session_ops(s.path, s.threads, live, s.vocab)
    rows += [
        Row(
            f"open+prefill(1)+release with {n} live sessions",
            ops[n],
            ops[live[0]],
            "us",
            "<= 2.0",
            f"peer: the same with {live[0]} live",
        )
        for n in live
    ]
    return rows


_KERNELS_RUN = """
import json, sys
sys.path.insert(0, sys.argv[1])
from pathlib import Path
import llama_shard as ls
from bench import ours_batched, ours_prefill_and_tg
path, threads, npp, ntg, reps, vocab = Path(sys.argv[2]), *map(int, sys.argv[3:8])
single = ours_prefill_and_tg(path, threads, npp, ntg, reps, vocab)
batched = ours_batched(path, threads, npp, ntg, [8], vocab)[8]
print(json.dumps({"amx": ls.cpu_backend()["amx"], "pp": single["pp"], "tg": single["tg"], "tg8": batched["tg"]}))
"""


def ours_kernels(s: Shapes, amx: bool) -> dict:
    """pp, tg (1 session) and 8 sessions' aggregate decode in a process of its own: AMX is chosen
    once per process, by the self-check (LLAMA_SHARD_CPU_PROBE_FAIL=amx is the fallback)."""
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_SHARD_CPU_PROBE_FAIL"}
    if not amx:
        env["LLAMA_SHARD_CPU_PROBE_FAIL"] = "amx"
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            _KERNELS_RUN,
            str(Path(__file__).parent),
            str(s.path),
            *map(str, (s.threads, s.npp, s.ntg, s.reps, s.vocab)),
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    if out.returncode != 0:
        raise RuntimeError(f"the kernels' run exited {out.returncode}: {out.stderr[-2000:]}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["amx"] == amx, res
    return res


def cpu_kernel_rows(s: Shapes) -> list[Row]:
    """On a CPU with AMX: the AMX kernels against the fallback (AMX off, the same build's AVX-512
    kernels), and both against stock llama.cpp built without AMX (the pin's AMX crashes unpatched)."""
    from llama_shard import cpu_backend

    if not cpu_backend()["amx"]:
        log("AMX is not in use here: the AMX rows are left out")
        return []
    log("CPU kernels: AMX against the fallback, and stock llama.cpp built without AMX")
    stock = None if s.stock is None else find_stock_tools(build=s.build_stock, no_amx=True)
    amx, off, peer, peer8 = alternate(
        s.repeat,
        lambda: ours_kernels(s, True),
        lambda: ours_kernels(s, False),
        stock and (lambda: stock_llama_bench(stock["llama-bench"], s.path, s.threads, s.npp, s.ntg, s.reps)),
        stock and (lambda: stock_batched_bench(stock["llama-batched-bench"], s.path, s.threads, s.npp, s.ntg, [8])),
    )
    peer_tg8 = peer8.get(8, {}).get("tg")
    note = "peer: the fallback in this run"
    stock_note = "peer: stock built with " + NO_AMX_FLAGS
    return [
        Row(f"prefill pp{s.npp}, AMX (vs fallback)", amx["pp"], off["pp"], "tok/s", "", note),
        Row(f"decode tg{s.ntg}, 1 session, AMX (vs fallback)", amx["tg"], off["tg"], "tok/s", "", note),
        Row("aggregate decode, 8 sessions, AMX (vs fallback)", amx["tg8"], off["tg8"], "tok/s", "", note),
        Row(f"prefill pp{s.npp}, AMX (vs stock without AMX)", amx["pp"], peer.get("pp"), "tok/s", "", stock_note),
        Row(
            f"prefill pp{s.npp}, fallback (vs stock without AMX)",
            off["pp"],
            peer.get("pp"),
            "tok/s",
            ">= 0.95",
            stock_note,
        ),
        Row(
            f"decode tg{s.ntg}, 1 session, fallback (vs stock without AMX)",
            off["tg"],
            peer.get("tg"),
            "tok/s",
            ">= 0.95",
            stock_note,
        ),
        Row(
            "aggregate decode, 8 sessions, fallback (vs stock without AMX)",
            off["tg8"],
            peer_tg8,
            "tok/s",
            ">= 0.95",
            stock_note,
        ),
    ]


def gpu_rows(s: Shapes) -> list[Row]:
    """On a machine with a GPU (benchmarks/gpu_check.sh; not in the default sections): Generate streams
    on one worker with every layer on the device against stock llama-batched-bench -ngl 99 built
    with the same ggml backend, on the same GPU."""
    device = os.environ.get("LLAMA_SHARD_BENCH_DEVICE", "auto")
    backend = os.environ.get("LLAMA_SHARD_BENCH_GPU_BACKEND", "cuda")
    log(f"a GPU node: every layer on {device} against stock built with {backend}, -ngl 99")
    n, n_streams = s.n_layer, 4 if s.quick else 8
    stock = find_stock_tools(build=s.build_stock, gpu=backend) if s.stock is not None else None
    ours, peer = alternate(
        s.repeat,
        lambda: {
            n_streams: ours_generate_streams(
                s.path, [(0, n - 1)], s.threads, s.npp, s.ntg, n_streams, s.vocab, worker_flags=("--device", device)
            )
        },
        stock
        and (
            lambda: stock_batched_bench(
                stock["llama-batched-bench"], s.path, s.threads, s.npp, s.ntg, [n_streams], extra=("-ngl", "99")
            )
        ),
    )
    return [
        Row(
            f"1 worker, every layer on {device}, {n_streams} Generate streams of {s.ntg} tokens "
            f"(vs batched-bench -ngl 99, {backend})",
            ours[n_streams],
            peer.get(n_streams, {}).get("tg"),
            "tok/s",
            ">= 0.9",
            "decode phase; streams opened at once over gRPC; the same GPU",
        )
    ]


def failover_rows(s: Shapes) -> list[Row]:
    """Replicas of a stage: what a caller sees when one is killed, drained, or both at random."""
    from failover import chaos, handover, killed_tail

    log("failover: a tail replica killed under 8 streams")
    k = killed_tail(s.path, s.n_layer, s.vocab, s.npp, 16 if s.quick else 64)
    tokens = 128 if s.quick else 1024
    log(f"failover: a live {tokens}-token session handed over by SIGTERM")
    h = handover(s.path, s.n_layer, s.vocab, tokens, 8 if s.quick else 24)
    seconds = 6 if s.quick else 300
    log(f"failover: {seconds} s of chaos under 16 OpenAI clients")
    c = chaos(s.path, s.n_layer, s.vocab, seconds)
    storm = c["storm"]
    split = f"{s.n_layer // 2}-layer halves, 1 thread per worker"
    return [
        Row(
            "8 Generate streams (4 greedy, 4 seeded), a tail replica killed (SIGKILL) mid-stream: longest stall "
            "between two tokens (vs the re-prefill of that stream)",
            k["stall"],
            k["reprefill"],
            "s",
            "<= peer + 1 s",
            f"{k['moved']} of 8 failed over; {k['differed']} differed, {k['failed']} failed "
            f"from the undisturbed run; without the kill the longest stall was {k['calm_stall']:.3f} s; {split}",
        ),
        Row(
            f"a live {tokens}-token session handed to the other replica by SIGTERM: seconds per session (vs "
            "its re-prefill)",
            h["per_session"],
            h["reprefill"],
            "s",
            "<= 0.1",
            f"{h['reprefills']} re-prefills, {h['moves']} move; tokens "
            f"{'the same as an undisturbed twin' if h['same'] else 'DIFFERED from an undisturbed twin'}; {split}",
        ),
        Row(
            f"16 clients of /v1/completions while replicas are killed or drained and restarted at random for "
            f"{seconds} s: completions per minute (vs undisturbed)",
            storm["per_min"],
            c["calm"]["per_min"],
            "1/min",
            "0 failed, 0 differed",
            f"{c['kills']} replicas killed or drained; {len(storm['failed'])} failed, {storm['differed']} "
            f"differed of {storm['done']}; {c['failovers']} failovers; head + 2 x 2 replicas, 1 thread each",
        ),
    ]


def proofs_rows(s: Shapes) -> list[Row]:
    """Receipts and spot checks: what they cost streams through two workers (a head and a tail, with a
    second tail replica for the replays; the head places the streams on both tails in every run)."""
    log("proofs: Generate streams with receipts off, on, and spot checks at 1% and 100%")
    n, n_streams = s.n_layer, 4 if s.quick else 8
    cut = compute_balanced_cut(s.path)
    split = [(0, cut - 1), (cut, n - 1)]
    kept: list[bytes] = []

    def run(flags: tuple, receipts: list | None = None) -> dict:
        return {
            n_streams: ours_generate_streams(
                s.path, split, 1, s.npp, s.ntg, n_streams, s.vocab, tail_replicas=2, head_flags=flags, receipts=receipts
            )
        }

    off, on, one, every = alternate(
        s.repeat,
        lambda: run(("--no-receipts",)),
        lambda: run((), kept),
        lambda: run(("--spot-check-rate", "0.01")),
        lambda: run(("--spot-check-rate", "1")),
    )
    per_token = sum(map(len, kept)) / max(1, len(kept) * (s.npp + s.ntg))
    shape = f"{n_streams} Generate streams of {s.ntg} tokens, head 0-{cut - 1} + 2 tail replicas {cut}-{n - 1}, 1 thread each"
    return [
        Row(
            "receipts on, no spot checks (vs receipts off: serve --no-receipts)",
            on[n_streams],
            off[n_streams],
            "tok/s",
            ">= 0.99",
            f"{shape}; every request's receipt collected and checked",
        ),
        Row("spot checks at 1% (vs receipts off)", one[n_streams], off[n_streams], "tok/s", ">= 0.98", shape),
        Row(
            "spot checks at 100% (vs receipts off)",
            every[n_streams],
            off[n_streams],
            "tok/s",
            "rate x a stage's compute",
            f"{shape}; each request replayed on the other tail once it ends",
        ),
        Row(
            "a route's receipt: bytes per token of the request (vs one f32 hidden row between the workers)",
            per_token,
            float(4 * gguf_shape(s.path).n_embd),
            "B/token",
            "",
            f"{len(kept)} receipts of 2 stages; tokens: {s.npp}-token prompts and {s.ntg} generated",
        ),
    ]


SECTIONS = (
    single_session_rows,
    concurrent_rows,
    split_rows,
    route_rows,
    generate_rows,
    openai_rows,
    structured_rows,
    prefixes_rows,
    speculation_rows,
    wire_rows,
    failover_rows,
    proofs_rows,
    memory_rows,
    engine_choice_rows,
    cpu_kernel_rows,
)
SECTION_NAMES = {f.__name__.removesuffix("_rows"): f for f in SECTIONS}
OPTIONAL_SECTIONS = {"gpu": gpu_rows}  # run only when named (--sections gpu): they need a GPU


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/bench.py", description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF file (default: the embedded SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-stock", action="store_true", help="skip stock llama.cpp (ratios n/a)")
    ap.add_argument("--no-build", action="store_true", help="use stock tools only if already built")
    ap.add_argument("--quick", action="store_true", help="small shapes (for tests)")
    ap.add_argument("--repeat", type=int, default=2, help="measure each pair this many times, keep each side's best")
    ap.add_argument("--json", help="also write the rows as JSON here")
    ap.add_argument(
        "--stock-bin-dir",
        help="where stock llama-bench and llama-batched-bench are (default: "
        "LLAMA_SHARD_STOCK_BIN_DIR, else build/stock-bench, built there if missing)",
    )
    ap.add_argument("--require-stock", action="store_true", help="exit 2, measuring nothing, without the stock tools")
    ap.add_argument(
        "--sections",
        default=",".join(SECTION_NAMES),
        metavar="NAMES",
        help=f"which sections to run, comma-separated (default: all of {', '.join(SECTION_NAMES)})",
    )
    ap.add_argument("--device", help="section gpu: the worker's --device (default auto)")
    ap.add_argument(
        "--gpu-backend",
        choices=("cuda", "vulkan"),
        default="cuda",
        help="section gpu: the ggml backend stock llama-batched-bench is built with (build/stock-<backend>)",
    )
    args = ap.parse_args(argv)
    sections = [SECTION_NAMES.get(n) or OPTIONAL_SECTIONS.get(n) for n in args.sections.split(",")]
    if None in sections:
        ap.error(f"--sections: choose among {', '.join([*SECTION_NAMES, *OPTIONAL_SECTIONS])}")
    if args.device and gpu_rows not in sections:
        ap.error("--device sets section gpu's worker: add gpu to --sections")
    if args.device:
        os.environ["LLAMA_SHARD_BENCH_DEVICE"] = args.device
    os.environ["LLAMA_SHARD_BENCH_GPU_BACKEND"] = args.gpu_backend
    if args.stock_bin_dir:
        os.environ["LLAMA_SHARD_STOCK_BIN_DIR"] = args.stock_bin_dir
    path = Path(args.model) if args.model else require_embedded_model()
    only_gpu = all(section in OPTIONAL_SECTIONS.values() for section in sections)  # builds its own stock tools
    stock = None if args.no_stock else {} if only_gpu else find_stock_tools(build=not args.no_build)
    wants_rpc = route_rows in sections or generate_rows in sections
    rpc_tools = None if args.no_stock or not wants_rpc else find_stock_tools(build=not args.no_build, rpc=True)
    missing = [
        name
        for name, tools in (("llama-bench/llama-batched-bench", stock), ("the RPC split", rpc_tools))
        if tools is None and (wants_rpc or name != "the RPC split")
    ]
    if missing:
        why = (
            "--no-stock"
            if args.no_stock
            else "not found (--stock-bin-dir) and not built (--no-build, or the build failed)"
        )
        log(f"stock llama.cpp {' and '.join(missing)}: {why}; their peer columns are n/a")
        if args.require_stock:
            return 2
    shapes = Shapes(path, args.threads, stock, rpc_tools, args.quick, max(1, args.repeat), not args.no_build)
    rows = [row for section in sections for row in section(shapes)]
    cmd = (
        "python benchmarks/bench.py"
        + (f" --model {args.model}" if args.model else "")
        + f" --threads {args.threads} --repeat {args.repeat}"
        + (f" --sections {args.sections}" if args.sections != ",".join(SECTION_NAMES) else "")
    )
    print(
        format_table(
            rows,
            f"{path.name}, {args.threads} threads, {os.cpu_count()} CPUs; peer: stock llama.cpp "
            f"({pin_label()}) unless noted; command: `{cmd}`",
        )
    )
    if args.json:
        Path(args.json).write_text(json.dumps([dataclasses.asdict(r) | {"ratio": r.ratio} for r in rows], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
