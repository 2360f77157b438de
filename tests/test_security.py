"""A worker facing a network: real TLS handshakes on loopback with certificates made here, bearer
tokens over TLS and mutual TLS, sessions owned by their principal, safe defaults and limits."""

from __future__ import annotations

import hashlib
import hmac
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llama_shard.local_workers import start_worker, stop_worker, wait_serving
from llama_shard.proto import shard_pb2 as pb
from llama_shard.proto import shard_pb2_grpc as pb_grpc
from llama_shard.proto.credentials import ClientSecurity

from support.pki import PKI, TOKENS, assertion, client_as, on_behalf_of, serve_worker, stub_for

pytestmark = pytest.mark.grpc


@pytest.fixture(scope="module")
def token_worker(synthetic_model, pki):
    PKI.update(pki)
    proc, addr = serve_worker(
        synthetic_model,
        (
            "--tls-cert",
            str(pki["server"].cert),
            "--tls-key",
            str(pki["server"].key),
            "--auth-token-file",
            str(pki["tokens"]),
            "--admin",
            "ops",
            "--max-sessions-per-principal",
            "3",
        ),
    )
    yield "localhost:" + addr.rsplit(":", 1)[1]
    stop_worker(proc)


@pytest.fixture(scope="module")
def mtls_worker(synthetic_model, pki):
    PKI.update(pki)
    proc, addr = serve_worker(
        synthetic_model,
        (
            "--tls-cert",
            str(pki["server"].cert),
            "--tls-key",
            str(pki["server"].key),
            "--tls-client-ca",
            str(pki["ca"].cert),
        ),
        ready=False,
    )
    yield proc, "localhost:" + addr.rsplit(":", 1)[1]
    stop_worker(proc)


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code()


def _prefill(stub, sid: str, epoch: int = 1, tokens=(1, 2, 3), position: int | None = 0):
    req = pb.StepRequest(session_id=sid, route_epoch=epoch, token_ids=list(tokens))
    if position is not None:
        req.position = position
    return stub.Prefill(req, timeout=30)


# --- token over TLS --------------------------------------------------------------------------------


def test_token_worker_refuses_every_wrong_caller_and_keeps_serving(token_worker, pki):
    alice = stub_for(token_worker, client_as(pki, "alice"))
    assert _prefill(alice, "a-first").outcome == pb.OUTCOME_OK
    plaintext = pb_grpc.ShardServiceStub(grpc.insecure_channel(token_worker))
    assert _code(lambda: plaintext.Info(pb.InfoRequest(), timeout=10)) == grpc.StatusCode.UNAVAILABLE
    other_ca = stub_for(
        token_worker, ClientSecurity(tls_ca=str(pki["other"].cert), token_file=str(pki["dir"] / "alice.token"))
    )
    assert _code(lambda: other_ca.Info(pb.InfoRequest(), timeout=10)) == grpc.StatusCode.UNAVAILABLE
    no_token = stub_for(token_worker, ClientSecurity(tls_ca=str(pki["ca"].cert)))
    assert _code(lambda: no_token.Info(pb.InfoRequest(), timeout=10)) == grpc.StatusCode.UNAUTHENTICATED
    wrong = pki["dir"] / "wrong.token"
    wrong.write_text("alice-token-0123456788\n")
    bad_token = stub_for(token_worker, ClientSecurity(tls_ca=str(pki["ca"].cert), token_file=str(wrong)))
    for call in (
        lambda: bad_token.Info(pb.InfoRequest(), timeout=10),
        lambda: _prefill(bad_token, "a-first"),
        lambda: bad_token.Release(pb.SessionRequest(session_id="a-first", route_epoch=1), timeout=10),
        lambda: bad_token.StepBatch(pb.StepBatchRequest(), timeout=10),
    ):
        assert _code(call) == grpc.StatusCode.UNAUTHENTICATED
    # the health service answers without credentials; alice's session is untouched
    creds = grpc.ssl_channel_credentials(root_certificates=pki["ca"].cert.read_bytes())
    with grpc.secure_channel(token_worker, creds) as ch:
        assert (
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status
            == health_pb2.HealthCheckResponse.SERVING
        )
    r = alice.Decode(pb.StepRequest(session_id="a-first", route_epoch=1, token_ids=[4]), timeout=30)
    assert r.outcome == pb.OUTCOME_OK and r.seq_len == 4


def _same_as_absent(reply_for_owned, reply_for_absent, owned: str, absent: str) -> None:
    a, b = pb.SessionReply() if isinstance(reply_for_owned, pb.SessionReply) else pb.StepReply(), None
    a.CopyFrom(reply_for_owned)
    a.detail = a.detail.replace(owned, absent)
    b = reply_for_absent
    assert a == b, (a, b)


def test_another_principal_cannot_touch_a_session_and_learns_nothing(token_worker, pki):
    alice, bob = stub_for(token_worker, client_as(pki, "alice")), stub_for(token_worker, client_as(pki, "bob"))
    assert _prefill(alice, "victim", epoch=5, tokens=[1, 2, 3, 4]).outcome == pb.OUTCOME_OK
    calls = {
        "resolve": lambda sid: bob.Resolve(pb.SessionRequest(session_id=sid, route_epoch=5), timeout=10),
        "decode": lambda sid: bob.Decode(pb.StepRequest(session_id=sid, route_epoch=5, token_ids=[9]), timeout=10),
        "continue": lambda sid: _prefill(bob, sid, epoch=5, tokens=[9], position=4),
        "truncate": lambda sid: bob.Truncate(pb.TruncateRequest(session_id=sid, route_epoch=5, length=1), timeout=10),
        "release": lambda sid: bob.Release(pb.SessionRequest(session_id=sid, route_epoch=5), timeout=10),
        "older epoch": lambda sid: bob.Decode(pb.StepRequest(session_id=sid, route_epoch=4, token_ids=[9]), timeout=10),
    }
    for name, call in calls.items():
        got, absent = call("victim"), call("never-opened")
        _same_as_absent(got, absent, "victim", "never-opened")
        if name != "release":
            assert got.outcome == pb.OUTCOME_CACHE_MISS and got.miss_reason == "UNKNOWN_SESSION", (name, got)
        else:
            assert got.outcome == pb.OUTCOME_OK and not got.released
    # a newer epoch or a fresh prefill from bob opens bob's own session, as for an absent id
    assert _prefill(bob, "victim", epoch=6, tokens=[7]).seq_len == 1
    r = alice.Decode(pb.StepRequest(session_id="victim", route_epoch=5, token_ids=[5]), timeout=30)
    assert r.outcome == pb.OUTCOME_OK and r.seq_len == 5
    # Info: counts for everyone, ids (with their owners) for the admin only
    bob_info = bob.Info(pb.InfoRequest(), timeout=10)
    assert bob_info.live_sessions >= 2 and list(bob_info.sessions) == []
    ops_info = stub_for(token_worker, client_as(pki, "ops")).Info(pb.InfoRequest(), timeout=10)
    owners = {(s.session_id, s.route_epoch): s.owner for s in ops_info.sessions}
    assert owners[("victim", 5)] == "alice" and owners[("victim", 6)] == "bob"
    for stub, epoch in ((alice, 5), (bob, 6)):
        assert stub.Release(pb.SessionRequest(session_id="victim", route_epoch=epoch), timeout=10).released


def test_the_per_principal_cap_answers_resource_exhausted_and_costs_others_nothing(token_worker, pki):
    alice, bob = stub_for(token_worker, client_as(pki, "alice")), stub_for(token_worker, client_as(pki, "bob"))
    held = [f"cap-{i}" for i in range(3)]
    for sid in held[:2]:  # with a-first from the first test: 3, the cap
        assert _prefill(alice, sid).outcome == pb.OUTCOME_OK
    alice.Release(pb.SessionRequest(session_id="a-first", route_epoch=1), timeout=10)
    assert _prefill(alice, held[2]).outcome == pb.OUTCOME_OK
    assert _code(lambda: _prefill(alice, "one-too-many")) == grpc.StatusCode.RESOURCE_EXHAUSTED
    batch = pb.StepBatchRequest(
        steps=[
            pb.BatchedStep(
                kind=pb.STEP_KIND_PREFILL, step=pb.StepRequest(session_id="one-too-many", route_epoch=1, token_ids=[1])
            )
        ]
    )
    assert _code(lambda: alice.StepBatch(batch, timeout=10)) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (
        alice.Resolve(pb.SessionRequest(session_id="one-too-many", route_epoch=1), timeout=10).miss_reason
        == "UNKNOWN_SESSION"
    )  # nothing was created
    assert _prefill(bob, "bob-own").outcome == pb.OUTCOME_OK  # another principal is not affected
    r = alice.Decode(pb.StepRequest(session_id=held[0], route_epoch=1, token_ids=[4]), timeout=10)
    assert r.outcome == pb.OUTCOME_OK  # a session alice holds still steps
    alice.Release(pb.SessionRequest(session_id=held[0], route_epoch=1), timeout=10)
    assert _prefill(alice, "one-too-many").outcome == pb.OUTCOME_OK  # a released slot is free again
    for sid in (*held[1:], "one-too-many"):
        alice.Release(pb.SessionRequest(session_id=sid, route_epoch=1), timeout=10)
    bob.Release(pb.SessionRequest(session_id="bob-own", route_epoch=1), timeout=10)


# --- mutual TLS --------------------------------------------------------------------------------------


def _wait_answering(proc, stub, timeout_s: float = 120) -> None:
    """Until the worker answers Info with this stub's credentials (it loads in the background)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            stub.Info(pb.InfoRequest(), timeout=2)
            return
        except grpc.RpcError:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)


def test_mutual_tls_principal_is_the_certificate_name(mtls_worker, pki):
    proc, address = mtls_worker
    alice_sec = ClientSecurity(
        tls_ca=str(pki["ca"].cert), tls_cert=str(pki["alice"].cert), tls_key=str(pki["alice"].key)
    )
    alice = stub_for(address, alice_sec)
    _wait_answering(proc, alice)
    assert _prefill(alice, "m-victim").outcome == pb.OUTCOME_OK
    no_cert = stub_for(address, ClientSecurity(tls_ca=str(pki["ca"].cert)))
    assert _code(lambda: no_cert.Info(pb.InfoRequest(), timeout=10)) == grpc.StatusCode.UNAVAILABLE
    mallory = stub_for(
        address,
        ClientSecurity(tls_ca=str(pki["ca"].cert), tls_cert=str(pki["mallory"].cert), tls_key=str(pki["mallory"].key)),
    )  # "alice", signed by another CA
    assert _code(lambda: mallory.Info(pb.InfoRequest(), timeout=10)) == grpc.StatusCode.UNAVAILABLE
    bob = stub_for(
        address, ClientSecurity(tls_ca=str(pki["ca"].cert), tls_cert=str(pki["bob"].cert), tls_key=str(pki["bob"].key))
    )
    r = bob.Resolve(pb.SessionRequest(session_id="m-victim", route_epoch=1), timeout=10)
    assert r.miss_reason == "UNKNOWN_SESSION"
    assert list(bob.Info(pb.InfoRequest(), timeout=10).sessions) == []  # no --admin: nobody sees ids
    assert alice.Resolve(pb.SessionRequest(session_id="m-victim", route_epoch=1), timeout=10).seq_len == 3


# --- safe defaults, reloads, the RPC limit, a chained route ----------------------------------------


def test_an_exposed_address_needs_tls_and_authentication_or_insecure(synthetic_model, pki):
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "llama_shard.cli",
            "serve",
            "--model",
            str(synthetic_model),
            "--host",
            "0.0.0.0",
            "--port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2
    assert "--tls-cert" in res.stderr and "--auth-token-file" in res.stderr and "--insecure" in res.stderr
    tls_only = subprocess.run(
        [
            sys.executable,
            "-m",
            "llama_shard.cli",
            "serve",
            "--model",
            str(synthetic_model),
            "--host",
            "0.0.0.0",
            "--port",
            "0",
            "--tls-cert",
            str(pki["server"].cert),
            "--tls-key",
            str(pki["server"].key),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert tls_only.returncode == 2  # TLS without authentication is not enough
    token_in_clear = subprocess.run(
        [
            sys.executable,
            "-m",
            "llama_shard.cli",
            "serve",
            "--model",
            str(synthetic_model),
            "--auth-token-file",
            str(pki["tokens"]),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert token_in_clear.returncode == 2 and "needs TLS" in token_in_clear.stderr
    # the metrics endpoint (plaintext, no authentication) joins the rule, even beside a TLS worker
    exposed_metrics = subprocess.run(
        [
            sys.executable,
            "-m",
            "llama_shard.cli",
            "serve",
            "--model",
            str(synthetic_model),
            "--port",
            "0",
            "--metrics-port",
            "0",
            "--metrics-host",
            "0.0.0.0",
            "--tls-cert",
            str(pki["server"].cert),
            "--tls-key",
            str(pki["server"].key),
            "--auth-token-file",
            str(pki["tokens"]),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert exposed_metrics.returncode == 2 and "metrics" in exposed_metrics.stderr
    proc, addr = start_worker(synthetic_model, 0, 5, 1, extra=("--host", "0.0.0.0", "--insecure"))
    try:
        wait_serving(proc, "127.0.0.1:" + addr.rsplit(":", 1)[1])
    finally:
        assert stop_worker(proc)[0] == 0


def test_token_file_and_certificates_reload_without_a_restart(synthetic_model, pki, tmp_path):
    PKI.update(pki)
    tokens, cert, key = tmp_path / "tokens", tmp_path / "server.cert", tmp_path / "server.key"
    tokens.write_text(f"alice:{TOKENS['alice']}\n")
    shutil.copy(pki["server"].cert, cert)
    shutil.copy(pki["server"].key, key)
    proc, addr = serve_worker(
        synthetic_model, ("--tls-cert", str(cert), "--tls-key", str(key), "--auth-token-file", str(tokens))
    )
    address = "localhost:" + addr.rsplit(":", 1)[1]
    try:
        bob = stub_for(address, client_as(pki, "bob"))
        assert _code(lambda: bob.Info(pb.InfoRequest(), timeout=10)) == grpc.StatusCode.UNAUTHENTICATED
        tokens.write_text(f"alice:{TOKENS['alice']}\nbob:{TOKENS['bob']}\n")
        proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        while True:
            try:
                bob.Info(pb.InfoRequest(), timeout=10)
                break
            except grpc.RpcError:
                assert time.monotonic() < deadline, "the new token was not accepted"
                time.sleep(0.2)
        # a new certificate, from another CA: new connections get it, the worker keeps running
        alice = stub_for(address, client_as(pki, "alice"))
        assert _prefill(alice, "kept").outcome == pb.OUTCOME_OK
        renewed = pki["other"].issue("worker-renewed", server=True)
        shutil.copy(renewed.key, key)
        shutil.copy(renewed.cert, cert)
        os.utime(cert)
        new_ca = stub_for(
            address, ClientSecurity(tls_ca=str(pki["other"].cert), token_file=str(pki["dir"] / "alice.token"))
        )
        r = new_ca.Resolve(pb.SessionRequest(session_id="kept", route_epoch=1), timeout=10)
        assert r.outcome == pb.OUTCOME_OK and r.seq_len == 3  # the session survived the renewal
    finally:
        assert stop_worker(proc)[0] == 0


def test_the_rpc_limit_answers_resource_exhausted_and_the_worker_goes_on(synthetic_model):
    proc, addr = serve_worker(synthetic_model, ("--max-concurrent-rpcs", "1"))
    codes: list = []
    try:
        stub = pb_grpc.ShardServiceStub(grpc.insecure_channel(addr))

        def hammer() -> None:
            for _ in range(30):
                try:
                    stub.Prefill(
                        pb.StepRequest(
                            session_id=f"h{threading.get_ident()}",
                            route_epoch=1,
                            token_ids=list(range(1, 200)),
                            position=0,
                        ),
                        timeout=30,
                    )
                    codes.append(grpc.StatusCode.OK)
                except grpc.RpcError as e:
                    codes.append(e.code())

        threads = [threading.Thread(target=hammer) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes and grpc.StatusCode.OK in codes
        assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}
        assert stub.Info(pb.InfoRequest(), timeout=10).first == 0  # serving as before
    finally:
        assert stop_worker(proc)[0] == 0


def test_a_chained_route_over_tls_forwards_with_the_workers_own_token(synthetic_model, pki):
    from llama_shard.route import RemoteStage, RouteClient

    PKI.update(pki)
    tls = (
        "--tls-cert",
        str(pki["server"].cert),
        "--tls-key",
        str(pki["server"].key),
        "--auth-token-file",
        str(pki["tokens"]),
    )
    route_key = ("--route-key-file", str(pki["route_key"]))  # the head signs whom it forwards for; the tail checks
    tail, tail_addr = serve_worker(synthetic_model, (*tls, "--forwarder", "ops", "--admin", "bob", *route_key), 3, 5)
    tail_name = "localhost:" + tail_addr.rsplit(":", 1)[1]
    refused = subprocess.run(
        [
            sys.executable,
            "-m",
            "llama_shard.cli",
            "serve",
            "--model",
            str(synthetic_model),
            "--layers",
            "0-2",
            "--port",
            "0",
            *tls,
            "--peer",
            tail_name,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 2 and "--peer-tls-ca" in refused.stderr  # a peer it could not authenticate
    head, head_addr = serve_worker(
        synthetic_model,
        (
            *tls,
            "--peer",
            tail_name,
            "--peer-tls-ca",
            str(pki["ca"].cert),
            "--peer-token-file",
            str(pki["dir"] / "ops.token"),
            *route_key,
        ),
        0,
        2,
    )
    try:
        security = client_as(pki, "alice")
        stages = [
            RemoteStage("localhost:" + head_addr.rsplit(":", 1)[1], security=security),
            RemoteStage(tail_name, security=security),
        ]
        client = RouteClient(stages)
        assert client.chained
        session = client.session("tls-route")
        tokens = client.generate_many([session], [[1, 17, 42, 99, 5]], 8)[0]
        from llama_shard.engine.pipeline import LocalPipeline

        whole = [
            t
            for t, _ in LocalPipeline(synthetic_model, None, n_ctx=256, n_seq_max=1, n_batch=32, n_threads=1).generate(
                [1, 17, 42, 99, 5], 8
            )
        ]
        assert tokens == whole
        # driven token by token from here: the head signs on its step RPCs as in its own loop
        stepped = RouteClient(stages, route_loop=False)  # the same stages: client.close() closes them
        stepped_session = stepped.session("tls-route-steps")
        assert stepped.generate_many([stepped_session], [[1, 17, 42, 99, 5]], 8)[0] == whole
        stepped_session.release()
        # a principal whose name is not ASCII: the head names her to the tail in -bin metadata
        zoe = ClientSecurity(tls_ca=str(pki["ca"].cert), token_file=str(pki["dir"] / "zoe.token"))
        zoe_client = RouteClient([RemoteStage(stages[0].address, security=zoe), RemoteStage(tail_name, security=zoe)])
        zoe_session = zoe_client.session("tls-route-zoe")
        assert zoe_client.generate_many([zoe_session], [[1, 17, 42, 99, 5]], 8)[0] == whole
        zoe_tail = stub_for(tail_name, zoe)
        assert (
            zoe_tail.Resolve(
                pb.SessionRequest(session_id="tls-route-zoe", route_epoch=zoe_session.epoch), timeout=10
            ).seq_len
            > 0
        )  # keyed by zoë on the tail too
        zoe_session.release()
        zoe_client.close()
        # the tail keyed the session by alice (the head, "ops", forwards on her behalf): she sees it
        # there herself, bob does not, and bob naming alice as a forwarder would is not believed
        tail_alice = stub_for(tail_name, security)
        assert (
            tail_alice.Resolve(pb.SessionRequest(session_id="tls-route", route_epoch=session.epoch), timeout=10).seq_len
            > 0
        )
        bob = stub_for(tail_name, client_as(pki, "bob"))
        r = bob.Resolve(
            pb.SessionRequest(session_id="tls-route", route_epoch=session.epoch),
            timeout=10,
            metadata=(("llama-shard-on-behalf-of-bin", b"alice"),),
        )
        assert r.miss_reason == "UNKNOWN_SESSION"
        # the forwarder's scope: it acts for others on step RPCs only, and never for an admin. Acting
        # "for alice" on a session call or Info it is itself: it cannot see, list or drop her session
        ops = stub_for(tail_name, client_as(pki, "ops"))
        for_alice = (("llama-shard-on-behalf-of-bin", b"alice"),)
        key = pb.SessionRequest(session_id="tls-route", route_epoch=session.epoch)
        assert ops.Resolve(key, timeout=10, metadata=for_alice).miss_reason == "UNKNOWN_SESSION"
        assert not ops.Release(key, timeout=10, metadata=for_alice).released
        assert (
            ops.Truncate(
                pb.TruncateRequest(session_id="tls-route", route_epoch=session.epoch, length=0),
                timeout=10,
                metadata=for_alice,
            ).outcome
            == pb.OUTCOME_CACHE_MISS
        )
        assert (
            list(ops.Info(pb.InfoRequest(), timeout=10, metadata=(("llama-shard-on-behalf-of-bin", b"bob"),)).sessions)
            == []
        )
        assert tail_alice.Resolve(key, timeout=10).seq_len > 0  # untouched
        with pytest.raises(grpc.RpcError) as e:  # stepping for an admin: not believed, and not the forwarder either
            ops.Prefill(
                pb.StepRequest(session_id="x", route_epoch=0),
                timeout=10,
                metadata=(("llama-shard-on-behalf-of-bin", b"bob"),),
            )
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        session.release()
        r = tail_alice.Resolve(pb.SessionRequest(session_id="tls-route", route_epoch=session.epoch), timeout=10)
        assert r.outcome == pb.OUTCOME_CACHE_MISS  # released on every worker by its owner
        client.close()
    finally:
        stop_worker(head)
        stop_worker(tail)


def _rows(n: int, n_embd: int, seed: int) -> pb.Tensor:
    data = np.random.default_rng(seed).standard_normal((n, n_embd)).astype(np.float32)
    return pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[n, n_embd], data=data.tobytes())


def test_a_forwarder_token_without_the_route_key_steps_no_ones_session(synthetic_model, pki):
    """The leaked peer token ("ops", a --forwarder) without the route key: no signature, another
    key, a stale or future issued-at, a signature for another name, a blank name: UNAUTHENTICATED,
    never ops itself, and alice's session is unchanged. With the head's assertion, a middle worker
    passes it on unchanged and the tail keys the session by alice."""
    PKI.update(pki)
    flags = (
        "--tls-cert",
        str(pki["server"].cert),
        "--tls-key",
        str(pki["server"].key),
        "--auth-token-file",
        str(pki["tokens"]),
        "--forwarder",
        "ops",
        "--route-key-file",
        str(pki["route_key"]),
    )
    tail, tail_addr = serve_worker(synthetic_model, flags, 4, 5)
    tail_name = "localhost:" + tail_addr.rsplit(":", 1)[1]
    middle, middle_addr = serve_worker(
        synthetic_model,
        (
            *flags,
            "--peer",
            tail_name,
            "--peer-tls-ca",
            str(pki["ca"].cert),
            "--peer-token-file",
            str(pki["dir"] / "ops.token"),
        ),
        2,
        3,
    )
    middle_name = "localhost:" + middle_addr.rsplit(":", 1)[1]
    try:
        ops, alice_tail = stub_for(middle_name, client_as(pki, "ops")), stub_for(tail_name, client_as(pki, "alice"))
        n_embd = ops.Info(pb.InfoRequest(), timeout=10).n_embd
        # the head's step for alice: through the middle to the tail, keyed by alice on both
        r = ops.Prefill(
            pb.StepRequest(
                session_id="victim",
                route_epoch=1,
                hidden=_rows(4, n_embd, 1),
                position=0,
                forward=[pb.Hop(address=tail_name)],
            ),
            timeout=30,
            metadata=on_behalf_of(pki, "alice"),
        )
        assert r.outcome == pb.OUTCOME_OK and r.seq_len == 4, r
        key = pb.SessionRequest(session_id="victim", route_epoch=1)
        assert alice_tail.Resolve(key, timeout=10).seq_len == 4
        assert stub_for(middle_name, client_as(pki, "alice")).Resolve(key, timeout=10).seq_len == 4
        route_key, wrong_key = pki["route_key"].read_bytes(), os.urandom(32)
        now = int(time.time())
        name = ("llama-shard-on-behalf-of-bin", b"alice")
        forged = {
            "no signature": (name,),
            "another key": (name, ("llama-shard-on-behalf-of-sig-bin", assertion(wrong_key, "alice"))),
            "stale": (name, ("llama-shard-on-behalf-of-sig-bin", assertion(route_key, "alice", now - 301))),
            "from the future": (name, ("llama-shard-on-behalf-of-sig-bin", assertion(route_key, "alice", now + 120))),
            "another name's": (name, ("llama-shard-on-behalf-of-sig-bin", assertion(route_key, "bob"))),
            "truncated": (name, ("llama-shard-on-behalf-of-sig-bin", assertion(route_key, "alice")[:-1])),
            "a blank name": on_behalf_of(pki, " "),
            "an empty name": on_behalf_of(pki, ""),
        }
        for target in (tail_name, middle_name):  # the middle checks before it forwards
            forwarder = stub_for(target, client_as(pki, "ops"))
            for why, metadata in forged.items():
                step = pb.StepRequest(session_id="victim", route_epoch=1, hidden=_rows(1, n_embd, 2))
                assert (
                    _code(lambda: forwarder.Decode(step, timeout=10, metadata=metadata))
                    == grpc.StatusCode.UNAUTHENTICATED
                ), (target, why)
                batch = pb.StepBatchRequest(steps=[pb.BatchedStep(kind=pb.STEP_KIND_DECODE, step=step)])
                assert (
                    _code(lambda: forwarder.StepBatch(batch, timeout=10, metadata=metadata))
                    == grpc.StatusCode.UNAUTHENTICATED
                ), (target, why)
        assert alice_tail.Resolve(key, timeout=10).seq_len == 4  # untouched
        # and ops stepping as itself reaches only its own key space
        r = stub_for(tail_name, client_as(pki, "ops")).Decode(
            pb.StepRequest(session_id="victim", route_epoch=1, hidden=_rows(1, n_embd, 3)), timeout=10
        )
        assert r.outcome == pb.OUTCOME_CACHE_MISS and r.miss_reason == "UNKNOWN_SESSION"
        assert alice_tail.Resolve(key, timeout=10).seq_len == 4
    finally:
        stop_worker(middle)
        stop_worker(tail)


def test_a_forwarder_needs_a_private_route_key_file(synthetic_model, pki, tmp_path):
    tls = (
        "--tls-cert",
        str(pki["server"].cert),
        "--tls-key",
        str(pki["server"].key),
        "--auth-token-file",
        str(pki["tokens"]),
        "--forwarder",
        "ops",
    )

    def serve(*flags):
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "llama_shard.cli",
                "serve",
                "--model",
                str(synthetic_model),
                "--port",
                "0",
                *tls,
                *flags,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )

    missing = serve()
    assert missing.returncode == 2 and "--forwarder" in missing.stderr and "--route-key-file" in missing.stderr
    readable, short = tmp_path / "readable.key", tmp_path / "short.key"
    readable.write_bytes(os.urandom(32))
    readable.chmod(0o640)
    short.write_bytes(os.urandom(31))
    short.chmod(0o600)
    for path, says in (
        (readable, "chmod 600"),
        (short, "31 bytes"),
        (tmp_path, "not a regular file"),
        (tmp_path / "absent.key", "cannot open"),
    ):
        res = serve("--route-key-file", str(path))
        assert res.returncode == 2 and says in res.stderr and "--route-key-file" in res.stderr, (path, res.stderr)


def _https(port: int, ctx, method: str, path: str, body: bytes | None, headers: dict) -> int:
    """The status of one request on a new connection."""
    import http.client

    conn = http.client.HTTPSConnection("localhost", port, timeout=30, context=ctx)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json", **headers})
        return conn.getresponse().status
    finally:
        conn.close()


def test_a_certificate_without_a_common_name_is_no_principal(synthetic_model, pki, tmp_path):
    """Mutual TLS: a client certificate whose common name is empty, or that has none, is no
    credential (before: the anonymous principal, whose keys are the raw ids: it reached
    `<alice's tag>/chat`, alice's session): UNAUTHENTICATED on gRPC, 401 on the HTTP port, and
    alice's session, named by its real tag (computed here from the warm directory's key) or by
    the old unkeyed one, is untouched."""
    import ssl

    from llama_shard.local_workers import free_port

    PKI.update(pki)
    warm = tmp_path / "warm"
    warm.mkdir(mode=0o700)
    http_port = free_port()
    proc, addr = serve_worker(
        synthetic_model,
        (
            "--tls-cert",
            str(pki["server"].cert),
            "--tls-key",
            str(pki["server"].key),
            "--tls-client-ca",
            str(pki["ca"].cert),
            "--warm-dir",
            str(warm),
            "--warm-disk",
            "64MiB",
            "--http-port",
            str(http_port),
        ),
        ready=False,
    )
    address = "localhost:" + addr.rsplit(":", 1)[1]

    def as_cert(issued) -> pb_grpc.ShardServiceStub:
        return stub_for(
            address, ClientSecurity(tls_ca=str(pki["ca"].cert), tls_cert=str(issued.cert), tls_key=str(issued.key))
        )

    try:
        alice = as_cert(pki["alice"])
        _wait_answering(proc, alice)
        assert _prefill(alice, "chat").outcome == pb.OUTCOME_OK
        tag_key = hmac.new(
            (warm / "llama-shard.key").read_bytes(), b"llama-shard owner tag v1", hashlib.sha256
        ).digest()
        real = hmac.new(tag_key, b"alice", hashlib.sha256).hexdigest()[:16]
        old = hashlib.blake2b(b"alice", digest_size=8).hexdigest()
        assert real != old  # tags are keyed: nobody without the worker's secret computes one
        named = ssl.create_default_context(cafile=str(pki["ca"].cert))
        named.load_cert_chain(pki["alice"].cert, pki["alice"].key)
        assert _https(http_port, named, "GET", "/v1/models", None, {}) == 200  # a named certificate gets in
        for issued in (pki["empty_cn"], pki["no_cn"]):
            nameless = as_cert(issued)
            for sid in (f"{real}/chat", f"{old}/chat", "chat"):
                key = pb.SessionRequest(session_id=sid, route_epoch=1)
                for call in (
                    lambda: nameless.Resolve(key, timeout=10),
                    lambda: nameless.Release(key, timeout=10),
                    lambda: nameless.Decode(pb.StepRequest(session_id=sid, route_epoch=1, token_ids=[4]), timeout=10),
                    lambda: nameless.Info(pb.InfoRequest(), timeout=10),
                ):
                    assert _code(call) == grpc.StatusCode.UNAUTHENTICATED, (issued, sid)
            ctx = ssl.create_default_context(cafile=str(pki["ca"].cert))
            ctx.load_cert_chain(issued.cert, issued.key)
            for method, path, body in (
                ("GET", "/v1/models", None),
                ("POST", "/v1/completions", b'{"model": "m", "prompt": [1], "max_tokens": 1}'),
            ):
                assert _https(http_port, ctx, method, path, body, {"X-Session-Id": f"{real}/chat"}) == 401, (
                    issued,
                    path,
                )
        # another principal naming alice's internal key reaches a key of his own
        bob = as_cert(pki["bob"])
        assert (
            bob.Resolve(pb.SessionRequest(session_id=f"{real}/chat", route_epoch=1), timeout=10).miss_reason
            == "UNKNOWN_SESSION"
        )
        r = alice.Resolve(pb.SessionRequest(session_id="chat", route_epoch=1), timeout=10)
        assert r.outcome == pb.OUTCOME_OK and r.seq_len == 3  # untouched
    finally:
        stop_worker(proc)


def test_owner_tags_are_keyed_per_worker_and_kept_with_its_warm_directory(pki, tmp_path):
    from llama_shard.worker.security import ServerSecurity

    def security():
        return ServerSecurity(str(pki["server"].cert), str(pki["server"].key), None, str(pki["tokens"]))

    one, two = security(), security()
    assert one.tag("alice") != hashlib.blake2b(b"alice", digest_size=8).hexdigest()  # not computable by anyone
    assert one.tag("alice") != two.tag("alice")  # without a warm directory: a secret per process
    assert one.split_key(one.engine_key("alice", "chat")) == (one.tag("alice"), "chat")
    warm = tmp_path / "warm"
    warm.mkdir(mode=0o700)
    (warm / "llama-shard.key").write_bytes(os.urandom(32))
    (warm / "llama-shard.key").chmod(0o600)
    one.key_owner_tags(str(warm))
    two.key_owner_tags(str(warm))
    assert one.tag("alice") == two.tag("alice") != one.tag("bob")  # a restart on the directory keeps them
    tag_key = hmac.new((warm / "llama-shard.key").read_bytes(), b"llama-shard owner tag v1", hashlib.sha256).digest()
    assert one.tag("alice") == hmac.new(tag_key, "alice".encode(), hashlib.sha256).hexdigest()[:16]


@pytest.mark.slow
def test_generate_reaches_a_route_over_tls_with_a_token_and_is_refused_without(embedded_model, pki):
    PKI.update(pki)
    tls = (
        "--tls-cert",
        str(pki["server"].cert),
        "--tls-key",
        str(pki["server"].key),
        "--auth-token-file",
        str(pki["tokens"]),
    )
    workers = [serve_worker(embedded_model, tls, 0, 14), serve_worker(embedded_model, tls, 15, 29)]
    route = ",".join(
        f"{a}-{b}@localhost:{addr.rsplit(':', 1)[1]}" for (a, b), (_, addr) in zip([(0, 14), (15, 29)], workers)
    )
    cmd = [
        sys.executable,
        "-m",
        "llama_shard.cli",
        "generate",
        "--model",
        str(embedded_model),
        "--route",
        route,
        "--prompt",
        "The capital of France is",
        "--max-tokens",
        "6",
        "--tls-ca",
        str(pki["ca"].cert),
    ]
    try:
        ok = subprocess.run(
            [*cmd, "--token-file", str(pki["dir"] / "alice.token")], capture_output=True, text=True, timeout=300
        )
        assert ok.returncode == 0, ok.stderr[-2000:]
        assert ok.stdout.strip()
        refused = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert refused.returncode == 2 and "UNAUTHENTICATED" in refused.stderr
    finally:
        for proc, _ in workers:
            stop_worker(proc)


# --- the token file: read between two stats, a bad version refused, a deleted file revokes ------------


def test_a_token_file_rewritten_while_it_is_read_is_read_again(tmp_path, monkeypatch):
    """Forced ordering: the file is rewritten (alice -> alice + bob) between the reload's read and
    its second stat. The table must end with bob (a stamp taken after the read would keep the old
    table until the next edit)."""
    import pathlib

    from llama_shard.worker.security import TokenTable

    path = tmp_path / "tokens"
    path.write_text(f"alice:{TOKENS['alice']}\n")
    table = TokenTable(str(path))
    real_read = pathlib.Path.read_text
    rewritten = []

    def read_then_rewrite(self, *args, **kwargs):
        text = real_read(self, *args, **kwargs)
        if not rewritten and self == path:
            rewritten.append(True)
            path.write_text(f"alice:{TOKENS['alice']}\nbob:{TOKENS['bob']}\n")
        return text

    path.write_text(f"alice:{TOKENS['alice']}\n# edited\n")  # a change, so the next call reloads
    monkeypatch.setattr(pathlib.Path, "read_text", read_then_rewrite)
    assert table.principal(TOKENS["alice"]) == "alice"
    assert rewritten and table.principal(TOKENS["bob"]) == "bob"


@pytest.mark.parametrize(
    "bad", ["", "# only a comment\n", f"alice:{TOKENS['alice']}\nbob:{TOKENS['alice']}\n", "alice:short\n"]
)
def test_a_bad_token_file_keeps_the_last_good_table_and_says_so(tmp_path, capfd, bad):
    from llama_shard.worker.security import TokenTable

    path = tmp_path / "tokens"
    path.write_text(f"alice:{TOKENS['alice']}\n")
    table = TokenTable(str(path))
    path.write_text(bad)
    assert table.principal(TOKENS["alice"]) == "alice"  # the last good table
    assert "keeping the last good token table" in capfd.readouterr().err
    with pytest.raises(ValueError):
        TokenTable(str(path))  # at start-up a bad file is an error


def test_a_deleted_token_file_revokes_every_token(tmp_path, capfd):
    from llama_shard.worker.security import TokenTable

    path = tmp_path / "tokens"
    path.write_text(f"alice:{TOKENS['alice']}\n")
    table = TokenTable(str(path))
    assert table.principal(TOKENS["alice"]) == "alice"
    path.unlink()
    assert table.principal(TOKENS["alice"]) is None
    assert "is gone" in capfd.readouterr().err
    path.write_text(f"bob:{TOKENS['bob']}\n")
    assert table.principal(TOKENS["bob"]) == "bob" and table.principal(TOKENS["alice"]) is None


def test_sessions_resumed_from_disk_count_against_their_owners_cap(synthetic_model, pki, tmp_path):
    """alice (cap 1) holds one session; the worker restarts on its disk tier and resumes it: it
    is still hers, so a second new session is refused (before: the restarted worker counted 0)."""
    PKI.update(pki)
    flags = (
        "--tls-cert",
        str(pki["server"].cert),
        "--tls-key",
        str(pki["server"].key),
        "--auth-token-file",
        str(pki["tokens"]),
        "--warm-dir",
        str(tmp_path / "warm"),
        "--warm-disk",
        "64MiB",
        "--max-sessions-per-principal",
        "1",
    )
    (tmp_path / "warm").mkdir(mode=0o700)
    proc, addr = serve_worker(synthetic_model, flags)
    alice = stub_for("localhost:" + addr.rsplit(":", 1)[1], client_as(pki, "alice"))
    assert _prefill(alice, "kept").outcome == pb.OUTCOME_OK
    assert stop_worker(proc)[0] == 0  # SIGTERM: the session goes to disk
    proc, addr = serve_worker(synthetic_model, flags)
    try:
        alice = stub_for("localhost:" + addr.rsplit(":", 1)[1], client_as(pki, "alice"))
        assert _code(lambda: _prefill(alice, "second")) == grpc.StatusCode.RESOURCE_EXHAUSTED
        r = alice.Resolve(pb.SessionRequest(session_id="kept", route_epoch=1), timeout=10)
        assert r.outcome == pb.OUTCOME_OK and r.seq_len == 3  # resumed, and hers
        bob = stub_for("localhost:" + addr.rsplit(":", 1)[1], client_as(pki, "bob"))
        assert _prefill(bob, "bobs").outcome == pb.OUTCOME_OK  # the cap is per principal
    finally:
        assert stop_worker(proc)[0] == 0


def test_only_a_trusted_worker_or_an_admin_may_hand_sessions_over_or_drain(token_worker, pki):
    """Handover writes KV into a session of the owner it names: an ordinary principal may not call
    it (nor Drain), whatever it sends; an admin's malformed hand-over is refused, nothing changed."""
    alice, ops = stub_for(token_worker, client_as(pki, "alice")), stub_for(token_worker, client_as(pki, "ops"))
    before = ops.Info(pb.InfoRequest(), timeout=10)
    forged = pb.HandoverRequest(
        session_id="bob-chat",
        owner="bob",
        seq_len=4,
        state=b"\0" * 64,
        state_bytes=64,
        recipe_fingerprint=before.recipe_fingerprint,
        model_digest=before.model_digest,
    )
    forged.state_sha256 = hashlib.sha256(forged.state).digest()
    for call, request in (
        (lambda r, timeout: alice.Handover(iter([r]), timeout=timeout), forged),
        (alice.Drain, pb.DrainRequest()),
    ):
        with pytest.raises(grpc.RpcError) as e:
            call(request, timeout=10)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    reply = ops.Handover(iter([forged]), timeout=10)  # an admin may call it: the bytes are still checked
    assert reply.outcome == pb.OUTCOME_INVALID_ARGUMENT and "hand-over refused" in reply.detail, reply
    forged.owner = "ops"  # an admin's own sessions are not a thing on this worker
    assert ops.Handover(iter([forged]), timeout=10).outcome == pb.OUTCOME_INVALID_ARGUMENT
    after = ops.Info(pb.InfoRequest(), timeout=10)
    assert (after.live_sessions, after.reserved_tokens) == (before.live_sessions, before.reserved_tokens)
