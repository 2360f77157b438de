"""An OpenAI request's JSON, turned into the wire's `GenerateRequest`.

Here only types are checked (a JSON value the wire cannot hold is a 400 naming its key); every range
is checked once, by the head's generation loop when the stream opens (`GenerationLoops._check`, and
for the sampling parameters the native `SamplingParams.problem`), whose refusal names the wire's
field, mapped back to the request's key by `PARAM_NAMES`.
"""
from __future__ import annotations

import json
import math
import secrets

from ...proto import shard_pb2 as pb
from ...proto.requests import SAMPLING_PARAMETERS
from .errors import HttpError

INT32_MAX = (1 << 31) - 1
#: the wire's field -> the request's key, where they differ (a refusal names the request's)
PARAM_NAMES = {p.wire: p.request for p in SAMPLING_PARAMETERS if p.wire != p.request} | {
    "stop_token_ids": "stop"}


def number(body: dict, name: str, lo: float = -math.inf, hi: float = math.inf, *, integer: bool = False):
    """The JSON number under `name` (None when absent): a 400 for another type, a non-finite float,
    or a value outside [lo, hi] (the bounds the caller's field can hold)."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        raise HttpError(400, f"{name} must be {'an integer' if integer else 'a number'}, got {json.dumps(value)[:40]}",
                        name)
    if isinstance(value, float) and not math.isfinite(value):
        raise HttpError(400, f"{name} must be a finite number", name)
    if not lo <= value <= hi:
        raise HttpError(400, f"{name} must be in [{lo:g}, {hi:g}], got {value}", name)
    return value


def flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise HttpError(400, f"{name} must be a boolean", name)
    return value


def stops(body: dict) -> list[str]:
    """The stop sequences (a string or a list of strings); their bounds are the loop's (check_stops)."""
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise HttpError(400, "stop must be a string or a list of strings", "stop")
    return stops


def sampling_from(body: dict, context_tokens: int) -> pb.Sampling:
    """OpenAI's sampling parameters and llama.cpp's extensions (top_k, min_p, repeat_penalty,
    repeat_last_n), named as `SAMPLING_PARAMETERS` says; a parameter not given keeps llama.cpp's
    neutral default (temperature 1, no truncation, no penalty, a penalty window of 64 or the context
    if shorter); no seed: a random one. Ranges: the native check's, when the stream opens."""
    s = pb.Sampling()
    for p in SAMPLING_PARAMETERS:
        value = number(body, p.request, -INT32_MAX, INT32_MAX, integer=p.integer)
        if value is not None:
            setattr(s, p.wire, value)
    if s.HasField("temperature") and 0 < s.temperature < 0.001:
        s.temperature = 0.0  # llama.cpp: below its smallest temperature the largest logit wins
    seed = number(body, "seed", -(1 << 63), (1 << 64) - 1, integer=True)
    s.seed = (seed % 0xFFFFFFFF) if seed is not None else secrets.randbelow(0xFFFFFFFF)
    if not s.HasField("penalty_last_n"):  # llama.cpp's 64, on a context that may be shorter
        s.penalty_last_n = min(64, context_tokens)
    return s


def generate_request(body: dict, tokens: list[int], context_tokens: int, stop_token_ids: list[int], *,
                     logprobs: bool, top: int) -> pb.GenerateRequest:
    """The GenerateRequest of a body (its session and route are the endpoint's to fill in)."""
    max_tokens = number(body, "max_completion_tokens", 1, INT32_MAX, integer=True)
    if max_tokens is None:
        max_tokens = number(body, "max_tokens", 1, INT32_MAX, integer=True)
    ignore_eos = flag(body, "ignore_eos")  # llama.cpp's extension
    req = pb.GenerateRequest(prompt=tokens, sampling=sampling_from(body, context_tokens), max_tokens=max_tokens or 0,
                             stop_token_ids=[] if ignore_eos else stop_token_ids, stop=stops(body),
                             logprobs=logprobs, top_logprobs=top)
    max_drafts = number(body, "max_drafts", 0, INT32_MAX, integer=True)  # speculation: 0 off, else up to k
    if max_drafts is not None:
        req.max_drafts = max_drafts
    return req
