"""A retried step is answered again, bit-exact, instead of a miss: when a decode's reply is lost
(the caller's deadline passed, the connection dropped) and the same decode arrives again, expecting
the length it expected the first time, the engine recomputes it from that start. Both engines."""

from __future__ import annotations

import collections
import threading
import time
from concurrent import futures

import grpc
import numpy as np
import pytest

from llama_shard import CacheMiss, HotKvStateConfig, HotKvStateManager, KvBoundaryAdapter, ManualClock, ShardModel
from llama_shard.reference import ReferenceModel, ReferenceShard


@pytest.fixture(params=["native", "reference"])
def adapter(request, synthetic_model):
    model = (
        ShardModel(str(synthetic_model), None, 2)
        if request.param == "native"
        else ReferenceShard(ReferenceModel.from_gguf(synthetic_model))
    )
    mgr = HotKvStateManager(
        model, HotKvStateConfig(max_sessions=2, context_tokens=64, budget_tokens=128, ttl_seconds=0), ManualClock()
    )
    yield KvBoundaryAdapter(model, mgr)
    mgr.close()


def test_a_repeated_decode_is_answered_again_bit_exact(adapter):
    out = adapter.prefill("s", 0, token_ids=[1, 17, 42])
    first = adapter.decode("s", 0, token_ids=[out.token_id], expected_seq_len=3)
    again = adapter.decode("s", 0, token_ids=[out.token_id], expected_seq_len=3)  # the first reply was lost
    assert first.seq_len == again.seq_len == 4
    assert np.array_equal(first.logits, again.logits) and first.token_id == again.token_id
    nxt = adapter.decode("s", 0, token_ids=[again.token_id], expected_seq_len=4)
    assert nxt.seq_len == 5  # and the session goes on from there


def test_a_different_step_at_an_old_position_is_still_a_miss(adapter):
    out = adapter.prefill("s", 0, token_ids=[1, 17, 42])
    adapter.decode("s", 0, token_ids=[out.token_id], expected_seq_len=3)
    other = adapter.decode("s", 0, token_ids=[(out.token_id + 1) % 320], expected_seq_len=3)
    assert isinstance(other, CacheMiss) and other.reason.name == "SEQ_LEN_MISMATCH"
    two_back = adapter.decode("s", 0, token_ids=[5], expected_seq_len=2)
    assert isinstance(two_back, CacheMiss)


@pytest.mark.grpc
def test_a_lost_reply_on_the_wire_is_retried_with_no_re_prefill(synthetic_model):
    from llama_shard.local_workers import start_worker, stop_worker, wait_serving
    from llama_shard.proto import shard_pb2 as pb
    from llama_shard.proto import shard_pb2_grpc as pb_grpc

    proc, addr = start_worker(synthetic_model, 0, 5, 1)
    try:
        wait_serving(proc, addr)
        stub = pb_grpc.ShardServiceStub(grpc.insecure_channel(addr))
        r = stub.Prefill(pb.StepRequest(session_id="w", route_epoch=1, token_ids=[1, 17, 42], position=0), timeout=30)
        req = pb.StepRequest(session_id="w", route_epoch=1, token_ids=[r.token_id], position=3)
        first, again = stub.Decode(req, timeout=30), stub.Decode(req, timeout=30)
        assert first.outcome == again.outcome == pb.OUTCOME_OK
        assert (first.token_id, first.seq_len) == (again.token_id, again.seq_len) == (first.token_id, 4)
        info = stub.Info(pb.InfoRequest(), timeout=10)
        assert sum(info.misses.values()) == 0
    finally:
        stop_worker(proc)


class ReplyDroppingProxy(grpc.GenericRpcHandler):
    """A loopback gRPC proxy in front of one worker that forwards every call and loses chosen
    replies after the worker has applied the step: `drops[(method, n)]` is "deadline" (the reply
    is held until the caller's deadline has passed) or "unavailable" (the connection is reported
    dropped). `calls` counts the calls per method name."""

    def __init__(self, target: str, drops: dict, hold_s: float):
        self.upstream = grpc.insecure_channel(target)
        self.drops, self.hold_s = drops, hold_s
        self.calls: collections.Counter = collections.Counter()
        self.lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        self.server.add_generic_rpc_handlers((self,))
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def service(self, handler_call_details):
        method = handler_call_details.method
        forward = self.upstream.unary_unary(method)  # raw bytes both ways

        def handle(request: bytes, context):
            with self.lock:
                self.calls[method.rsplit("/", 1)[-1]] += 1
                n = self.calls[method.rsplit("/", 1)[-1]]
            reply = forward(request, timeout=30)
            drop = self.drops.get((method.rsplit("/", 1)[-1], n))
            if drop == "deadline":
                time.sleep(self.hold_s)  # the caller has given up by now
            elif drop == "unavailable":
                context.abort(grpc.StatusCode.UNAVAILABLE, "connection dropped by the test proxy")
            return reply

        return grpc.unary_unary_rpc_method_handler(handle)

    def close(self):
        self.server.stop(0)
        self.upstream.close()


@pytest.mark.grpc
def test_route_client_retries_lost_decode_replies_with_the_same_tokens_and_no_re_prefill(synthetic_model):
    """Two workers (0-2, 3-5), each behind a proxy: the head loses its 3rd decode reply to the
    caller's deadline, the tail its 5th to a dropped connection, both after the step was applied.
    RouteClient retries each once and gets the tokens of an undisturbed route, with no re-prefill
    and no miss on either worker."""
    from llama_shard.local_workers import start_worker, stop_worker, wait_serving
    from llama_shard.route import RemoteStage, RouteClient

    workers = [start_worker(synthetic_model, 0, 2, 1), start_worker(synthetic_model, 3, 5, 1)]
    proxies, client, direct = [], None, None
    try:
        for proc, addr in workers:
            wait_serving(proc, addr)
        prompt, n_tokens, timeout_s = [1, 17, 42, 99, 7], 12, 2.0
        direct = RouteClient([RemoteStage(addr) for _, addr in workers])
        expected = direct.session("direct").generate(prompt, n_tokens)
        proxies = [
            ReplyDroppingProxy(workers[0][1], {("Decode", 3): "deadline"}, hold_s=timeout_s + 0.5),
            ReplyDroppingProxy(workers[1][1], {("Decode", 5): "unavailable"}, hold_s=0),
        ]
        client = RouteClient([RemoteStage(p.address, timeout_s=timeout_s) for p in proxies])
        session = client.session("through-proxies")
        got = session.generate(prompt, n_tokens)
        assert got == expected
        assert session.reprefills == 0
        decodes = n_tokens - 1
        assert [(p.calls["Prefill"], p.calls["Decode"]) for p in proxies] == [(1, decodes + 1), (1, decodes + 1)]
        for stage in direct.stages:
            assert sum(stage.stats().misses.values()) == 0
    finally:
        for c in (client, direct):
            if c is not None:
                c.close()
        for p in proxies:
            p.close()
        for proc, _ in workers:
            stop_worker(proc)
