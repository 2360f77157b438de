"""`llama-shard verify-receipt FILE`: checks a route's receipt offline (receipts/verify.py); exit 0 when
it verifies and no spot check in it found a mismatch, else 1. The file
holds the receipt as GenerateFinal.receipt has it (protobuf bytes), as base64 text, or as the JSON
an OpenAI-compatible response was saved as (its "receipt" field, at the top or under "llama_shard")."""

from __future__ import annotations

import argparse
import base64
import binascii
import json
from pathlib import Path

from google.protobuf.message import DecodeError

from ..errors import InvalidInputError
from ..proto import shard_pb2 as pb
from ..receipts.verify import check_route, describe

#: the largest receipt file read (a route of 32 stages' receipts is a few KiB)
MAX_RECEIPT_FILE_BYTES = 1 << 20


def _receipt_bytes(data: bytes) -> bytes:
    """The protobuf bytes of a receipt file in any of its three forms."""
    text = None
    try:
        text = data.decode("ascii").strip()
    except UnicodeDecodeError:
        return data  # protobuf bytes
    if text.startswith("{"):
        try:
            doc = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as e:
            raise InvalidInputError(f"the file is not JSON that names a receipt: {e}") from None
        found = doc.get("receipt") if isinstance(doc, dict) else None
        if found is None and isinstance(doc, dict) and isinstance(doc.get("llama_shard"), dict):
            found = doc["llama_shard"].get("receipt")
        if not isinstance(found, str):
            raise InvalidInputError('the JSON has no "receipt" field (ask for one: "receipt": true)')
        text = found
    try:
        return base64.b64decode(text, validate=True)
    except binascii.Error:
        return data  # protobuf bytes that happen to be ASCII


def cmd_verify_receipt(args: argparse.Namespace) -> int:
    path = Path(args.file)
    if not path.is_file():
        raise InvalidInputError(f"{path}: no such file")
    if path.stat().st_size > MAX_RECEIPT_FILE_BYTES:
        raise InvalidInputError(f"{path}: larger than a receipt ({MAX_RECEIPT_FILE_BYTES} bytes at most)")
    receipt = pb.RouteReceipt()
    try:
        receipt.ParseFromString(_receipt_bytes(path.read_bytes()))
    except DecodeError:
        raise InvalidInputError(f"{path}: not a route receipt") from None
    keys = None
    if args.key:
        try:
            keys = [bytes.fromhex(k) if k != "-" else None for k in args.key]
        except ValueError:
            raise InvalidInputError("--key takes a public key in hex (InfoReply.receipt_key), or '-'") from None
    for line in describe(receipt):
        print(line)
    problems = check_route(receipt, keys=keys)
    if problems:
        print("not verified:")
        for p in problems:
            print(f"  {p}")
        return 1
    print(f"verified: {len(receipt.stages)} stages, nonce {receipt.nonce.hex()}")
    caught = [c for c in receipt.spot_checks if c.outcome.startswith("mismatch")]
    if caught:  # the head's statement (not signed by the replicas): the route it ran was caught
        print(f"but the head's spot check found a mismatch at stage {caught[0].stage} ({caught[0].worker})")
        return 1
    return 0
