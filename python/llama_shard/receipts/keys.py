"""A worker's receipt key: Ed25519, made per process or kept in a file (serve --receipt-key FILE, so
that a worker's receipts are signed by the same key across restarts). Its public half is in Info
(`receipt_key`): a head pins the key each worker showed it over the route's authenticated channel,
which binds the receipts to the worker the head chose."""

from __future__ import annotations

import os
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from ..errors import InvalidInputError
from ..proto import shard_pb2 as pb

PUBLIC_KEY_BYTES = 32


class NodeKey:
    def __init__(self, private: Ed25519PrivateKey):
        self._private = private
        self.public = private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)

    @classmethod
    def generate(cls) -> "NodeKey":
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def create(cls, path: str | Path) -> "NodeKey":
        """A new key, written to `path` (PEM, PKCS#8, unencrypted; mode 0600, never over a file)."""
        key = Ed25519PrivateKey.generate()
        pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except OSError as e:
            raise InvalidInputError(f"--receipt-key {path}: cannot create it: {e.strerror}") from None
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
        return cls(key)

    @classmethod
    def from_pem(cls, pem: bytes, where: str) -> "NodeKey":
        """The key a PEM file's bytes hold; InvalidInputError naming `where` unless it is Ed25519."""
        try:
            key = serialization.load_pem_private_key(pem, password=None)
        except (ValueError, TypeError) as e:
            raise InvalidInputError(f"--receipt-key {where}: not an unencrypted PEM private key ({e})") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise InvalidInputError(f"--receipt-key {where}: an Ed25519 key is needed, not {type(key).__name__}")
        return cls(key)

    def sign(self, body: pb.ReceiptBody) -> pb.StageReceipt:
        data = body.SerializeToString(deterministic=True)
        return pb.StageReceipt(body=data, signature=self._private.sign(data), public_key=self.public)


def signed_body(stage: pb.StageReceipt) -> pb.ReceiptBody | str:
    """The body a stage receipt's signature covers, or why it does not verify."""
    if len(stage.public_key) != PUBLIC_KEY_BYTES:
        return f"its public key is {len(stage.public_key)} bytes, not {PUBLIC_KEY_BYTES}"
    try:
        Ed25519PublicKey.from_public_bytes(stage.public_key).verify(stage.signature, stage.body)
    except (InvalidSignature, ValueError):
        return "its signature does not verify"
    body = pb.ReceiptBody()
    try:
        body.ParseFromString(stage.body)
    except Exception:  # noqa: BLE001 - a signed body that does not parse is a bad receipt, whatever the error
        return "its body does not parse"
    return body
