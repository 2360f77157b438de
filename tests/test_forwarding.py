"""Forwarding that cannot be looped or abused: a chained step names each worker once, no more hops
than layers after the worker, no worker twice (whatever address spells it), and a hop holds a
handler at most --max-hop-seconds whatever the caller's deadline; a chained step without a client
deadline works."""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest

from llama_shard.local_workers import free_port, start_worker, stop_worker, wait_serving
from llama_shard.proto import shard_pb2 as pb
from llama_shard.proto import shard_pb2_grpc as pb_grpc
from llama_shard.proto.wire import encode_tensor

pytestmark = pytest.mark.grpc


@pytest.fixture(scope="module")
def mesh(synthetic_model):
    """Three workers of the 6-layer synthetic model: a head (0-1) bound to every interface, a
    middle (2-3) and a tail (4-5). The head may forward to itself (as 127.0.0.1 and as 127.0.0.2, a
    spelling it cannot know is its own) and to the middle; the middle back to the head (127.0.0.2)
    and to the tail: a misconfigured mesh in which only the rules keep steps from looping."""
    ports = {name: free_port() for name in ("head", "middle", "tail")}
    head_self, head_alias = f"127.0.0.1:{ports['head']}", f"127.0.0.2:{ports['head']}"
    middle, tail = f"127.0.0.1:{ports['middle']}", f"127.0.0.1:{ports['tail']}"
    procs = {
        "tail": start_worker(synthetic_model, 4, 5, port=ports["tail"])[0],
        "middle": start_worker(
            synthetic_model,
            2,
            3,
            port=ports["middle"],
            extra=("--peer", tail, "--peer", head_alias, "--max-hop-seconds", "5"),
        )[0],
        "head": start_worker(
            synthetic_model,
            0,
            1,
            port=ports["head"],
            extra=(
                "--host",
                "0.0.0.0",
                "--insecure",
                "--peer",
                head_self,
                "--peer",
                head_alias,
                "--peer",
                middle,
                "--max-hop-seconds",
                "5",
            ),
        )[0],
    }
    try:
        for name, proc in procs.items():
            wait_serving(proc, f"127.0.0.1:{ports[name]}")
        yield {"head": head_self, "head_alias": head_alias, "middle": middle, "tail": tail}
    finally:
        for proc in procs.values():
            stop_worker(proc)


def _prefill(address: str, forward: list[str], sid: str, timeout: float | None = 30) -> pb.StepReply:
    with grpc.insecure_channel(address) as ch:
        req = pb.StepRequest(
            session_id=sid, route_epoch=0, token_ids=[1, 2, 3], position=0, forward=[pb.Hop(address=a) for a in forward]
        )
        return pb_grpc.ShardServiceStub(ch).Prefill(req, timeout=timeout)


def _info(address: str) -> pb.InfoReply:
    with grpc.insecure_channel(address) as ch:
        return pb_grpc.ShardServiceStub(ch).Info(pb.InfoRequest(), timeout=10)


def test_a_chained_step_without_a_client_deadline_works(mesh):
    """gRPC reports about 7.5e9 s left on a call without a deadline; the hop's timeout is the
    worker's own bound, not an overflow (today: UNAVAILABLE ... DEADLINE_EXCEEDED in 0.01 s)."""
    r = _prefill(mesh["head"], [mesh["middle"], mesh["tail"]], "no-deadline", timeout=None)
    assert r.outcome == pb.OUTCOME_OK and r.stage == 2 and r.seq_len == 3, r


@pytest.mark.parametrize("case", ["self", "self-alias-first", "twice", "too-many"])
def test_a_forward_list_that_would_loop_is_refused_before_anything_is_computed(mesh, case):
    forward = {
        "self": [mesh["head"]],
        "self-alias-first": [mesh["head"], mesh["middle"], mesh["tail"]],
        "twice": [mesh["middle"], mesh["middle"]],
        "too-many": [mesh["middle"]] + [f"10.0.0.{i}:1" for i in range(12)],
    }[case]
    before = _info(mesh["head"]).engine_requests
    r = _prefill(mesh["head"], forward, f"refused-{case}")
    assert r.outcome == pb.OUTCOME_INVALID_ARGUMENT and r.stage == 0, r
    assert {
        "self": "names this worker",
        "self-alias-first": "names this worker",
        "twice": "twice",
        "too-many": "at most 4 more",
    }[case] in r.detail
    assert _info(mesh["head"]).engine_requests == before  # nothing computed


def test_a_loop_through_an_address_the_worker_cannot_know_is_its_own_ends_at_its_second_visit(mesh):
    """head -> middle -> head (as 127.0.0.2) -> ...: the head's second visit is refused (VISITED),
    in one round, not after every hop a long deadline would allow."""
    t0 = time.monotonic()
    r = _prefill(mesh["head"], [mesh["middle"], mesh["head_alias"]], "loop", timeout=40)
    assert time.monotonic() - t0 < 5
    assert r.outcome == pb.OUTCOME_INVALID_ARGUMENT and "loop" in r.detail and r.stage == 2, r


def test_a_slow_hop_holds_the_handler_at_most_max_hop_seconds_and_others_are_served(mesh, synthetic_model):
    """A peer that never answers (a listening socket that accepts and stays silent) behind a
    caller with a 60 s deadline: the head gives up after --max-hop-seconds (5), and meanwhile other
    clients' Info and Prefill calls are answered."""
    import socket

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    port = silent.getsockname()[1]
    head_port = free_port()
    proc, head = start_worker(
        synthetic_model, 0, 1, port=head_port, extra=("--peer", f"127.0.0.1:{port}", "--max-hop-seconds", "3")
    )
    try:
        wait_serving(proc, head, route_up=False)  # its peer never answers Info: NOT_SERVING
        result = {}

        def stuck():
            t0 = time.monotonic()
            result["reply"] = _prefill(head, [f"127.0.0.1:{port}"], "held", timeout=60)
            result["seconds"] = time.monotonic() - t0

        thread = threading.Thread(target=stuck)
        thread.start()
        time.sleep(0.5)
        t0 = time.monotonic()
        assert _info(head).first == 0 and _prefill(head, [], "other", timeout=10).outcome == pb.OUTCOME_OK
        assert "reply" not in result and time.monotonic() - t0 < 10  # served while the stuck call is held
        thread.join(30)
        assert result["reply"].outcome == pb.OUTCOME_UNAVAILABLE and result["reply"].stage == 1
        assert 2.5 <= result["seconds"] < 10, result
        assert dict(_info(head).forwarded_hidden_bytes) == {}  # nothing was delivered
    finally:
        stop_worker(proc)
        silent.close()


def test_max_hop_seconds_is_range_checked(synthetic_model):
    proc, _ = start_worker(synthetic_model, 0, 1, extra=("--max-hop-seconds", "0"))
    code, err = stop_worker(proc, send_sigterm=False)
    assert code == 2 and "--max-hop-seconds" in err


def test_hidden_rows_to_a_middle_are_forwarded_with_the_loop_rules_too(mesh):
    """The middle (2-3) got a forward list naming the head it may reach: refused as a loop only
    when it is one; to the tail it forwards."""
    x = encode_tensor(np.zeros((2, 64), np.float32))
    with grpc.insecure_channel(mesh["middle"]) as ch:
        stub = pb_grpc.ShardServiceStub(ch)
        ok = stub.Prefill(
            pb.StepRequest(session_id="m", route_epoch=0, hidden=x, position=0, forward=[pb.Hop(address=mesh["tail"])]),
            timeout=30,
        )
        assert ok.outcome == pb.OUTCOME_OK and ok.stage == 1, ok
        # to the tail, then on: the tail is the last stage, there is nothing after it
        r = stub.Prefill(
            pb.StepRequest(
                session_id="m2",
                route_epoch=0,
                hidden=x,
                position=0,
                forward=[pb.Hop(address=mesh["tail"]), pb.Hop(address=mesh["head_alias"])],
            ),
            timeout=30,
        )
        assert r.outcome == pb.OUTCOME_INVALID_ARGUMENT, r


def test_an_oversized_forward_list_or_message_is_refused_before_it_is_parsed(mesh):
    """100,000 hops (500 kB, under the message bound) are refused by length before the list is copied; a message
    larger than any valid request of this worker (a full batch of full-context rows) is refused by
    gRPC before any handler runs; the worker keeps serving."""
    with grpc.insecure_channel(mesh["head"], options=[("grpc.max_send_message_length", 256 << 20)]) as ch:
        stub = pb_grpc.ShardServiceStub(ch)
        hops = [pb.Hop(address="x")] * 100_000
        r = stub.Prefill(pb.StepRequest(session_id="hops", route_epoch=0, token_ids=[1], forward=hops), timeout=60)
        assert r.outcome == pb.OUTCOME_INVALID_ARGUMENT and "at most" in r.detail, r.detail
        with pytest.raises(grpc.RpcError) as e:
            stub.Prefill(pb.StepRequest(session_id="big", route_epoch=0, token_ids=[1] * (40 << 20)), timeout=60)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert stub.Info(pb.InfoRequest(), timeout=10).first == 0


def test_a_route_that_mixes_attention_kernels_is_refused_naming_both(synthetic_model):
    """A head with flash attention and a tail without (or K/V types that differ) would give logits
    that are neither setting's whole model: the tail refuses the head's chained step and its
    Generate stream, naming both settings; a client's route over the two is refused up front."""
    from llama_shard.errors import InvalidInputError
    from llama_shard.route import RemoteStage, RouteClient

    tail_port, head_port = free_port(), free_port()
    tail, head = f"127.0.0.1:{tail_port}", f"127.0.0.1:{head_port}"
    procs = [
        start_worker(synthetic_model, 3, 5, port=tail_port, extra=("--flash-attn", "off"))[0],
        start_worker(synthetic_model, 0, 2, port=head_port, extra=("--peer", tail))[0],
    ]
    try:
        wait_serving(procs[0], tail)
        wait_serving(procs[1], head)
        info = _info(tail)
        assert (info.flash_attn, info.numerics) == (False, "K/V f16, flash attention off")
        assert _info(head).numerics == "K/V f16, flash attention on (llama-shard's kernel)"
        reply = _prefill(head, [tail], "mixed")
        assert reply.outcome == pb.OUTCOME_INCOMPATIBLE_RECIPE and reply.stage == 1, reply
        assert "flash attention off" in reply.detail and "flash attention on" in reply.detail
        with grpc.insecure_channel(head) as ch:
            events = list(
                pb_grpc.ShardServiceStub(ch).Generate(
                    pb.GenerateRequest(
                        session_id="mixed-gen", prompt=[1, 2, 3], max_tokens=2, forward=[pb.Hop(address=tail)]
                    ),
                    timeout=30,
                )
            )
        final = events[-1].final
        assert (final.finish_reason, final.outcome, final.stage) == ("error", pb.OUTCOME_INCOMPATIBLE_RECIPE, 1)
        with pytest.raises(InvalidInputError, match="flash attention off.*flash attention on|flash attention on.*off"):
            RouteClient([RemoteStage(head), RemoteStage(tail)])
        assert procs[0].poll() is None and procs[1].poll() is None  # both still serve
        assert _info(head).numerics and _info(tail).numerics
    finally:
        for proc in procs:
            stop_worker(proc)
