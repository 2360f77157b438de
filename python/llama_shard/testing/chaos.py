"""Workers that come and go, for the failover tests and the benchmark's failover section.

mesh = Mesh(model, [(0, 14), (15, 29), (15, 29)], [("--peer", "{1}", "--peer", "{2}"), (), ()])
mesh.start(1).start(2).start(0)     # "{k}" in a flag is worker k's address
monkey = ChaosMonkey(mesh, [[1, 2]]).start()   # kills and restarts replicas of each stage
...
monkey.stop(); mesh.stop()
"""

from __future__ import annotations

import random
import signal
import threading
import time

import grpc

from ..local_workers import free_port, start_worker, stop_worker, wait_serving
from ..proto import shard_pb2 as pb
from ..proto import shard_pb2_grpc as pb_grpc


class Mesh:
    """Workers of one model on loopback: `ranges[k]` served at `addresses[k]`, started with
    `flags[k]` ("{k}" in a flag: worker k's address); a worker killed or stopped can be started
    again at the same address."""

    def __init__(self, model, ranges, flags, threads: int = 1):
        self.model, self.ranges, self.flags, self.threads = model, ranges, flags, threads
        self.ports = [free_port() for _ in ranges]
        self.addresses = [f"127.0.0.1:{p}" for p in self.ports]
        self.procs: list = [None] * len(ranges)
        self.channels: dict = {}
        self.stderr: dict[int, list[str]] = {k: [] for k in range(len(ranges))}  # of stopped workers

    def start(self, k: int, wait: bool = True, route_up: bool = True) -> "Mesh":
        if self.procs[k] is not None:  # a killed or stopped one: reaped first
            self.reap(k)
        first, last = self.ranges[k]
        flags = tuple(f.format(*self.addresses) for f in self.flags[k])
        self.procs[k], _ = start_worker(self.model, first, last, self.threads, port=self.ports[k], extra=flags)
        if wait:
            wait_serving(self.procs[k], self.addresses[k], route_up=route_up)
        return self

    def reap(self, k: int) -> int:
        """Waits for worker k to exit (SIGTERM if it still runs); its exit code."""
        code, stderr = stop_worker(self.procs[k])
        self.stderr[k].append(stderr)
        self.procs[k] = None
        return code

    def alive(self, k: int) -> bool:
        return self.procs[k] is not None and self.procs[k].poll() is None

    def stub(self, k: int = 0) -> pb_grpc.ShardServiceStub:
        if k not in self.channels:
            self.channels[k] = grpc.insecure_channel(self.addresses[k])
        return pb_grpc.ShardServiceStub(self.channels[k])

    def info(self, k: int = 0) -> pb.InfoReply:
        return self.stub(k).Info(pb.InfoRequest(), timeout=10)

    def stop(self) -> None:
        for ch in self.channels.values():
            ch.close()
        for k, p in enumerate(self.procs):
            if p is not None:
                self.reap(k)


class ChaosMonkey:
    """Every `period` seconds (drawn uniformly), kills (SIGKILL, or SIGTERM `sigterm_share` of the
    time: a drain) one worker of a stage whose replicas are all up, and starts it again
    `down_s` seconds later; never two of one stage at once, so each stage keeps a replica."""

    def __init__(
        self,
        mesh: Mesh,
        stages: list[list[int]],
        period: tuple[float, float] = (2.0, 4.0),
        down_s: tuple[float, float] = (1.0, 3.0),
        sigterm_share: float = 0.3,
        seed: int = 0,
    ):
        self.mesh, self.stages = mesh, stages
        self.period, self.down_s, self.sigterm_share = period, down_s, sigterm_share
        self.random = random.Random(seed)
        self.events: list[tuple[float, str, str]] = []  # (seconds since start, address, "kill" / "term" / "back")
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos", daemon=True)
        self._t0 = 0.0

    def start(self) -> "ChaosMonkey":
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def kills(self) -> int:
        """Workers killed or stopped so far."""
        return sum(1 for e in list(self.events) if e[2] in ("kill", "term"))

    def run_for(self, seconds: float, kills: int, bound_s: float = 600.0) -> None:
        """Lets the monkey work for at least `seconds` and until it has killed or stopped `kills`
        workers (a loaded machine fits fewer restart cycles in a given time), at most `bound_s`."""
        t0 = time.monotonic()
        while (
            time.monotonic() - t0 < bound_s
            and not self.errors
            and (time.monotonic() - t0 < seconds or self.kills() < kills)
        ):
            time.sleep(0.2)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(120)

    def _note(self, k: int, what: str) -> None:
        self.events.append((time.monotonic() - self._t0, self.mesh.addresses[k], what))

    def _run(self) -> None:
        mesh = self.mesh
        while not self._stop.wait(self.random.uniform(*self.period)):
            stage = self.random.choice(self.stages)
            if not all(mesh.alive(k) for k in stage):
                continue
            victim = self.random.choice(stage)
            term = self.random.random() < self.sigterm_share
            mesh.procs[victim].send_signal(signal.SIGTERM if term else signal.SIGKILL)
            self._note(victim, "term" if term else "kill")
            self._stop.wait(self.random.uniform(*self.down_s))
            try:
                mesh.start(victim)
                self._note(victim, "back")
            except Exception as e:  # noqa: BLE001 - reported by the test, which fails on it
                self.errors.append(f"{mesh.addresses[victim]} did not come back: {e}")
                return
