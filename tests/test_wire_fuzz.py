"""Wire fuzzing against a live worker: generated messages for every step and session method
(extreme and negative numbers, empty and long ids, wrong shapes, dtypes and truncated tensor bytes,
unknown enum values, unknown fields, chained hops to nowhere), each field at the largest size the
receive limit lets through and just past it, and raw random bytes. Every call gets an Outcome or a
clean gRPC status; afterwards the worker still serves the whole model's tokens, its RSS bounded."""

from __future__ import annotations

import collections

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llama_shard.engine.pipeline import LocalPipeline
from llama_shard.local_workers import start_worker, stop_worker, wait_serving
from llama_shard.proto import shard_pb2 as pb
from llama_shard.proto import shard_pb2_grpc as pb_grpc
from llama_shard.testing.process import resident_bytes

from conftest import varint

pytestmark = pytest.mark.grpc

SERVICE = "/llama_shard.v1.ShardService/"
# what a malformed call may get: a typed reply, or a status saying the call itself was refused
CLEAN = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.OUT_OF_RANGE}

i64 = st.integers(-(2**63), 2**63 - 1)
i32 = st.integers(-(2**31), 2**31 - 1)
ids = st.one_of(st.text(max_size=8), st.text(min_size=250, max_size=300), st.sampled_from(["", "a", "fz-0"]))
tensors = st.builds(
    lambda shape, dtype, data: pb.Tensor(shape=shape, dtype=dtype, data=data),
    st.lists(st.integers(-3, 1 << 40), max_size=3),
    st.integers(-1, 3),
    st.binary(max_size=1024),
)


# fields this schema does not have (a newer client's), appended to a message's bytes: a varint
# field 99 and a length-delimited field 1234
unknown_fields = st.sampled_from([b"", b"", varint(99 << 3) + varint(7), varint(1234 << 3 | 2) + varint(3) + b"xyz"])


def with_unknown_fields(message, extra: bytes):
    message.MergeFromString(extra)  # protobuf keeps unknown fields and sends them on
    return message


@st.composite
def step_requests(draw) -> pb.StepRequest:
    req = pb.StepRequest(
        session_id=draw(ids),
        route_epoch=draw(i64),
        recipe_fingerprint=draw(st.sampled_from(["", "", "", "bogus"])),
        reply_dtype=draw(st.integers(-1, 3)),
        return_logits=draw(st.booleans()),
    )
    choice = draw(st.integers(0, 2))
    if choice == 0:
        req.token_ids.extend(draw(st.lists(i32, max_size=40)))
    elif choice == 1:
        req.hidden.CopyFrom(draw(tensors))
    if draw(st.booleans()):
        req.position = draw(i32)
    for address in draw(st.lists(st.text(max_size=12), max_size=2)):
        req.forward.add(address=address)
    return with_unknown_fields(req, draw(unknown_fields))


@pytest.fixture(scope="module")
def worker(synthetic_model):
    proc, addr = start_worker(synthetic_model, 0, 5, 1)
    wait_serving(proc, addr)
    channel = grpc.insecure_channel(addr)
    yield proc, channel
    channel.close()
    stop_worker(proc)


COUNTS: collections.Counter = collections.Counter()


def _call(fn, request):
    try:
        reply = fn(request, timeout=30)
    except grpc.RpcError as e:
        assert e.code() in CLEAN, (e.code(), e.details(), request)
        COUNTS[f"status {e.code().name}"] += 1
        return
    for r in getattr(reply, "replies", [reply]):
        assert r.outcome in pb.Outcome.values()
        COUNTS[pb.Outcome.Name(r.outcome)] += 1


@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
@pytest.mark.slow
def test_generated_messages_get_an_outcome_or_a_clean_status(worker, data):
    proc, channel = worker
    stub = pb_grpc.ShardServiceStub(channel)
    method = data.draw(st.sampled_from(["Prefill", "Decode", "StepBatch", "Truncate", "Release", "Resolve"]))
    if method in ("Prefill", "Decode"):
        _call(getattr(stub, method), data.draw(step_requests()))
    elif method == "StepBatch":
        steps = data.draw(
            st.lists(
                st.builds(lambda k, s: pb.BatchedStep(kind=k, step=s), st.integers(-1, 3), step_requests()), max_size=10
            )
        )
        _call(stub.StepBatch, with_unknown_fields(pb.StepBatchRequest(steps=steps), data.draw(unknown_fields)))
    elif method == "Truncate":
        _call(
            stub.Truncate,
            with_unknown_fields(
                pb.TruncateRequest(session_id=data.draw(ids), route_epoch=data.draw(i64), length=data.draw(i32)),
                data.draw(unknown_fields),
            ),
        )
    else:
        _call(
            getattr(stub, method),
            with_unknown_fields(
                pb.SessionRequest(session_id=data.draw(ids), route_epoch=data.draw(i64)), data.draw(unknown_fields)
            ),
        )
    assert proc.poll() is None


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    method=st.sampled_from(["Prefill", "Decode", "StepBatch", "Truncate", "Release", "Resolve", "Info"]),
    payload=st.binary(max_size=2048),
)
def test_raw_bytes_get_a_clean_status(worker, method, payload):
    proc, channel = worker
    call = channel.unary_unary(SERVICE + method, request_serializer=lambda b: b, response_deserializer=lambda b: b)
    try:
        call(payload, timeout=30)
        COUNTS["raw: parsed"] += 1
    except grpc.RpcError as e:
        # bytes that do not parse: INVALID_ARGUMENT with the parser's reason (not gRPC's own INTERNAL)
        assert e.code() in CLEAN, (e.code(), e.details())
        COUNTS[f"raw: {e.code().name}"] += 1
    assert proc.poll() is None


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
@pytest.mark.slow
def test_maximum_and_oversize_fields_get_an_outcome_or_a_clean_status(worker, data):
    """Each field at the largest size the worker's receive limit lets through, and at one that makes
    the message just too large: a token list of one-byte or five-byte ids, hidden bytes, a session
    id, a recipe fingerprint, a forward list. Each gets a typed reply or a clean status (the
    oversize ones RESOURCE_EXHAUSTED before they are parsed), and the worker keeps serving."""
    proc, channel = worker
    limit = pb_grpc.ShardServiceStub(channel).Info(pb.InfoRequest(), timeout=30).max_request_bytes
    assert 0 < limit < 64 << 20
    field = data.draw(st.sampled_from(["ids1", "ids5", "hidden", "session_id", "fingerprint", "forward"]))
    over = data.draw(st.booleans())
    head = pb.StepRequest(route_epoch=data.draw(i64), position=data.draw(st.integers(-1, 600))).SerializeToString()
    room = limit - len(head) - 16  # what one field may take, with its tag and length
    size = room + (2048 if over else 0)
    req = pb.StepRequest()
    if field == "ids1":
        req.token_ids.extend([data.draw(st.integers(0, 127))] * size)
    elif field == "ids5":
        req.token_ids.extend([data.draw(st.sampled_from([-1, -(2**31), 2**31 - 1]))] * (size // 10))
    elif field == "hidden":
        rows = data.draw(st.integers(1, 4))
        req.hidden.CopyFrom(
            pb.Tensor(shape=[rows, max(1, size // (4 * rows))], dtype=pb.DTYPE_FLOAT32, data=bytes(size))
        )
    elif field == "session_id":
        req.session_id = "s" * size
    elif field == "fingerprint":
        req.recipe_fingerprint = "f" * size
    else:
        hop = pb.Hop(address="127.0.0.1:1")
        req.forward.extend([hop] * (size // len(pb.StepRequest(forward=[hop]).SerializeToString())))
    message = head + req.SerializeToString()
    method = data.draw(st.sampled_from(["Prefill", "Decode", "StepBatch"]))
    if method == "StepBatch":
        message = pb.StepBatchRequest(
            steps=[pb.BatchedStep(kind=1, step=pb.StepRequest.FromString(message))]
        ).SerializeToString()
    call = channel.unary_unary(SERVICE + method, request_serializer=lambda b: b, response_deserializer=lambda b: b)
    try:
        reply = call(message, timeout=60)
        assert len(message) <= limit
        if method == "StepBatch":
            outcomes = [r.outcome for r in pb.StepBatchReply.FromString(reply).replies]
        else:
            outcomes = [pb.StepReply.FromString(reply).outcome]
        assert all(o in pb.Outcome.values() for o in outcomes)
        COUNTS[f"max-size {field}: {','.join(pb.Outcome.Name(o) for o in outcomes)}"] += 1
    except grpc.RpcError as e:
        assert e.code() in CLEAN, (e.code(), e.details())
        if len(message) > limit:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        COUNTS[f"{'over' if len(message) > limit else 'max'}-size {field}: {e.code().name}"] += 1
    assert proc.poll() is None


def test_after_the_fuzzing_the_worker_serves_exact_tokens_in_bounded_memory(worker, synthetic_model):
    proc, channel = worker
    stub = pb_grpc.ShardServiceStub(channel)
    prompt = [1, 17, 42, 99, 5]
    r = stub.Prefill(pb.StepRequest(session_id="after", route_epoch=7, token_ids=prompt, position=0), timeout=30)
    tokens = [r.token_id]
    for _ in range(7):
        r = stub.Decode(pb.StepRequest(session_id="after", route_epoch=7, token_ids=[tokens[-1]]), timeout=30)
        assert r.outcome == pb.OUTCOME_OK
        tokens.append(r.token_id)
    whole = LocalPipeline(synthetic_model, None, n_ctx=256, n_seq_max=1, n_batch=32, n_threads=1)
    assert tokens == [t for t, _ in whole.generate(prompt, 8)]
    rss = resident_bytes(proc.pid)
    print(f"fuzz: {sum(COUNTS.values())} calls: {dict(COUNTS)}; worker RSS {rss / 2**20:.0f} MiB")
    assert rss < 512 << 20
