"""Every check of a Generate request, once, before anything is computed (ranges: proto/requests.py
and the native sampling check; InvalidInputError names the request field in `param`)."""

from __future__ import annotations

from typing import NamedTuple

from ...engine.hot_kv import check_key
from ...errors import InvalidInputError
from ...proto import shard_pb2 as pb
from ...proto.requests import (
    check_max_drafts,
    check_stops,
    check_top_logprobs,
    sampling_from_wire,
)
from ...proto.wire import wire_dtype_name, wire_dtypes_for
from ...structured.checks import check_grammar
from .host import HeadHost


class CheckedRequest(NamedTuple):
    params: object  # the sampler's parameters (None: greedy without a sampler)
    max_tokens: int  # the request's, or all the context leaves
    max_drafts: int  # drafts per step it gets (0: none)
    wire_dtype: int  # its route's hidden rows


def _check_route(host: HeadHost, req: pb.GenerateRequest) -> int:
    """The request's route and wire type; the wire type."""
    info = host.info
    if req.recipe_fingerprint and req.recipe_fingerprint != host.fingerprint:
        raise InvalidInputError("the request's KV recipe fingerprint does not match this worker's")
    if info.first != 0:
        raise InvalidInputError(
            f"Generate runs on the head of a route; this worker holds layers {info.first}-{info.last}"
        )
    if not req.forward and not info.is_tail and host.replicas is None:
        raise InvalidInputError(
            f"this worker holds layers {info.first}-{info.last} of {info.n_layer}: name the "
            f"rest of the route in forward"
        )
    refusal = host.forward_refusal(req.forward)
    if refusal is not None:
        raise InvalidInputError(refusal.text)
    wire_dtype = req.wire_dtype if req.HasField("wire_dtype") else host.wire_dtype
    if wire_dtype not in wire_dtypes_for(info.n_embd):
        raise InvalidInputError(
            f"wire_dtype {wire_dtype_name(wire_dtype)}: this model's rows travel as "
            f"{', '.join(map(wire_dtype_name, wire_dtypes_for(info.n_embd)))}"
        )
    if not req.forward and host.replicas is not None and (why := host.replicas.unreadable(wire_dtype)):
        raise InvalidInputError(why.text)
    return wire_dtype


def _check_prompt(host: HeadHost, req: pb.GenerateRequest) -> int:
    """The prompt and what may follow it; the tokens the context leaves after it."""
    n, context, n_vocab = len(req.prompt), host.context_tokens, host.info.n_vocab
    if n == 0:
        raise InvalidInputError("the prompt is empty", param="prompt")
    if n >= context:
        raise InvalidInputError(
            f"the prompt has {n} tokens; a session holds at most {context} (context_tokens), "
            f"the prompt and at least one generated token",
            param="prompt",
        )
    if any(not 0 <= t < n_vocab for t in req.prompt):
        raise InvalidInputError(f"a prompt token is outside the vocabulary (0..{n_vocab - 1})", param="prompt")
    room = context - n
    if req.max_tokens < 0 or req.max_tokens > room:
        raise InvalidInputError(
            f"max_tokens is {req.max_tokens}; with a {n}-token prompt the context "
            f"({context} tokens) leaves room for 1..{room} (0: all of it)",
            param="max_tokens",
        )
    check_stops(list(req.stop), list(req.stop_token_ids), n_vocab)
    if not 0 <= req.keep_prefix <= n:
        raise InvalidInputError(
            f"keep_prefix is {req.keep_prefix}; it counts prompt tokens (0..{n})", param="keep_prefix"
        )
    return room


def check_request(host: HeadHost, req: pb.GenerateRequest, default_drafts: int, drafting: bool) -> CheckedRequest:
    """`default_drafts`: a request's drafts per step unless it says; `drafting`: the head drafts at all."""
    check_key(req.session_id, req.route_epoch)
    wire_dtype = _check_route(host, req)
    room = _check_prompt(host, req)
    check_top_logprobs(req.top_logprobs)
    if req.HasField("max_drafts"):
        check_max_drafts(req.max_drafts)
    info = host.info
    params = sampling_from_wire(req.sampling, info.n_vocab, host.context_tokens) if req.HasField("sampling") else None
    if params is not None and host.vocab_model is not None:
        check_grammar(params, host.vocab_model)  # llama.cpp's parser, here rather than at the tail's first step
    max_drafts = req.max_drafts if req.HasField("max_drafts") else default_drafts
    if not drafting or req.logprobs or req.top_logprobs:  # a verification returns no logprobs
        max_drafts = 0
    return CheckedRequest(params, req.max_tokens or room, max_drafts, wire_dtype)
