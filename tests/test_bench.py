"""The benchmark command's code path, fast, on the synthetic model, so it cannot rot. The stock
tools are stood in for by scripts that print what llama-bench / llama-batched-bench print (their
real output is parsed the same way when `python -m llama_shard.bench` runs for real)."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap

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


def test_bench_quick_prints_a_table_with_ratios(synthetic_model, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in [("llama-bench", FAKE_LLAMA_BENCH), ("llama-batched-bench", FAKE_BATCHED_BENCH),
                       ("ggml-rpc-server", FAKE_RPC_SERVER)]:
        p = bin_dir / name
        p.write_text(textwrap.dedent(body.format(python=sys.executable)))
        p.chmod(p.stat().st_mode | stat.S_IEXEC)
    out_json = tmp_path / "rows.json"
    env = dict(os.environ, LLAMA_SHARD_STOCK_BIN_DIR=str(bin_dir), LLAMA_SHARD_STOCK_RPC_BIN_DIR=str(bin_dir))
    res = subprocess.run([sys.executable, "-m", "llama_shard.bench", "--model", str(synthetic_model), "--quick",
                          "--no-build", "--json", str(out_json)], capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "| metric | llama-shard | peer | ratio | target |" in res.stdout
    rows = {r["metric"]: r for r in json.loads(out_json.read_text())}
    assert rows["prefill pp16 (llama-bench)"]["peer"] == 1000.0
    assert rows["aggregate decode, 4 sessions (batched-bench)"]["peer"] == 200.0
    pipe = [r for m, r in rows.items() if m.startswith("2 workers x 1 thread on loopback")]
    assert len(pipe) == 1 and pipe[0]["peer"] == 100.0
    for r in rows.values():
        assert r["ours"] and r["ours"] > 0, r
        assert r["ratio"] is not None, r
    kv = [r for m, r in rows.items() if m.startswith("KV bytes/token")]
    assert kv and all(abs(r["ratio"] - 0.5) < 1e-9 for r in kv)
