"""Checks a route's receipt (a head before it answers, `llama-shard verify-receipt` offline).

What a receipt that verifies proves: every stage signed its statement with the key it shows (and,
where the checker pins keys, the key the head saw); the stages ran the same model file (by digest),
session, epoch and request (the nonce) with the same numerics; their layer ranges tile the model;
each stage's output commitment equals the next one's input commitment (the rows one sent are the
rows the next took in), and every stage saw the same answers pass. It is consistency: it does not
prove that a stage computed its layers rightly (a spot check does, for what it replays)."""

from __future__ import annotations

from ..proto import shard_pb2 as pb
from .keys import signed_body

VERSION = 1


def stage_bodies(receipt: pb.RouteReceipt) -> tuple[list[pb.ReceiptBody], list[str]]:
    """Each stage's verified body, and the problems of those that do not verify."""
    bodies, problems = [], []
    for i, stage in enumerate(receipt.stages):
        body = signed_body(stage)
        if isinstance(body, str):
            problems.append(f"stage {i}: {body}")
        else:
            bodies.append(body)
    return bodies, problems


def check_route(
    receipt: pb.RouteReceipt,
    *,
    keys: list[bytes | None] | None = None,
    nonce: bytes | None = None,
) -> list[str]:
    """The receipt's problems (none: it verifies). `keys`: the public key expected of each stage
    (None where not pinned); `nonce`: the request's, when the checker knows it."""
    if not receipt.stages:
        return ["the receipt names no stage"]
    bodies, problems = stage_bodies(receipt)
    if problems:
        return problems
    if nonce is not None and receipt.nonce != nonce:
        problems.append("the receipt is for another request (its nonce differs)")
    if keys is not None:
        if len(keys) != len(bodies):
            problems.append(f"the route has {len(keys)} stages, the receipt {len(bodies)}")
        for i, (stage, key) in enumerate(zip(receipt.stages, keys)):
            if key is not None and stage.public_key != key:
                problems.append(f"stage {i} signed with another key than its worker showed")
    first = bodies[0]
    same = ("model_digest", "n_layer", "numerics", "session_id", "route_epoch", "nonce", "version")
    for i, body in enumerate(bodies):
        if body.version != VERSION:
            problems.append(f"stage {i}: receipt version {body.version}, not {VERSION}")
        if body.nonce != receipt.nonce:
            problems.append(f"stage {i} signed another request's steps (its nonce differs)")
        for field in same:
            if getattr(body, field) != getattr(first, field):
                problems.append(f"stage {i}'s {field} differs from stage 0's")
        if body.steps == 0:
            problems.append(f"stage {i} committed no step")
    # the layers tile the model, in order
    if first.first != 0:
        problems.append(f"stage 0 starts at layer {first.first}, not 0")
    for i in range(1, len(bodies)):
        if bodies[i].first != bodies[i - 1].last + 1:
            problems.append(f"stage {i} starts at layer {bodies[i].first}; stage {i - 1} ended at {bodies[i - 1].last}")
    if bodies[-1].last != first.n_layer - 1:
        problems.append(f"the last stage ends at layer {bodies[-1].last}, not {first.n_layer - 1}")
    # what one sent is what the next took in; every stage saw the same steps and answers
    for i in range(1, len(bodies)):
        if bodies[i].in_chain != bodies[i - 1].out_chain:
            problems.append(f"stage {i} took in other rows than stage {i - 1} sent out")
        if bodies[i].steps != first.steps or bodies[i].answer_chain != first.answer_chain:
            problems.append(f"stage {i} saw other steps or answers than stage 0")
    return problems


def describe(receipt: pb.RouteReceipt) -> list[str]:
    """A line per stage, as people read it (verify-receipt prints them)."""
    bodies, _ = stage_bodies(receipt)
    lines = []
    for i, b in enumerate(bodies):
        lines.append(
            f"stage {i}: layers {b.first}-{b.last} of {b.n_layer}, {b.steps} steps at positions "
            f"{b.first_pos}-{b.end_pos}, {b.numerics} on {b.backend}, key {receipt.stages[i].public_key.hex()[:16]}"
        )
    for c in receipt.spot_checks:
        error = f"; largest row error {c.max_error:.3g} (tolerance {c.tolerance:.3g})" if c.tolerance else ""
        lines.append(f"spot check of stage {c.stage} ({c.worker}) on {c.replica or 'no replica'}: {c.outcome}{error}")
    return lines
