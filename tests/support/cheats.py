"""Dishonest workers, for the tests only: this file is not part of the package (no flag, environment
variable or wire field of a worker reaches it). A cheat is an honest ShardWorker in this process whose
engine's outputs, or whose claims about itself, are changed:

- "noise": every output row (hidden rows, or the tail's logits) plus N(0, 1e-3) noise;
- "stale_row": a decode step answered with the row computed for the session's previous position;
- "skip_layer": it loads one layer fewer than it says (first + 1 .. last) and claims the whole range
  (its Info, recipe fingerprint and receipts say first .. last);
- "other_quant": it loads another quantization of the same model (its layers' Q4_1 weights brought
  down to Q4_0's precision) and claims the original file's digest;
- "other_tokens" (a tail): it answers the token after the one its logits give;
- "refuse_replays": it computes live steps honestly and refuses every step that carries no receipt
  nonce (a spot check's row replay), as a full worker would (OUTCOME_BUDGET_EXCEEDED).

Each cheat keeps the honest worker's receipts honest about what it did: what a receipt alone cannot
show, a spot check must."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np

from llama_shard.cli.parser import build_parser
from llama_shard.cli.serve import serve_config, serve_security, worker_options_of
from llama_shard.engine.hot_kv import BoundaryBundle, StepKind, TailOutput
from llama_shard.local_workers import WORKER_DEFAULTS
from llama_shard.proto import shard_pb2 as pb

CHEATS = ("noise", "stale_row", "skip_layer", "other_quant")
#: a worker that computes honestly and signs a receipt at odds with the rows it took in
FALSE_RECEIPT = "false_receipt"
#: a tail that computes honestly and answers the token after the one its logits give
OTHER_TOKENS = "other_tokens"
#: a worker that tells a spot check's replays apart (no receipt nonce) and refuses them
REFUSE_REPLAYS = "refuse_replays"
NOISE = 1e-3


class _Claimed:
    """A ModelInfo that says the worker starts at `first` (what it claims, not what it loaded)."""

    def __init__(self, real, first: int):
        self._real, self.first = real, first

    def __getattr__(self, name):
        return getattr(self._real, name)


def requantized_copy(model: Path, first: int, last: int, out: Path) -> Path:
    """`model` with layers first..last's Q4_1 tensors brought down to Q4_0's precision (still Q4_1):
    another quantization of the same model, of the same size and layout."""
    from gguf import GGMLQuantizationType as T
    from gguf import GGUFReader
    from gguf.quants import dequantize, quantize

    shutil.copyfile(model, out)
    reader = GGUFReader(str(out), "r+")
    for t in reader.tensors:
        if t.name.startswith("blk.") and first <= int(t.name.split(".")[1]) <= last and t.tensor_type == T.Q4_1:
            t.data[...] = quantize(dequantize(quantize(dequantize(t.data, T.Q4_1), T.Q4_0), T.Q4_0), T.Q4_1)
    reader.data.flush()
    return out


def _tamper(adapter, cheat: str, seed: int = 7) -> None:
    rng = np.random.default_rng(seed)
    honest = adapter.step_many
    last: dict[str, object] = {}  # session -> its previous output

    def noisy(out):
        if isinstance(out, BoundaryBundle):
            return dataclasses.replace(out, hidden=(out.hidden + rng.normal(0, NOISE, out.hidden.shape)).astype("f4"))
        rows = None if out.rows is None else (out.rows + rng.normal(0, NOISE, out.rows.shape)).astype("f4")
        logits = (out.logits + rng.normal(0, NOISE, out.logits.shape)).astype("f4")
        return dataclasses.replace(out, logits=logits, rows=rows)

    def stale(step, out):
        before, last[step.session_id] = last.get(step.session_id), out
        if before is None or step.kind != StepKind.DECODE or step.n_tokens != 1:
            return out
        if isinstance(out, BoundaryBundle):
            return dataclasses.replace(out, hidden=before.hidden[-1:].copy())
        assert isinstance(out, TailOutput)
        return dataclasses.replace(out, logits=before.logits.copy(), rows=None)

    def cheating(steps, on_queued=None):
        outs = honest(steps, on_queued)
        if cheat == "noise":
            return [noisy(o) if isinstance(o, (BoundaryBundle, TailOutput)) else o for o in outs]
        return [stale(s, o) if isinstance(o, (BoundaryBundle, TailOutput)) else o for s, o in zip(steps, outs)]

    adapter.step_many = cheating


def cheating_worker(model: Path, first: int, last: int, cheat: str, honest_info, tmp: Path, peers=()):
    """A started ShardWorker that serves layers first..last of `model` as an honest worker of the
    test routes would (WORKER_DEFAULTS, one thread), cheating as `cheat` says. `honest_info`: an
    honest replica's InfoReply (what a cheat claims to be)."""
    from llama_shard.node import ShardWorker

    path, loaded = model, (first, last)
    if cheat == "skip_layer":
        loaded = (first + 1, last)
    elif cheat == "other_quant":
        path = requantized_copy(model, first, last, tmp / "other-quant.gguf")
    argv = ["serve", "--model", str(path), "--layers", f"{loaded[0]}-{loaded[1]}", *WORKER_DEFAULTS, "--threads", "1"]
    argv += ["--port", "0"]  # any free port (ShardWorker.address says which)
    for p in peers:
        argv += ["--peer", p]
    args = build_parser().parse_args(argv)
    config, _ = serve_config(args, loaded)
    worker = ShardWorker(str(path), loaded, config, worker_options_of(args, *serve_security(args)))
    servicer = worker.servicer
    if cheat in ("noise", "stale_row"):
        _tamper(servicer.steps.adapter, cheat)
    if cheat == "skip_layer":  # it says it is what it replaces
        servicer.info = servicer.steps.info = _Claimed(servicer.info, first)
        servicer.fingerprint = servicer.steps.fingerprint = honest_info.recipe_fingerprint
        servicer.receipt_signer.template.first = first
    if cheat == "other_quant":
        servicer.model_digest = servicer.receipt_signer.template.model_digest = honest_info.model_digest
    if cheat == REFUSE_REPLAYS:
        honest_reply = servicer.steps._reply

        def refuse_replays(req, out, params=None, key=None):
            if req.receipt_nonce:
                return honest_reply(req, out, params, key)
            return pb.StepReply(outcome=pb.OUTCOME_BUDGET_EXCEEDED, detail="the KV budget is full")

        servicer.steps._reply = refuse_replays
    if cheat == OTHER_TOKENS:
        honest_reply, n_vocab = servicer.steps._reply, servicer.info.n_vocab

        def other_tokens(req, out, params=None, key=None):
            reply = honest_reply(req, out, params, key)
            if reply.outcome == pb.OUTCOME_OK and isinstance(out, TailOutput):
                reply.token_id = (reply.token_id + 1) % n_vocab
                if len(reply.tokens):
                    reply.tokens[-1] = reply.token_id
            return reply

        servicer.steps._reply = other_tokens
    if cheat == FALSE_RECEIPT:
        sign = servicer.receipt_signer.key.sign

        def false_sign(body):
            body.in_chain = bytes(32)
            return sign(body)

        servicer.receipt_signer.key.sign = false_sign
    return worker.start()
