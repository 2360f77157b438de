"""What the disk tier's signed files cost, measured through the public API.

    python benchmarks/warm_files.py [--tokens 512] [--threads 2] [--rounds 3] [--model PATH ...]

For each SHA-256 the build can use (OpenSSL's libcrypto when it was found, and the vendored one,
forced with LLAMA_SHARD_SHA256=vendored), in a process of its own: a session of --tokens tokens
(whole model) is prefilled, pushed to disk by a second session (one hot slot, no host tier: the
step that writes the file), and decoded again (the step that restores it; `restore_seconds` is
the engine's own timer: read, MAC and digest checked, positions checked, handed to llama.cpp).
The page cache is warm. Then the model digest (XXH3-128 of every byte) of each --model file.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ONE_PROCESS = r"""
import json, os, shutil, sys, tempfile, time
import llama_shard as ls
from llama_shard._native import warm_sha256
path, n_tokens, threads, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
model = ls.ShardModel(path, None, threads)
rows = []
for r in range(rounds):
    d = tempfile.mkdtemp(prefix="warm-files-")
    config = ls.HotKvStateConfig(max_sessions=1, context_tokens=n_tokens + 8, warm_dir=d + "/w", warm_disk_bytes=1 << 34)
    m = ls.HotKvStateManager(model, config, n_batch=min(512, n_tokens))
    ad = ls.KvBoundaryAdapter(model, m)
    tokens = [(i * 7) % 1000 + 10 for i in range(n_tokens)]
    t = time.perf_counter(); ad.prefill("a", 0, token_ids=tokens); prefill = time.perf_counter() - t
    t = time.perf_counter(); ad.prefill("b", 0, token_ids=[5]); write = time.perf_counter() - t
    t = time.perf_counter(); out = ad.decode("a", 0, token_ids=[6]); restore_step = time.perf_counter() - t
    st = m.stats()
    assert st["disk_restores"] == 1 and isinstance(out, ls.TailOutput), st
    rows.append({"prefill_ms": prefill * 1e3, "write_step_ms": write * 1e3, "restore_step_ms": restore_step * 1e3,
                 "restore_ms": st["restore_seconds"] * 1e3})
    m.close()
    shutil.rmtree(d, ignore_errors=True)
print(json.dumps({"sha256": warm_sha256(), "rows": rows}))
"""


def one_implementation(model: str, tokens: int, threads: int, rounds: int, vendored: bool) -> dict:
    env = dict(os.environ)
    env.pop("LLAMA_SHARD_SHA256", None)
    if vendored:
        env["LLAMA_SHARD_SHA256"] = "vendored"
    res = subprocess.run(
        [sys.executable, "-c", ONE_PROCESS, model, str(tokens), str(threads), str(rounds)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    from llama_shard import embedded_model_path
    from llama_shard._native import model_digest

    ap = argparse.ArgumentParser(prog="python benchmarks/warm_files.py", description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", help="GGUF file(s) (default: the embedded SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    models = args.model or [str(embedded_model_path())]
    seen = set()
    print(
        f"{args.tokens}-token session, whole model ({os.path.basename(models[0])}), {args.threads} threads, "
        f"median of {args.rounds} rounds:"
    )
    print(f"{'sha256':>9} {'prefill ms':>11} {'write step ms':>14} {'restore ms':>11} {'restore step ms':>16}")
    for vendored in (False, True):
        got = one_implementation(models[0], args.tokens, args.threads, args.rounds, vendored)
        if got["sha256"] in seen:
            continue  # a build without OpenSSL: the default is the vendored one
        seen.add(got["sha256"])
        med = {k: statistics.median(r[k] for r in got["rows"]) for k in got["rows"][0]}
        print(
            f"{got['sha256']:>9} {med['prefill_ms']:11.1f} {med['write_step_ms']:14.1f} {med['restore_ms']:11.1f} "
            f"{med['restore_step_ms']:16.1f}"
        )
    print("model digest (XXH3-128 of the whole file, page cache warm after a first read):")
    for path in models:
        model_digest(path)
        times = []
        for _ in range(args.rounds):
            t = time.perf_counter()
            model_digest(path)
            times.append(time.perf_counter() - t)
        size = os.path.getsize(path)
        best = min(times)
        print(f"  {os.path.basename(path)}: {size / 1e6:.0f} MB in {best * 1e3:.0f} ms ({size / 1e9 / best:.2f} GB/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
