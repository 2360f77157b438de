"""A worker's commitments to what it computed for one request, and the steps a head keeps to replay.

A step is committed by three 32-byte entries, each SHA-256 over (start position, tokens, digest):
its input (the token ids, or the hidden rows exactly as they arrived: type, shape, bytes), its
output (the rows exactly as sent on; the tail: its logit rows) and the answer that came back (the
tail's tokens, which pass every stage). A receipt's chain is SHA-256 over the sorted entries.

Why sorted, not a running hash in arrival order: a pipelined stream's windows are answered out of
order between two workers, and a step is committed only once its whole route answered OK (a miss
or a failed hop further on commits nothing anywhere, so every stage commits the same steps). Stage
k's output entries and stage k+1's input entries are then the same multiset, hashed alike: equal
chains. Entries carry their positions, so the order is not lost.

Digests: rows and tokens with SHA-256; a tail's logit rows (n_vocab floats per row) with XXH3-128,
which costs 1/20 of SHA-256 there (0.6 ms a row of 152k floats here). A worker cannot use a weaker
hash to pass off other rows: to match the honest logits' digest it would need the honest logits.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from collections import OrderedDict
from typing import NamedTuple

import numpy as np
import xxhash

from ..proto import shard_pb2 as pb

#: a nonce is 16 bytes (the head's `secrets.token_bytes(16)`); a step's other lengths are refused
NONCE_BYTES = 16


def tokens_digest(tokens) -> bytes:
    return hashlib.sha256(b"tokens" + np.asarray(tokens, dtype="<i4").tobytes()).digest()


def rows_digest(tensor: pb.Tensor) -> bytes:
    """The hidden rows as they travel: their wire type, shape and bytes."""
    h = hashlib.sha256(b"rows")
    h.update(struct.pack(f"<i{len(tensor.shape)}q", tensor.dtype, *tensor.shape))
    h.update(tensor.data)
    return h.digest()


def logits_digest(rows: np.ndarray) -> bytes:
    rows = np.ascontiguousarray(rows, dtype="<f4")
    return b"logits" + struct.pack("<2q", *rows.reshape(rows.shape[0], -1).shape) + xxhash.xxh3_128_digest(rows)


def answer_of(reply: pb.StepReply) -> list[int]:
    """The tokens a tail answered a step with (its accepted drafts, then its own)."""
    return list(reply.tokens) if len(reply.tokens) else [reply.token_id]


def _entry(pos: int, n: int, digest: bytes) -> bytes:
    return hashlib.sha256(struct.pack("<qq", pos, n) + digest).digest()


def chain_of(entries: list[bytes]) -> bytes:
    h = hashlib.sha256(b"llama-shard chain v1")
    for e in sorted(entries):
        h.update(e)
    return h.digest()


class Commitment:
    """One request's committed steps on this worker (receipts.chain's entries)."""

    __slots__ = ("ins", "outs", "answers", "first_pos", "end_pos", "overflowed")

    def __init__(self):
        self.ins: list[bytes] = []
        self.outs: list[bytes] = []
        self.answers: list[bytes] = []
        self.first_pos, self.end_pos = 1 << 31, 0
        self.overflowed = False

    def add(self, pos: int, n: int, in_digest: bytes, out_digest: bytes, answer: list[int]) -> None:
        self.ins.append(_entry(pos, n, in_digest))
        self.outs.append(_entry(pos, n, out_digest))
        self.answers.append(_entry(pos, n, tokens_digest(answer)))
        self.first_pos, self.end_pos = min(self.first_pos, pos), max(self.end_pos, pos + n)

    def fill(self, body: pb.ReceiptBody) -> None:
        body.steps = len(self.ins)
        body.first_pos, body.end_pos = (self.first_pos, self.end_pos) if self.ins else (0, 0)
        body.in_chain, body.out_chain, body.answer_chain = (
            chain_of(self.ins),
            chain_of(self.outs),
            chain_of(self.answers),
        )


class CommittedStep(NamedTuple):
    """What a step computed here adds to its request's commitment, once its route answered OK."""

    key: tuple  # (engine key, epoch, nonce)
    pos: int
    n: int
    in_digest: bytes
    out_digest: bytes


class ReceiptChains:
    """Every request's commitment on this worker, keyed (engine key, epoch, nonce); bounded: the
    least recently used past `cap` are forgotten (their receipt is then refused), and a request
    commits at most `max_steps` steps (then its receipt is refused: it says nothing it cannot prove).

    A head also keeps the steps it sent on for the requests it will replay (`record`, `recorded`):
    its spot checks send the very same requests to another replica."""

    def __init__(self, cap: int, max_steps: int):
        self.cap, self.max_steps = cap, max_steps
        self._commitments: OrderedDict[tuple, Commitment] = OrderedDict()
        self._recordings: OrderedDict[bytes, list] = OrderedDict()
        self._lock = threading.Lock()

    def commit(self, step: CommittedStep, answer: list[int]) -> None:
        with self._lock:
            c = self._commitments.get(step.key)
            if c is None:
                c = self._commitments[step.key] = Commitment()
                while len(self._commitments) > self.cap:
                    self._commitments.popitem(last=False)
            self._commitments.move_to_end(step.key)
            if len(c.ins) >= self.max_steps:
                c.overflowed = True
                return
            c.add(step.pos, step.n, step.in_digest, step.out_digest, answer)

    def get(self, key: tuple) -> Commitment | None:
        with self._lock:
            return self._commitments.get(key)

    def drop(self, key: tuple) -> None:
        with self._lock:
            self._commitments.pop(key, None)

    # --- a head's recordings (spot checks) --------------------------------------------------------

    def record(self, nonce: bytes) -> None:
        """Keeps the steps this worker sends on under `nonce` from now on (bounded as commitments)."""
        with self._lock:
            self._recordings[nonce] = []
            while len(self._recordings) > self.cap:
                self._recordings.popitem(last=False)

    def recording(self, nonce: bytes) -> bool:
        return bool(nonce) and nonce in self._recordings

    def keep_sent(self, nonce: bytes, order: int, kind, request: pb.StepRequest) -> None:
        """A step sent on under `nonce` and answered OK; `order`: when the engine queued it here."""
        with self._lock:
            steps = self._recordings.get(nonce)
            if steps is not None and len(steps) < self.max_steps:
                sent = pb.StepRequest()
                sent.CopyFrom(request)
                del sent.forward[:]
                steps.append((order, kind, sent))

    def recorded(self, nonce: bytes) -> list | None:
        """The (kind, StepRequest) steps sent on under `nonce` and answered OK, in the order this
        worker's engine ran them (a pipelined stream's windows may be answered out of it); forgotten
        here. None: not recorded (or pushed out by the bound)."""
        with self._lock:
            steps = self._recordings.pop(nonce, None)
        return None if steps is None else [(kind, req) for _, kind, req in sorted(steps, key=lambda s: s[0])]
