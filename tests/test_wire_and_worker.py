"""The shard worker over gRPC, on loopback, with SmolLM2 split in two worker processes: exact
tokens against the whole model in-process, failure and restart of a worker, epochs on the wire,
malformed requests, metrics, health, graceful shutdown, and the demo."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import numpy as np
import pytest

from llama_shard import StepKind
from llama_shard.engine.pipeline import LocalPipeline
from llama_shard.local_workers import start_worker, stop_worker, wait_serving
from llama_shard.proto import shard_pb2 as pb
from llama_shard.proto import shard_pb2_grpc as pb_grpc
from llama_shard.proto.wire import decode_tensor, encode_tensor
from llama_shard.route import RemoteStage, RouteClient, RouteError

from conftest import REPO, varint
from support.worker import Worker


def test_generated_code_matches_the_proto(tmp_path):
    pytest.importorskip("grpc_tools", reason="regenerating the proto code needs grpcio-tools (the dev extra)")
    from llama_shard.proto import generate

    generate.generate(tmp_path)
    for name in generate.GENERATED:
        assert (tmp_path / name).read_text() == (generate.HERE / name).read_text(), (
            f"{name} is stale: run python -m llama_shard.proto.generate"
        )


def test_tensor_round_trip_and_float16_cost():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((5, 64)) * 4).astype(np.float32)
    assert decode_tensor(encode_tensor(x), 64, 8).tobytes() == x.tobytes()
    half = decode_tensor(encode_tensor(x, pb.DTYPE_FLOAT16), 64, 8)
    rel = float(np.abs(half - x).max() / np.abs(x).max())
    assert rel < 1e-3  # float16 rounding: relative error <= 2^-11 of the largest value
    from llama_shard import InvalidInputError

    bad = encode_tensor(x)
    bad.data = bad.data[:-3]
    for t in (
        bad,
        pb.Tensor(shape=[5, 63], data=x.tobytes()),
        pb.Tensor(shape=[320], data=x.tobytes()),
        pb.Tensor(shape=[5, 64], dtype=7, data=x.tobytes()),
    ):
        with pytest.raises(InvalidInputError):
            decode_tensor(t, 64, 8)


def test_q8_0_rows_are_llama_cpps_blocks():
    """q8_0 on the wire is llama.cpp's block_q8_0, rounded as its reference quantizer rounds (gguf-py
    mirrors it): the same bytes, the same values back, ties rounded away from zero."""
    from gguf import GGMLQuantizationType, quants

    from llama_shard import InvalidInputError

    rng = np.random.default_rng(3)
    ties = np.zeros((1, 64), np.float32)
    ties[0, 0], ties[0, 1:32] = 127, np.arange(31) + 0.5  # scale 1: every value a tie
    ties[0, 32], ties[0, 33:] = -127, -(np.arange(31) + 0.5)
    for x in [
        ties,
        np.zeros((2, 64), np.float32),
        *((rng.standard_normal((3, 576)) * 10.0 ** rng.uniform(-3, 3)).astype(np.float32) for _ in range(8)),
    ]:
        t = encode_tensor(x, pb.DTYPE_Q8_0)
        ref = quants.quantize(x, GGMLQuantizationType.Q8_0)
        assert t.data == ref.tobytes() and len(t.data) == x.shape[0] * x.shape[1] // 32 * 34
        back = decode_tensor(t, x.shape[1], 8)
        assert back.tobytes() == quants.dequantize(ref, GGMLQuantizationType.Q8_0).astype(np.float32).tobytes()
        assert np.abs(back - x).max() <= np.abs(x).max() / 127 * 0.5 * 1.01  # half a step of the largest block
    x = np.ones((2, 64), np.float32)
    bad_scale = encode_tensor(x, pb.DTYPE_Q8_0)
    raw = bytearray(bad_scale.data)
    raw[0:2] = np.float16(np.inf).tobytes()
    bad_scale.data = bytes(raw)
    short = encode_tensor(x, pb.DTYPE_Q8_0)
    short.data = short.data[:-1]
    for t in (bad_scale, short, pb.Tensor(shape=[2, 48], dtype=pb.DTYPE_Q8_0, data=b"\0" * 2 * 51)):
        with pytest.raises(InvalidInputError):
            decode_tensor(t, t.shape[1], 8)
    with pytest.raises(InvalidInputError):
        encode_tensor(np.ones((2, 48), np.float32), pb.DTYPE_Q8_0)  # not whole blocks


# --- workers on loopback ------------------------------------------------------------------------

PROMPTS = [
    "The capital of France is",
    "Once upon a time,",
    "def fib(n):",
    "The three primary colors are",
    "Water boils at",
    "My favourite book is",
    "import numpy as np",
    "The quick brown fox",
]
N_TOKENS = 20

pytestmark = [pytest.mark.model, pytest.mark.grpc]


@pytest.fixture(scope="module")
def whole_tokens(embedded_model):
    pipe = LocalPipeline(embedded_model, None, n_ctx=512, n_seq_max=1, n_batch=128, n_threads=2)
    return {p: [t for t, _ in pipe.generate(pipe.head.tokenize(p), N_TOKENS)] for p in PROMPTS}


@pytest.fixture(scope="module")
def tokenizer(embedded_model):
    from llama_shard import ShardModel

    return ShardModel(str(embedded_model), (0, 0), 1)


@pytest.fixture(scope="module")
def workers(embedded_model):
    head, tail = Worker(embedded_model, "0-14"), Worker(embedded_model, "15-29")
    yield head, tail
    for w in (head, tail):
        w.stop()


@pytest.mark.slow
def test_two_workers_give_the_whole_models_tokens_to_eight_concurrent_sessions(workers, whole_tokens, tokenizer):
    head, tail = workers
    client = RouteClient([RemoteStage(head.address), RemoteStage(tail.address)])
    results, errors = {}, []

    def run(i, p):
        try:
            s = client.session(f"conc-{i}")
            results[p] = s.generate(tokenizer.tokenize(p), N_TOKENS)
            s.release()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i, p)) for i, p in enumerate(PROMPTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    dt = time.perf_counter() - t0
    print(f"8 sessions x {N_TOKENS} tokens through 2 workers on loopback: {8 * N_TOKENS / dt:.1f} tok/s aggregate")
    assert not errors, errors
    assert results == whole_tokens
    client.close()


def test_micro_batched_route_gives_the_whole_models_tokens(workers, whole_tokens, tokenizer):
    """generate_many: 8 sessions in 2 micro-batches, one StepBatch message per worker per step."""
    head, tail = workers
    client = RouteClient([RemoteStage(head.address), RemoteStage(tail.address)])
    before = [s.stats() for s in client.stages]
    sessions = [client.session(f"mb-{i}") for i in range(len(PROMPTS))]
    streamed: dict[int, list[int]] = {i: [] for i in range(len(PROMPTS))}
    t0 = time.perf_counter()
    got = client.generate_many(
        sessions,
        [tokenizer.tokenize(p) for p in PROMPTS],
        N_TOKENS,
        micro_batches=2,
        on_token=lambda i, t: streamed[i].append(t),
    )
    dt = time.perf_counter() - t0
    print(
        f"8 sessions x {N_TOKENS} tokens in 2 micro-batches through 2 workers on loopback: "
        f"{8 * N_TOKENS / dt:.1f} tok/s aggregate, prefill included"
    )
    after = [s.stats() for s in client.stages]
    assert {p: g for p, g in zip(PROMPTS, got)} == whole_tokens
    assert [streamed[i] for i in range(len(PROMPTS))] == got
    for b, a in zip(before, after):
        steps, requests = a.engine_steps - b.engine_steps, a.engine_requests - b.engine_requests
        # every decode step of a micro-batch is one engine step of its 4 sessions (prefills go in
        # prefill_chunk pieces): far fewer steps than requests
        assert requests >= 8 * N_TOKENS and steps <= requests / 3, (steps, requests)
    for s in sessions:
        s.release()
    client.close()


def test_step_batch_answers_each_step_on_its_own(workers, tokenizer):
    head, _ = workers
    stub = pb_grpc.ShardServiceStub(grpc.insecure_channel(head.address))
    ids = tokenizer.tokenize(PROMPTS[0])

    def step(kind, sid, **kw):
        return pb.BatchedStep(kind=kind, step=pb.StepRequest(session_id=sid, route_epoch=0, **kw))

    r = stub.StepBatch(
        pb.StepBatchRequest(
            steps=[
                step(pb.STEP_KIND_PREFILL, "sb-a", token_ids=ids),
                step(pb.STEP_KIND_PREFILL, "sb-b", token_ids=[10**6]),  # bad token: only this one fails
                step(pb.STEP_KIND_UNSPECIFIED, "sb-c", token_ids=ids),  # no kind
                step(pb.STEP_KIND_PREFILL, "sb-a", token_ids=ids),  # the same session twice
                step(pb.STEP_KIND_DECODE, "sb-gone", token_ids=[1]),  # unknown session: a miss
                step(pb.STEP_KIND_PREFILL, "sb-d", token_ids=ids, reply_dtype=5),  # unknown reply dtype
                step(pb.STEP_KIND_PREFILL, "sb-e", token_ids=ids, reply_dtype=pb.DTYPE_FLOAT16),
            ]
        ),
        timeout=30,
    )
    outcomes = [pb.Outcome.Name(x.outcome) for x in r.replies]
    assert outcomes == [
        "OUTCOME_OK",
        "OUTCOME_INVALID_ARGUMENT",
        "OUTCOME_INVALID_ARGUMENT",
        "OUTCOME_INVALID_ARGUMENT",
        "OUTCOME_CACHE_MISS",
        "OUTCOME_INVALID_ARGUMENT",
        "OUTCOME_OK",
    ]
    assert r.replies[4].miss_reason == "UNKNOWN_SESSION"
    a, e = decode_tensor(r.replies[0].hidden, 576, 512), decode_tensor(r.replies[6].hidden, 576, 512)
    assert a.shape == e.shape == (len(ids), 576)
    assert float(np.abs(a - e).max()) <= 1e-3 * float(np.abs(a).max())  # float16 on request
    # nothing was created for the refused steps
    live = {x.session_id for x in stub.Info(pb.InfoRequest(), timeout=10).sessions}
    assert {"sb-a", "sb-e"} <= live and not live & {"sb-b", "sb-c", "sb-d", "sb-gone"}
    # more steps than the shard has sessions: refused whole with a clean status, nothing changed;
    # a message larger than any valid request (200,000 steps: 4.9 MB) is refused before it is parsed
    for n, code, why in (
        (9, grpc.StatusCode.INVALID_ARGUMENT, "at most 8 steps"),
        (200_000, grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max"),
    ):
        with pytest.raises(grpc.RpcError) as e:
            stub.StepBatch(
                pb.StepBatchRequest(steps=[step(pb.STEP_KIND_DECODE, f"sb-many-{i}", token_ids=[1]) for i in range(n)]),
                timeout=60,
            )
        assert e.value.code() == code and why in e.value.details(), e.value.details()
    assert not stub.StepBatch(pb.StepBatchRequest(), timeout=10).replies
    for sid in ("sb-a", "sb-e"):
        stub.Release(pb.SessionRequest(session_id=sid, route_epoch=0), timeout=10)


@pytest.mark.slow
def test_killed_tail_is_a_clear_error_and_a_restart_recovers_by_reprefill(embedded_model, whole_tokens, tokenizer):
    head, tail = Worker(embedded_model, "0-14"), Worker(embedded_model, "15-29")
    try:
        client = RouteClient([RemoteStage(head.address, timeout_s=10), RemoteStage(tail.address, timeout_s=10)])
        session = client.session("survivor")
        prompt = PROMPTS[0]
        stream = session.stream(tokenizer.tokenize(prompt), N_TOKENS)
        got = [next(stream) for _ in range(8)]
        tail.stop(signal.SIGKILL)
        with pytest.raises(RouteError) as e:
            got.append(next(stream))
        assert "UNAVAILABLE" in str(e.value)
        # the same worker comes back on the same port, with an empty cache
        tail = Worker(embedded_model, "15-29", port=tail.port)
        out = session._step(StepKind.DECODE, [got[-1]])  # the next step: a miss on the tail, then a re-prefill
        assert session.reprefills == 1
        got.append(out.token_id)
        while len(got) < N_TOKENS:
            got.append(session._step(StepKind.DECODE, [got[-1]]).token_id)
        assert got == whole_tokens[prompt]
        # a micro-batch whose sessions all miss on a restarted tail is re-prefilled together
        group = [client.session(f"group-{i}") for i in range(3)]
        prompts = [tokenizer.tokenize(p) for p in PROMPTS[1:4]]
        outs = client.step_sessions(StepKind.PREFILL, group, prompts)
        tail.stop(signal.SIGKILL)
        tail = Worker(embedded_model, "15-29", port=tail.port)
        history = [list(p) + [o.token_id] for p, o in zip(prompts, outs)]
        for _ in range(4):
            outs = client.step_sessions(StepKind.DECODE, group, [[h[-1]] for h in history])
            for h, o in zip(history, outs):
                h.append(o.token_id)
        assert [s.reprefills for s in group] == [1, 1, 1]
        for h, p, prompt_ids in zip(history, PROMPTS[1:4], prompts):
            assert h[len(prompt_ids) :] == whole_tokens[p][:5]
    finally:
        head.stop()
        tail.stop()


def test_epoch_change_mid_session_continues_with_the_same_tokens(workers, whole_tokens, tokenizer):
    head, tail = workers
    stages = [RemoteStage(head.address), RemoteStage(tail.address)]
    client = RouteClient(stages)
    s = client.session("mover")
    stream = s.stream(tokenizer.tokenize(PROMPTS[1]), N_TOKENS)
    got = [next(stream) for _ in range(5)]
    client.change_route([RemoteStage(head.address), RemoteStage(tail.address)])  # new route, new epoch
    got += list(stream)
    assert got == whole_tokens[PROMPTS[1]]
    assert s.epoch == 1 and s.reprefills == 1
    # the old epoch's state was superseded on both workers: a stale request is a typed reply
    stub = pb_grpc.ShardServiceStub(grpc.insecure_channel(head.address))
    r = stub.Decode(pb.StepRequest(session_id="mover", route_epoch=0, token_ids=[1]), timeout=10)
    assert r.outcome == pb.OUTCOME_STALE_EPOCH and r.current_epoch == 1
    s.release()


def test_malformed_requests_get_typed_replies_and_the_worker_keeps_serving(workers):
    head, tail = workers
    tail_stub = pb_grpc.ShardServiceStub(grpc.insecure_channel(tail.address))
    head_stub = pb_grpc.ShardServiceStub(grpc.insecure_channel(head.address))
    x = np.zeros((2, 576), np.float32)
    cases = {
        "wrong shape": pb.StepRequest(
            session_id="m", route_epoch=0, hidden=pb.Tensor(shape=[2, 575], data=x.tobytes())
        ),
        "wrong dtype": pb.StepRequest(
            session_id="m", route_epoch=0, hidden=pb.Tensor(shape=[2, 576], dtype=9, data=x.tobytes())
        ),
        "truncated bytes": pb.StepRequest(
            session_id="m", route_epoch=0, hidden=pb.Tensor(shape=[2, 576], data=x.tobytes()[:-1])
        ),
        "tokens to a non-head": pb.StepRequest(session_id="m", route_epoch=0, token_ids=[1, 2]),
        "no input": pb.StepRequest(session_id="m", route_epoch=0),
        "empty session id": pb.StepRequest(session_id="", route_epoch=0, hidden=encode_tensor(x)),
        "negative epoch": pb.StepRequest(session_id="m", route_epoch=-4, hidden=encode_tensor(x)),
        "NaN rows": pb.StepRequest(
            session_id="m", route_epoch=0, hidden=encode_tensor(np.full((1, 576), np.nan, np.float32))
        ),
        "q8_0 rows, a byte short": pb.StepRequest(
            session_id="m",
            route_epoch=0,
            hidden=pb.Tensor(shape=[2, 576], dtype=pb.DTYPE_Q8_0, data=encode_tensor(x, pb.DTYPE_Q8_0).data[:-1]),
        ),
        "q8_0 rows, an infinite scale": pb.StepRequest(
            session_id="m",
            route_epoch=0,
            hidden=pb.Tensor(
                shape=[1, 576], dtype=pb.DTYPE_Q8_0, data=(np.float16(np.inf).tobytes() + b"\1" * 32) * 18
            ),
        ),
        "unknown reply dtype": pb.StepRequest(session_id="m", route_epoch=0, hidden=encode_tensor(x), reply_dtype=9),
    }
    for name, req in cases.items():
        r = tail_stub.Prefill(req, timeout=10)
        assert r.outcome == pb.OUTCOME_INVALID_ARGUMENT, name
        assert r.detail, name
    r = head_stub.Prefill(pb.StepRequest(session_id="m", route_epoch=0, token_ids=[10**6]), timeout=10)
    assert r.outcome == pb.OUTCOME_INVALID_ARGUMENT
    r = head_stub.Prefill(
        pb.StepRequest(session_id="m", route_epoch=0, token_ids=[1], recipe_fingerprint="0" * 64), timeout=10
    )
    assert r.outcome == pb.OUTCOME_INCOMPATIBLE_RECIPE
    # unknown fields: a newer client's message parses, extra fields are ignored
    raw = pb.StepRequest(session_id="u", route_epoch=0, token_ids=[1, 2]).SerializeToString() + b"\xf8\x07\x01"
    ch = grpc.insecure_channel(head.address)
    call = ch.unary_unary(
        "/llama_shard.v1.ShardService/Prefill",
        request_serializer=lambda b: b,
        response_deserializer=pb.StepReply.FromString,
    )
    assert call(raw, timeout=10).outcome == pb.OUTCOME_OK
    # garbage bytes are a clean gRPC status, not a crash
    with pytest.raises(grpc.RpcError) as e:
        call(b"\xff\xff\xff\xff", timeout=10)
    assert e.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNKNOWN)
    # an oversized message is refused by the transport
    big = pb.StepRequest(session_id="m", route_epoch=0, hidden=pb.Tensor(shape=[70000, 576], data=b"\0" * (65 * 2**20)))
    with pytest.raises(grpc.RpcError) as e:
        tail_stub.Prefill(big, timeout=30)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # and the worker still serves
    assert head_stub.Resolve(pb.SessionRequest(session_id="u", route_epoch=0), timeout=10).seq_len == 2
    head_stub.Release(pb.SessionRequest(session_id="u", route_epoch=0), timeout=10)


def test_release_racing_decode_is_safe(workers, tokenizer):
    head, tail = workers
    client = RouteClient([RemoteStage(head.address), RemoteStage(tail.address)])
    stop = threading.Event()
    errors = []

    def releaser():
        stub = pb_grpc.ShardServiceStub(grpc.insecure_channel(head.address))
        while not stop.is_set():
            stub.Release(pb.SessionRequest(session_id="racer", route_epoch=0), timeout=10)
            time.sleep(0.002)

    t = threading.Thread(target=releaser)
    t.start()
    try:
        s = client.session("racer")
        s.generate(tokenizer.tokenize(PROMPTS[2]), 12)  # misses are re-prefilled; nothing breaks
    except RouteError as e:
        errors.append(e)  # giving up after repeated misses is a clean, typed failure
    finally:
        stop.set()
        t.join()
    info = RemoteStage(head.address).stats()
    assert info.reserved_tokens == sum(x.seq_len for x in info.sessions)
    assert all("still a cache miss" in str(e) for e in errors)


def test_metrics_and_health(workers):
    head, _ = workers
    text = urllib.request.urlopen(f"http://127.0.0.1:{head.metrics_port}/metrics", timeout=10).read().decode()
    for name in (
        "llama_shard_live_sessions",
        "llama_shard_reserved_tokens",
        "llama_shard_budget_tokens",
        "llama_shard_cache_misses_total",
        "llama_shard_evictions_total",
        "llama_shard_step_seconds_bucket",
        "llama_shard_warm_sessions",
        "llama_shard_spills_total",
        "llama_shard_restores_total",
        "llama_shard_restore_seconds_bucket",
        "llama_shard_disk_bytes",
    ):
        assert name in text, name
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(head.address))
    r = stub.Check(health_pb2.HealthCheckRequest(service="llama_shard.v1.ShardService"), timeout=10)
    assert r.status == health_pb2.HealthCheckResponse.SERVING


def test_sigterm_with_live_sessions_exits_zero_and_reports(embedded_model, tokenizer):
    w = Worker(embedded_model, "0-29")
    client = RouteClient([RemoteStage(w.address)])
    for i in range(3):
        client.session(f"live-{i}").generate(tokenizer.tokenize(PROMPTS[i]), 4)
    t0 = time.perf_counter()
    code, err = w.stop(signal.SIGTERM)
    assert code == 0
    assert time.perf_counter() - t0 < 10
    assert "released 3 session(s)" in err


@pytest.mark.slow
def test_a_worker_with_a_disk_tier_resumes_its_sessions_after_a_restart(embedded_model, tokenizer, tmp_path):
    """SIGTERM writes every session to --warm-dir; a worker restarted on it continues them without
    a re-prefill, and the tokens are those of a conversation that never saw the restart."""
    extra = ("--warm-dir", str(tmp_path / "kv"), "--warm-disk", "64MiB")
    w = Worker(embedded_model, "0-29", extra=extra)
    client = RouteClient([RemoteStage(w.address)])
    turn1, turn2 = tokenizer.tokenize(PROMPTS[0]), tokenizer.tokenize(" And Germany's?")
    a = client.session("a")
    first = a.generate(turn1, 4)
    code, err = w.stop(signal.SIGTERM)
    assert code == 0 and "wrote 1 session(s)" in err, err[-2000:]

    w = Worker(embedded_model, "0-29", port=w.port, extra=extra)
    try:
        client = RouteClient([RemoteStage(w.address)])
        info = client.stages[0].stats()
        assert [(s.session_id, s.tier) for s in info.sessions] == [("a", "disk")]
        reply = client.stages[0].stub.Resolve(pb.SessionRequest(session_id="a", route_epoch=a.epoch), timeout=10)
        assert (reply.outcome, reply.tier, reply.seq_len) == (pb.OUTCOME_OK, "disk", len(turn1) + 3)  # not moved
        a.client = client
        second = a.generate([first[-1], *turn2], 4)
        assert a.reprefills == 0
        ref = client.session("ref")
        assert ref.generate(turn1, 4) == first
        assert ref.generate([first[-1], *turn2], 4) == second
        assert client.stages[0].stats().restores >= 1
    finally:
        w.stop()


@pytest.mark.slow
def test_a_quiet_worker_applies_its_ttl(embedded_model, tokenizer):
    """No request arrives after the session's: the worker's own sweep evicts it after --ttl."""
    w = Worker(embedded_model, "0-29", extra=("--ttl", "3", "--sweep-seconds", "0.2"))
    try:
        client = RouteClient([RemoteStage(w.address)])
        client.session("idle").generate(tokenizer.tokenize(PROMPTS[0]), 2)
        assert client.stages[0].stats().live_sessions == 1
        deadline = time.monotonic() + 20  # the TTL and a sweep, however late a loaded machine runs it
        while client.stages[0].stats().evictions_ttl == 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        info = client.stages[0].stats()
        assert (info.live_sessions, info.evictions_ttl) == (0, 1)
    finally:
        w.stop()


@pytest.mark.slow
def test_demo_runs_end_to_end():
    res = subprocess.run(
        [sys.executable, "-m", "llama_shard.cli", "demo", "--max-tokens", "16"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = res.stdout
    assert "four concurrent chat sessions through both workers, each a Generate stream" in out and "[chat-1]" in out
    # the demo renders a chat as the endpoint and `generate --chat` do (the model's own template): the
    # same answer to the same question (test_openai_http compares the endpoint with generate --chat)
    first = next(line for line in out.splitlines() if line.startswith("  [chat-1]") and "user:" not in line)
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "llama_shard.cli",
            "generate",
            "--prompt",
            "What is the capital of France?",
            "--chat",
            "--max-tokens",
            "16",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert cli.returncode == 0, cli.stderr[-2000:]
    assert cli.stdout.strip().startswith(first.removeprefix("  [chat-1] ").strip()[:12]), (first, cli.stdout)
    assert out.count("0 live session(s) [none]; 0 of 2048 budget tokens reserved") == 2
    assert out.count(": exit 0") == 2


# --- chained routes: the head worker forwards to the tail itself ----------------------------------


@pytest.fixture(scope="module")
def chain(embedded_model):
    """A tail, and a head whose operator allows it to forward to that tail (serve --peer)."""
    tail = Worker(embedded_model, "15-29")
    head = Worker(embedded_model, "0-14", extra=("--peer", tail.address))
    yield head, tail
    for w in (head, tail):
        w.stop()


@pytest.mark.slow
def test_a_chained_route_gives_the_whole_models_tokens(chain, whole_tokens, tokenizer):
    head, tail = chain
    stages = [RemoteStage(head.address), RemoteStage(tail.address)]
    client = RouteClient(stages)
    assert client.chained and not RouteClient(stages, chained=False).chained
    tail_before = stages[1].stats().engine_requests
    s = client.session("chained-one")
    assert s.generate(tokenizer.tokenize(PROMPTS[0]), N_TOKENS) == whole_tokens[PROMPTS[0]]
    # every step reached the tail through the head: the tail served one request per step
    assert stages[1].stats().engine_requests - tail_before == N_TOKENS
    s.release()
    # micro-batched pipelining over the chain: two groups of four, each group one message per step
    sessions = [client.session(f"chained-{i}") for i in range(8)]
    got = client.generate_many(sessions, [tokenizer.tokenize(p) for p in PROMPTS], N_TOKENS, micro_batches=2)
    assert got == [whole_tokens[p] for p in PROMPTS]
    for sess in sessions:
        sess.release()


@pytest.mark.slow
def test_a_heads_wire_dtype_is_its_routes_default_and_a_request_may_name_another(
    embedded_model, whole_tokens, tokenizer
):
    """serve --wire-dtype q8_0: the head's own route sends q8_0 rows (34 bytes per 32 values) when a
    Generate request names no type; one naming f32 gets exact rows, and the whole model's tokens."""
    tail = Worker(embedded_model, "15-29")
    head = Worker(embedded_model, "0-14", extra=("--peer", tail.address, "--wire-dtype", "q8_0"))
    try:
        stub = pb_grpc.ShardServiceStub(grpc.insecure_channel(head.address))
        info = stub.Info(pb.InfoRequest(), timeout=10)
        assert info.wire_dtype == pb.DTYPE_Q8_0
        assert list(info.wire_dtypes) == [pb.DTYPE_FLOAT32, pb.DTYPE_FLOAT16, pb.DTYPE_Q8_0]

        def generate(sid: str, prompt: list[int], **wire) -> list[int]:
            req = pb.GenerateRequest(
                session_id=sid, route_epoch=0, prompt=prompt, max_tokens=N_TOKENS, max_drafts=0, **wire
            )
            events = list(stub.Generate(req, timeout=60))
            assert events[-1].final.finish_reason == "length", events[-1]
            return [e.token.token_id for e in events if e.HasField("token")]

        def forwarded() -> dict[str, int]:
            return dict(stub.Info(pb.InfoRequest(), timeout=10).forwarded_hidden_bytes)

        agree = 0
        for i, p in enumerate(PROMPTS[:4]):
            prompt = tokenizer.tokenize(p)
            rows = len(prompt) + N_TOKENS - 1  # every computed token's row but the last sampled one's
            before = forwarded()
            got = generate(f"q8-{i}", prompt)
            after = forwarded()
            assert after.get("q8_0", 0) - before.get("q8_0", 0) == rows * 576 // 32 * 34
            assert after.get("f32", 0) == before.get("f32", 0)
            agree += got == whole_tokens[p]
            assert generate(f"f32-{i}", prompt, wire_dtype=pb.DTYPE_FLOAT32) == whole_tokens[p]
            assert forwarded().get("f32", 0) - after.get("f32", 0) == rows * 576 * 4
        print(f"q8_0 rows: {agree} of 4 prompts gave the whole model's {N_TOKENS} greedy tokens")
    finally:
        for w in (head, tail):
            w.stop()


def test_a_peer_that_cannot_read_the_heads_wire_dtype_is_refused_naming_it():
    from types import SimpleNamespace

    from llama_shard import InvalidInputError
    from llama_shard.head.replicas import Replicas

    own = SimpleNamespace(n_layer=30, n_embd=576, architecture="llama", first=0, last=14)
    older = pb.InfoReply(n_layer=30, n_embd=576, architecture="llama", first=15, last=29)  # lists no wire types
    newer = pb.InfoReply(
        n_layer=30,
        n_embd=576,
        architecture="llama",
        first=15,
        last=29,
        wire_dtypes=[pb.DTYPE_FLOAT32, pb.DTYPE_FLOAT16, pb.DTYPE_Q8_0],
    )
    with pytest.raises(InvalidInputError, match="peer old:1 reads hidden rows as f32, f16; this head sends q8_0"):
        Replicas(own, "", "", "me", ("old:1",), lambda address, timeout: older, wire_dtype=pb.DTYPE_Q8_0).start(
            wait_s=1
        )
    for info, wire in ((older, pb.DTYPE_FLOAT16), (newer, pb.DTYPE_Q8_0)):
        r = Replicas(own, "", "", "me", ("p:1",), lambda address, timeout, info=info: info, wire_dtype=wire).start(
            wait_s=1
        )
        assert r.complete()
        r.stop()


def test_a_worker_forwards_only_to_the_peers_its_operator_allows(chain, workers):
    head, tail = chain
    other_tail = workers[1]  # a real worker, but not one this head's operator named
    with grpc.insecure_channel(head.address) as ch:
        stub = pb_grpc.ShardServiceStub(ch)
        before = stub.Info(pb.InfoRequest(), timeout=10)
        assert list(before.peers) == [tail.address]
        for address in (other_tail.address, "10.0.0.1:50051", "evil.example:443", ""):
            req = pb.StepRequest(
                session_id="fwd", route_epoch=0, token_ids=[1, 2, 3], forward=[pb.Hop(address=address)]
            )
            r = stub.Prefill(req, timeout=10)
            assert r.outcome == pb.OUTCOME_INVALID_ARGUMENT and "does not forward" in r.detail, r
            batch = pb.StepBatchRequest(
                steps=[pb.BatchedStep(kind=pb.STEP_KIND_PREFILL, step=req)], forward=[pb.Hop(address=address)]
            )
            assert stub.StepBatch(batch, timeout=10).replies[0].outcome == pb.OUTCOME_INVALID_ARGUMENT
        after = stub.Info(pb.InfoRequest(), timeout=10)
        assert after.engine_requests == before.engine_requests  # nothing was computed
        r = stub.Resolve(pb.SessionRequest(session_id="fwd", route_epoch=0), timeout=10)
        assert r.outcome == pb.OUTCOME_CACHE_MISS and r.miss_reason == "UNKNOWN_SESSION"
    with grpc.insecure_channel(tail.address) as ch:  # the tail has nothing to forward to
        x = np.zeros((1, 576), np.float32)
        r = pb_grpc.ShardServiceStub(ch).Decode(
            pb.StepRequest(
                session_id="fwd", route_epoch=0, hidden=encode_tensor(x), forward=[pb.Hop(address=head.address)]
            ),
            timeout=10,
        )
        assert r.outcome == pb.OUTCOME_INVALID_ARGUMENT and "tail" in r.detail


def test_a_huge_prompt_is_refused_before_anything_is_allocated(chain):
    """2,000,000 token ids (8 MB on the wire) for a head with 576-wide rows would need 4.6 GB of
    output: the worker answers BUDGET_EXCEEDED at once and keeps serving."""
    head, _ = chain
    with grpc.insecure_channel(head.address, options=[("grpc.max_send_message_length", 64 * 2**20)]) as ch:
        stub = pb_grpc.ShardServiceStub(ch)
        before = stub.Info(pb.InfoRequest(), timeout=10)
        r = stub.Prefill(pb.StepRequest(session_id="huge", route_epoch=0, token_ids=[1] * 2_000_000), timeout=60)
        assert r.outcome == pb.OUTCOME_BUDGET_EXCEEDED, r
        after = stub.Info(pb.InfoRequest(), timeout=10)
        assert (after.live_sessions, after.reserved_tokens) == (before.live_sessions, before.reserved_tokens)
        # and it keeps serving: the same session id with a prompt that fits
        r = stub.Prefill(pb.StepRequest(session_id="huge", route_epoch=0, token_ids=[1, 2, 3]), timeout=60)
        assert r.outcome == pb.OUTCOME_OK, r
        stub.Release(pb.SessionRequest(session_id="huge", route_epoch=0), timeout=10)


def test_a_miss_on_the_chain_names_its_stage_and_the_client_reprefills(chain, whole_tokens, tokenizer):
    head, tail = chain
    # the client-driven loop on a chained route (a Generate stream would run ahead of what is read;
    # the head's own loop and its re-prefill are tests/test_generate.py's)
    client = RouteClient([RemoteStage(head.address), RemoteStage(tail.address)], route_loop=False)
    s = client.session("chained-miss")
    stream = s.stream(tokenizer.tokenize(PROMPTS[2]), N_TOKENS)
    got = [next(stream) for _ in range(6)]
    with grpc.insecure_channel(tail.address) as ch:  # the tail alone drops the session
        pb_grpc.ShardServiceStub(ch).Release(pb.SessionRequest(session_id="chained-miss", route_epoch=0), timeout=10)
    with grpc.insecure_channel(head.address) as ch:
        r = pb_grpc.ShardServiceStub(ch).Decode(
            pb.StepRequest(
                session_id="chained-miss",
                route_epoch=0,
                token_ids=[got[-1]],
                position=len(tokenizer.tokenize(PROMPTS[2])) + 5,
                forward=[pb.Hop(address=tail.address)],
            ),
            timeout=10,
        )
        assert r.outcome == pb.OUTCOME_CACHE_MISS and r.miss_reason == "RELEASED" and r.stage == 1
    # the head now holds one token more than the route: the client's next step re-prefills
    got += list(stream)
    assert got == whole_tokens[PROMPTS[2]] and s.reprefills == 1
    s.release()


@pytest.mark.slow
def test_a_killed_tail_on_a_chained_route_is_a_clear_error_then_a_reprefill(embedded_model, whole_tokens, tokenizer):
    tail = Worker(embedded_model, "15-29")
    head = Worker(embedded_model, "0-14", extra=("--peer", tail.address))
    try:
        # the client-driven loop on a chained route (the head's own loop: tests/test_generate.py)
        client = RouteClient(
            [RemoteStage(head.address, timeout_s=10), RemoteStage(tail.address, timeout_s=10)], route_loop=False
        )
        assert client.chained
        session = client.session("chained-survivor")
        stream = session.stream(tokenizer.tokenize(PROMPTS[0]), N_TOKENS)
        got = [next(stream) for _ in range(8)]
        tail.stop(signal.SIGKILL)
        with pytest.raises(RouteError) as e:
            got.append(next(stream))
        assert "UNAVAILABLE" in str(e.value) and "stage 1" in str(e.value) and tail.address in str(e.value)
        tail = Worker(embedded_model, "15-29", port=tail.port)
        out = session._step(StepKind.DECODE, [got[-1]])
        assert session.reprefills == 1
        got.append(out.token_id)
        while len(got) < N_TOKENS:
            got.append(session._step(StepKind.DECODE, [got[-1]]).token_id)
        assert got == whole_tokens[PROMPTS[0]]
    finally:
        head.stop()
        tail.stop()


def _peak_and_current_rss(pid: int) -> tuple[int, int]:
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                fields[key] = int(value.split()[0]) * 1024
    return fields["VmHWM"], fields["VmRSS"]


def test_maximum_size_messages_under_concurrency_keep_the_workers_memory_bounded(embedded_model):
    """max_concurrent_rpcs callers each send the largest message the worker parses: 16 token lists
    of one-byte ids (each becomes a 4-byte int when parsed), then 16 hidden tensors, then 16 that
    are one KiB too large. What may be alive at once: each call's bytes as gRPC received them and
    Python's copy (2 x max_concurrent_rpcs x the largest request), and what is parsed and held by
    handlers, at most max_in_flight_request_bytes admitted at once, 5x its size once parsed. Before
    the ids were counted ahead of list(), one 60 MB request alone took the worker to 1.89 GB.
    Measured here: +259-261 MiB over a resting 149 MiB, for a bound of 2 x 16 x 9.6 + 5 x 19.1 MB."""
    from concurrent.futures import ThreadPoolExecutor

    proc, address = start_worker(embedded_model, 0, 5, 1, extra=("--max-concurrent-rpcs", "16"))
    try:
        wait_serving(proc, address)
        with grpc.insecure_channel(
            address,
            options=[("grpc.max_send_message_length", 256 * 2**20), ("grpc.max_receive_message_length", 64 * 2**20)],
        ) as ch:
            stub = pb_grpc.ShardServiceStub(ch)
            info = stub.Info(pb.InfoRequest(), timeout=10)
            limit, in_flight = info.max_request_bytes, info.max_in_flight_request_bytes
            assert limit == 8 * (512 * (576 * 4 + 8) + 4096) + (1 << 16) and in_flight == 2 * limit
            assert (
                stub.Prefill(
                    pb.StepRequest(session_id="warm-up", route_epoch=0, token_ids=[1, 2, 3]), timeout=60
                ).outcome
                == pb.OUTCOME_OK
            )
            _, resting = _peak_and_current_rss(proc.pid)

            head = pb.StepRequest(session_id="big", route_epoch=0).SerializeToString()
            field = pb.StepRequest.DESCRIPTOR.fields_by_name["token_ids"].number

            def packed_ids(total: int) -> bytes:  # a packed repeated int32 of ids 1, filling `total` bytes
                for n in range(total - len(head) - 2, 0, -1):
                    body = b"\x01" * n
                    out = head + varint(field << 3 | 2) + varint(len(body)) + body
                    if len(out) <= total:
                        return out
                raise AssertionError

            rows = (limit - 1024) // (576 * 4)
            hidden = pb.StepRequest(
                session_id="big",
                route_epoch=0,
                hidden=pb.Tensor(shape=[rows, 576], dtype=pb.DTYPE_FLOAT32, data=bytes(rows * 576 * 4)),
            ).SerializeToString()
            waves = {
                "token ids": packed_ids(limit),
                "hidden rows": hidden,
                "one KiB too large": packed_ids(limit + 1024),
            }
            assert len(waves["token ids"]) == limit and len(hidden) <= limit
            prefill = ch.unary_unary(
                "/llama_shard.v1.ShardService/Prefill",
                request_serializer=lambda b: b,
                response_deserializer=pb.StepReply.FromString,
            )

            def send(message: bytes) -> str:
                try:
                    return pb.Outcome.Name(prefill(message, timeout=120).outcome)
                except grpc.RpcError as e:
                    return e.code().name

            seen = {}
            for name, message in waves.items():
                with ThreadPoolExecutor(16) as pool:
                    seen[name] = sorted(set(pool.map(send, [message] * 16)))
            peak, _ = _peak_and_current_rss(proc.pid)
            assert proc.poll() is None
            print(
                f"largest request {limit / 1e6:.1f} MB, in flight {in_flight / 1e6:.1f} MB; resting RSS "
                f"{resting / 2**20:.0f} MiB, peak {peak / 2**20:.0f} MiB (+{(peak - resting) / 2**20:.0f}); {seen}"
            )
            assert set(seen["token ids"]) <= {"OUTCOME_BUDGET_EXCEEDED", "RESOURCE_EXHAUSTED"}
            assert set(seen["hidden rows"]) <= {
                "OUTCOME_INVALID_ARGUMENT",
                "OUTCOME_BUDGET_EXCEEDED",
                "RESOURCE_EXHAUSTED",
            }
            assert seen["one KiB too large"] == ["RESOURCE_EXHAUSTED"]
            assert peak - resting <= 2 * 16 * limit + 5 * in_flight, (peak - resting) / 2**20
            r = stub.Prefill(pb.StepRequest(session_id="after", route_epoch=0, token_ids=[1, 2, 3]), timeout=60)
            assert r.outcome == pb.OUTCOME_OK
    finally:
        stop_worker(proc)


def test_admission_bounds_the_request_bytes_parsed_and_held_at_once():
    """AdmitRequests in isolation: a request is admitted while the bytes already admitted leave room,
    refused (RESOURCE_EXHAUSTED, nothing parsed) when they do not, and its share comes back when the
    handler returns, raises, or when gRPC drops the call before the handler runs."""
    import gc

    from llama_shard.worker.admission import AdmitRequests

    parsed = []

    def behavior(request, context):
        if request.session_id.startswith("raise"):
            raise RuntimeError("handler failed")
        return request.session_id

    handler = grpc.unary_unary_rpc_method_handler(
        behavior, request_deserializer=lambda b: parsed.append(b) or pb.StepRequest.FromString(b)
    )
    admission = AdmitRequests(max_in_flight_bytes=100)
    wrapped = admission.intercept_service(lambda _details: handler, type("D", (), {"method": "/x/Prefill"})())

    class Context:
        def abort(self, code, details):
            raise grpc.RpcError(code, details)

    def message(sid: str, size: int) -> bytes:
        return pb.StepRequest(session_id=sid + "x" * (size - len(sid) - 2)).SerializeToString()

    a = wrapped.request_deserializer(message("a", 60))
    assert admission.in_flight.held == 60
    b = wrapped.request_deserializer(message("b", 60))  # 120 > 100: refused, not parsed
    assert admission.in_flight.held == 60 and len(parsed) == 1
    with pytest.raises(grpc.RpcError) as refused:
        wrapped.unary_unary(b, Context())
    assert refused.value.args[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert wrapped.unary_unary(a, Context()).startswith("a") and admission.in_flight.held == 0
    c = wrapped.request_deserializer(message("raise", 90))
    with pytest.raises(RuntimeError):
        wrapped.unary_unary(c, Context())
    assert admission.in_flight.held == 0
    d = wrapped.request_deserializer(message("d", 90))  # a call dropped before its handler
    assert admission.in_flight.held == 90
    del d
    gc.collect()
    assert admission.in_flight.held == 0
    bad = wrapped.request_deserializer(b"\xff\xff\xff")  # does not parse: nothing held
    assert admission.in_flight.held == 0
    with pytest.raises(grpc.RpcError) as unparsable:
        wrapped.unary_unary(bad, Context())
    assert unparsable.value.args[0] == grpc.StatusCode.INVALID_ARGUMENT
