"""Certificates, tokens and a route key made for the tests, and workers started with them: the
helpers the security tests share (conftest.py's `pki` fixture makes one set per module)."""

from __future__ import annotations

import hashlib
import hmac
import os
import subprocess
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llama_shard.local_workers import start_worker, wait_serving
from llama_shard.proto import shard_pb2_grpc as pb_grpc
from llama_shard.proto.credentials import ClientSecurity
from llama_shard.testing.certs import CertificateAuthority

TOKENS = {"alice": "alice-token-0123456789", "bob": "bob-token-0123456789ab", "ops": "ops-token-0123456789abc"}
ZOE_TOKEN = "zoe-token-0123456789abcd"


def serve_worker(
    model, flags: tuple, first: int = 0, last: int = 5, ready: bool = True
) -> tuple[subprocess.Popen, str]:
    proc, addr = start_worker(model, first, last, 1, extra=("--context-tokens", "256", *flags))
    if ready:
        probe = ("localhost:" + addr.rsplit(":", 1)[1]) if "--tls-cert" in flags else addr
        wait_tls(proc, probe) if "--tls-cert" in flags else wait_serving(proc, addr)
    return proc, addr


def wait_tls(proc, address: str, timeout_s: float = 120.0) -> None:
    """The health check over TLS, without credentials: it stays reachable for orchestrators."""
    creds = grpc.ssl_channel_credentials(root_certificates=PKI["ca"].cert.read_bytes())
    deadline = time.monotonic() + timeout_s
    with grpc.secure_channel(address, creds) as ch:
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read()
            try:
                r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                time.sleep(0.1)
    raise TimeoutError(address)


PKI: dict = {}


def stub_for(address: str, security: ClientSecurity) -> pb_grpc.ShardServiceStub:
    return pb_grpc.ShardServiceStub(security.channel(address, []))


def client_as(pki, principal: str) -> ClientSecurity:
    return ClientSecurity(tls_ca=str(pki["ca"].cert), token_file=str(pki["dir"] / f"{principal}.token"))


def assertion(key: bytes, principal: str, issued_at: int | None = None) -> bytes:
    """The head's on-behalf-of assertion, built from its wire format (not the worker's code): version
    1, issued-at as 8 big-endian bytes, HMAC-SHA256 under the route key of those and the name."""
    head = bytes([1]) + (int(time.time()) if issued_at is None else issued_at).to_bytes(8, "big")
    return head + hmac.new(key, head + principal.encode("utf-8"), hashlib.sha256).digest()


def on_behalf_of(pki, principal: str, **kw) -> tuple:
    """Metadata a head sends for `principal`, signed with the pki's route key."""
    return (
        ("llama-shard-on-behalf-of-bin", principal.encode("utf-8")),
        ("llama-shard-on-behalf-of-sig-bin", assertion(pki["route_key"].read_bytes(), principal, **kw)),
    )


def make_pki(d: Path) -> dict:
    """Two certificate authorities, certificates, token files and a route key in `d` (the `pki`
    fixture of conftest.py)."""
    ca, other = CertificateAuthority.create(d, "mesh-ca"), CertificateAuthority.create(d, "other-ca")
    tokens = d / "tokens"
    # and a principal whose name is not ASCII (a token file is UTF-8; so is a certificate's CN)
    tokens.write_text(
        "# principal:token\n" + "".join(f"{p}:{t}\n" for p, t in TOKENS.items()) + f"zoë:{ZOE_TOKEN}\n",
        encoding="utf-8",
    )
    for principal, token in TOKENS.items():
        (d / f"{principal}.token").write_text(token + "\n")
    (d / "zoe.token").write_text(ZOE_TOKEN + "\n")
    route_key = d / "route.key"  # the route's shared secret (serve --route-key-file)
    route_key.write_bytes(os.urandom(32))
    route_key.chmod(0o600)
    return {
        "dir": d,
        "ca": ca,
        "other": other,
        "server": ca.issue("worker", server=True),
        "tokens": tokens,
        "alice": ca.issue("alice"),
        "bob": ca.issue("bob"),
        "mallory": other.issue("alice"),
        "empty_cn": ca.issue(""),
        "no_cn": ca.issue(None),
        "route_key": route_key,
    }
