"""Seeded sampling on a route against stock llama.cpp's own sampler on the whole model.

    python benchmarks/stock_sampling.py [--tokens 16]

Stock: `llama-shard-stock-sample` (benchmarks/stock/stock_sample.cpp: common_sampler, the sampler
llama-server and llama-completion use, from the pinned source; built in build/stock-bench on first
use). Ours: a `Generate` stream on live workers over loopback, 1 thread each as stock. Layouts:
SmolLM2 whole, in 2 and in 3 shards, Gemma 3 270M in 2 shards (when installed); 3 seeds x 3 prompts
x 2 parameter sets (one with penalties), plus greedy. Prints one row per layout and exits 1 on any
difference."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
from common import REPO, log

from llama_shard._native import SamplingParams, ShardModel
from llama_shard.engine.models import gemma3_model_path, require_embedded_model
from llama_shard.local_workers import start_worker, stop_worker, wait_serving
from llama_shard.proto import shard_pb2 as pb
from llama_shard.proto import shard_pb2_grpc as pb_grpc
from llama_shard.proto.requests import sampling_to_wire as params_to_wire

PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):"]
PARAMS = {
    "top-k/top-p/min-p": dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
    "penalties": dict(
        temperature=1.0,
        top_k=0,
        top_p=0.9,
        penalty_last_n=32,
        penalty_repeat=1.3,
        penalty_freq=0.2,
        penalty_present=0.3,
    ),
}
SEEDS = [1, 42, 1234]
TOOL = "llama-shard-stock-sample"


def stock_tool() -> Path:
    build_dir = REPO / "build" / "stock-bench"
    tool = build_dir / "bin" / TOOL
    if tool.is_file():
        return tool
    log(f"building {TOOL} from the pinned llama.cpp in {build_dir} (a few minutes)")
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
            "-DLLAMA_SHARD_OPENMP=ON",
            f"-DPython_EXECUTABLE={sys.executable}",
        ],
        check=True,
        stdout=sys.stderr,
    )
    subprocess.run(
        [cmake, "--build", str(build_dir), "--target", TOOL, "-j", str(os.cpu_count() or 2)],
        check=True,
        stdout=sys.stderr,
    )
    return tool


def stock_tokens(tool: Path, model: Path, prompt: list[int], params: SamplingParams | None, n: int) -> list[int]:
    p = params or SamplingParams()
    temp = -1.0 if params is None else p.temperature  # negative: greedy (the argmax, no sampler)
    args = [
        n,
        p.seed,
        temp,
        p.top_k,
        p.top_p,
        p.min_p,
        p.penalty_last_n,
        p.penalty_repeat,
        p.penalty_freq,
        p.penalty_present,
        *prompt,
    ]
    out = subprocess.run([str(tool), str(model), *map(str, args)], capture_output=True, text=True, check=True)
    return [int(t) for t in out.stdout.split()]


def route_tokens(addresses: list[str], sid: str, prompt: list[int], params: SamplingParams | None, n: int) -> list[int]:
    req = pb.GenerateRequest(
        session_id=sid, prompt=prompt, max_tokens=n, forward=[pb.Hop(address=a) for a in addresses[1:]]
    )
    if params is not None:
        req.sampling.CopyFrom(params_to_wire(params))
    with grpc.insecure_channel(addresses[0]) as ch:
        events = list(pb_grpc.ShardServiceStub(ch).Generate(req, timeout=120))
    final = events[-1].final
    if final.finish_reason != "length":
        raise RuntimeError(f"{sid}: {final}")
    return [e.token.token_id for e in events[:-1]]


def compare(tool: Path, model: Path, ranges: list[tuple[int, int]], n: int) -> tuple[int, int]:
    procs = []
    try:
        for first, last in reversed(ranges):
            peer = ("--peer", procs[-1][1]) if procs else ()
            procs.append(start_worker(model, first, last, threads=1, extra=peer))
        procs.reverse()
        for proc, addr in procs:
            wait_serving(proc, addr)
        addresses = [addr for _, addr in procs]
        vocab = ShardModel(str(model), (0, 0), 1)
        same = total = 0
        cases = [(None, None)] + [(name, seed) for name in PARAMS for seed in SEEDS]
        for i, text in enumerate(PROMPTS):
            prompt = vocab.tokenize(text)
            for name, seed in cases:
                params = None if name is None else SamplingParams(seed=seed, **PARAMS[name])
                ours = route_tokens(addresses, f"stock-{name}-{seed}-{i}", prompt, params, n)
                theirs = stock_tokens(tool, model, prompt, params, n)
                total += 1
                same += ours == theirs
                if ours != theirs:
                    log(f"differs: {name} seed {seed} prompt {i}: ours {ours} stock {theirs}")
        return same, total
    finally:
        for proc, _ in procs:
            stop_worker(proc)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16)
    args = ap.parse_args(argv)
    tool = stock_tool()
    smol = require_embedded_model()
    layouts = [
        ("SmolLM2-135M whole", smol, [(0, 29)]),
        ("SmolLM2-135M 2 shards", smol, [(0, 14), (15, 29)]),
        ("SmolLM2-135M 3 shards", smol, [(0, 9), (10, 19), (20, 29)]),
    ]
    gemma = gemma3_model_path()
    if gemma is not None:
        n_layer = ShardModel(str(gemma), (0, 0), 1).info.n_layer
        layouts.append(("Gemma 3 270M 2 shards", gemma, [(0, n_layer // 2 - 1), (n_layer // 2, n_layer - 1)]))
    print(
        f"seeded Generate on a route against stock common_sampler on the whole model, {args.tokens} tokens each "
        f"(3 prompts x (greedy + 2 parameter sets x 3 seeds))"
    )
    print("| layout | sequences identical |")
    print("| --- | ---: |")
    ok = True
    for name, model, ranges in layouts:
        same, total = compare(tool, model, ranges, args.tokens)
        ok &= same == total
        print(f"| {name} | {same}/{total} |", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
