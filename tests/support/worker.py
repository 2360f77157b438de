"""One worker process on loopback with its metrics port, stopped by a signal: the helper the wire
tests share."""

from __future__ import annotations

import signal
import subprocess

from llama_shard.local_workers import free_port, start_worker, wait_serving


class Worker:
    """`serve` of `layers` ("first-last") of `model`, 256 context tokens a session, 1 thread."""

    def __init__(self, model, layers: str, port: int | None = None, extra: tuple = ()):
        self.port = port or free_port()
        self.metrics_port = free_port()
        first, last = (int(x) for x in layers.split("-"))
        self.proc, self.address = start_worker(
            model,
            first,
            last,
            1,
            port=self.port,
            extra=("--context-tokens", "256", "--metrics-port", str(self.metrics_port), *extra),
        )
        wait_serving(self.proc, self.address)

    def stop(self, sig=signal.SIGTERM, timeout=30) -> tuple[int, str]:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stderr.closed:
            return self.proc.returncode, ""
        with self.proc.stderr:
            return self.proc.returncode, self.proc.stderr.read()
