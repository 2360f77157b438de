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
    """One request's committed steps on this worker: each step's three entries (input, output,
    answer) as one 96-byte key, kept once: a step computed again with the same bytes (a retried hop,
    a re-prefill after a miss) is one step, on every stage alike."""

    __slots__ = ("steps", "first_pos", "end_pos", "overflowed")

    def __init__(self):
        self.steps: set[bytes] = set()
        self.first_pos, self.end_pos = 1 << 31, 0
        self.overflowed = False

    def add(self, pos: int, n: int, in_digest: bytes, out_digest: bytes, answer: list[int]) -> bool:
        """Adds a step; False when the same step was committed already."""
        step = _entry(pos, n, in_digest) + _entry(pos, n, out_digest) + _entry(pos, n, tokens_digest(answer))
        if step in self.steps:
            return False
        self.steps.add(step)
        self.first_pos, self.end_pos = min(self.first_pos, pos), max(self.end_pos, pos + n)
        return True

    def fill(self, body: pb.ReceiptBody) -> None:
        body.steps = len(self.steps)
        body.first_pos, body.end_pos = (self.first_pos, self.end_pos) if self.steps else (0, 0)
        body.in_chain = chain_of([s[:32] for s in self.steps])
        body.out_chain = chain_of([s[32:64] for s in self.steps])
        body.answer_chain = chain_of([s[64:] for s in self.steps])


class CommittedStep(NamedTuple):
    """What a step computed here adds to its request's commitment, once its route answered OK."""

    key: tuple  # (engine key, epoch, nonce)
    pos: int
    n: int
    in_digest: bytes
    out_digest: bytes


class ReceiptChains:
    """Every request's commitment on this worker, keyed (engine key, epoch, nonce). Bounded: at most
    `cap` requests and `max_steps` steps in all (about 200 bytes each), the least recently used
    requests forgotten first (their receipt is then refused); a request past `max_steps` on its own
    is marked overflowed (its receipt is refused: it says nothing it cannot prove).

    A head also keeps the steps it sent on for the requests it will replay (`record`, `recorded`):
    its spot checks send the very same requests to another replica; at most `max_record_bytes` of
    them in all (a recording past it is dropped: that request is not checked)."""

    def __init__(self, cap: int, max_steps: int, max_record_bytes: int = 64 << 20):
        self.cap, self.max_steps, self.max_record_bytes = cap, max_steps, max_record_bytes
        self._commitments: OrderedDict[tuple, Commitment] = OrderedDict()
        self._steps = 0  # committed steps in all
        self._recordings: OrderedDict[bytes, list | None] = OrderedDict()  # None: dropped (too large)
        self._record_bytes = 0
        self._lock = threading.Lock()

    def commit(self, step: CommittedStep, answer: list[int]) -> None:
        with self._lock:
            c = self._commitments.get(step.key)
            if c is None:
                c = self._commitments[step.key] = Commitment()
            self._commitments.move_to_end(step.key)
            if len(c.steps) >= self.max_steps:
                c.overflowed = True
                return
            if c.add(step.pos, step.n, step.in_digest, step.out_digest, answer):
                self._steps += 1
            while len(self._commitments) > self.cap or (self._steps > self.max_steps and len(self._commitments) > 1):
                _, old = self._commitments.popitem(last=False)
                self._steps -= len(old.steps)

    def fill(self, key: tuple, body: pb.ReceiptBody) -> str | None:
        """Fills a receipt's body with the request's commitment; why it cannot be (None: filled)."""
        with self._lock:
            c = self._commitments.get(key)
            if c is None:
                return "committed no step of this request (or forgot it: it keeps the latest requests only)"
            if c.overflowed:
                return "committed more steps than a receipt holds"
            c.fill(body)
            return None

    # --- a head's recordings (spot checks) --------------------------------------------------------

    def record(self, nonce: bytes) -> None:
        """Keeps the steps this worker sends on under `nonce` from now on."""
        with self._lock:
            self._recordings[nonce] = []
            while len(self._recordings) > self.cap:
                self._forget_locked(next(iter(self._recordings)))

    def recording(self, nonce: bytes) -> bool:
        return bool(nonce) and self._recordings.get(nonce) is not None

    def keep_sent(self, nonce: bytes, order: int, kind, request: pb.StepRequest) -> None:
        """A step sent on under `nonce` and answered OK; `order`: when the engine queued it here."""
        sent = pb.StepRequest()
        sent.CopyFrom(request)
        del sent.forward[:]
        size = sent.ByteSize()
        with self._lock:
            steps = self._recordings.get(nonce)
            if steps is None:
                return
            if len(steps) >= self.max_steps or self._record_bytes + size > self.max_record_bytes:
                self._forget_locked(nonce)
                self._recordings[nonce] = None  # dropped: this request is not checked
                return
            steps.append((order, kind, sent, size))
            self._record_bytes += size

    def _forget_locked(self, nonce: bytes) -> list | None:
        steps = self._recordings.pop(nonce, None)
        self._record_bytes -= sum(s[3] for s in steps or ())
        return steps

    def recorded(self, nonce: bytes) -> list | None:
        """The (kind, StepRequest) steps sent on under `nonce` and answered OK, in the order this
        worker's engine ran them (a pipelined stream's windows may be answered out of it); forgotten
        here. None: not recorded, dropped or pushed out by the bounds."""
        with self._lock:
            steps = self._forget_locked(nonce)
        return None if steps is None else [(kind, req) for _, kind, req, _ in sorted(steps, key=lambda s: s[0])]
