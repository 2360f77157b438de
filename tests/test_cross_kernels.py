"""Spot checks across kernels (head/row_checks.py, receipts/tolerance.py): a stage whose only other
replica runs other CPU kernels (LLAMA_SHARD_CPU_VARIANT, so any machine has one) is replayed stage
by stage, its worker held to its own commitment and its partner to the tolerance.

- The tolerance's measure: a row's relative error, logits centred first; shapes that differ or
  values that are not finite never pass.
- On live workers over loopback (SmolLM2, a head and two tail replicas of other kernels, one thread
  each): every request of an honest route is "close", within the tolerance and above 0 (the kernels
  do round differently), and no replica is taken out.
- Each cheat of tests/support/cheats.py served as the tail, with two honest replicas of other
  kernels beside it, is caught by the first request's spot check, and only the cheat is out.
"""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest

from llama_shard import cpu_backend
from llama_shard.local_workers import free_port, start_worker, stop_worker, wait_serving
from llama_shard.proto import shard_pb2 as pb
from llama_shard.proto import shard_pb2_grpc as pb_grpc
from llama_shard.receipts.tolerance import HIDDEN_TOLERANCE, LOGITS_TOLERANCE, Closeness, row_errors

from support.cheats import CHEATS, cheating_worker

PROMPT = [1, 504, 3458, 282, 4649, 314]  # "The capital of France is" in SmolLM2's vocabulary
TAIL = (15, 29)


def test_a_row_error_is_relative_centred_for_logits_and_never_passes_what_it_cannot_compare():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(3, 64)).astype(np.float32)
    assert row_errors(a, a).tolist() == [0.0, 0.0, 0.0]
    b = a * 1.01
    assert np.allclose(row_errors(a, b), 0.01, rtol=1e-3)
    shifted = a + 5.0  # the same distribution: a logit row is defined up to a constant
    assert row_errors(a, shifted, centered=True).max() < 1e-6 < row_errors(a, shifted).min()
    assert np.isinf(row_errors(a, a[:2])).all()
    nan = a.copy()
    nan[1, 3] = np.nan
    assert np.isinf(row_errors(a, nan)[1])
    c = Closeness()
    c.add(a, b)
    c.add(a, nan)
    assert c.rows == 6 and not c.within(max(HIDDEN_TOLERANCE, LOGITS_TOLERANCE))


def _other_variant() -> str:
    """CPU kernels other than the ones this machine picks, that it can run."""
    c = cpu_backend()
    if "haswell" not in c.get("available", ()):
        pytest.skip("one CPU variant in this build (a source build): no other kernels to compare with")
    return "sandybridge" if c["variant"] == "haswell" else "haswell"


class _Route:
    """A head (layers 0-14) at spot-check rate 1 and tail workers, over loopback, one thread each."""

    def __init__(self, model, tails: list[str]):
        peers = sum((["--peer", a] for a in tails), [])
        self.proc, self.address = start_worker(
            model, 0, TAIL[0] - 1, port=free_port(), extra=(*peers, "--spot-check-rate", "1")
        )
        wait_serving(self.proc, self.address)
        self.channel = grpc.insecure_channel(self.address)
        self.stub = pb_grpc.ShardServiceStub(self.channel)
        deadline = time.monotonic() + 30
        while sorted(r.state for r in self.info().replicas) != ["up"] * len(tails):
            assert time.monotonic() < deadline, self.info().replicas
            time.sleep(0.1)

    def receipt(self, sid: str, n: int = 16, **kw) -> pb.RouteReceipt:
        events = list(
            self.stub.Generate(pb.GenerateRequest(session_id=sid, prompt=PROMPT, max_tokens=n, receipt=True, **kw))
        )
        final = events[-1].final
        assert final.finish_reason == "length" and final.receipt_verdict == "verified", final
        r = pb.RouteReceipt()
        r.ParseFromString(final.receipt)
        return r

    def info(self) -> pb.InfoReply:
        return self.stub.Info(pb.InfoRequest(), timeout=10)

    def stop(self) -> None:
        self.channel.close()
        stop_worker(self.proc)


@pytest.fixture(scope="module")
def other_tails(embedded_model):
    """Two honest tails on other kernels than this machine's (subprocesses), shared by the module."""
    env = {"LLAMA_SHARD_CPU_VARIANT": _other_variant()}
    procs = [start_worker(embedded_model, *TAIL, env=env) for _ in range(2)]
    try:
        for proc, address in procs:
            wait_serving(proc, address)
        yield [address for _, address in procs]
    finally:
        for proc, _ in procs:
            stop_worker(proc)


@pytest.mark.model
@pytest.mark.grpc
def test_an_honest_route_across_kernels_is_close_and_no_replica_is_out(embedded_model, other_tails):
    mine = start_worker(embedded_model, *TAIL)  # this machine's kernels
    wait_serving(*mine)
    route = _Route(embedded_model, [mine[1], other_tails[0]])
    try:
        seeded = pb.Sampling(temperature=0.8, top_k=40, seed=5)
        for kw in ({}, {"sampling": seeded}, {"max_drafts": 4, "max_tokens": 24}):
            n = kw.pop("max_tokens", 16)
            r = route.receipt(f"honest-{len(kw)}-{n}", n, **kw)
            [check] = r.spot_checks
            assert check.outcome.startswith("close"), check
            assert check.replica != check.worker and check.tolerance == pytest.approx(LOGITS_TOLERANCE)
            assert 0 < check.max_error <= check.tolerance, check  # other kernels: close, not equal
        info = route.info()
        assert (info.spot_checks, info.spot_check_failures) == (3, 0)
        assert all(r.state == "up" for r in info.replicas)
    finally:
        route.stop()
        stop_worker(mine[0])


@pytest.mark.model
@pytest.mark.grpc
@pytest.mark.slow
@pytest.mark.parametrize("cheat", CHEATS)
def test_a_cheating_tail_is_caught_against_replicas_of_other_kernels(embedded_model, other_tails, tmp_path, cheat):
    honest = start_worker(embedded_model, *TAIL)  # what the cheat claims to be (not in the route)
    wait_serving(*honest)
    with grpc.insecure_channel(honest[1]) as ch:
        info = pb_grpc.ShardServiceStub(ch).Info(pb.InfoRequest(), timeout=10)
    stop_worker(honest[0])
    worker = cheating_worker(embedded_model, *TAIL, cheat, info, tmp_path)
    route = _Route(embedded_model, [worker.address, *other_tails])
    try:
        [check] = route.receipt(f"{cheat}-1").spot_checks
        assert check.worker == worker.address, check  # the first route takes the first peer
        if cheat == "noise":  # fresh noise each time: it cannot repeat what it committed
            assert check.outcome == "mismatch: its worker did not repeat the rows it committed", check
        else:  # a third replica of other kernels says which of the two is wrong
            assert check.outcome.startswith("mismatch (arbitrated by"), check
            assert check.max_error > check.tolerance, check
        states = {r.address: r.state for r in route.info().replicas}
        assert states == {worker.address: "failed-check", other_tails[0]: "up", other_tails[1]: "up"}, states
        [again] = route.receipt(f"{cheat}-2").spot_checks
        assert again.worker != worker.address and again.outcome.startswith("equal"), again
    finally:
        route.stop()
        worker.stop()
