"""A route that proves its work (receipts/, head/proofs.py, docs/security.md "Receipts and spot checks").

- A route receipt built from signed stage receipts verifies, and fails once any byte of it is flipped,
  or a stage is dropped or moved (checked in this process, and through `llama-shard verify-receipt`).
- On live workers over loopback with SmolLM2 (a head and two tail replicas, one thread each): every
  request's receipt verifies against the keys the workers showed in Info, over gRPC and the OpenAI
  endpoint; at spot-check rate 1 every replay gives equal bytes on the other replica (no false alarm);
  bad receipt inputs are refused and change nothing.
- Each cheat of tests/support/cheats.py (noise of 1e-3, a stale row, a skipped layer, another
  quantization) served as the tail the head routes to is caught by the first request's spot check; a
  third replica arbitrates, so only the cheat is taken out of routes, and the next request avoids it.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest

from llama_shard.local_workers import free_port, start_worker, stop_worker, wait_serving
from llama_shard.proto import shard_pb2 as pb
from llama_shard.proto import shard_pb2_grpc as pb_grpc
from llama_shard.receipts.chain import Commitment
from llama_shard.receipts.keys import NodeKey
from llama_shard.receipts.verify import check_route

from support.cheats import CHEATS, FALSE_RECEIPT, cheating_worker

PROMPT = [1, 504, 3458, 282, 4649, 314]  # "The capital of France is" in SmolLM2's vocabulary
TAIL = (15, 29)


# --- receipts, in this process ----------------------------------------------------------------------


def _synthetic_receipt(n_stages: int = 3, n_layer: int = 30) -> pb.RouteReceipt:
    """Stages that tile n_layer layers, each one's input commitment its predecessor's output."""
    nonce = b"n" * 16
    cuts = [round(i * n_layer / n_stages) for i in range(n_stages + 1)]
    receipt = pb.RouteReceipt(nonce=nonce)
    rows = [bytes([i]) * 32 for i in range(n_stages + 1)]
    for i in range(n_stages):
        c = Commitment()
        for pos in range(4):
            c.add(pos, 1, rows[i] + bytes([pos]), rows[i + 1] + bytes([pos]), [7 + pos])
        body = pb.ReceiptBody(
            version=1,
            model_digest="m",
            n_layer=n_layer,
            first=cuts[i],
            last=cuts[i + 1] - 1,
            numerics="K/V f16",
            session_id="s",
            route_epoch=1,
            nonce=nonce,
        )
        c.fill(body)
        receipt.stages.append(NodeKey.generate().sign(body))
    return receipt


def _verifies(data: bytes) -> bool:
    receipt = pb.RouteReceipt()
    try:
        receipt.ParseFromString(data)
    except Exception:  # noqa: BLE001 - bytes that do not parse do not verify
        return False
    return not check_route(receipt)


def test_a_receipt_verifies_and_any_flipped_byte_or_moved_stage_fails():
    receipt = _synthetic_receipt()
    data = receipt.SerializeToString()
    assert _verifies(data)
    for i in range(len(data)):  # every byte, each flipped alone
        flipped = bytearray(data)
        flipped[i] ^= 0x01
        assert not _verifies(bytes(flipped)), f"byte {i} of {len(data)} flipped, and it still verifies"
    stages = list(receipt.stages)
    for order in ([stages[1], stages[0], stages[2]], [stages[0], stages[2], stages[1]], stages[::-1]):
        assert check_route(pb.RouteReceipt(nonce=receipt.nonce, stages=order))
    for dropped in range(3):
        assert check_route(pb.RouteReceipt(nonce=receipt.nonce, stages=stages[:dropped] + stages[dropped + 1 :]))
    keys = [s.public_key for s in stages]
    assert not check_route(receipt, keys=keys, nonce=receipt.nonce)
    assert check_route(receipt, keys=[keys[0], keys[2], keys[1]]), "a stage signed by another key than pinned"
    assert check_route(receipt, nonce=b"x" * 16), "another request's receipt"


def _verify_receipt_cli(path, *args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "llama_shard.cli", "verify-receipt", str(path), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_verify_receipt_reads_bytes_base64_and_json_and_refuses_a_flipped_byte(tmp_path):
    receipt = _synthetic_receipt()
    data = receipt.SerializeToString()
    forms = {
        "r.bin": data,
        "r.b64": base64.b64encode(data),
        "r.json": json.dumps({"choices": [], "receipt": base64.b64encode(data).decode()}).encode(),
    }
    for name, content in forms.items():
        (tmp_path / name).write_bytes(content)
        done = _verify_receipt_cli(tmp_path / name)
        assert done.returncode == 0 and "verified: 3 stages" in done.stdout, (name, done.stdout, done.stderr)
    keys = [s.public_key.hex() for s in receipt.stages]
    assert _verify_receipt_cli(tmp_path / "r.bin", *sum((["--key", k] for k in keys), [])).returncode == 0
    wrong = _verify_receipt_cli(tmp_path / "r.bin", "--key", keys[1], "--key", "-", "--key", "-")
    assert wrong.returncode == 1 and "another key" in wrong.stdout
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x10
    (tmp_path / "bad.bin").write_bytes(bytes(flipped))
    done = _verify_receipt_cli(tmp_path / "bad.bin")
    assert done.returncode != 0, done.stdout
    (tmp_path / "empty.json").write_text("{}")
    done = _verify_receipt_cli(tmp_path / "empty.json")
    assert done.returncode == 2 and "no \"receipt\" field" in done.stderr, done.stderr


# --- live routes ----------------------------------------------------------------------------------


class _Route:
    """A head (layers 0-14, HTTP too) and tail workers, all over loopback, one thread each."""

    def __init__(self, model, tails: list[str], head_flags=()):
        self.http_port = free_port()
        port = free_port()
        peers = sum((["--peer", a] for a in tails), [])
        self.proc, self.address = start_worker(
            model, 0, TAIL[0] - 1, port=port, extra=(*peers, "--http-port", str(self.http_port), *head_flags)
        )
        wait_serving(self.proc, self.address)
        self.channel = grpc.insecure_channel(self.address)
        self.stub = pb_grpc.ShardServiceStub(self.channel)
        deadline = time.monotonic() + 30  # every tail probed and up: the routes below depend on which
        while sorted(r.state for r in self.info().replicas) != ["up"] * len(tails):
            assert time.monotonic() < deadline, self.info().replicas
            time.sleep(0.1)

    def generate(self, sid: str, n: int = 12, **kw) -> pb.GenerateFinal:
        events = list(self.stub.Generate(pb.GenerateRequest(session_id=sid, prompt=PROMPT, max_tokens=n, **kw)))
        assert events[-1].HasField("final") and events[-1].final.finish_reason == "length", events[-1]
        return events[-1].final

    def info(self) -> pb.InfoReply:
        return self.stub.Info(pb.InfoRequest(), timeout=10)

    def stop(self) -> None:
        self.channel.close()
        stop_worker(self.proc)


@pytest.fixture(scope="module")
def tails(embedded_model):
    """Two honest tail replicas (subprocesses), shared by the module's tests."""
    procs = [start_worker(embedded_model, *TAIL) for _ in range(2)]
    try:
        for proc, address in procs:
            wait_serving(proc, address)
        yield [address for _, address in procs]
    finally:
        for proc, _ in procs:
            stop_worker(proc)


def _keys(route: _Route, receipt: pb.RouteReceipt) -> list[bytes]:
    """The keys the workers of the receipt's stages show in Info (the head's, then its replicas')."""
    by_key = {route.info().receipt_key}
    for r in route.info().replicas:
        with grpc.insecure_channel(r.address) as ch:
            by_key.add(pb_grpc.ShardServiceStub(ch).Info(pb.InfoRequest(), timeout=10).receipt_key)
    assert all(s.public_key in by_key for s in receipt.stages)
    return [s.public_key for s in receipt.stages]


@pytest.mark.model
@pytest.mark.grpc
def test_an_honest_route_verifies_and_every_spot_check_is_equal(embedded_model, tails, tmp_path):
    route = _Route(embedded_model, tails, ("--spot-check-rate", "1"))
    try:
        seeded = pb.Sampling(temperature=0.8, top_k=40, seed=5)
        finals = [
            route.generate("greedy", receipt=True),
            route.generate("seeded", sampling=seeded, receipt=True),
            route.generate("drafts", 24, receipt=True, max_drafts=4),
            route.generate("unasked"),
        ]
        for f in finals:
            assert f.receipt_verdict == "verified", f
        assert not finals[3].receipt  # only when asked
        for f in finals[:3]:
            receipt = pb.RouteReceipt()
            receipt.ParseFromString(f.receipt)
            assert len(receipt.stages) == 2
            assert not check_route(receipt, keys=_keys(route, receipt))
            assert [c.outcome for c in receipt.spot_checks] == ["equal"], receipt.spot_checks
            assert receipt.spot_checks[0].replica != receipt.spot_checks[0].worker
        info = route.info()
        assert (info.spot_checks, info.spot_check_failures, info.receipt_failures) == (4, 0, 0)
        assert all(r.state == "up" for r in info.replicas)

        # the OpenAI endpoint: the receipt when asked, which verify-receipt reads from the saved answer
        body = json.dumps({"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "receipt": True}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{route.http_port}/v1/completions", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as resp:
            answer = json.loads(resp.read())
        assert answer["receipt_verdict"] == "verified" and answer["receipt"], answer
        (tmp_path / "answer.json").write_text(json.dumps(answer))
        done = _verify_receipt_cli(tmp_path / "answer.json")
        assert done.returncode == 0 and "spot check of stage 1" in done.stdout, done.stdout
    finally:
        route.stop()
    # bad receipt inputs: refused, nothing computed
    tail = pb_grpc.ShardServiceStub(grpc.insecure_channel(tails[0]))
    reply = tail.Prefill(pb.StepRequest(session_id="n", route_epoch=1, receipt_nonce=b"short", hidden=pb.Tensor()))
    assert reply.outcome == pb.OUTCOME_INVALID_ARGUMENT and "nonce" in reply.detail
    assert "nonce" in tail.Receipt(pb.ReceiptRequest(session_id="n", route_epoch=1, nonce=b"abc")).detail
    unknown = tail.Receipt(pb.ReceiptRequest(session_id="n", route_epoch=1, nonce=b"z" * 16))
    assert not unknown.receipts and "committed no step" in unknown.detail


@pytest.mark.model
@pytest.mark.grpc
@pytest.mark.slow
@pytest.mark.parametrize("cheat", CHEATS)
def test_a_cheating_tail_is_caught_by_the_first_spot_check(embedded_model, tails, tmp_path, cheat):
    with grpc.insecure_channel(tails[0]) as ch:
        honest = pb_grpc.ShardServiceStub(ch).Info(pb.InfoRequest(), timeout=10)
    worker = cheating_worker(embedded_model, *TAIL, cheat, honest, tmp_path)
    cheat_address = worker.address
    route = _Route(embedded_model, [cheat_address, *tails], ("--spot-check-rate", "1"))
    try:
        first = route.generate(f"{cheat}-1", receipt=True)
        receipt = pb.RouteReceipt()
        receipt.ParseFromString(first.receipt)
        # what the cheat signed is consistent: the receipt alone cannot tell
        assert first.receipt_verdict == "verified"
        assert receipt.spot_checks[0].worker == cheat_address
        assert receipt.spot_checks[0].outcome.startswith("mismatch (arbitrated by"), receipt.spot_checks
        (tmp_path / "caught.bin").write_bytes(first.receipt)
        done = _verify_receipt_cli(tmp_path / "caught.bin")
        assert done.returncode == 1 and "spot check found a mismatch at stage 1" in done.stdout, done.stdout
        states = {r.address: r.state for r in route.info().replicas}
        assert states == {cheat_address: "failed-check", tails[0]: "up", tails[1]: "up"}, states
        assert (route.info().spot_checks, route.info().spot_check_failures) == (1, 1)
        again = pb.RouteReceipt()
        again.ParseFromString(route.generate(f"{cheat}-2", receipt=True).receipt)
        assert again.spot_checks[0].worker != cheat_address and again.spot_checks[0].outcome == "equal"
    finally:
        route.stop()
        worker.stop()


@pytest.mark.model
@pytest.mark.grpc
@pytest.mark.slow
def test_a_worker_whose_receipt_is_at_odds_with_its_rows_fails_verification(embedded_model, tails, tmp_path):
    """It computes honestly (the spot check finds equal bytes) but signs another input chain: the
    head's verdict names the break, counts it, and verify-receipt refuses the receipt."""
    with grpc.insecure_channel(tails[0]) as ch:
        honest = pb_grpc.ShardServiceStub(ch).Info(pb.InfoRequest(), timeout=10)
    worker = cheating_worker(embedded_model, *TAIL, FALSE_RECEIPT, honest, tmp_path)
    route = _Route(embedded_model, [worker.address])
    try:
        final = route.generate("false", receipt=True)
        assert final.receipt_verdict.startswith("not verified") and "took in other rows" in final.receipt_verdict
        assert route.info().receipt_failures == 1
        (tmp_path / "r.bin").write_bytes(final.receipt)
        done = _verify_receipt_cli(tmp_path / "r.bin")
        assert done.returncode == 1 and "stage 1 took in other rows than stage 0 sent out" in done.stdout, done.stdout
    finally:
        route.stop()
        worker.stop()


def test_a_receipt_key_file_is_made_private_kept_and_refused_when_open_or_foreign(tmp_path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    from llama_shard.errors import InvalidInputError
    from llama_shard.worker.receipts import load_receipt_key

    path = tmp_path / "receipt.pem"
    made = load_receipt_key(str(path))
    assert path.stat().st_mode & 0o777 == 0o600
    assert load_receipt_key(str(path)).public == made.public  # the same key across restarts
    path.chmod(0o644)
    with pytest.raises(InvalidInputError, match="group or others"):
        load_receipt_key(str(path))
    other = tmp_path / "ec.pem"
    other.write_bytes(
        ec.generate_private_key(ec.SECP256R1()).private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    other.chmod(0o600)
    with pytest.raises(InvalidInputError, match="Ed25519"):
        load_receipt_key(str(other))
    with pytest.raises(InvalidInputError, match="regular file"):
        load_receipt_key(str(tmp_path))
