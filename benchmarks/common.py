"""What the benchmark entry points share: the table, the peer (stock llama.cpp tools built from the
pinned source), the managers they measure, and process accounting.

The entry points (`bench.py`, `pipeline_study.py`, `hot_path_study.py`, `warm_study.py`) import
this module by name: Python puts the script's folder first on sys.path. They measure the
installed `llama_shard` package (pip install . or an editable install); the stock tools are built
from the checkout this folder is in.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from llama_shard import HotKvStateConfig, HotKvStateManager, ShardModel
from llama_shard.engine.hot_kv import ManualClock

REPO = Path(__file__).resolve().parents[1]
STOCK_TOOLS = ("llama-bench", "llama-batched-bench")


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def pin_label() -> str:
    """The peer's version, from the pin file: 'llama-cpp-python 0.3.36 = upstream 0c1e57098'."""
    pin = json.loads((REPO / "third_party" / "llama-cpp-pin.json").read_text())
    return f"{pin['package']} {pin['version']} = upstream {pin['upstream_commit']}"


# ---------------------------------------------------------------------------------------------
# the table
# ---------------------------------------------------------------------------------------------


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


def format_table(rows: list[Row], header: str) -> str:
    lines = [header, "", "| metric | llama-shard | peer | ratio | target |", "| --- | ---: | ---: | ---: | --- |"]
    for r in rows:
        ours = "n/a" if r.ours is None else f"{r.ours:,.1f} {r.unit}"
        peer = "n/a" if r.peer is None else f"{r.peer:,.1f} {r.unit}"
        ratio = "n/a" if r.ratio is None else f"{r.ratio:.3f}"
        target = r.target + (f" ({r.note})" if r.note else "")
        lines.append(f"| {r.metric} | {ours} | {peer} | {ratio} | {target} |")
    return "\n".join(lines)


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


# ---------------------------------------------------------------------------------------------
# the peer: stock llama.cpp tools from the same pin
# ---------------------------------------------------------------------------------------------

# what stock llama.cpp built "without AMX" means: the flags that worked around the pin's AMX crash
NO_AMX_FLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def find_stock_tools(
    build: bool = True, rpc: bool = False, no_amx: bool = False, server: bool = False, gpu: str = ""
) -> dict[str, Path] | None:
    """The stock tools from the pinned source: in LLAMA_SHARD_STOCK_BIN_DIR (or
    LLAMA_SHARD_STOCK_RPC_BIN_DIR) when set, else in build/stock-bench, built there when missing (CMake option
    LLAMA_SHARD_BUILD_STOCK_BENCH; the patches are gated, so without a shard range they behave as
    upstream). With rpc=True, an RPC-enabled build (GGML_RPC=ON) with ggml-rpc-server, for
    llama.cpp's own way of splitting a model across processes. With no_amx=True, llama-bench and
    llama-batched-bench compiled without the AMX kernels (NO_AMX_FLAGS): in LLAMA_SHARD_STOCK_NOAMX_BIN_DIR
    when set, else in build/stock-noamx. With server=True, llama-server (built without its web page),
    where llama-bench is. With gpu="cuda" or "vulkan", the tools built with that ggml backend (as
    upstream builds them: static, in build/stock-<gpu>; LLAMA_SHARD_STOCK_GPU_BIN_DIR when set)."""
    tools = ("ggml-rpc-server", "llama-batched-bench") if rpc else ("llama-server",) if server else STOCK_TOOLS
    name = "stock-rpc" if rpc else ("stock-noamx" if no_amx else f"stock-{gpu}" if gpu else "stock-bench")
    env = os.environ.get(
        "LLAMA_SHARD_STOCK_RPC_BIN_DIR"
        if rpc
        else "LLAMA_SHARD_STOCK_NOAMX_BIN_DIR"
        if no_amx
        else "LLAMA_SHARD_STOCK_GPU_BIN_DIR"
        if gpu
        else "LLAMA_SHARD_STOCK_BIN_DIR"
    )
    if env:  # a directory named explicitly is the only place looked at
        found = {t: Path(env) / t for t in tools}
        return found if all(p.is_file() for p in found.values()) else None
    found = {t: REPO / "build" / name / "bin" / t for t in tools}
    if all(p.is_file() for p in found.values()):
        return found
    if not build:
        return None
    build_dir = REPO / "build" / name
    log(f"building stock {', '.join(tools)} from the pinned llama.cpp in {build_dir} (a few minutes)")
    cmake = shutil.which("cmake") or "cmake"
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    subprocess.run(
        [
            cmake,
            "-S",
            str(REPO),
            "-B",
            str(build_dir),
            *gen,
            "-DCMAKE_BUILD_TYPE=Release",
            "-DLLAMA_SHARD_BUILD_STOCK_BENCH=ON",
            "-DLLAMA_SHARD_BUILD_PYTHON=OFF",
            "-DLLAMA_SHARD_BUILD_TESTS=OFF",
            f"-DGGML_RPC={'ON' if rpc else 'OFF'}",
            "-DLLAMA_SHARD_OPENMP=ON",  # stock as upstream builds it (the engine uses ggml's own pool)
            *([f"-DGGML_{gpu.upper()}=ON"] if gpu else []),
            *(["-DCMAKE_CUDA_ARCHITECTURES=native"] if gpu == "cuda" else []),
            *([f"-DCMAKE_C_FLAGS={NO_AMX_FLAGS}", f"-DCMAKE_CXX_FLAGS={NO_AMX_FLAGS}"] if no_amx else []),
            f"-DPython_EXECUTABLE={sys.executable}",
        ],
        check=True,
        stdout=sys.stderr,
    )
    subprocess.run(
        [cmake, "--build", str(build_dir), "--target", *tools, "-j", str(os.cpu_count() or 2)],
        check=True,
        stdout=sys.stderr,
    )
    found = {t: build_dir / "bin" / t for t in tools}
    return found if all(p.is_file() for p in found.values()) else None


def stock_llama_bench(tool: Path, model: Path, threads: int, n_prompt: int, n_gen: int, reps: int) -> dict:
    out = subprocess.run(
        [
            str(tool),
            "-m",
            str(model),
            "-t",
            str(threads),
            "-p",
            str(n_prompt),
            "-n",
            str(n_gen),
            "-r",
            str(reps),
            "-o",
            "json",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return {"pp" if e["n_prompt"] > 0 else "tg": float(e["avg_ts"]) for e in json.loads(out)}


def stock_batched_bench(
    tool: Path, model: Path, threads: int, npp: int, ntg: int, npl: list[int], extra: tuple = ()
) -> dict[int, dict]:
    out = subprocess.run(
        [
            str(tool),
            "-m",
            str(model),
            "-t",
            str(threads),
            "-c",
            "4096",
            "-b",
            "512",
            "-ub",
            "512",
            "-npp",
            str(npp),
            "-ntg",
            str(ntg),
            "-npl",
            ",".join(map(str, npl)),
            "--output-format",
            "jsonl",
            *extra,
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    res = {}
    for line in (out.stdout + "\n" + out.stderr).splitlines():
        line = line.strip()
        if line.startswith("{") and "speed_tg" in line:
            d = json.loads(line)
            res[int(d["pl"])] = {"pp": float(d["speed_pp"]), "tg": float(d["speed_tg"])}
    return res


def stock_server_streams(
    tool: Path, model: Path, threads: int, npp: int, ntg: int, n_clients: int, vocab: int
) -> float:
    """Stock llama-server (-np n_clients -t threads) with n_clients HTTP clients at once, each
    streaming ntg tokens (greedy, ignore_eos) after its own random npp-token prompt: aggregate
    decode tokens/s, timed as ours_generate_streams times Generate streams (from the moment every
    client has its first token to the last token, counting the tokens that arrived in between)."""
    import http.client
    import threading

    import numpy as np

    from llama_shard.local_workers import free_port

    port = free_port()
    context = npp + ntg + 8
    server = subprocess.Popen(
        [
            str(tool),
            "-m",
            str(model),
            "-t",
            str(threads),
            "-np",
            str(n_clients),
            "-c",
            str(n_clients * context),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"llama-server did not start (exit {server.poll()})")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                pass
            time.sleep(0.2)
        rng = np.random.default_rng(11)
        prompts = [rng.integers(0, vocab, npp).tolist() for _ in range(n_clients)]
        arrivals: list[list[tuple[float, int]]] = [[] for _ in range(n_clients)]
        failures: list[str] = []
        ready = threading.Barrier(n_clients)

        def client(i: int) -> None:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
            body = json.dumps(
                {
                    "prompt": prompts[i],
                    "n_predict": ntg,
                    "stream": True,
                    "ignore_eos": True,
                    "temperature": 0.0,
                    "cache_prompt": False,
                }
            )
            ready.wait()
            conn.request("POST", "/completion", body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                failures.append(f"HTTP {resp.status}: {resp.read()[:200]!r}")
                return
            for line in resp:  # server-sent events: one `data: {json}` line per token, then the last
                if line.startswith(b"data: "):
                    chunk = json.loads(line[6:])
                    arrivals[i].append((time.perf_counter(), int(chunk.get("tokens_predicted", 0))))
                    if chunk.get("stop"):
                        break

        threads_ = [threading.Thread(target=client, args=(i,)) for i in range(n_clients)]
        for t in threads_:
            t.start()
        for t in threads_:
            t.join()
        if failures or not all(arrivals):
            raise RuntimeError(f"llama-server streams failed: {failures[:3]}")
        start = max(a[0][0] for a in arrivals)
        end = max(a[-1][0] for a in arrivals)
        tokens = sum(a[-1][1] - max((n for t, n in a if t <= start), default=0) for a in arrivals)
        return tokens / (end - start)
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


def stock_rpc_split(tools: dict, model: Path, n_layer: int, npp: int, ntg: int, npl: list[int]) -> dict[int, dict]:
    """llama.cpp's RPC backend: ggml-rpc-server (1 thread) holds the second half of the layers,
    llama-batched-bench (1 thread) the rest; the halves run one after the other."""
    import socket

    from llama_shard.local_workers import free_port

    port = free_port()
    server = subprocess.Popen(
        [str(tools["ggml-rpc-server"]), "-H", "127.0.0.1", "-p", str(port), "-t", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with socket.socket() as sk:
                if sk.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        return stock_batched_bench(
            tools["llama-batched-bench"],
            model,
            1,
            npp,
            ntg,
            npl,
            ("--rpc", f"127.0.0.1:{port}", "-ngl", str(n_layer - n_layer // 2)),
        )
    finally:
        server.terminate()
        server.wait(10)


# ---------------------------------------------------------------------------------------------
# llama-shard's side
# ---------------------------------------------------------------------------------------------


def bench_manager(
    model: ShardModel, sessions: int, context: int, threads: int, n_batch: int = 512
) -> HotKvStateManager:
    """A manager sized for a measurement: no TTL, a budget that fits every session."""
    cfg = HotKvStateConfig(
        max_sessions=sessions, context_tokens=context, budget_tokens=sessions * context, ttl_seconds=0
    )
    return HotKvStateManager(model, cfg, ManualClock(), n_batch=n_batch, n_threads=threads)


def user_manager(model: ShardModel, sessions: int, context: int) -> HotKvStateManager:
    """A manager as the README builds one: a config and the model, nothing else."""
    return HotKvStateManager(
        model, HotKvStateConfig(max_sessions=sessions, context_tokens=context, budget_tokens=sessions * context)
    )


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of a process (this one when pid is None), from /proc."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def model_and_vocab(path: Path) -> tuple[int, int]:
    """(layers, vocabulary size) of a GGUF, loading one layer only."""
    info = ShardModel(str(path), (0, 0), 1).info
    return info.n_layer, info.n_vocab
