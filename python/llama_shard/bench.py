"""Side-by-side benchmark against stock llama.cpp from the same pin, in one run.

    python -m llama_shard.bench [--model PATH] [--threads 2] [--no-stock] [--json OUT]
    python -m llama_shard.bench --pipeline-study ROUNDS [--micro-batches 2]   # the pipelining target only
    python -m llama_shard.bench --hot-path-study ROUNDS   # the step loop's figures (libgomp spin, overhead)

Stock `llama-bench` and `llama-batched-bench` are built from the same pinned source (the patches
are gated: without a shard range they behave as upstream) by the opt-in CMake option
LLAMA_SHARD_BUILD_STOCK_BENCH in build/stock-bench, or found through LLAMA_SHARD_STOCK_BIN_DIR.
Every figure is measured in this run on the same model, threads and shapes, and reported with its
ratio to the peer (see ../shared/design/BENCHMARKS.md). The default model is the embedded SmolLM2.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from ._native import ShardModel
from .hot_kv import HotKvStateConfig, ManualClock, Step, StepKind
from .manager import HotKvStateManager, KvBoundaryAdapter
from .models import compute_balanced_cut, gguf_layer_count, require_embedded_model

def _checkout() -> Path:
    """The llama-shard checkout the stock tools are built from: the one this file is in (an editable
    install), else the current directory when it is one (a regular install run from the checkout)."""
    for root in (Path(__file__).resolve().parents[2], Path.cwd()):
        if (root / "third_party" / "materialize.py").is_file():
            return root
    return Path.cwd()


REPO = _checkout()
STOCK_TOOLS = ("llama-bench", "llama-batched-bench")


@dataclasses.dataclass
class Row:
    metric: str
    ours: float | None
    peer: float | None
    unit: str
    target: str = ""
    note: str = ""

    @property
    def ratio(self) -> float | None:
        if self.ours is None or self.peer in (None, 0):
            return None
        return self.ours / self.peer


def _log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# the peer: stock llama.cpp tools from the same pin
# ---------------------------------------------------------------------------------------------

def find_stock_tools(build: bool = True, rpc: bool = False) -> dict[str, Path] | None:
    """The stock tools from the pinned source; with rpc=True, an RPC-enabled build (GGML_RPC=ON)
    with ggml-rpc-server, for llama.cpp's own way of splitting a model across processes."""
    tools = ("ggml-rpc-server", "llama-batched-bench") if rpc else STOCK_TOOLS
    name = "stock-rpc" if rpc else "stock-bench"
    candidates = []
    env = os.environ.get("LLAMA_SHARD_STOCK_RPC_BIN_DIR" if rpc else "LLAMA_SHARD_STOCK_BIN_DIR")
    if env:
        candidates.append(Path(env))
    candidates += [REPO / "build" / name / "bin"]
    for d in candidates:
        found = {t: d / t for t in tools}
        if all(p.is_file() for p in found.values()):
            return found
    if not build or not (REPO / "CMakeLists.txt").is_file():
        return None
    build_dir = REPO / "build" / name
    _log(f"building stock {', '.join(tools)} from the pinned llama.cpp in {build_dir} (a few minutes)")
    cmake = shutil.which("cmake") or "cmake"
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    subprocess.run([cmake, "-S", str(REPO), "-B", str(build_dir), *gen, "-DCMAKE_BUILD_TYPE=Release",
                    "-DLLAMA_SHARD_BUILD_STOCK_BENCH=ON", "-DLLAMA_SHARD_BUILD_PYTHON=OFF",
                    "-DLLAMA_SHARD_BUILD_TESTS=OFF", f"-DGGML_RPC={'ON' if rpc else 'OFF'}",
                    f"-DPython_EXECUTABLE={sys.executable}"], check=True, stdout=sys.stderr)
    subprocess.run([cmake, "--build", str(build_dir), "--target", *tools, "-j", str(os.cpu_count() or 2)],
                   check=True, stdout=sys.stderr)
    found = {t: build_dir / "bin" / t for t in tools}
    return found if all(p.is_file() for p in found.values()) else None


def stock_llama_bench(tool: Path, model: Path, threads: int, n_prompt: int, n_gen: int, reps: int) -> dict:
    out = subprocess.run([str(tool), "-m", str(model), "-t", str(threads), "-p", str(n_prompt), "-n", str(n_gen),
                          "-r", str(reps), "-o", "json"], capture_output=True, text=True, check=True).stdout
    res = {}
    for entry in json.loads(out):
        key = "pp" if entry["n_prompt"] > 0 else "tg"
        res[key] = float(entry["avg_ts"])
    return res


def stock_batched_bench(tool: Path, model: Path, threads: int, npp: int, ntg: int, npl: list[int],
                        extra: tuple = ()) -> dict[int, dict]:
    out = subprocess.run([str(tool), "-m", str(model), "-t", str(threads), "-c", "4096", "-b", "512", "-ub", "512",
                          "-npp", str(npp), "-ntg", str(ntg), "-npl", ",".join(map(str, npl)),
                          "--output-format", "jsonl", *extra], capture_output=True, text=True, check=True)
    res = {}
    for line in (out.stdout + "\n" + out.stderr).splitlines():
        line = line.strip()
        if line.startswith("{") and "speed_tg" in line:
            d = json.loads(line)
            res[int(d["pl"])] = {"pp": float(d["speed_pp"]), "tg": float(d["speed_tg"])}
    return res


# ---------------------------------------------------------------------------------------------
# llama-shard, same shapes
# ---------------------------------------------------------------------------------------------

def _manager(model: ShardModel, sessions: int, context: int, threads: int, n_batch: int = 512) -> HotKvStateManager:
    cfg = HotKvStateConfig(max_sessions=sessions, context_tokens=context, budget_tokens=sessions * context, ttl_seconds=0)
    return HotKvStateManager(model, cfg, ManualClock(), n_batch=n_batch, n_threads=threads)


def ours_prefill_and_tg(path: Path, threads: int, n_prompt: int, n_gen: int, reps: int, vocab: int) -> dict:
    """llama-bench's shapes: a fresh n_prompt-token prompt; n_gen single-token decodes from empty."""
    model = ShardModel(str(path), None, threads)
    mgr = _manager(model, 1, max(n_prompt, n_gen) + 8, threads)
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
        mgr = _manager(model, pl, npp + ntg, threads)
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


def _user_manager(model: ShardModel, sessions: int, context: int) -> HotKvStateManager:
    """A manager as the README builds one: a config and the model, nothing else."""
    return HotKvStateManager(model, HotKvStateConfig(max_sessions=sessions, context_tokens=context,
                                                     budget_tokens=sessions * context))


def ours_adapter_callers(path: Path, threads: int, npp: int, ntg: int, npl: list[int], vocab: int,
                         use_async: bool = False) -> dict[int, float]:
    """What a user gets: `pl` threads (or asyncio tasks), each driving its own session through
    `KvBoundaryAdapter(model, manager)` exactly as the README constructs it. Prompts are prefilled
    first; the decode phase is timed (llama-batched-bench's speed_tg)."""
    import asyncio
    import threading

    model = ShardModel(str(path), None, threads)
    rng = np.random.default_rng(6)
    res = {}
    for pl in npl:
        manager = _user_manager(model, pl, npp + ntg + 8)
        adapter = KvBoundaryAdapter(model, manager)
        prompts = [rng.integers(0, vocab, npp).tolist() for _ in range(pl)]
        if use_async:
            async def main() -> float:
                outs = await asyncio.gather(*(adapter.prefill_async(f"u{j}", 0, token_ids=prompts[j]) for j in range(pl)))

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
        _log(f"{'asyncio tasks' if use_async else 'threads'} x {pl}: {res[pl]:.1f} tok/s; engine {st['steps']} steps "
             f"for {st['requests']} requests, busy {st['busy_seconds'] / max(st['steps'], 1) * 1e3:.1f} ms per step")
        manager.close()
    return res


def ours_worker_clients(path: Path, threads: int, npp: int, ntg: int, n_clients: int, vocab: int,
                        env: dict[str, str] | None = None) -> float:
    """One `llama-shard serve` worker (the whole model, `threads` threads) and `n_clients` gRPC
    clients in this process, each driving its own session with Prefill and then Decode calls.
    The decode phase is timed. `env`: variables set for the worker process only."""
    import threading

    import grpc

    from .demo import start_worker, wait_serving
    from .proto import shard_pb2 as pb
    from .proto import shard_pb2_grpc as pb_grpc

    n_layer = gguf_layer_count(path)
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})  # inherited by the worker process only: this one has loaded its libraries
    try:
        proc, addr = start_worker(path, 0, n_layer - 1, threads, extra=(
            "--max-sessions", str(n_clients), "--context-tokens", str(npp + ntg + 8),
            "--budget-tokens", str(n_clients * (npp + ntg + 8))))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        wait_serving(proc, addr)
        rng = np.random.default_rng(7)
        prompts = [rng.integers(0, vocab, npp).tolist() for _ in range(n_clients)]
        ready = threading.Barrier(n_clients + 1)
        failures: list[str] = []

        def client(j: int) -> None:
            with grpc.insecure_channel(addr) as channel:
                stub = pb_grpc.ShardServiceStub(channel)
                r = stub.Prefill(pb.StepRequest(session_id=f"c{j}", route_epoch=0, token_ids=prompts[j]), timeout=120)
                ready.wait()
                for _ in range(ntg):
                    r = stub.Decode(pb.StepRequest(session_id=f"c{j}", route_epoch=0, token_ids=[r.token_id]), timeout=120)
                    if r.outcome != pb.OUTCOME_OK:
                        failures.append(pb.Outcome.Name(r.outcome))
                        return

        clients = [threading.Thread(target=client, args=(j,)) for j in range(n_clients)]
        for t in clients:
            t.start()
        with grpc.insecure_channel(addr) as channel:
            info = pb_grpc.ShardServiceStub(channel).Info
            ready.wait()
            i0, cpu0 = info(pb.InfoRequest(), timeout=30), (_cpu_seconds(proc.pid), _cpu_seconds())
            t0 = time.perf_counter()
            for t in clients:
                t.join()
            wall = time.perf_counter() - t0
            i1, cpu1 = info(pb.InfoRequest(), timeout=30), (_cpu_seconds(proc.pid), _cpu_seconds())
        if failures:
            raise RuntimeError(f"worker clients failed: {failures[:3]}")
        steps, busy = i1.engine_steps - i0.engine_steps, i1.engine_busy_seconds - i0.engine_busy_seconds
        # where the time goes: the engine's share of the wall time, the requests per step, and the
        # CPU of the worker process (compute threads included) and of the clients
        _log(f"worker profile, {n_clients} gRPC clients: {n_clients * ntg} tokens in {wall:.2f}s; engine busy "
             f"{busy:.2f}s ({busy / wall:.0%} of the wall time) in {steps} steps of "
             f"{(i1.engine_requests - i0.engine_requests) / max(steps, 1):.1f} requests, {busy / max(steps, 1) * 1e3:.1f} ms each; "
             f"CPU worker {cpu1[0] - cpu0[0]:.2f}s, clients {cpu1[1] - cpu0[1]:.2f}s")
        return n_clients * ntg / wall
    finally:
        proc.terminate()
        proc.wait(30)


def ours_pipeline(path: Path, threads: int, split: list[tuple[int, int]], npp: int, ntg: int, vocab: int) -> float:
    """Decode tokens/s of one session through in-process shards, one after the other."""
    shards = [ShardModel(str(path), r, threads) for r in split] if split else [ShardModel(str(path), None, threads)]
    mgrs = [_manager(m, 1, npp + ntg + 8, threads) for m in shards]
    rng = np.random.default_rng(2)

    def step(kind, tokens):
        (r, out), = mgrs[0].step_batch([Step(kind, "p", 0, tokens)])
        for m in mgrs[1:]:
            (r, out), = m.step_batch([Step(kind, "p", 0, hidden=out)])
        return out

    step(StepKind.PREFILL, rng.integers(0, vocab, npp).tolist())
    t0 = time.perf_counter()
    for _ in range(ntg):
        step(StepKind.DECODE, [int(rng.integers(0, vocab))])
    return ntg / (time.perf_counter() - t0)


def kv_layout_comparison(path: Path, threads: int, lengths: list[int], ntg: int, vocab: int) -> dict[bool, float]:
    """Aggregate decode tokens/s of sessions with different cached lengths, one llama_decode per step,
    in one pool of cells shared by all sequences (kv_unified) vs one stream per sequence."""
    from ._native import ShardContext

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


def stock_rpc_split(tools: dict, model: Path, n_layer: int, npp: int, ntg: int, npl: list[int]) -> dict[int, dict]:
    """llama.cpp's RPC backend: ggml-rpc-server (1 thread) holds the second half of the layers,
    llama-batched-bench (1 thread) the rest; the halves run one after the other."""
    import socket

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    server = subprocess.Popen([str(tools["ggml-rpc-server"]), "-H", "127.0.0.1", "-p", str(port), "-t", "1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with socket.socket() as sk:
                if sk.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        return stock_batched_bench(tools["llama-batched-bench"], model, 1, npp, ntg, npl,
                                   ("--rpc", f"127.0.0.1:{port}", "-ngl", str(n_layer - n_layer // 2)))
    finally:
        server.terminate()
        server.wait(10)


def _cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of a process (this one when pid is None)."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _engine_counters(stage) -> tuple[float, int, int]:
    """(seconds busy, steps, requests) of a stage's engine: a worker's Info, or a local scheduler."""
    if hasattr(stage, "manager"):
        st = stage.manager.loop_stats()
        return st["busy_seconds"], st["steps"], st["requests"]
    info = stage.stats()
    return info.engine_busy_seconds, info.engine_steps, info.engine_requests


# name -> stages served by workers; "chained": the head worker forwards to the tail itself (serve --peer)
TOPOLOGIES = {"chained": 2, "two workers": 2, "local head": 1, "in process": 0}


def ours_two_stages(path: Path, n_layer: int, npp: int, ntg: int, npl: list[int], vocab: int,
                     micro_batches: int = 2, topology: str = "two workers") -> dict[int, float]:
    """Two 1-thread stages split the model where per-token compute balances (the tail also runs
    the LM head). Topologies: "two workers", two `llama-shard serve` processes on loopback driven
    by this process; "local head", the head in this process (a LocalStage, as llama-batched-bench
    keeps its half local) and the tail in one `serve` process; "in process", both stages are
    LocalStages here: the same client and engines with no gRPC and no second process, which shows
    what the transport costs. `pl` sessions are dealt into `micro_batches` groups
    of consecutive sessions; each group steps through the route on its own thread, one message per
    worker per step, so while the tail computes one group the head computes the other
    (pipelining). Like llama-batched-bench, prompts are prefilled first and only the decode is
    timed."""
    import threading

    from .demo import free_port, start_worker, wait_serving
    from .route import LocalStage, RemoteStage, RouteClient, RouteError

    cut = compute_balanced_cut(path)
    ranges = [(0, cut - 1), (cut, n_layer - 1)]
    n_local = len(ranges) - TOPOLOGIES[topology]  # the first n_local stages run in this process
    if topology == "chained":
        tail_port = free_port()
        tail = start_worker(path, *ranges[1], 1, port=tail_port)
        procs = [start_worker(path, *ranges[0], 1, extra=("--peer", f"127.0.0.1:{tail_port}")), tail]
    else:
        procs = [start_worker(path, first, last, 1) for first, last in ranges[n_local:]]
    res = {}
    try:
        for proc, addr in procs:
            wait_serving(proc, addr)
        config = HotKvStateConfig(max_sessions=8, context_tokens=512, budget_tokens=2048)  # as start_worker's
        stages = ([LocalStage(ShardModel(str(path), r, 1), config) for r in ranges[:n_local]]
                  + [RemoteStage(addr) for _, addr in procs])
        client = RouteClient(stages, chained=topology == "chained")
        rng = np.random.default_rng(5)
        for pl in npl:
            sessions = [client.session(f"pipe-{pl}-{j}") for j in range(pl)]
            n_groups = max(1, min(micro_batches, pl))
            groups = [list(range(g * pl // n_groups, (g + 1) * pl // n_groups)) for g in range(n_groups)]
            last_token: dict[int, int] = {}
            failures: list[RouteError] = []

            def step(kind: StepKind, group: list[int], feeds: list[list[int]]) -> None:
                outs = client.step_sessions(kind, [sessions[i] for i in group], feeds)
                for i, out in zip(group, outs):
                    if isinstance(out, RouteError):
                        raise out
                    last_token[i] = int(out.token_id)

            for group in groups:  # sessions open in order: each group holds consecutive seq ids
                step(StepKind.PREFILL, group, [rng.integers(0, vocab, npp).tolist() for _ in group])

            def decode(group: list[int]) -> None:
                try:
                    for _ in range(ntg):
                        step(StepKind.DECODE, group, [[last_token[i]] for i in group])
                except RouteError as e:
                    failures.append(e)

            threads = [threading.Thread(target=decode, args=(g,)) for g in groups]
            cpu0 = [_cpu_seconds(proc.pid) for proc, _ in procs] + [_cpu_seconds()]
            eng0 = [_engine_counters(s) for s in client.stages]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
            if failures:
                raise failures[0]
            cpu = [b - a for a, b in zip(cpu0, [_cpu_seconds(proc.pid) for proc, _ in procs] + [_cpu_seconds()])]
            eng = [tuple(b - a for a, b in zip(before, _engine_counters(s))) for before, s in zip(eng0, client.stages)]
            res[pl] = pl * ntg / wall
            # where the time goes: CPU seconds of each process during the decode, and how long each
            # worker's engine was busy, in how many steps of how many requests
            names = ["head", "tail"][n_local:] + [" + ".join(["client", *["head", "tail"][:n_local]])]
            _log(f"pipeline profile ({topology}), {pl} session(s) in "
                 f"{n_groups} micro-batch(es), {pl * ntg} tokens in {wall:.2f}s wall ({wall / ntg * 1e3:.1f} ms per round): CPU "
                 + ", ".join(f"{n} {c:.2f}s" for n, c in zip(names, cpu))
                 + f" ({sum(cpu) / (wall * (os.cpu_count() or 1)):.0%} of {os.cpu_count()} cores); engine busy "
                 + ", ".join(f"{stage} {b:.2f}s in {n} steps ({r / max(n, 1):.1f} req/step)"
                             for stage, (b, n, r) in zip(("head", "tail"), eng)))
            for sess in sessions:
                sess.release()
        client.close()
    finally:
        for proc, _ in procs:
            proc.terminate()
            proc.wait(30)
    return res


_RSS_PROBE = """
import json, sys
import llama_shard as ls
def rss():
    with open('/proc/self/status') as f:
        for line in f:
            if line.startswith('VmRSS:'):
                return int(line.split()[1]) * 1024
layers = json.loads(sys.argv[2])
r0 = rss()
m = ls.ShardModel(sys.argv[1], tuple(layers) if layers else None, 1)
print(json.dumps({"rss": rss() - r0, "weights": m.info.weight_bytes, "kv": m.info.kv_bytes_per_token}))
"""


def ours_memory(path: Path, layers) -> dict:
    out = subprocess.run([sys.executable, "-c", _RSS_PROBE, str(path), json.dumps(layers)], capture_output=True,
                         text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def ours_session_ops(path: Path, threads: int, live_counts: list[int], vocab: int, cycles: int = 200) -> dict[int, float]:
    """Microseconds per open + 1-token prefill + release with `n` other sessions live (one-layer head shard)."""
    model = ShardModel(str(path), (0, 0), threads)
    res = {}
    for n in live_counts:
        mgr = _manager(model, n + 1, 16, threads, n_batch=16)
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
# the table
# ---------------------------------------------------------------------------------------------

def best(runs: list[dict]) -> dict:
    """Each figure's best over runs (nested dicts merged key by key)."""
    out: dict = {}
    for r in runs:
        for k, v in r.items():
            out[k] = max(out.get(k, v), v) if not isinstance(v, dict) else best([out.get(k, {}), v])
    return out


def alternate(repeat: int, *measures) -> list[dict]:
    """The machine is shared and noisy: every measure (None or False: skipped, giving {}) runs
    `repeat` times, taking turns with the others, and each one's best is kept."""
    runs: list[list[dict]] = [[] for _ in measures]
    for _ in range(repeat):
        for out, measure in zip(runs, measures):
            if measure:
                out.append(measure())
    return [best(r) for r in runs]


def run(path: Path, threads: int, stock: dict | None, quick: bool, repeat: int = 2,
        rpc_tools: dict | None = None) -> list[Row]:
    n_layer = gguf_layer_count(path)
    vocab = ShardModel(str(path), (0, 0), 1).info.n_vocab
    npp, ntg, reps = (16, 8, 1) if quick else (128, 64, 3)
    npl = [1, 4] if quick else [1, 4, 8, 16]
    live = [10, 50] if quick else [10, 100, 250]
    rows: list[Row] = []

    _log("llama-shard: prefill and single-session decode")
    ours, peer = alternate(repeat, lambda: ours_prefill_and_tg(path, threads, npp, ntg, reps, vocab),
                           stock and (lambda: stock_llama_bench(stock["llama-bench"], path, threads, npp, ntg, reps)))
    rows.append(Row(f"prefill pp{npp} (llama-bench)", ours["pp"], peer.get("pp"), "tok/s", ">= 0.95"))
    rows.append(Row(f"decode tg{ntg}, 1 session (llama-bench)", ours["tg"], peer.get("tg"), "tok/s", ">= 0.95"))

    _log("llama-shard: concurrent sessions (the engine, and what users run around it)")
    user_npl = [pl for pl in npl if pl > 1]
    n_clients = 4 if quick else 8
    ours_b, peer_b, threads_b, async_b, worker_b = alternate(
        repeat, lambda: ours_batched(path, threads, npp, ntg, npl, vocab),
        stock and (lambda: stock_batched_bench(stock["llama-batched-bench"], path, threads, npp, ntg, npl)),
        lambda: ours_adapter_callers(path, threads, npp, ntg, user_npl, vocab),
        lambda: ours_adapter_callers(path, threads, npp, ntg, user_npl, vocab, use_async=True),
        lambda: {n_clients: ours_worker_clients(path, threads, npp, ntg, n_clients, vocab)})
    for pl in npl:
        rows.append(Row(f"aggregate decode, {pl} session{'s' if pl > 1 else ''} (batched-bench)", ours_b[pl]["tg"],
                        peer_b.get(pl, {}).get("tg"), "tok/s", ">= 0.95" if pl in (1, 4, 8) else ""))
    for pl in user_npl:
        rows.append(Row(f"{pl} threads, each a session through KvBoundaryAdapter(model, manager)", threads_b[pl],
                        peer_b.get(pl, {}).get("tg"), "tok/s", ">= 0.95", "peer: batched-bench, same sessions"))
    for pl in user_npl:
        rows.append(Row(f"{pl} asyncio tasks, each a session through KvBoundaryAdapter(model, manager)", async_b[pl],
                        peer_b.get(pl, {}).get("tg"), "tok/s", ">= 0.95", "peer: batched-bench, same sessions"))
    rows.append(Row(f"1 worker ({threads} threads), {n_clients} gRPC clients each sending Decode", worker_b[n_clients],
                    peer_b.get(n_clients, {}).get("tg"), "tok/s", ">= 0.95",
                    "clients in the benchmark process; peer: batched-bench"))

    _log("llama-shard: 2-shard in-process pipeline")
    half = [(0, n_layer // 2 - 1), (n_layer // 2, n_layer - 1)]
    whole_tg = max(ours_pipeline(path, threads, [], npp, ntg, vocab) for _ in range(repeat))
    split_tg = max(ours_pipeline(path, threads, half, npp, ntg, vocab) for _ in range(repeat))
    rows.append(Row(f"decode through 2 shards {half[0][0]}-{half[0][1]},{half[1][0]}-{half[1][1]} vs whole",
                    split_tg, whole_tg, "tok/s", ">= 0.90", "peer: the whole model in llama-shard"))

    _log("two worker processes on loopback vs llama.cpp's RPC split")
    pipe_npl = [1, 8] if not quick else [1, 2]
    ours_p, relay_p, local_p, peer_p = alternate(
        repeat, lambda: ours_two_stages(path, n_layer, npp, ntg, pipe_npl, vocab, topology="chained"),
        lambda: ours_two_stages(path, n_layer, npp, ntg, pipe_npl[-1:], vocab, topology="two workers"),
        lambda: ours_two_stages(path, n_layer, npp, ntg, pipe_npl[-1:], vocab, topology="local head"),
        rpc_tools and (lambda: stock_rpc_split(rpc_tools, path, n_layer, npp, ntg, pipe_npl)))
    cut = compute_balanced_cut(path)
    peer_note = (f"peer: ggml-rpc-server with layers {n_layer - n_layer // 2}-{n_layer - 1} + "
                 "llama-batched-bench, 1 thread each")
    for pl in pipe_npl:
        rows.append(Row(f"2 workers x 1 thread on loopback (0-{cut - 1},{cut}-{n_layer - 1}), chained, {pl} session"
                        f"{'s' if pl > 1 else ''} (vs RPC split)",
                        ours_p[pl], peer_p.get(pl, {}).get("tg"), "tok/s", ">= 1.6" if pl > 1 else ">= 1.0", peer_note))
    pl = pipe_npl[-1]
    rows.append(Row(f"2 workers x 1 thread on loopback, client-relayed, {pl} sessions (vs RPC split)",
                    relay_p[pl], peer_p.get(pl, {}).get("tg"), "tok/s", "", peer_note))
    rows.append(Row(f"head 0-{cut - 1} in the client process + 1 worker {cut}-{n_layer - 1} on loopback, 1 thread each, "
                    f"{pl} sessions (vs RPC split: the same topology)", local_p[pl], peer_p.get(pl, {}).get("tg"),
                    "tok/s", ">= 1.6", peer_note))

    _log("memory")
    whole_m = ours_memory(path, None)
    for r in half:
        m = ours_memory(path, list(r))
        rows.append(Row(f"resident memory of shard {r[0]}-{r[1]} vs whole", m["rss"] / 2**20, whole_m["rss"] / 2**20,
                        "MiB", "<= 0.60", f"weights {m['weights'] / 2**20:.1f} of {whole_m['weights'] / 2**20:.1f} MiB"))
        rows.append(Row(f"KV bytes/token of shard {r[0]}-{r[1]} vs whole", m["kv"], whole_m["kv"], "B", "",
                        "owned layers only"))

    _log("KV layout: one shared pool vs one stream per session")
    lengths = [16, 32, 48, 64] if quick else [64, 128, 256, 384, 512, 768, 1024, 1536]
    layout = kv_layout_comparison(path, threads, lengths, ntg, vocab)
    rows.append(Row(f"decode, {len(lengths)} sessions of {lengths[0]}-{lengths[-1]} cached tokens: per-session streams vs shared pool",
                    layout[False], layout[True], "tok/s", "choice", "peer: kv_unified=true in llama-shard"))

    _log("session operations")
    ops = ours_session_ops(path, threads, live, vocab)
    base = ops[live[0]]
    for n in live:
        rows.append(Row(f"open+prefill(1)+release with {n} live sessions", ops[n], base, "us", "<= 2.0",
                        f"peer: the same with {live[0]} live"))
    return rows


# ---------------------------------------------------------------------------------------------
# the pipelining study: the spread of the target ratio, and its compute bound
# ---------------------------------------------------------------------------------------------

def _stage_step_ms(path: str, layers: tuple[int, int], seconds: float, start=None, out=None) -> float:
    """ms per decode step of 4 sessions (128 cached tokens, kept near that) on one shard, 1 thread.
    With `start` (an Event) the timing begins when it is set; the result also goes to `out`."""
    model = ShardModel(path, layers, 1)
    mgr = _manager(model, 4, 512, 1)
    rng = np.random.default_rng(0)
    head = model.info.is_head

    def inputs(n):
        if head:
            return rng.integers(0, model.info.n_vocab, n).tolist(), None
        return None, rng.standard_normal((n, model.info.n_embd)).astype(np.float32)

    mgr.step_batch([Step.prefill(f"s{j}", 0, *inputs(128), start_pos=0) for j in range(4)])
    if start is not None:
        start.wait()
    steps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(8):
            mgr.step_batch([Step.decode(f"s{j}", 0, *inputs(1)) for j in range(4)])
            steps += 1
        for j in range(4):
            mgr.truncate(f"s{j}", 0, 128)
    ms = (time.perf_counter() - t0) / steps * 1e3
    if out is not None:
        out.put((layers, ms))
    return ms


def stage_costs(path: Path, ranges: list[tuple[int, int]], seconds: float) -> dict[str, list[float]]:
    """Each stage's 4-session step time alone, then with both stages computing at once (two
    processes), which is what a pipeline does."""
    import multiprocessing as mp

    alone = [_stage_step_ms(str(path), r, seconds) for r in ranges]
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_stage_step_ms, args=(str(path), r, seconds, start, out)) for r in ranges]
    for pr in procs:
        pr.start()
    time.sleep(5.0)  # both load and prefill before the timing starts (a few hundred ms here)
    start.set()
    together = dict(out.get(timeout=300) for _ in procs)
    for pr in procs:
        pr.join()
    return {"alone": alone, "together": [together[r] for r in ranges]}


def pipeline_study(path: Path, rounds: int, rpc_tools: dict | None, micro_batches: int = 2, quick: bool = False) -> str:
    """The 8-session pipelining ratio over `rounds` alternating rounds, for each topology (two
    worker processes; the head in this process + one worker; both stages in this process, no
    gRPC) against llama.cpp's RPC split, with two bounds: the compute bound from our own stage
    times, and the pipelining ceiling from stock llama.cpp in the same round (a perfect two-stage
    pipeline of 4-session micro-batches runs each half of the model on its own core, so it makes
    twice the whole model's 4-session decode rate)."""
    import statistics

    n_layer = gguf_layer_count(path)
    vocab = ShardModel(str(path), (0, 0), 1).info.n_vocab
    cut = compute_balanced_cut(path)
    ranges = [(0, cut - 1), (cut, n_layer - 1)]
    lines = [f"{path.name}: pipelining at 8 sessions, 1 thread per worker, cut {cut}, "
             f"{micro_batches} micro-batches, {rounds} alternating rounds", ""]
    npp, ntg, seconds = (16, 8, 0.3) if quick else (128, 64, 4.0)
    costs = stage_costs(path, ranges, seconds)
    for name, ms in costs.items():
        lines.append(f"4-session step, {name}: " + ", ".join(f"layers {a}-{b} {m:.1f} ms" for (a, b), m in zip(ranges, ms)))
    # two micro-batches of 4 keep each stage on one 4-session step at a time: 8 tokens per 2 steps
    bound = 8 / (2 * max(costs["together"]) / 1e3) if micro_batches == 2 else None
    if bound:
        lines.append(f"compute bound with free transport: 8 tokens per 2 x {max(costs['together']):.1f} ms = {bound:.1f} tok/s")
    ratios: dict[str, list[float]] = {name: [] for name in [*TOPOLOGIES, "ceiling"]}
    peers: list[float] = []
    for k in range(rounds):
        ours = {name: ours_two_stages(path, n_layer, npp, ntg, [8], vocab, micro_batches, topology=name)[8]
                for name in TOPOLOGIES}
        line = f"round {k + 1}: " + ", ".join(f"{name} {v:.1f}" for name, v in ours.items())
        if rpc_tools:
            peer = stock_rpc_split(rpc_tools, path, n_layer, npp, ntg, [8])[8]["tg"]
            whole = stock_batched_bench(rpc_tools["llama-batched-bench"], path, 1, npp, ntg, [4, 8])
            whole4 = whole[4]["tg"]
            peers.append(peer)
            for name, v in ours.items():
                ratios[name].append(v / peer)
            ratios["ceiling"].append(2 * whole4 / peer)
            line += (f"; RPC split {peer:.1f}, stock whole model at 4 sessions {whole4:.1f} (8: {whole[8]['tg']:.1f}) tok/s; ratios "
                     + ", ".join(f"{r[-1]:.3f}" for r in ratios.values()))
        else:
            line += "; RPC split n/a"
        lines.append(line)
    for name, r in ratios.items():
        if r:
            label = "ceiling (2 x stock whole model at 4 sessions)" if name == "ceiling" else name
            lines.append(f"{label} / RPC split: min {min(r):.3f}, median {statistics.median(r):.3f}, max {max(r):.3f}, "
                         f"{sum(x >= 1.6 for x in r)} of {len(r)} rounds >= 1.6")
    for name in TOPOLOGIES:
        if ratios["ceiling"]:
            of = [a / c for a, c in zip(ratios[name], ratios["ceiling"])]
            lines.append(f"{name} / ceiling (same round): min {min(of):.3f}, median {statistics.median(of):.3f}, "
                         f"max {max(of):.3f}, {sum(x >= 0.88 for x in of)} of {len(of)} rounds >= 0.88")
    if peers and bound:
        lines.append(f"compute bound / best RPC split: {bound:.1f} / {max(peers):.1f} = {bound / max(peers):.3f}")
    return "\n".join(lines)


def hot_path_study(path: Path, threads: int, rounds: int, quick: bool = False) -> str:
    """Two questions about the step loop: does libgomp's spin after each step (its workers spin
    before they sleep) slow a worker serving 8 gRPC clients (the default spin count against
    30,000), and what does a decode through the adapter and the step loop cost beyond the engine
    step itself (a synthetic model, so that the compute is small)."""
    import tempfile

    from .testing.synthetic import SyntheticSpec, write_synthetic_gguf

    vocab = ShardModel(str(path), (0, 0), 1).info.n_vocab
    npp, ntg, n_clients = (16, 8, 4) if quick else (128, 64, 8)
    lines = [f"{path.name}: one worker ({threads} threads), {n_clients} gRPC clients, {rounds} alternating rounds"]
    spins = {"300000 (libgomp's default)": "300000", "30000": "30000"}
    got: dict[str, list[float]] = {name: [] for name in spins}
    for _ in range(rounds):
        for name, value in spins.items():
            got[name].append(ours_worker_clients(path, threads, npp, ntg, n_clients, vocab, {"GOMP_SPINCOUNT": value}))
    for name, rates in got.items():
        lines.append(f"GOMP_SPINCOUNT={name}: " + ", ".join(f"{r:.1f}" for r in rates) + " tok/s")
    with tempfile.TemporaryDirectory() as tmp:
        synthetic = Path(tmp) / "synthetic.gguf"
        write_synthetic_gguf(str(synthetic), SyntheticSpec())
        model = ShardModel(str(synthetic), None, threads)
        manager = _user_manager(model, 1, 4096)
        adapter = KvBoundaryAdapter(model, manager)
        n = 200 if quick else 2000
        token = adapter.prefill("o", 0, token_ids=[1, 2, 3]).token_id
        before = manager.loop_stats()
        t0 = time.perf_counter()
        for _ in range(n):
            token = adapter.decode("o", 0, token_ids=[token]).token_id
        per_step = (time.perf_counter() - t0) / n
        after = manager.loop_stats()
        busy = (after["busy_seconds"] - before["busy_seconds"]) / (after["steps"] - before["steps"])
        manager.close()
    lines.append(f"a lone session on a synthetic model, {n} decodes through KvBoundaryAdapter: {per_step * 1e6:.0f} us "
                 f"per decode, of which the engine step {busy * 1e6:.0f} us: {(per_step - busy) * 1e6:.0f} us for the "
                 "adapter, the step loop and the thread hand-offs")
    return "\n".join(lines)


def format_table(rows: list[Row], header: str) -> str:
    lines = [header, "",
             "| metric | llama-shard | peer | ratio | target |",
             "| --- | ---: | ---: | ---: | --- |"]
    for r in rows:
        ours = "n/a" if r.ours is None else f"{r.ours:,.1f} {r.unit}"
        peer = "n/a" if r.peer is None else f"{r.peer:,.1f} {r.unit}"
        ratio = "n/a" if r.ratio is None else f"{r.ratio:.3f}"
        target = r.target + (f" ({r.note})" if r.note else "")
        lines.append(f"| {r.metric} | {ours} | {peer} | {ratio} | {target} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m llama_shard.bench", description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF file (default: the embedded SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-stock", action="store_true", help="skip stock llama.cpp (ratios n/a)")
    ap.add_argument("--no-build", action="store_true", help="use stock tools only if already built")
    ap.add_argument("--quick", action="store_true", help="small shapes (for tests)")
    ap.add_argument("--repeat", type=int, default=2, help="measure each pair this many times, keep each side's best")
    ap.add_argument("--json", help="also write the rows as JSON here")
    ap.add_argument("--pipeline-study", type=int, metavar="ROUNDS",
                    help="only the 8-session pipelining comparison, ROUNDS alternating rounds, with its compute bound")
    ap.add_argument("--micro-batches", type=int, default=2, help="micro-batches for --pipeline-study")
    ap.add_argument("--hot-path-study", type=int, metavar="ROUNDS",
                    help="only the step loop's figures: libgomp spin in a worker with 8 clients, adapter overhead")
    ap.add_argument("--warm-study", action="store_true",
                    help="only the warm tier and memory plan figures: restore vs re-prefill, tier overhead, chat "
                         "sessions over few slots, the oversubscribed route, RSS under churn, KV types")
    args = ap.parse_args(argv)
    path = Path(args.model) if args.model else require_embedded_model()
    if args.warm_study:
        from .warm_study import warm_study
        print(warm_study(path, args.threads, args.quick))
        return 0
    if args.hot_path_study:
        print(hot_path_study(path, args.threads, args.hot_path_study, args.quick))
        return 0
    rpc_tools = None if args.no_stock else find_stock_tools(build=not args.no_build, rpc=True)
    if args.pipeline_study:
        print(pipeline_study(path, args.pipeline_study, rpc_tools, args.micro_batches, args.quick))
        return 0
    stock = None if args.no_stock else find_stock_tools(build=not args.no_build)
    if stock is None and not args.no_stock:
        _log("stock llama.cpp tools not available: peer columns are n/a")
    rows = run(path, args.threads, stock, args.quick, max(1, args.repeat), rpc_tools)
    cmd = ("python -m llama_shard.bench" + (f" --model {args.model}" if args.model else "") +
           f" --threads {args.threads} --repeat {args.repeat}")
    header = (f"{path.name}, {args.threads} threads, {os.cpu_count()} CPUs; peer: stock llama.cpp "
              f"(pinned llama-cpp-python 0.3.36 = upstream 0c1e57098) unless noted; command: `{cmd}`")
    print(format_table(rows, header))
    if args.json:
        Path(args.json).write_text(json.dumps([dataclasses.asdict(r) | {"ratio": r.ratio} for r in rows], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
