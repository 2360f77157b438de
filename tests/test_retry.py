"""A retried step is answered again, bit-exact, instead of a miss: when a decode's reply is lost
(the caller's deadline passed, the connection dropped) and the same decode arrives again, expecting
the length it expected the first time, the engine recomputes it from that start. Both engines."""
from __future__ import annotations

import grpc
import numpy as np
import pytest

from llama_shard import CacheMiss, HotKvStateConfig, HotKvStateManager, KvBoundaryAdapter, ManualClock, ShardModel
from llama_shard.reference import ReferenceModel, ReferenceShard


@pytest.fixture(params=["native", "reference"])
def adapter(request, synthetic_model):
    model = (ShardModel(str(synthetic_model), None, 2) if request.param == "native"
             else ReferenceShard(ReferenceModel.from_gguf(synthetic_model)))
    mgr = HotKvStateManager(model, HotKvStateConfig(max_sessions=2, context_tokens=64, budget_tokens=128, ttl_seconds=0),
                            ManualClock())
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


def test_a_lost_reply_on_the_wire_is_retried_with_no_re_prefill(synthetic_model):
    from llama_shard.proto import shard_pb2 as pb
    from llama_shard.proto import shard_pb2_grpc as pb_grpc
    from llama_shard.testing.workers import start_worker, stop_worker, wait_serving

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
