"""A route that survives its nodes: replicas of a stage, failover mid-stream, health that tells the
truth, and drain that hands live sessions to a replica (head/replicas.py, worker/handover.py).

What is shown here, on live workers over loopback with SmolLM2 (one thread each, as the whole-model
reference in test_generate.py):
- the head places each session on one replica per stage (the least loaded) and lists them in Info;
- a tail replica killed (SIGKILL) under 8 concurrent streams, greedy and seeded: every stream ends
  `length` with exactly the tokens of the same run without the kill, its failovers and re-prefilled
  tokens counted in the final event; the longest stall between two tokens is printed;
- the same for the middle stage of a three-worker route with two middle replicas;
- the head's gRPC health and HTTP /health say NOT_SERVING / 503 naming the stage while its only
  replica is down, and SERVING / 200 once it is back; the replica's gauge follows;
- two peers of one range that compute differently are refused at the head's start, naming both;
- a tail replica stopped with SIGTERM under 8 live streams hands every session to the other replica:
  0 re-prefills, the same tokens;
- chaos: replicas of the middle and the tail stage killed or stopped and restarted at random while
  16 clients stream completions from the OpenAI endpoint: no request fails, every greedy completion
  is the undisturbed route's, and nothing stays reserved once the sessions' TTL passed
  (LLAMA_SHARD_CHAOS_SECONDS, default 20; the benchmark's failover section runs 300).
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llama_shard._native import SamplingParams, ShardModel
from llama_shard.local_workers import free_port, start_worker, stop_worker
from llama_shard.proto import shard_pb2 as pb
from llama_shard.proto.requests import sampling_to_wire
from llama_shard.testing.chaos import ChaosMonkey, Mesh
from llama_shard.worker.handover import handover_messages

pytestmark = pytest.mark.grpc

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The three primary colours are",
]
SEEDED = dict(temperature=0.9, top_k=40, top_p=0.95, min_p=0.05)


#: a grammar on some seeded streams: its state follows the session through a failover or a move
WORDS = 'root ::= [A-Za-z] [a-z ,.]+'


def _request(sid: str, prompt: list[int], n: int, seed: int | None, grammar: str = "") -> pb.GenerateRequest:
    req = pb.GenerateRequest(session_id=sid, prompt=prompt, max_tokens=n)  # no forward: the head's own route
    if seed is not None:
        req.sampling.CopyFrom(sampling_to_wire(SamplingParams(seed=seed, grammar=grammar, **SEEDED)))
    return req


def _run_streams(mesh: Mesh, tag: str, prompts, n: int, on_token=None) -> list[dict]:
    """8 concurrent streams (even: greedy, odd: seeded, 3 and 7 under a grammar too) on the head; each one's tokens, final event
    and the longest gap between two of its tokens. `on_token(i, count)` runs in stream i's thread."""
    results: list[dict] = [{} for _ in range(8)]

    def run(i: int) -> None:
        req = _request(
            f"{tag}-{i}", prompts[i % len(prompts)], n, None if i % 2 == 0 else 1000 + i, WORDS if i % 4 == 3 else ""
        )
        tokens, gaps, last = [], [], None
        for event in mesh.stub().Generate(req, timeout=180):
            now = time.monotonic()
            if event.HasField("final"):
                results[i] = {"tokens": tokens, "final": event.final, "stall": max(gaps, default=0.0)}
                return
            if last is not None:
                gaps.append(now - last)
            last = now
            tokens.append(event.token.token_id)
            if on_token is not None:
                on_token(i, len(tokens))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    assert all(r for r in results), "a stream did not end"
    return results


@pytest.fixture(scope="module")
def prompts(embedded_model):
    vocab = ShardModel(str(embedded_model), (0, 0), 1)
    return [vocab.tokenize(p) for p in PROMPTS]


def mesh_holder(mesh: Mesh, session_id: str, among) -> int:
    """Which of the workers `among` holds the session (by their Info)."""
    return next(k for k in among if any(s.session_id == session_id for s in mesh.info(k).sessions))


def _kill_when(mesh: Mesh, candidates, after_tokens: int, sessions_tag: str):
    """An on_token callback: once every stream has `after_tokens` tokens, SIGKILL the candidate
    worker that holds the session of the stream that got there last (once). Returns (callback,
    what it killed)."""
    counts: dict[int, int] = {}
    killed: list[int] = []
    lock = threading.Lock()

    def on_token(i: int, n: int) -> None:
        with lock:
            counts[i] = n
            if killed or len(counts) < 8 or min(counts.values()) < after_tokens:
                return
            # the replica of the stream that has just got there: it is still running
            victim = mesh_holder(mesh, f"{sessions_tag}{i}", candidates)
            mesh.procs[victim].send_signal(signal.SIGKILL)
            killed.append(victim)

    return on_token, killed


@pytest.mark.slow
def test_a_killed_tail_replica_loses_no_token(embedded_model, prompts):
    # head 0-14, two tail replicas 15-29: the head lists both
    mesh = Mesh(
        embedded_model,
        [(0, 14), (15, 29), (15, 29)],
        [("--peer", "{1}", "--peer", "{2}", "--max-hop-seconds", "20"), (), ()],
    )
    try:
        mesh.start(1).start(2).start(0)
        replicas = mesh.info(0).replicas
        assert [(r.stage, r.first, r.last, r.state) for r in replicas] == [(1, 15, 29, "up")] * 2
        reference = _run_streams(mesh, "calm", prompts, 24)
        assert all(r["final"].finish_reason == "length" and r["final"].failovers == 0 for r in reference)
        # the least loaded replica takes each new session: 4 and 4
        assert sorted(r.sessions for r in mesh.info(0).replicas) == [4, 4]
        on_token, killed = _kill_when(mesh, (1, 2), 6, "kill-")
        t0 = time.monotonic()
        results = _run_streams(mesh, "kill", prompts, 24, on_token)
        seconds = time.monotonic() - t0
        assert killed, "the replica was not killed"
        for i, (calm, hit) in enumerate(zip(reference, results)):
            assert hit["final"].finish_reason == "length", (i, hit["final"])
            assert hit["tokens"] == calm["tokens"], i
        moved = [r for r in results if r["final"].failovers]
        assert 1 <= len(moved) <= 8 and all(r["final"].reprefilled_tokens > 0 for r in moved)
        stall = max(r["stall"] for r in moved)
        calm_stall = max(r["stall"] for r in reference)
        print(
            f"\n  8 streams, a tail replica killed: {len(moved)} failed over, all 8 exact; longest stall "
            f"{stall:.3f} s (without the kill {calm_stall:.3f} s); {seconds:.1f} s in all"
        )
        assert stall < calm_stall + 20.0  # within the hop's bound (--max-hop-seconds 20)
        info = mesh.info(0)
        assert info.failovers == len(moved)
        dead = [r for r in info.replicas if r.address == mesh.addresses[killed[0]]][0]
        assert dead.state in ("down", "probing") and dead.failovers == len(moved) and dead.last_error
        # the killed replica comes back: probed, up again, and the head uses it for new sessions
        mesh.start(killed[0])
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(r.state != "up" for r in mesh.info(0).replicas):
            time.sleep(0.2)
        assert all(r.state == "up" for r in mesh.info(0).replicas)
    finally:
        mesh.stop()


@pytest.mark.slow
def test_a_killed_middle_replica_of_a_three_worker_route_loses_no_token(embedded_model, prompts):
    mesh = Mesh(
        embedded_model,
        [(0, 9), (10, 19), (10, 19), (20, 29)],
        [("--peer", "{1}", "--peer", "{2}", "--peer", "{3}"), ("--peer", "{3}"), ("--peer", "{3}"), ()],
    )
    try:
        mesh.start(3).start(1).start(2).start(0)
        assert [(r.stage, r.first, r.last) for r in mesh.info(0).replicas] == [(1, 10, 19), (1, 10, 19), (2, 20, 29)]
        reference = _run_streams(mesh, "calm", prompts, 16)
        on_token, killed = _kill_when(mesh, (1, 2), 4, "kill-")
        results = _run_streams(mesh, "kill", prompts, 16, on_token)
        assert killed
        for i, (calm, hit) in enumerate(zip(reference, results)):
            assert hit["final"].finish_reason == "length" and hit["tokens"] == calm["tokens"], (i, hit["final"])
        assert sum(r["final"].failovers for r in results) >= 1
    finally:
        mesh.stop()


def _http_health(port: int) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/health")
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def _grpc_health(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status


def _until(predicate, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


@pytest.mark.slow
def test_health_says_which_stage_has_no_replica_and_recovers(embedded_model):
    http_port, metrics_port = free_port(), free_port()
    mesh = Mesh(
        embedded_model,
        [(0, 14), (15, 29)],
        [("--peer", "{1}", "--http-port", str(http_port), "--metrics-port", str(metrics_port)), ()],
    )
    try:
        mesh.start(1).start(0)
        assert _http_health(http_port) == (200, {"status": "ok"})
        tail = mesh.addresses[1]
        gauge = f'llama_shard_replica_up{{address="{tail}",stage="1"}}'

        def metric() -> str:
            return urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()

        assert _until(lambda: f"{gauge} 1.0" in metric())  # set by the head's first probe of the stage
        mesh.procs[1].send_signal(signal.SIGKILL)
        mesh.procs[1].wait()
        assert _until(lambda: _grpc_health(mesh.addresses[0]) == health_pb2.HealthCheckResponse.NOT_SERVING)
        status, body = _http_health(http_port)
        assert status == 503 and "stage 1 (layers 15-29)" in body["error"]["message"], body
        assert f"{gauge} 0.0" in metric()
        mesh.start(1)
        assert _until(lambda: _grpc_health(mesh.addresses[0]) == health_pb2.HealthCheckResponse.SERVING)
        assert _http_health(http_port)[0] == 200 and f"{gauge} 1.0" in metric()
    finally:
        mesh.stop()


@pytest.mark.slow
def test_replicas_that_compute_differently_are_refused_at_start_naming_both(embedded_model):
    mesh = Mesh(embedded_model, [(15, 29), (15, 29)], [("--flash-attn", "on"), ("--flash-attn", "off")])
    try:
        mesh.start(0).start(1)
        head, _ = start_worker(embedded_model, 0, 14, extra=("--peer", mesh.addresses[0], "--peer", mesh.addresses[1]))
        code, stderr = stop_worker(head, send_sigterm=False)
        assert code == 2, stderr[-2000:]
        assert mesh.addresses[0] in stderr and mesh.addresses[1] in stderr and "compute differently" in stderr
    finally:
        mesh.stop()


@pytest.mark.slow
def test_sigterm_hands_every_live_session_to_the_other_replica(embedded_model, prompts):
    mesh = Mesh(
        embedded_model,
        [(0, 14), (15, 29), (15, 29)],
        [("--peer", "{1}", "--peer", "{2}"), ("--replica", "{2}"), ("--replica", "{1}")],
    )
    try:
        mesh.start(1).start(2).start(0)
        reference = _run_streams(mesh, "calm", prompts, 24)
        stopped: list[int] = []
        counts: dict[int, int] = {}
        lock = threading.Lock()

        def on_token(i: int, n: int) -> None:
            with lock:
                counts[i] = n
                if stopped or len(counts) < 8 or min(counts.values()) < 6:
                    return
                victim = mesh_holder(mesh, f"drain-{i}", (1, 2))
                mesh.procs[victim].send_signal(signal.SIGTERM)
                stopped.append(victim)

        results = _run_streams(mesh, "drain", prompts, 24, on_token)
        assert stopped
        code = mesh.reap(stopped[0])
        stderr = mesh.stderr[stopped[0]][-1]
        assert code == 0, stderr[-2000:]
        line = [x for x in stderr.splitlines() if "handed" in x]
        print("\n  " + (line[0] if line else stderr[-500:]))
        other = 2 if stopped[0] == 1 else 1
        took = mesh.info(other)
        for i, (calm, hit) in enumerate(zip(reference, results)):
            assert hit["final"].finish_reason == "length" and hit["tokens"] == calm["tokens"], (i, hit["final"])
            assert hit["final"].reprefills == 0 and hit["final"].failovers == 0, (
                i,
                hit["final"],
                took.misses,
                took.evictions_lru,
                took.max_sessions,
            )
        assert sum(r["final"].moves for r in results) >= 1
        assert took.handover_sessions >= 1
    finally:
        mesh.stop()


@pytest.mark.slow
def test_a_drain_hands_idle_sessions_over_and_their_next_turn_computes_only_its_new_tokens(embedded_model, prompts):
    """8 sessions (greedy, seeded, two under a grammar) answer a first turn and go idle; the tail
    replica holding some of them is stopped (SIGTERM: a drain) and gone before their next turn. The
    head's record still places them there: it sends each next turn to the other replica, naming
    the drained one (StepRequest.handed_from), and that replica, which received their KV, goes on:
    0 re-prefilled tokens, and each turn's tokens are those of the same two turns undisturbed."""
    mesh = Mesh(
        embedded_model,
        [(0, 14), (15, 29), (15, 29)],
        [("--peer", "{1}", "--peer", "{2}"), ("--replica", "{2}"), ("--replica", "{1}")],
    )
    tail = [4, 13]  # each next turn's own new tokens

    def two_turns(tag: str, between=lambda: None) -> tuple[list[dict], list[dict]]:
        first = _run_streams(mesh, tag, prompts, 12)
        between()
        following = [prompts[i % len(prompts)] + first[i]["tokens"] + tail for i in range(8)]
        return first, _run_streams(mesh, tag, following, 8)

    try:
        mesh.start(1).start(2).start(0)
        _, calm = two_turns("calm")
        drained: list[int] = []

        def drain() -> None:
            victim = mesh_holder(mesh, "idle-0", (1, 2))
            mesh.procs[victim].send_signal(signal.SIGTERM)
            assert mesh.reap(victim) == 0, mesh.stderr[victim][-1][-2000:]
            drained.append(victim)

        first, turn = two_turns("idle", drain)
        other = 2 if drained[0] == 1 else 1
        took = mesh.info(other)
        print(
            f"\n  a drained replica's idle sessions: {took.handover_sessions} handed over; their next turns "
            f"re-prefilled {sum(r['final'].reprefilled_tokens for r in turn)} tokens, computed "
            f"{sum(r['final'].prompt_tokens - r['final'].cached_tokens for r in turn)} new prompt tokens; "
            f"failovers {sum(r['final'].failovers for r in turn)}"
        )
        assert took.handover_sessions >= 1
        for i, (calm_turn, hit) in enumerate(zip(calm, turn)):
            final = hit["final"]
            assert hit["tokens"] == calm_turn["tokens"] and final.finish_reason == "length", (i, final)
            assert final.reprefilled_tokens == 0 and final.reprefills == 0, (i, final)
            assert final.cached_tokens == len(prompts[i % len(prompts)]) + 12 - 1, (i, final)
    finally:
        mesh.stop()


@pytest.mark.slow
def test_chaos_on_the_openai_endpoint_fails_no_request(embedded_model, prompts):
    openai = pytest.importorskip("openai")
    seconds = float(os.environ.get("LLAMA_SHARD_CHAOS_SECONDS", "20"))
    http_port = free_port()
    common = ("--ttl", "4", "--sweep-seconds", "1", "--max-sessions", "16", "--budget-tokens", "8192")
    mesh = Mesh(
        embedded_model,
        [(0, 9), (10, 19), (10, 19), (20, 29), (20, 29)],
        [
            (
                "--peer",
                "{1}",
                "--peer",
                "{2}",
                "--peer",
                "{3}",
                "--peer",
                "{4}",
                "--http-port",
                str(http_port),
                *common,
            ),
            ("--peer", "{3}", "--peer", "{4}", "--replica", "{2}", *common),
            ("--peer", "{3}", "--peer", "{4}", "--replica", "{1}", *common),
            ("--replica", "{4}", *common),
            ("--replica", "{3}", *common),
        ],
    )
    try:
        for k in (3, 4, 1, 2, 0):
            mesh.start(k)
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{http_port}/v1", api_key="unused", max_retries=0, timeout=120
        )

        def complete(text: str) -> str:
            parts = client.completions.create(
                model=embedded_model.stem,
                prompt=text,
                max_tokens=12,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            return "".join(c.choices[0].text for c in parts if c.choices)

        oracle = {p: complete(p) for p in PROMPTS}
        failures: list[str] = []
        done = [0]
        stop = threading.Event()

        def client_loop(i: int) -> None:
            while not stop.is_set():
                prompt = PROMPTS[(i + done[0]) % len(PROMPTS)]
                try:
                    got = complete(prompt)
                except Exception as e:  # noqa: BLE001 - every failure is the test's
                    failures.append(f"client {i}: {e!r}")
                    continue
                if got != oracle[prompt]:
                    failures.append(f"client {i}: {prompt!r} gave {got!r}, not {oracle[prompt]!r}")
                done[0] += 1

        monkey = ChaosMonkey(mesh, [[1, 2], [3, 4]], period=(1.0, 2.5), down_s=(1.0, 2.0)).start()
        clients = [threading.Thread(target=client_loop, args=(i,)) for i in range(16)]
        for t in clients:
            t.start()
        monkey.run_for(seconds, kills=2)  # its kills, however long they take on a loaded machine
        monkey.stop()
        stop.set()
        for t in clients:
            t.join(180)
        kills = monkey.kills()
        print(
            f"\n  chaos for {seconds:g} s or more: {kills} replicas killed or stopped, {done[0]} completions, "
            f"{len(failures)} failed; head failovers {mesh.info(0).failovers}"
        )
        assert not monkey.errors, monkey.errors
        assert kills >= 2 and done[0] >= 16
        assert failures == [], failures[:5]
        assert mesh.info(0).generate_streams == 0
        # once the sessions' TTL has passed, no worker holds a token
        assert _until(lambda: all(mesh.info(k).reserved_tokens == 0 for k in range(5)), 30), [
            mesh.info(k).reserved_tokens for k in range(5)
        ]
    finally:
        mesh.stop()


def test_a_forged_or_foreign_hand_over_is_refused_and_changes_nothing(embedded_model):
    """The receiving side of a drain, over the wire: a genuine hand-over opens the session (and it
    steps on); bytes with a wrong digest, cut, with a position changed, random, of another range or
    model, for an owner this worker cannot have, at a stale epoch or past its context are refused
    with the receiver unchanged, and the worker serves on (a crash would fail every later call)."""
    import struct

    import numpy as np

    from llama_shard import HotKvStateConfig, HotKvStateManager, KvBoundaryAdapter
    from llama_shard.engine.hot_kv import ManualClock
    from llama_shard.proto.wire import encode_tensor

    mesh = Mesh(embedded_model, [(15, 29)], [()])
    try:
        mesh.start(0)
        tail = mesh.stub(0)
        info = mesh.info(0)
        cfg = HotKvStateConfig(max_sessions=2, context_tokens=128, budget_tokens=256, ttl_seconds=0)
        donors = {
            r: HotKvStateManager(ShardModel(str(embedded_model), r, 1), cfg, ManualClock(), n_batch=64)
            for r in ((15, 29), (0, 14))
        }
        rows = np.full((20, info.n_embd), 0.01, np.float32)
        KvBoundaryAdapter(donors[(15, 29)].model, donors[(15, 29)]).prefill("s", 0, boundary=rows, start_pos=0)
        KvBoundaryAdapter(donors[(0, 14)].model, donors[(0, 14)]).prefill(
            "s", 0, token_ids=list(range(1, 21)), start_pos=0
        )
        assert donors[(15, 29)].recipe.fingerprint() == info.recipe_fingerprint
        _, blob = donors[(15, 29)].export_session("s", 0)
        _, other_range = donors[(0, 14)].export_session("s", 0)

        def handover(
            state: bytes, sid: str = "moved", epoch: int = 0, seq_len: int = 20, *, more: bytes = b"", **kw
        ) -> pb.SessionReply:
            """The stream a drain sends (in 4 KiB chunks, the first with `kw` changed), and `more` after."""
            messages = handover_messages(
                pb.HandoverRequest(
                    session_id=sid,
                    route_epoch=epoch,
                    seq_len=seq_len,
                    recipe_fingerprint=info.recipe_fingerprint,
                    model_digest=info.model_digest,
                ),
                state,
                4096,
            )
            for k, v in kw.items():
                setattr(messages[0], k, v)
            return tail.Handover(iter([*messages, *([pb.HandoverRequest(state=more)] if more else [])]), timeout=30)

        def held():
            i = mesh.info(0)
            return (
                i.live_sessions,
                i.reserved_tokens,
                sorted((s.session_id, s.route_epoch, s.seq_len) for s in i.sessions),
            )

        reply = handover(blob, sid="kept", epoch=2)
        assert reply.outcome == pb.OUTCOME_OK and reply.seq_len == 20, reply
        step = pb.StepRequest(session_id="kept", route_epoch=2, hidden=encode_tensor(rows[:1]), position=20)
        assert tail.Decode(step, timeout=30).seq_len == 21  # it steps on from where the donor was
        before = held()
        state = donors[(15, 29)].engine.export_session("s", 0, 0.0)[1]  # llama.cpp's, inside the hand-over
        at = len(blob) - len(state) + 12  # after its magic, seq id and stream count: the streams' cell counts
        while struct.unpack_from("<I", blob, at)[0] == 0:
            at += 4
        at += 4 + 12 * 5  # the sixth cell's position
        moved_position = bytearray(blob)
        struct.pack_into("<i", moved_position, at, struct.unpack_from("<i", blob, at)[0] + 1)
        cases = {
            "wrong digest": (handover(blob, state_sha256=b"\0" * 32), pb.OUTCOME_INVALID_ARGUMENT),
            "cut": (handover(blob[:-7]), pb.OUTCOME_INVALID_ARGUMENT),
            "a position changed": (handover(bytes(moved_position)), pb.OUTCOME_INVALID_ARGUMENT),
            "random": (handover(np.random.default_rng(1).bytes(len(blob))), pb.OUTCOME_INVALID_ARGUMENT),
            "another range, named": (
                handover(other_range, recipe_fingerprint=donors[(0, 14)].recipe.fingerprint()),
                pb.OUTCOME_INCOMPATIBLE_RECIPE,
            ),
            "another range, lied about": (handover(other_range), pb.OUTCOME_INCOMPATIBLE_RECIPE),
            "another model": (handover(blob, model_digest="0" * 40), pb.OUTCOME_INCOMPATIBLE_RECIPE),
            "an owner on a worker without authentication": (
                handover(blob, owner="mallory"),
                pb.OUTCOME_INVALID_ARGUMENT,
            ),
            "a stale epoch": (handover(blob, sid="kept", epoch=1), pb.OUTCOME_STALE_EPOCH),
            "past the context": (handover(blob, seq_len=100000), pb.OUTCOME_INVALID_ARGUMENT),
            "an id no key is made of": (handover(blob, sid=""), pb.OUTCOME_INVALID_ARGUMENT),
            # the stream itself: its size is bounded before a chunk is gathered, and must add up
            "more than a session holds": (handover(blob, state_bytes=2**40), pb.OUTCOME_INVALID_ARGUMENT),
            "no size": (handover(blob, state_bytes=0), pb.OUTCOME_INVALID_ARGUMENT),
            "chunks past the size": (handover(blob, more=b"\0" * 64), pb.OUTCOME_INVALID_ARGUMENT),
            "chunks short of the size": (handover(blob, state_bytes=len(blob) + 1), pb.OUTCOME_INVALID_ARGUMENT),
            "an empty stream": (tail.Handover(iter([]), timeout=30), pb.OUTCOME_INVALID_ARGUMENT),
        }
        for name, (reply, outcome) in cases.items():
            assert reply.outcome == outcome, (name, reply)
            assert "hand-over refused" in reply.detail, (name, reply.detail)
        assert held() == before
        assert mesh.procs[0].poll() is None
    finally:
        mesh.stop()
