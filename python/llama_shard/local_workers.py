"""Start and stop `llama-shard serve` workers on loopback: for the demo, the tests and the benchmarks.

    proc, address = start_worker(model_path, 0, 14, threads=1)
    wait_serving(proc, address)      # the gRPC health check says SERVING
    ...
    code, stderr = stop_worker(proc) # SIGTERM (the worker persists its warm tier), its exit and stderr

A worker is a child process of this one, running `python -m llama_shard.cli serve` with the same
interpreter; its stdout is discarded and its stderr kept (a pipe) for the error a failed start
reports.
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

from ._native import CPU_DEVICE

#: what start_worker passes unless told otherwise: 8 hot slots of 512 tokens, 2,048 tokens budgeted,
#: on the CPU (serve's default is auto: a GPU where there is one; `extra` may name a device)
WORKER_DEFAULTS = ("--max-sessions", "8", "--context-tokens", "512", "--budget-tokens", "2048", "--device", CPU_DEVICE)


#: the ports free_port handed out (the kernel may hand the same free port out twice in a row, and
#: the worker given it binds only seconds later: a second one would then fail to bind)
_handed_out: set[int] = set()
_handed_out_lock = threading.Lock()


def free_port() -> int:
    """A loopback port that is free now (for a worker started next), never one this process was
    handed before."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with _handed_out_lock:
            if port not in _handed_out:
                _handed_out.add(port)
                return port


def start_worker(
    model: str | Path,
    first: int,
    last: int,
    threads: int = 1,
    extra: tuple[str, ...] = (),
    port: int | None = None,
    defaults: tuple[str, ...] = WORKER_DEFAULTS,
    env: dict[str, str] | None = None,
) -> tuple[subprocess.Popen, str]:
    """Starts a worker for layers first..last; returns the process and its address. `extra` serve
    flags come after `defaults`, so they win (argparse keeps the last); `env`: variables added to
    this process's environment (LLAMA_SHARD_CPU_VARIANT, say)."""
    port = port or free_port()
    cmd = [
        sys.executable,
        "-m",
        "llama_shard.cli",
        "serve",
        "--model",
        str(model),
        "--layers",
        f"{first}-{last}",
        "--port",
        str(port),
        "--threads",
        str(threads),
        *defaults,
        *extra,
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})}
    )
    return proc, f"127.0.0.1:{port}"


def wait_for_port(proc: subprocess.Popen, port: int, timeout_s: float = 120.0) -> None:
    """Returns when the worker's HTTP port accepts connections (a TLS worker's health check needs
    credentials; its HTTP port binds before gRPC serves); raises if it exits or times out."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"worker exited with {proc.returncode} before its HTTP port {port} opened") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"the HTTP port {port} did not open within {timeout_s:g} s") from None
            time.sleep(0.2)


def wait_serving(proc: subprocess.Popen, address: str, timeout_s: float = 120.0, route_up: bool = True) -> None:
    """Returns when the worker's health check says SERVING (`route_up` False: once it answers at all;
    a head says NOT_SERVING while a later stage has no healthy replica); raises if it exits or times
    out."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                stderr = proc.stderr.read() if proc.stderr else ""
                raise RuntimeError(f"worker {address} exited with {proc.returncode}: {stderr[-2000:]}")
            try:
                r = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                if r.status == health_pb2.HealthCheckResponse.SERVING or not route_up:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    raise TimeoutError(f"worker {address} did not become ready in {timeout_s}s")


def stop_worker(proc: subprocess.Popen, timeout_s: float = 30.0, send_sigterm: bool = True) -> tuple[int, str]:
    """SIGTERM (unless the caller sent it already: a second one could land while the worker exits),
    wait (SIGKILL after timeout_s); returns the exit code and what the worker wrote to stderr (its
    pipe is closed)."""
    if send_sigterm and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        _, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, stderr = proc.communicate()
    return proc.returncode, stderr or ""
