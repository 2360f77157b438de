"""How a client reaches a worker: TLS trust, a client certificate, a bearer token.

Used by the route client, `llama-shard generate --route` and a worker forwarding to its peer alike,
so it lives with the wire, below both the client (`route/`) and the server (`serve/`). The server's
side of the same set-ups (`ServerSecurity`: certificates served, tokens checked, principals) is in
`worker/security.py`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import grpc

from ..errors import InvalidInputError


def read_bytes(path: str | None) -> bytes | None:
    return None if path is None else Path(path).read_bytes()


@dataclasses.dataclass(frozen=True)
class ClientSecurity:
    """How a client (RemoteStage, `llama-shard generate`, a worker forwarding to its peer) reaches
    a worker: plaintext when nothing is set, else TLS trusting `tls_ca` (the system's roots when
    None), with a client certificate for mutual TLS and/or a bearer token."""

    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    token_file: str | None = None

    @property
    def secure(self) -> bool:
        return any((self.tls_ca, self.tls_cert, self.token_file))

    def token(self) -> str | None:
        if self.token_file is None:
            return None
        lines = [ln.strip() for ln in Path(self.token_file).read_text().splitlines() if ln.strip()]
        if len(lines) != 1:
            raise InvalidInputError(f"{self.token_file} must hold one line: the token")
        return lines[0]

    def channel(self, address: str, options: list) -> grpc.Channel:
        if not self.secure:
            return grpc.insecure_channel(address, options=options)
        if bool(self.tls_cert) != bool(self.tls_key):
            raise InvalidInputError("--tls-cert and --tls-key go together")
        creds = grpc.ssl_channel_credentials(
            root_certificates=read_bytes(self.tls_ca),
            private_key=read_bytes(self.tls_key),
            certificate_chain=read_bytes(self.tls_cert),
        )
        token = self.token()
        if token is not None:
            creds = grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(token))
        return grpc.secure_channel(address, creds, options=options)
