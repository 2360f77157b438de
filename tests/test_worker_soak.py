"""A soak over gRPC: sessions through one worker (open by prefill, decode, release), with random
epoch changes and abandoned sessions left to a short TTL. RSS stays flat after a warm-up and the
worker ends with nothing live and nothing reserved (so every seq id is free again). CI runs 10,000
sessions; LLAMA_SHARD_SOAK_SESSIONS sets another count (100000 for a long run)."""

from __future__ import annotations

import os
import random
import time

import grpc
import pytest

from llama_shard.local_workers import start_worker, stop_worker, wait_serving
from llama_shard.proto import shard_pb2 as pb
from llama_shard.proto import shard_pb2_grpc as pb_grpc
from llama_shard.testing.process import resident_bytes

pytestmark = pytest.mark.grpc
SESSIONS = int(os.environ.get("LLAMA_SHARD_SOAK_SESSIONS", "10000"))
RSS_GROWTH_BOUND = 24 << 20  # after the warm-up: allocator pools and gRPC buffers settle below this


@pytest.mark.slow
def test_sessions_through_a_worker_leave_nothing_behind(synthetic_model):
    proc, addr = start_worker(
        synthetic_model,
        0,
        5,
        1,
        extra=("--ttl", "0.2", "--sweep-seconds", "0.1", "--context-tokens", "64", "--budget-tokens", "512"),
    )
    try:
        wait_serving(proc, addr)
        stub = pb_grpc.ShardServiceStub(grpc.insecure_channel(addr))
        rng = random.Random(3)
        warm_up = min(500, SESSIONS // 4)
        rss_after_warm_up = None
        outcomes: dict[str, int] = {}
        for i in range(SESSIONS):
            if i == warm_up:
                rss_after_warm_up = resident_bytes(proc.pid)
            sid, epoch = f"soak-{rng.getrandbits(48):012x}", rng.randrange(3)
            tokens = [rng.randrange(1, 320) for _ in range(rng.randrange(1, 24))]
            r = stub.Prefill(
                pb.StepRequest(session_id=sid, route_epoch=epoch, token_ids=tokens, position=0), timeout=30
            )
            outcomes[pb.Outcome.Name(r.outcome)] = outcomes.get(pb.Outcome.Name(r.outcome), 0) + 1
            for _ in range(rng.randrange(0, 4)):
                r = stub.Decode(
                    pb.StepRequest(session_id=sid, route_epoch=epoch, token_ids=[r.token_id or 1]), timeout=30
                )
            if rng.random() < 0.1:  # a route change: the session moves to a newer epoch
                epoch += 1
                stub.Prefill(
                    pb.StepRequest(session_id=sid, route_epoch=epoch, token_ids=tokens, position=0), timeout=30
                )
            if rng.random() < 0.8:  # the rest are abandoned, left to the TTL
                stub.Release(pb.SessionRequest(session_id=sid, route_epoch=epoch), timeout=30)
        rss_end = resident_bytes(proc.pid)
        deadline = time.monotonic() + 10
        while True:  # the worker's own sweep expires what was abandoned
            info = stub.Info(pb.InfoRequest(), timeout=30)
            if (info.live_sessions, info.reserved_tokens) == (0, 0) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        print(
            f"soak: {SESSIONS} sessions {outcomes}; RSS after warm-up {rss_after_warm_up / 2**20:.1f} MiB, "
            f"at the end {rss_end / 2**20:.1f} MiB"
        )
        assert outcomes == {"OUTCOME_OK": SESSIONS}
        assert (info.live_sessions, info.reserved_tokens) == (0, 0)
        assert rss_end - rss_after_warm_up < RSS_GROWTH_BOUND
    finally:
        stop_worker(proc)
