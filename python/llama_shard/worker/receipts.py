"""A worker's receipts (shard.proto's Receipt): the commitment its StepRunner kept for a request,
signed with its node key, then the later stages' receipts, chained as a step is (receipts/ holds the
commitments, keys and checks; this is where a worker signs)."""

from __future__ import annotations

import os
import time

import grpc

from ..errors import LlamaShardError
from ..proto import shard_pb2 as pb
from ..proto.wire import call_reconnecting
from ..receipts.chain import NONCE_BYTES
from ..receipts.keys import NodeKey
from .security import read_private_file

#: the largest receipt key file read (an Ed25519 PEM is 119 bytes)
MAX_KEY_FILE_BYTES = 4096


def load_receipt_key(path: str) -> NodeKey:
    """serve --receipt-key: the key in `path`, read as a secret is (this user's regular file, closed
    to group and others), or a new one made there when there is no file; InvalidInputError else."""
    if not os.path.lexists(path):
        return NodeKey.create(path)
    return NodeKey.from_pem(read_private_file(path, "--receipt-key", 1, MAX_KEY_FILE_BYTES), path)


class ReceiptSigner:
    """Signs `steps`' (a StepRunner's) commitments with `key` as the worker `template` describes
    (its model digest, range, numerics, backend, instance)."""

    def __init__(self, steps, key: NodeKey, template: pb.ReceiptBody):
        self.steps, self.key, self.template = steps, key, template

    def sign(
        self, principal: str, visited: tuple[str, ...], request: pb.ReceiptRequest, deadline: float, assertion=None
    ) -> pb.ReceiptReply:
        """This worker's signed receipt for a request's committed steps, then (chained like a step)
        the later stages' in `request.forward`; a stage that has none stops the list (`detail`)."""
        refusal = self.steps.forward_refusal(request.forward, visited)
        if refusal is not None:
            return pb.ReceiptReply(detail=refusal.text)
        if len(request.nonce) != NONCE_BYTES:
            return pb.ReceiptReply(detail=f"a receipt's nonce is {NONCE_BYTES} bytes, got {len(request.nonce)}")
        try:
            key = self.steps.security.engine_key(principal, request.session_id)
        except LlamaShardError as e:
            return pb.ReceiptReply(detail=str(e))
        body = pb.ReceiptBody()
        body.CopyFrom(self.template)
        body.session_id, body.route_epoch, body.nonce = request.session_id, request.route_epoch, request.nonce
        why = self.steps.receipts.fill((key, request.route_epoch, request.nonce), body)
        if why is not None:
            return pb.ReceiptReply(detail=f"this worker {why}")
        reply = pb.ReceiptReply(receipts=[self.key.sign(body)])
        if not request.forward:
            return reply
        hop = request.forward[0]
        nxt = pb.ReceiptRequest(
            session_id=request.session_id,
            route_epoch=request.route_epoch,
            nonce=request.nonce,
            forward=request.forward[1:],
        )
        try:
            later = call_reconnecting(
                lambda: self.steps.peers.receipt(
                    hop.address,
                    nxt,
                    max(deadline - time.monotonic(), 0.001),
                    principal,
                    visited + (self.steps.worker_id,),
                    assertion,
                ),
                deadline,
            )
        except grpc.RpcError as e:
            return pb.ReceiptReply(
                receipts=reply.receipts, detail=f"worker {hop.address} could not be reached: {e.code().name}", stage=1
            )
        reply.receipts.extend(later.receipts)
        reply.detail, reply.stage = later.detail, later.stage + 1 if later.detail else 0
        return reply
