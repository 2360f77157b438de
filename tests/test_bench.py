"""The benchmark command's code path, fast, on the synthetic model, so it cannot rot. The stock
tools are stood in for by scripts that print what llama-bench / llama-batched-bench print (their
real output is parsed the same way when `python benchmarks/bench.py` runs for real). The benchmarks
run as scripts from the checkout, against the installed package."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO

BENCHMARKS = REPO / "benchmarks"

FAKE_LLAMA_BENCH = """#!{python}
import json
print(json.dumps([{{"n_prompt": 16, "n_gen": 0, "avg_ts": 1000.0}}, {{"n_prompt": 0, "n_gen": 8, "avg_ts": 100.0}}]))
"""

FAKE_RPC_SERVER = """#!{python}
import socket, sys, time
args = sys.argv
s = socket.socket(); s.bind(("127.0.0.1", int(args[args.index("-p") + 1]))); s.listen()
time.sleep(60)
"""

FAKE_BATCHED_BENCH = """#!{python}
import sys
args = sys.argv
npl = [int(x) for x in args[args.index("-npl") + 1].split(",")]
for pl in npl:
    print('{{"n_kv_max": 4096, "pp": 16, "tg": 8, "pl": %d, "speed_pp": 500.0, "speed_tg": %f}}' % (pl, 50.0 * pl), file=sys.stderr)
"""

FAKE_LLAMA_SERVER = """#!{python}
import json, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
args = sys.argv
class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200); self.send_header("Content-Type", "text/event-stream"); self.end_headers()
        for i in range(1, req["n_predict"] + 1):
            time.sleep(0.002)
            self.wfile.write(b"data: " + json.dumps({{"content": "x", "stop": False, "tokens_predicted": i}}).encode() + b"\\n\\n")
        self.wfile.write(b"data: " + json.dumps({{"content": "", "stop": True, "tokens_predicted": req["n_predict"]}}).encode() + b"\\n\\n")
ThreadingHTTPServer(("127.0.0.1", int(args[args.index("--port") + 1])), Handler).serve_forever()
"""


@pytest.fixture
def fake_stock_env(tmp_path) -> dict:
    """An environment whose stock llama.cpp tools are the fakes above."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in [
        ("llama-bench", FAKE_LLAMA_BENCH),
        ("llama-batched-bench", FAKE_BATCHED_BENCH),
        ("ggml-rpc-server", FAKE_RPC_SERVER),
        ("llama-server", FAKE_LLAMA_SERVER),
    ]:
        p = bin_dir / name
        p.write_text(textwrap.dedent(body.format(python=sys.executable)))
        p.chmod(p.stat().st_mode | stat.S_IEXEC)
    return dict(
        os.environ,
        LLAMA_SHARD_STOCK_BIN_DIR=str(bin_dir),
        LLAMA_SHARD_STOCK_RPC_BIN_DIR=str(bin_dir),
        LLAMA_SHARD_STOCK_NOAMX_BIN_DIR=str(bin_dir),
    )


@pytest.mark.slow
def test_bench_quick_prints_a_table_with_ratios(synthetic_model, tmp_path, fake_stock_env):
    out_json = tmp_path / "rows.json"
    env = fake_stock_env
    res = subprocess.run(
        [
            sys.executable,
            BENCHMARKS / "bench.py",
            "--model",
            str(synthetic_model),
            "--quick",
            "--repeat",
            "1",  # (the table's shape is what is tested: each pair measured once)
            "--no-build",
            "--json",
            str(out_json),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "| metric | llama-shard | peer | ratio | target |" in res.stdout
    rows = {r["metric"]: r for r in json.loads(out_json.read_text())}
    assert rows["prefill pp16 (llama-bench)"]["peer"] == 1000.0
    assert rows["aggregate decode, 4 sessions (batched-bench)"]["peer"] == 200.0
    pipe = [r for m, r in rows.items() if m.startswith("2 workers x 1 thread on loopback")]
    assert len(pipe) == 3 and all(p["peer"] > 0 for p in pipe)  # chained at 1 and 2 sessions, relayed at 2
    tls = [r for m, r in rows.items() if "token over TLS (vs plaintext)" in m]
    assert len(tls) == 2 and all(r["ratio"] > 0 for r in tls)  # the chain over TLS at 1 and 2 sessions
    for r in rows.values():
        assert r["ours"] and r["ours"] > 0, r
        assert r["ratio"] is not None, r
    kv = [r for m, r in rows.items() if m.startswith("KV bytes/token")]
    assert kv and all(abs(r["ratio"] - 0.5) < 1e-9 for r in kv)
    from llama_shard import cpu_backend

    amx_rows = [m for m in rows if "AMX" in m or "fallback" in m]
    assert len(amx_rows) == (7 if cpu_backend()["amx"] else 0), amx_rows  # AMX vs fallback vs stock without AMX


def test_bench_says_why_the_stock_columns_are_missing_and_can_require_them(synthetic_model, tmp_path):
    empty = tmp_path / "no-tools"
    empty.mkdir()
    env = dict(os.environ, LLAMA_SHARD_STOCK_BIN_DIR=str(empty), LLAMA_SHARD_STOCK_RPC_BIN_DIR=str(empty))
    res = subprocess.run(
        [
            sys.executable,
            BENCHMARKS / "bench.py",
            "--model",
            str(synthetic_model),
            "--quick",
            "--no-build",
            "--require-stock",
            "--stock-bin-dir",
            str(empty),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp_path,
    )
    assert res.returncode == 2 and "| metric |" not in res.stdout
    assert "not found (--stock-bin-dir) and not built" in res.stderr


@pytest.mark.slow
def test_pipeline_study_prints_rounds_the_spread_and_both_bounds(synthetic_model, fake_stock_env):
    res = subprocess.run(
        [
            sys.executable,
            BENCHMARKS / "pipeline_study.py",
            "2",
            "--model",
            str(synthetic_model),
            "--quick",
            "--no-build",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=fake_stock_env,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    assert "4-session step, alone: layers 0-" in out and "4-session step, together: layers 0-" in out
    assert "compute bound with free transport" in out
    assert "round 1: chained" in out and "round 2: chained" in out and ", two workers " in out
    assert ", local head " in out and ", in process " in out
    # the fake batched-bench reports 50 tok/s per session: the RPC split 400 at 8 sessions, the
    # whole model 200 at 4 (400 at 8), so the ceiling is 2 x 200 / 400
    assert "RPC split 400.0, stock whole model at 4 sessions 200.0 (8: 400.0) tok/s" in out
    for name in ("chained", "two workers", "local head", "in process"):
        assert f"{name} / RPC split: min" in out
        assert f"{name} / ceiling (same round): min" in out
    assert "ceiling (2 x stock whole model at 4 sessions) / RPC split: min 1.000, median 1.000, max 1.000" in out
    assert "compute bound / best RPC split:" in out


def test_hot_path_study_compares_spin_counts_and_prints_the_overhead(synthetic_model):
    res = subprocess.run(
        [sys.executable, BENCHMARKS / "hot_path_study.py", "1", "--model", str(synthetic_model), "--quick"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "GOMP_SPINCOUNT=300000 (libgomp's default): " in res.stdout
    assert "GOMP_SPINCOUNT=30000: " in res.stdout
    assert "us for the adapter, the step loop and the thread hand-offs" in res.stdout


def test_warm_study_prints_every_figure(synthetic_model):
    res = subprocess.run(
        [sys.executable, BENCHMARKS / "warm_study.py", "--model", str(synthetic_model), "--quick"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    assert "restore from host memory" in out and "from disk, cold page cache" in out
    assert "decode, 8 sessions, nothing spilling: tier off" in out
    assert "warm tier 256 MiB:" in out and "0 tokens re-prefilled (0 re-prefills)" in out
    assert "churn: 500 sessions" in out and out.rstrip().count(": True") >= 1
    assert "f16  :" in out


def test_compare_builds_prints_both_installs_and_their_cpu_kernels(synthetic_model):
    res = subprocess.run(
        [
            sys.executable,
            BENCHMARKS / "compare_builds.py",
            "--other",
            sys.executable,
            "--model",
            str(synthetic_model),
            "--quick",
            "--rounds",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "| decode, 1 session |" in res.stdout and "| aggregate decode, 8 sessions |" in res.stdout
    assert "this: " in res.stdout and "other: " in res.stdout
