"""`llama-shard demo`: the whole thing working, end to end, on the embedded model.

Starts two workers on loopback that split the model in half (each a `llama-shard serve` process),
runs four concurrent chat sessions through them (two micro-batches, pipelined), streams their text, shows each worker's sessions
and budget, releases the sessions and shows the budget returned, then shuts the workers down with
SIGTERM and reports their exit.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ._native import ShardModel
from .models import gguf_layer_count
from .route import RemoteStage, RouteClient

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is 12 times 12?",
]


def _say(msg: str) -> None:
    print(msg, flush=True)


def free_port() -> int:
    """A loopback port that is free now (for a worker started next)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_worker(model: Path, first: int, last: int, threads: int, extra: tuple = (),
                 port: int | None = None) -> tuple[subprocess.Popen, str]:
    port = port or free_port()
    cmd = [sys.executable, "-m", "llama_shard.cli", "serve", "--model", str(model), "--layers", f"{first}-{last}",
           "--port", str(port), "--threads", str(threads), "--max-sessions", "8", "--context-tokens", "512",
           "--budget-tokens", "2048", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return proc, f"127.0.0.1:{port}"


def wait_serving(proc: subprocess.Popen, address: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"worker {address} exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
            try:
                r = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    raise TimeoutError(f"worker {address} did not become ready in {timeout_s}s")


def _show_workers(stages) -> None:
    for st in stages:
        info = st.stats()
        sessions = ", ".join(f"{s.session_id}({s.seq_len})" for s in info.sessions) or "none"
        sessions = ", ".join(f"{s.session_id}({s.seq_len}, {s.tier})" for s in info.sessions) or "none"
        _say(f"  worker {info.first:>2}-{info.last:<2} @ {st.address}: {info.live_sessions} live session(s) "
             f"[{sessions}]; {info.reserved_tokens} of {info.budget_tokens} budget tokens reserved "
             f"({info.reserved_tokens * info.kv_bytes_per_token / 2**20:.2f} MiB KV); warm tier: "
             f"{info.warm_sessions} session(s), {info.warm_bytes / 2**20:.2f} MiB, {info.spills} spills, "
             f"{info.restores} restores")


def run_demo(model: Path, threads: int = 1, max_tokens: int = 48) -> int:
    n_layer = gguf_layer_count(model)
    half = n_layer // 2
    ranges = [(0, half - 1), (half, n_layer - 1)]
    _say(f"llama-shard demo: {model.name}, {n_layer} layers split {ranges[0][0]}-{ranges[0][1]} | {ranges[1][0]}-{ranges[1][1]}")
    procs = []
    try:
        t0 = time.perf_counter()
        # a chained route: the head worker may forward each step to the tail itself (serve --peer),
        # so a token costs the client one round trip instead of one per worker
        tail_port = free_port()
        # two hot slots per worker for four sessions: the others wait in the warm tier (host memory)
        # and come back without a re-prefill
        tiers = ("--max-sessions", "2", "--warm-memory", "64MiB")
        for (first, last), port, extra in [(ranges[0], None, ("--peer", f"127.0.0.1:{tail_port}")),
                                           (ranges[1], tail_port, ())]:
            proc, addr = start_worker(model, first, last, threads, extra=extra + tiers, port=port)
            procs.append((proc, addr))
            _say(f"  starting worker {first}-{last} on {addr} (2 hot slots, 64 MiB warm tier)"
                 + (f", forwards to {extra[1]}" if extra else "") + " ...")
        for (proc, addr), (first, last) in zip(procs, ranges):
            wait_serving(proc, addr)
            _say(f"  worker {first}-{last} is serving ({time.perf_counter() - t0:.1f}s)")

        stages = [RemoteStage(addr) for _, addr in procs]
        client = RouteClient(stages)  # chained: every worker forwards to the next
        vocab = ShardModel(str(model), (0, 0), 1)  # tokenizer and chat template on the head side
        eos = vocab.token_eos

        _say(f"\nfour concurrent chat sessions through both workers, {'chained' if client.chained else 'client-relayed'} "
             f"(greedy, up to {max_tokens} tokens):")
        sessions = [client.session(f"chat-{i + 1}") for i in range(len(QUESTIONS))]
        texts = {i: [] for i in range(len(QUESTIONS))}
        lock = threading.Lock()
        lines_done = {i: 0 for i in range(len(QUESTIONS))}

        generated: dict[int, list[int]] = {i: [] for i in range(len(QUESTIONS))}

        def on_token(i: int, token: int) -> None:
            with lock:  # stream each session's text line by line as it is produced
                generated[i].append(token)
                text = vocab.detokenize([t for t in generated[i] if t != eos])
                lines = text.split("\n")
                for line in lines[lines_done[i]:-1]:
                    _say(f"  [chat-{i + 1}] {line}")
                lines_done[i] = len(lines) - 1
                texts[i] = text

        for i, q in enumerate(QUESTIONS):
            _say(f"  [chat-{i + 1}] user: {q}")
        prompts = [vocab.tokenize(vocab.apply_chat_template([("user", q)], True)) for q in QUESTIONS]
        t1 = time.perf_counter()
        # two micro-batches of two sessions: while the tail computes one, the head computes the other
        client.generate_many(sessions, prompts, max_tokens, stop=(eos,), micro_batches=2, on_token=on_token)
        dt = time.perf_counter() - t1
        for i in range(len(QUESTIONS)):  # the last (unterminated) line of each answer
            last = texts[i].split("\n")[-1]
            if last.strip():
                _say(f"  [chat-{i + 1}] {last}")
        n_tokens = sum(len(s.history) for s in sessions)
        _say(f"\n{len(QUESTIONS)} sessions done in {dt:.1f}s; {n_tokens} tokens held per worker; "
             f"{sum(s.reprefills for s in sessions)} re-prefill(s)")
        _show_workers(stages)

        for s in sessions:
            s.release()
        _say("\nafter releasing the sessions:")
        _show_workers(stages)
        client.close()
    finally:
        _say("\nshutting the workers down (SIGTERM):")
        for proc, addr in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc, addr in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            report = [ln for ln in (proc.stderr.read() or "").splitlines() if "shut down" in ln]
            _say(f"  worker {addr}: exit {proc.returncode}" + (f" - {report[-1].split(': ', 1)[-1]}" if report else ""))
    return 0 if all(p.returncode == 0 for p, _ in procs) else 1


if __name__ == "__main__":
    from .models import require_embedded_model

    raise SystemExit(run_demo(Path(os.environ.get("LLAMA_SHARD_MODEL", "")) if os.environ.get("LLAMA_SHARD_MODEL")
                              else require_embedded_model()))
