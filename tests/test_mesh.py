"""A mesh that places itself (serve --mesh-members / --join; mesh/): the coordinator's admissions,
plan, deaths and restorations on a clock of its own; a range fetched tensor by tensor is the file
`extract` writes, byte for byte, and a tampered tensor leaves nothing behind; bad input over the
wire (a wrong key, a principal that is no trusted worker, another model's file, a tensor outside the
assignment, a join flood, a report of 10^18 bytes) is refused with its reason and changes nothing;
the flags that contradict each other are refused before anything starts. The routes of real
processes are in test_mesh_routes.py."""

from __future__ import annotations

import hashlib

import pytest

from llama_shard._native import model_digest
from llama_shard.engine.models import gguf_shape
from llama_shard.engine.range_file import content_digest, write_range_file
from llama_shard.head.planner import MAX_MEMBERS, Member, ModelCosts
from llama_shard.mesh.coordinator import DEAD_AFTER_S, FORGET_DEAD_S, HEAD, MemberState, Mesh
from llama_shard.mesh.manifest import FetchRefused, RangeCache, RangeSource
from llama_shard.proto import shard_pb2 as pb

pytestmark = pytest.mark.model

MiB = 1 << 20


@pytest.fixture(scope="module")
def source(embedded_model):
    return RangeSource(str(embedded_model))


def _fetch_from(source: RangeSource, manifest: pb.RangeManifest, tamper: str = ""):
    def fetch(name: str, offset: int):
        for i, chunk in enumerate(source.chunks(manifest.first, manifest.last, name, offset)):
            if name == tamper and i == 0:
                chunk = bytes([chunk[0] ^ 1]) + chunk[1:]
            yield chunk

    return fetch


def test_a_fetched_range_is_the_extracted_file_and_a_restart_fetches_nothing(embedded_model, source, tmp_path):
    manifest = source.manifest(10, 19)
    digest = model_digest(str(embedded_model))
    cache = RangeCache(tmp_path / "cache")
    path = cache.obtain(digest, manifest, 30, _fetch_from(source, manifest))
    extracted = write_range_file(embedded_model, 10, 19, tmp_path / "extracted.gguf")
    assert path.read_bytes() == extracted.read_bytes()
    assert cache.fetched_bytes == sum(t.nbytes for t in manifest.tensors)
    assert cache.fetched_bytes < 0.4 * embedded_model.stat().st_size
    # every tensor's digest is its bytes' SHA-256 in the source
    blk = next(t for t in manifest.tensors if t.name.startswith("blk.10."))
    data = path.read_bytes()[blk.offset : blk.offset + blk.nbytes]
    assert hashlib.sha256(data).digest() == blk.sha256
    # found again: checked, not fetched
    again = RangeCache(tmp_path / "cache")
    assert again.obtain(digest, manifest, 30, _fetch_from(source, manifest)) == path
    assert again.fetched_bytes == 0
    # a range file names its source's content: replicas of whole and range files hand over
    assert content_digest(path) == content_digest(embedded_model) == digest


def test_a_tampered_tensor_is_refused_and_nothing_is_kept(embedded_model, source, tmp_path):
    manifest = source.manifest(10, 19)
    cache = RangeCache(tmp_path / "cache")
    victim = manifest.tensors[3].name
    with pytest.raises(FetchRefused, match="does not match the manifest"):
        cache.obtain("d", manifest, 30, _fetch_from(source, manifest, tamper=victim))
    assert list((tmp_path / "cache").iterdir()) == []
    # a file changed on disk after it was cached is fetched again, not loaded
    good = cache.obtain("d", manifest, 30, _fetch_from(source, manifest))
    raw = bytearray(good.read_bytes())
    raw[manifest.tensors[5].offset] ^= 0xFF
    good.write_bytes(bytes(raw))
    fetched = cache.fetched_bytes
    cache.obtain("d", manifest, 30, _fetch_from(source, manifest))
    assert cache.fetched_bytes > fetched
    assert (
        hashlib.sha256(good.read_bytes()).digest()
        == hashlib.sha256(write_range_file(embedded_model, 10, 19, tmp_path / "x.gguf").read_bytes()).digest()
    )


def test_a_manifest_out_of_bounds_is_refused_before_a_byte_is_written(source, tmp_path):
    manifest = source.manifest(10, 19)
    overlapping = pb.RangeManifest()
    overlapping.CopyFrom(manifest)
    overlapping.tensors[1].offset = overlapping.tensors[0].offset
    cache = RangeCache(tmp_path / "cache")
    for bad, why in ((overlapping, "overlaps"), (pb.RangeManifest(first=5, last=40), "not within")):
        with pytest.raises(FetchRefused, match=why):
            cache.obtain("d", bad, 30, _fetch_from(source, manifest))
    assert not (tmp_path / "cache").exists()


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _mesh(embedded_model, source, clock=None) -> Mesh:
    costs = ModelCosts.of(gguf_shape(str(embedded_model)), sessions=4, context_tokens=256)
    return Mesh(source, model_digest(str(embedded_model)), costs, 4, 256, clock=clock or Clock())


def _join(mesh, principal="", member_id="", memory=200 * MiB, layer_s=0.001, **fields) -> pb.JoinReply:
    report = pb.MemberReport(memory_bytes=memory, layer_s=layer_s, backend="cpu")
    return mesh.join(principal, pb.JoinRequest(member_id=member_id, report=report, **fields))


def test_joins_out_of_bounds_are_refused_and_change_nothing(embedded_model, source):
    mesh = _mesh(embedded_model, source)
    for fields, why in (
        (dict(memory=10**18), "memory"),
        (dict(layer_s=float("nan")), "layer time"),
        (dict(layer_s=-1.0), "layer time"),
        (dict(model_digest="1234:other"), "serves the model"),
        (dict(member_id="forged"), "no member"),
        (dict(address="x" * 300 + ":1"), "over 255 bytes"),
        (dict(address="no port here"), "not HOST:PORT"),
    ):
        reply = _join(mesh, **fields)
        assert not reply.admitted and why in reply.refused, (fields, reply.refused)
    assert mesh.members() == []
    # another caller cannot report (or fetch) as a member
    mine = _join(mesh, principal="a")
    assert mine.admitted
    assert "no member" in _join(mesh, principal="b", member_id=mine.member_id).refused
    denied = mesh.fetch(
        "b", pb.FetchRequest(member_id=mine.member_id, first=15, last=15, tensor="blk.15.attn_q.weight")
    )
    assert "no live member" in denied.text


def test_a_join_flood_is_bounded_and_ages_out(embedded_model, source):
    clock = Clock()
    mesh = _mesh(embedded_model, source, clock)
    ids = []
    for _ in range(MAX_MEMBERS - 1):
        reply = _join(mesh, layer_s=0.0)  # never measured
        assert reply.admitted
        ids.append(reply.member_id)
    full = _join(mesh)
    assert not full.admitted and "full" in full.refused
    clock.now += DEAD_AFTER_S + 1  # they stop reporting: dead, and their places free
    assert _join(mesh).admitted
    # the dead are forgotten: the table stays bounded however often the flood comes back
    clock.now += FORGET_DEAD_S + 1
    mesh.tick()
    assert len(mesh.members()) == 1


def test_the_plan_assigns_ranges_a_death_is_restored_and_a_newcomer_becomes_a_replica(embedded_model, source):
    clock = Clock()
    mesh = _mesh(embedded_model, source, clock)
    # half the whole model's stage each (the embeddings and buffers are a third of it): three stages
    # at least; a quarter for one member, which holds no stage and stands by
    half, quarter = mesh.costs.stage_bytes(0, 29) // 2, mesh.costs.stage_bytes(0, 29) // 4
    for i, memory in enumerate((half, half, half, quarter)):
        assert _join(mesh, memory=memory, layer_s=0.001 * (i + 1)).admitted
    plan = mesh.wait_planned(Member(HEAD, half, 0.001), 4, 0.1)
    assert len(plan.stages) >= 3, plan.describe()
    assert mesh.head_range == (0, plan.stages[0].last)
    members = mesh.members()
    assigned = [m for m in members if m.first >= 0]
    ranges = sorted({(m.first, m.last) for m in assigned})
    assert ranges[0][0] == mesh.head_range[1] + 1 and ranges[-1][1] == 29
    assert all(a[1] + 1 == b[0] for a, b in zip(ranges, ranges[1:]))
    # a fetch outside its assignment is refused; its own range and the probe layer are served
    holder = assigned[0]
    other = next(r for r in ranges if r != (holder.first, holder.last))
    why = mesh.fetch("", pb.FetchRequest(member_id=holder.member_id, first=other[0], last=other[1], tensor="x"))
    assert "not this member's" in why.text
    manifest = _join(mesh, member_id=holder.member_id, want_manifest=True).manifest
    assert (manifest.first, manifest.last) == (holder.first, holder.last)
    name = manifest.tensors[0].name
    own = pb.FetchRequest(member_id=holder.member_id, first=holder.first, last=holder.last, tensor=name)
    assert sum(len(c) for c in mesh.fetch("", own)) == manifest.tensors[0].nbytes
    own.tensor = "nope"
    assert "no tensor" in mesh.fetch("", own).text
    # every member serves; then one that holds a stage alone stops reporting
    for i, m in enumerate(assigned):
        serving = dict(serving=True, serving_first=m.first, serving_last=m.last)
        assert _join(mesh, member_id=m.member_id, address=f"127.0.0.1:{2000 + i}", **serving).assigned
    assert {m.state for m in mesh.members() if m.first >= 0} == {"serving"}
    alone = [m for m in assigned if sum((o.first, o.last) == (m.first, m.last) for o in assigned) == 1]
    victim = alone[0]
    stage = (victim.first, victim.last)
    assert mesh.restoring(stage) > 0
    clock.now += DEAD_AFTER_S / 2
    for m in members:
        if m.member_id != victim.member_id:
            _join(mesh, member_id=m.member_id)
    clock.now += DEAD_AFTER_S / 2 + 1
    mesh.tick()
    after = {m.member_id: m for m in mesh.members()}
    assert after[victim.member_id].state == MemberState.DEAD.value
    takers = [m for m in after.values() if (m.first, m.last) == stage and m.state != "dead"]
    assert len(takers) == 1 and takers[0].state == "assigned", mesh.describe()
    assert mesh.restoring(stage) > 0
    reply = _join(mesh, member_id=takers[0].member_id)
    assert reply.assigned and (reply.first, reply.last) == stage
    assert "dead" in _join(mesh, member_id=victim.member_id).refused
    # a member that joins now stands by for a stage with the fewest holders
    late = _join(mesh, memory=half)
    assert late.assigned and (late.first, late.last) in ranges
    assert "stage 1" in mesh.describe()


def test_mesh_flags_that_contradict_are_refused(tmp_path):
    import subprocess
    import sys

    for flags, why in (
        (["--join", "127.0.0.1:1", "--mesh-members", "2"], "one or the other"),
        (["--join", "127.0.0.1:1", "--layers", "0-3"], "--layers goes without"),
        (["--join", "127.0.0.1:1", "--peer", "127.0.0.1:2"], "--peer, --replica"),
        (["--mesh-cache", str(tmp_path)], "give --join too"),
        (["--mesh-memory", "1GiB"], "give --join or --mesh-members"),
        (["--mesh-members", "0"], "--mesh-members"),
        (["--join", "127.0.0.1:1", "--mesh-wait", "5"], "give --mesh-members too"),
    ):
        r = subprocess.run(
            [sys.executable, "-m", "llama_shard.cli", "serve", *flags], capture_output=True, text=True, timeout=60
        )
        assert r.returncode == 2 and why in r.stderr, (flags, r.stderr[-500:])


def _head(embedded_model, source, security):
    """A mesh's MeshService alone on a free loopback port (a head before its plan)."""
    from llama_shard.mesh.service import MeshServicer, mesh_server

    mesh = _mesh(embedded_model, source)
    server, port = mesh_server(MeshServicer(mesh, security), security, "127.0.0.1", 0)
    return mesh, server, port


def test_only_a_trusted_worker_joins_a_head_with_authentication(embedded_model, source, pki):
    import grpc

    from llama_shard.proto import shard_pb2_grpc as pb_grpc
    from llama_shard.proto.credentials import ClientSecurity
    from llama_shard.worker.security import ServerSecurity

    security = ServerSecurity(
        str(pki["server"].cert), str(pki["server"].key), None, str(pki["tokens"]), forwarders=("ops",),
        route_key_file=str(pki["route_key"]),
    )  # fmt: skip
    mesh, server, port = _head(embedded_model, source, security)
    wrong = pki["dir"] / "wrong.token"
    wrong.write_text("not-a-token-of-this-mesh-0123\n")
    try:
        report = pb.MemberReport(memory_bytes=200 * MiB)
        for token, code in (
            (wrong, grpc.StatusCode.UNAUTHENTICATED),
            (pki["dir"] / "alice.token", grpc.StatusCode.PERMISSION_DENIED),
        ):
            client = ClientSecurity(tls_ca=str(pki["ca"].cert), token_file=str(token))
            stub = pb_grpc.MeshServiceStub(client.channel(f"localhost:{port}", []))
            with pytest.raises(grpc.RpcError) as refused:
                stub.Join(pb.JoinRequest(report=report), timeout=10)
            assert refused.value.code() == code, refused.value.details()
            with pytest.raises(grpc.RpcError) as refused:
                list(stub.Fetch(pb.FetchRequest(first=15, last=15, tensor="blk.15.attn_q.weight"), timeout=10))
            assert refused.value.code() == code
        assert mesh.members() == []
        ops = ClientSecurity(tls_ca=str(pki["ca"].cert), token_file=str(pki["dir"] / "ops.token"))
        stub = pb_grpc.MeshServiceStub(ops.channel(f"localhost:{port}", []))
        reply = stub.Join(pb.JoinRequest(report=report), timeout=10)
        assert reply.admitted and len(mesh.members()) == 1
        # a tensor outside what it was given is refused, naming why
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Fetch(pb.FetchRequest(member_id=reply.member_id, first=0, last=29, tensor="output_norm.weight")))
        assert (
            refused.value.code() == grpc.StatusCode.PERMISSION_DENIED and "not this member's" in refused.value.details()
        )
    finally:
        server.stop(None)


def test_a_member_with_another_model_or_a_tampered_fetch_is_refused_and_keeps_nothing(
    embedded_model, gemma3_model, tmp_path
):
    import shutil
    import threading

    from llama_shard.mesh.member import JoinedNode, MeshRefused
    from llama_shard.proto.credentials import ClientSecurity
    from llama_shard.worker.security import ServerSecurity

    copy = tmp_path / "model.gguf"
    shutil.copyfile(embedded_model, copy)
    source = RangeSource(str(copy))
    mesh, server, port = _head(copy, source, ServerSecurity())
    never = lambda *a: pytest.fail("a refused member serves nothing")  # noqa: E731
    try:
        other = JoinedNode(
            f"127.0.0.1:{port}", ClientSecurity(), never, RangeCache(tmp_path / "a"), 200 * MiB, 1,
            str(gemma3_model), content_digest(gemma3_model),
        )  # fmt: skip
        with pytest.raises(MeshRefused, match="serves the model"):
            other.run(threading.Event())
        assert mesh.members() == []
        # the head's file changes under it after the manifest was made: the bytes it serves no longer
        # match, and the member keeps nothing
        manifest = source.manifest(mesh.probe_layer, mesh.probe_layer)
        victim = next(t for t in manifest.tensors if t.name.startswith(f"blk.{mesh.probe_layer}."))
        at = next(t for t in source.layout(mesh.probe_layer, mesh.probe_layer).tensors if t.name == victim.name)
        offset = int(at.data.ctypes.data - source._reader.data.ctypes.data)
        with open(copy, "r+b") as f:
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([byte[0] ^ 0xFF]))
        node = JoinedNode(f"127.0.0.1:{port}", ClientSecurity(), never, RangeCache(tmp_path / "b"), 200 * MiB, 1)
        with pytest.raises(FetchRefused, match="does not match"):
            node.run(threading.Event())
        assert not (tmp_path / "b").exists() or list((tmp_path / "b").iterdir()) == []
    finally:
        server.stop(None)


def test_a_head_announced_by_mdns_is_found_by_its_model():
    from llama_shard.mesh.discovery import Announcement, discover

    announcement = Announcement("127.0.0.1", 5999, "1234-abcdef0123456789")
    try:
        assert discover("1234-abcdef0123456789", timeout_s=10) == "127.0.0.1:5999"
        assert discover("9999-another-model", timeout_s=1) is None
    finally:
        announcement.close()


def test_a_member_declared_dead_joins_again_as_a_new_one(embedded_model, source, tmp_path):
    import threading
    import time

    from llama_shard.mesh.member import JoinedNode
    from llama_shard.proto.credentials import ClientSecurity
    from llama_shard.worker.security import ServerSecurity

    mesh, server, port = _head(embedded_model, source, ServerSecurity())
    mesh.clock = time.monotonic  # (a real clock: the member reports every second)
    node = JoinedNode(
        f"127.0.0.1:{port}", ClientSecurity(), lambda *a: pytest.fail("nothing is planned"), RangeCache(tmp_path),
        200 * MiB, 1, str(embedded_model), model_digest(str(embedded_model)),
    )  # fmt: skip
    stop, outcome = threading.Event(), []
    thread = threading.Thread(target=lambda: outcome.append(node.run(stop)), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not [m for m in mesh.members() if m.layer_s > 0] and time.monotonic() < deadline:
            time.sleep(0.1)
        (first,) = mesh.members()
        with mesh._lock:  # its reports stopped for longer than DEAD_AFTER_S, as after a long pause
            mesh._members[first.member_id].state = MemberState.DEAD
        while len(mesh.members()) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        states = {m.member_id: m.state for m in mesh.members()}
        assert states.pop(first.member_id) == "dead" and list(states.values()) == ["reporting"], states
        assert thread.is_alive()  # it did not exit, and did not measure itself again
    finally:
        stop.set()
        thread.join(30)
        server.stop(None)
    assert outcome == [0]


def test_a_mesh_heads_port_is_its_own():
    """A mesh head's first server shares its port with the head's worker (SO_REUSEPORT), so it first
    checks that no other process listens there: a second head, or any server, fails to bind."""
    import socket

    from llama_shard.mesh.service import MeshServicer, mesh_server
    from llama_shard.worker.security import ServerSecurity

    servicer = MeshServicer(None, ServerSecurity())
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot bind 127.0.0.1:{port}: .*in use by another process"):
            mesh_server(servicer, ServerSecurity(), "127.0.0.1", port)
    server, bound = mesh_server(servicer, ServerSecurity(), "127.0.0.1", port)  # free again: bound
    try:
        assert bound == port
        with pytest.raises(OSError, match="in use by another process"):
            mesh_server(servicer, ServerSecurity(), "127.0.0.1", port)  # a second head on it
    finally:
        server.stop(None)
