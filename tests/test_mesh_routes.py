"""A mesh of real processes on loopback: a head started with --mesh-members 4 and four members
started with only --join (different memory caps, 1 or 2 threads, three without the model file) form
a route whose 8 streams' greedy and seeded tokens equal the whole model's; a member that joins
mid-run is placed without disturbing a stream; a member that holds a stage alone is SIGKILLed
mid-run, another member loads its layers and the streams finish exact. Prints the time from start to
serving and the bytes each member fetched against the whole file's."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest

from llama_shard._native import CPU_DEVICE, SamplingParams, ShardModel
from llama_shard.engine.models import gguf_shape
from llama_shard.head.planner import ModelCosts
from llama_shard.local_workers import free_port, start_worker, stop_worker, wait_serving
from llama_shard.proto import shard_pb2 as pb
from llama_shard.proto import shard_pb2_grpc as pb_grpc
from llama_shard.proto.requests import sampling_to_wire

pytestmark = [pytest.mark.grpc, pytest.mark.slow, pytest.mark.model]

PROMPTS = ["The capital of France is", "Once upon a time,", "def fibonacci(n):", "The three primary colours are"]
SEEDED = dict(temperature=0.9, top_k=40, top_p=0.95, min_p=0.05)
SESSIONS, CONTEXT = 8, 512
#: what each member may use, as shares of the whole model's stage (weights, KV, buffers, headroom;
#: the embeddings and buffers are a third of it): three stages, a replica, one too small for any
HEAD_SHARE, MEMBER_SHARES = 0.5, (0.5, 0.5, 0.5, 0.25)


def _serve(*flags: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "llama_shard.cli", "serve", "--device", CPU_DEVICE, *flags]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _streams(stub, tag: str, prompts, n: int, on_token=None) -> list[dict]:
    """8 concurrent streams on a head (even: greedy, odd: seeded): each one's tokens and final event."""
    results: list[dict] = [{} for _ in range(8)]

    def run(i: int) -> None:
        req = pb.GenerateRequest(session_id=f"{tag}-{i}", prompt=prompts[i % len(prompts)], max_tokens=n)
        if i % 2:
            req.sampling.CopyFrom(sampling_to_wire(SamplingParams(seed=1000 + i, **SEEDED)))
        tokens = []
        for event in stub.Generate(req, timeout=300):
            if event.HasField("final"):
                results[i] = {"tokens": tokens, "final": event.final}
                return
            tokens.append(event.token.token_id)
            if on_token is not None:
                on_token(i, len(tokens))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert all(results), "a stream did not end"
    return results


class MeshProcs:
    def __init__(self, model, tmp_path):
        self.model, self.tmp = model, tmp_path
        costs = ModelCosts.of(gguf_shape(str(model)), SESSIONS, CONTEXT)
        self.whole = costs.stage_bytes(0, costs.n_layer - 1)
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.members: list[subprocess.Popen] = []
        self.head = None
        self.channel = grpc.insecure_channel(self.address)
        self.stub = pb_grpc.ShardServiceStub(self.channel)

    def start_head(self, members: int) -> None:
        self.head = _serve(
            "--model", str(self.model), "--port", str(self.port), "--threads", "1",
            "--max-sessions", str(SESSIONS), "--context-tokens", str(CONTEXT),
            "--mesh-members", str(members), "--mesh-wait", "120",
            "--mesh-memory", str(int(HEAD_SHARE * self.whole)),
        )  # fmt: skip

    def join(self, share: float, threads: int, with_model: bool = False) -> subprocess.Popen:
        k = len(self.members)
        flags = ["--model", str(self.model)] if with_model else []
        proc = _serve(
            "--join", self.address, "--port", str(free_port()), "--threads", str(threads),
            "--mesh-memory", str(int(share * self.whole)), "--mesh-cache", str(self.tmp / f"cache-{k}"), *flags,
        )  # fmt: skip
        self.members.append(proc)
        return proc

    def info(self) -> pb.InfoReply:
        return self.stub.Info(pb.InfoRequest(), timeout=10)

    def stop(self) -> str:
        out = []
        for proc in [*self.members, self.head]:
            if proc is not None:
                out.append(stop_worker(proc, timeout_s=30)[1][-3000:])
        self.channel.close()
        return "\n".join(out)


@pytest.fixture(scope="module")
def prompts(embedded_model):
    vocab = ShardModel(str(embedded_model), (0, 0), 1)
    return [vocab.tokenize(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def whole_tokens(embedded_model, prompts):
    """The 8 streams on the whole model in one worker (the reference every mesh run equals)."""
    proc, address = start_worker(embedded_model, 0, 29, threads=1)
    try:
        wait_serving(proc, address)
        with grpc.insecure_channel(address) as ch:
            return [r["tokens"] for r in _streams(pb_grpc.ShardServiceStub(ch), "whole", prompts, 24)]
    finally:
        stop_worker(proc)


@pytest.fixture(scope="module")
def mesh(embedded_model, tmp_path_factory):
    procs = MeshProcs(embedded_model, tmp_path_factory.mktemp("mesh"))
    t0 = time.monotonic()
    procs.start_head(4)
    for k, share in enumerate(MEMBER_SHARES):
        procs.join(share, threads=1 + k % 2, with_model=k == 0)
    try:
        wait_serving(procs.head, procs.address, timeout_s=240)
        procs.started_s = time.monotonic() - t0
        yield procs
    finally:
        logs = procs.stop()
        print("\n  mesh processes' last words:\n" + logs[-4000:])


def test_four_joined_members_form_a_route_whose_streams_equal_the_whole_model(
    mesh, prompts, whole_tokens, embedded_model
):
    info = mesh.info()
    members = list(info.mesh_members)
    assert len(members) == 4 and info.first == 0, info.mesh_plan
    size = embedded_model.stat().st_size
    print(
        f"\n  plan:\n{info.mesh_plan}\n  start to serving: {mesh.started_s:.1f} s; the whole file {size / 2**20:.1f} MiB"
    )
    for m in members:
        print(
            f"  member {m.address or m.member_id}: {m.state}, layers {m.first}-{m.last}, fetched {m.fetched_bytes / 2**20:.1f} MiB"
        )
    serving = [m for m in members if m.state == "serving"]
    ranges = sorted({(m.first, m.last) for m in serving})
    assert ranges[0][0] == info.last + 1 and ranges[-1][1] == info.n_layer - 1, info.mesh_plan
    assert all(a[1] + 1 == b[0] for a, b in zip(ranges, ranges[1:])), info.mesh_plan
    # a member fetches its range (and the probe layer it timed itself on), never the whole file
    assert all(m.fetched_bytes < 0.8 * size for m in members)
    results = _streams(mesh.stub, "joined", prompts, 24)
    for i, r in enumerate(results):
        assert r["final"].finish_reason == "length", (i, r["final"])
        assert r["tokens"] == whole_tokens[i], i


def _settled(mesh, members: int, timeout_s: float = 120.0) -> pb.InfoReply:
    """The head's Info once it knows `members` members, each measured, and none is still loading its
    range (a member too small for any stage stands by, reporting)."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = mesh.info()
        known = info.mesh_members
        if len(known) == members and all(m.layer_s > 0 and m.state != "assigned" for m in known):
            return info
        assert time.monotonic() < deadline, info.mesh_plan
        time.sleep(0.5)


def test_a_late_member_is_placed_without_disturbing_and_a_killed_sole_holder_is_restored(mesh, prompts, whole_tokens):
    # a member that joins while streams run becomes a replica, and disturbs none of them
    lock = threading.Lock()
    joined: list = []

    def join_now(i: int, n: int) -> None:
        with lock:
            if not joined and n >= 4:
                joined.append(mesh.join(0.5, threads=1))

    calm = _streams(mesh.stub, "late", prompts, 24, join_now)
    assert joined
    for i, r in enumerate(calm):
        assert r["tokens"] == whole_tokens[i] and r["final"].failovers == 0, (i, r["final"])
    info = _settled(mesh, 5)
    print(f"\n  a fifth member joined mid-run:\n{info.mesh_plan}")
    serving, holders = _holders(info)
    assert max(holders.values()) == 2, info.mesh_plan
    if min(holders.values()) > 1:
        # the planner chose fewer, faster stages (it times the members), and the late member made
        # every stage a pair: SIGKILL one of a pair while idle, so a stage is held alone
        spare = serving[0]
        _member_proc(mesh, spare).kill()
        info = _until(mesh, lambda i: any(m.address == spare.address and m.state == "dead" for m in i.mesh_members))
        print(f"  killed {spare.address} while idle, so a stage is held alone:\n{info.mesh_plan}")
        serving, holders = _holders(info)
    # SIGKILL a member that holds its stage alone, mid-run: another member loads those layers
    victim = next(m for m in serving if holders[(m.first, m.last)] == 1)
    proc = _member_proc(mesh, victim)
    counts: dict[int, int] = {}

    def on_token(i: int, n: int) -> None:
        with lock:
            counts[i] = n
            if len(counts) == 8 and min(counts.values()) >= 3 and not killed:
                proc.send_signal(signal.SIGKILL)
                killed.append(max(counts.values()))

    t0, killed = time.monotonic(), []
    results = _streams(mesh.stub, "killed", prompts, 24, on_token)
    assert killed and killed[0] < 24, [(len(r["tokens"]), r["final"].detail) for r in results]
    proc.wait(10)
    for i, r in enumerate(results):
        assert r["final"].finish_reason == "length", (i, r["final"])
        assert r["tokens"] == whole_tokens[i], i
    after = mesh.info()
    takers = [m for m in after.mesh_members if (m.first, m.last) == (victim.first, victim.last) and m.state != "dead"]
    print(
        f"  killed {victim.address} (layers {victim.first}-{victim.last}) mid-run: 8 streams exact in "
        f"{time.monotonic() - t0:.1f} s, {sum(r['final'].failovers for r in results)} failover(s); "
        f"now held by {[m.address for m in takers]}\n{after.mesh_plan}"
    )
    assert takers and all(m.state == "serving" for m in takers), after.mesh_plan


def _holders(info: pb.InfoReply) -> tuple[list, dict[tuple[int, int], int]]:
    """The serving members, and how many serve each range."""
    serving = [m for m in info.mesh_members if m.state == "serving"]
    return serving, {(m.first, m.last): sum((o.first, o.last) == (m.first, m.last) for o in serving) for m in serving}


def _until(mesh, ready, timeout_s: float = 60.0) -> pb.InfoReply:
    deadline = time.monotonic() + timeout_s
    while not ready(info := mesh.info()):
        assert time.monotonic() < deadline, info.mesh_plan
        time.sleep(0.5)
    return info


def _member_proc(mesh, member) -> subprocess.Popen:
    return next(p for p in mesh.members if p.poll() is None and member.address.endswith(_port_of(p)))


def _port_of(proc: subprocess.Popen) -> str:
    args = proc.args
    return ":" + args[args.index("--port") + 1]


def test_bad_joins_leave_the_running_route_unaffected(mesh, prompts, whole_tokens):
    stub = pb_grpc.MeshServiceStub(mesh.channel)
    before = len(mesh.info().mesh_members)
    digest = mesh.info().model_digest
    for request, why in (
        (pb.JoinRequest(report=pb.MemberReport(memory_bytes=10**18, layer_s=0.001)), "memory"),
        (pb.JoinRequest(report=pb.MemberReport(memory_bytes=1 << 30), model_digest="1-other"), "serves the model"),
        (pb.JoinRequest(member_id="not-a-member", report=pb.MemberReport(memory_bytes=1 << 30)), "no member"),
    ):
        reply = stub.Join(request, timeout=10)
        assert not reply.admitted and why in reply.refused, reply.refused
    with pytest.raises(grpc.RpcError) as refused:
        list(stub.Fetch(pb.FetchRequest(member_id="not-a-member", first=0, last=29, tensor="output_norm.weight")))
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    info = mesh.info()
    assert len(info.mesh_members) == before and info.model_digest == digest
    for i, r in enumerate(_streams(mesh.stub, "after-bad", prompts, 24)):
        assert r["tokens"] == whole_tokens[i] and r["final"].failovers == 0, (i, r["final"])
