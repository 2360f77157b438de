"""An OpenAI request's JSON, turned into the wire's `GenerateRequest`.

Here only types are checked (a JSON value the wire cannot hold is a 400 naming its key); every range
is checked once, by the head's generation loop when the stream opens (`GenerationLoops._check`, and
for the sampling parameters the native `SamplingParams.problem`), whose refusal names the wire's
field, mapped back to the request's key by `PARAM_NAMES`.
"""

from __future__ import annotations

import json
import math
import re
import secrets
from typing import NamedTuple

from ..._native import MAX_LOGIT_BIAS
from ...proto import shard_pb2 as pb
from ...proto.requests import SAMPLING_PARAMETERS
from .errors import HttpError

INT32_MAX = (1 << 31) - 1


class Parameter(NamedTuple):
    """A key a request may carry: on which endpoints ("chat", "completions") and what it does (the
    README's table says the same)."""

    name: str
    endpoints: tuple[str, ...]
    what: str


BOTH = ("chat", "completions")
#: every key a request may carry; any other is a 400 naming it (OpenAI does this), so nothing asked
#: is silently left undone
PARAMETERS = (
    Parameter("model", BOTH, "the served model's id or file name (another: 404); may be left out"),
    Parameter("messages", ("chat",), "the conversation, rendered by the model's own chat template; text content only"),
    Parameter("prompt", ("completions",), "a string or a list of token ids (one prompt)"),
    Parameter("stream", BOTH, "server-sent events, one per token, then `[DONE]`"),
    Parameter("stream_options", BOTH, "`include_usage`: a last chunk with the usage"),
    Parameter("max_tokens", BOTH, "the most tokens to generate (default: the rest of the context)"),
    Parameter("max_completion_tokens", ("chat",), "the same as max_tokens (it wins where both are given)"),
    Parameter("temperature", BOTH, "0: the largest logit; else in [0.001, 100] (default 1)"),
    Parameter("top_p", BOTH, "nucleus sampling, (0, 1]"),
    Parameter("top_k", BOTH, "llama.cpp's: keep the k likeliest tokens (0: off)"),
    Parameter("min_p", BOTH, "llama.cpp's: drop tokens under min_p times the likeliest's probability"),
    Parameter("frequency_penalty", BOTH, "[-100, 100], over the last repeat_last_n tokens"),
    Parameter("presence_penalty", BOTH, "[-100, 100], over the last repeat_last_n tokens"),
    Parameter("repeat_penalty", BOTH, "llama.cpp's: [0.01, 100] (1: off)"),
    Parameter("repeat_last_n", BOTH, "llama.cpp's: the penalties' window (default 64)"),
    Parameter("seed", BOTH, "the same seed and request give the same tokens, on any route and after a failover"),
    Parameter("stop", BOTH, "up to 16 strings (at most 256 characters each); never part of the answer"),
    Parameter("n", BOTH, "1 only (one choice per request)"),
    Parameter("receipt", BOTH, "llama-shard's: true adds the route's signed receipt (base64, `receipt`) to the answer"),
    Parameter("logprobs", BOTH, "chat: true for each token's log-probability; completions: how many alternatives"),
    Parameter("top_logprobs", ("chat",), "0 to 20 alternatives per token (needs logprobs)"),
    Parameter("echo", ("completions",), "false only"),
    Parameter("suffix", ("completions",), "empty only"),
    Parameter("best_of", ("completions",), "1 only"),
    Parameter("ignore_eos", BOTH, "llama.cpp's: generate past the end-of-generation tokens"),
    Parameter(
        "logit_bias",
        BOTH,
        "token id (a string) to a bias in [-100, 100] added to its logit first, as "
        "llama.cpp's logit-bias sampler does (-100: practically never); at most 1024 tokens",
    ),
    Parameter(
        "response_format",
        BOTH,
        "`{\"type\": \"text\"}`, `{\"type\": \"json_object\"}` (any JSON object) or "
        "`{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}`: the answer is "
        "sampled under llama.cpp's grammar of that schema (its own converter), so a complete answer parses "
        "and validates (one cut by max_tokens ends with finish_reason length)",
    ),
    Parameter(
        "grammar",
        BOTH,
        "llama-server's: GBNF with a `root` rule; only what it allows is sampled (not with response_format)",
    ),
    Parameter(
        "tools",
        ("chat",),
        "functions the model may call (`{\"type\": \"function\", \"function\": {name, "
        "description, parameters}}`, at most 128), rendered by the model's template; its calls come back as "
        "`tool_calls` with finish_reason `tool_calls`. Needs a template that writes `<tool_call>` blocks "
        "(Hermes, Qwen 2.5/3; `serve --chat-template-file`); another is a 400",
    ),
    Parameter(
        "tool_choice",
        ("chat",),
        "`auto` (default: the model decides; its output is parsed), `none`, "
        "`required` or `{\"type\": \"function\", \"function\": {\"name\": ...}}`: these two sample under "
        "a grammar of the calls (llama.cpp's converter of each tool's parameters), so every answer is a call",
    ),
    Parameter("parallel_tool_calls", ("chat",), "with `required`: one call or several (default true)"),
    Parameter("max_drafts", BOTH, "speculative decoding: the most drafted tokens per step (0: off; up to 15)"),
    # accepted, and without effect by their nature here
    Parameter("user", BOTH, "accepted, no effect (a string)"),
    Parameter("metadata", BOTH, "accepted, no effect (nothing is stored)"),
    Parameter("store", BOTH, "accepted, no effect (nothing is stored)"),
    Parameter("service_tier", BOTH, "accepted, no effect (one tier)"),
)
_ALLOWED = {e: {p.name for p in PARAMETERS if e in p.endpoints} for e in BOTH}
#: keys OpenAI or llama-server know that this endpoint does not do (yet): a 400 that says so
NOT_SUPPORTED = (
    "functions",
    "function_call",
    "json_schema",
    "modalities",
    "audio",
    "prediction",
    "reasoning_effort",
    "web_search_options",
    "n_probs",
    "cache_prompt",
)


def check_keys(body: dict, endpoint: str) -> None:
    """A 400 naming the first key of `body` this endpoint does not take (PARAMETERS)."""
    allowed = _ALLOWED[endpoint]
    for key in body:
        if key in allowed:
            continue
        if key in NOT_SUPPORTED:
            raise HttpError(400, f"{key} is not supported by this endpoint", key)
        raise HttpError(
            400,
            f"unrecognized request argument: {str(key)[:64]!r} (see the README's table of parameters)",
            str(key)[:64],
        )
    for key, kind, name in (
        ("metadata", dict, "an object"),
        ("store", bool, "a boolean"),
        ("service_tier", str, "a string"),
    ):  # without effect, but of their type
        if body.get(key) is not None and not isinstance(body[key], kind):
            raise HttpError(400, f"{key} must be {name}", key)


#: the wire's field -> the request's key, where they differ (a refusal names the request's)
PARAM_NAMES = {p.wire: p.request for p in SAMPLING_PARAMETERS if p.wire != p.request} | {"stop_token_ids": "stop"}


def _bound(value: float) -> str:
    """A bound as people write it: 2147483647, not 2.14748e+09."""
    return str(int(value)) if math.isfinite(value) and float(value).is_integer() else f"{value:g}"


def number(body: dict, name: str, lo: float = -math.inf, hi: float = math.inf, *, integer: bool = False):
    """The JSON number under `name` (None when absent): a 400 for another type, a non-finite float,
    or a value outside [lo, hi] (the bounds the caller's field can hold)."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        raise HttpError(
            400, f"{name} must be {'an integer' if integer else 'a number'}, got {json.dumps(value)[:40]}", name
        )
    if isinstance(value, float) and not math.isfinite(value):
        raise HttpError(400, f"{name} must be a finite number", name)
    if not lo <= value <= hi:
        raise HttpError(400, f"{name} must be in [{_bound(lo)}, {_bound(hi)}], got {value}", name)
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


def logit_bias(body: dict) -> list[pb.TokenBias]:
    """OpenAI's logit_bias: an object of token ids (as strings) to biases. Their ranges (the
    vocabulary, [-100, 100], distinct) are the native check's."""
    bias = body.get("logit_bias")
    if bias is None:
        return []
    if not isinstance(bias, dict):
        raise HttpError(400, "logit_bias must be an object of token ids to biases", "logit_bias")
    if len(bias) > MAX_LOGIT_BIAS:
        raise HttpError(400, f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}", "logit_bias")
    out = []
    for key, value in bias.items():
        if not TOKEN_ID.fullmatch(key) or not -INT32_MAX <= int(key) <= INT32_MAX:
            raise HttpError(400, f"logit_bias: {key[:24]!r} is not a token id", "logit_bias")
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or abs(value) > 1e30
            or not math.isfinite(value)
        ):  # (an int's size first: a huge one does not convert to float)
            raise HttpError(400, f"logit_bias: token {key}'s bias must be a number", "logit_bias")
        out.append(pb.TokenBias(token_id=int(key), bias=float(value)))
    return out


ANY_OBJECT = '{"type": "object"}'
TOKEN_ID = re.compile(r"-?[0-9]{1,10}")
#: a schema's nesting, and a pattern's groups: the converter recurses per level (the native check
#: says the same of the text; here the strings are decoded, so no escape hides a parenthesis)
MAX_SCHEMA_DEPTH = 64


def _schema_depth(value, depth: int = 0) -> int:
    if depth > MAX_SCHEMA_DEPTH:
        return depth
    if isinstance(value, dict):
        return max((_schema_depth(v, depth + 1) for v in value.values()), default=depth + 1)
    if isinstance(value, list):
        return max((_schema_depth(v, depth + 1) for v in value), default=depth + 1)
    if isinstance(value, str):
        deepest = groups = 0
        for c in value:
            groups += (c == "(") - (c == ")")
            deepest = max(deepest, groups)
        return depth + deepest
    return depth


def output_schema(body: dict) -> str | None:
    """The JSON Schema (as JSON text) that response_format asks the answer to follow, or None
    (absent, or type text). json_object is any JSON object, as llama-server has it."""
    fmt = body.get("response_format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise HttpError(400, "response_format must be an object with a string type", "response_format")
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return ANY_OBJECT
    if kind != "json_schema":
        raise HttpError(
            400, f"response_format type must be text, json_object or json_schema, not {kind[:40]!r}", "response_format"
        )
    wrapper = fmt.get("json_schema")
    if not isinstance(wrapper, dict) or not isinstance(wrapper.get("schema", {}), dict):
        raise HttpError(
            400, "response_format json_schema must be an object whose schema is an object", "response_format"
        )
    schema = wrapper.get("schema") or {}
    if _schema_depth(schema) > MAX_SCHEMA_DEPTH:
        raise HttpError(
            400,
            f"response_format: the schema (or a pattern's groups) nests deeper than {MAX_SCHEMA_DEPTH} levels",
            "response_format",
        )
    return json.dumps(schema) if schema else ANY_OBJECT


def grammar_text(body: dict) -> str:
    """llama-server's grammar key (GBNF); '' when absent."""
    grammar = body.get("grammar")
    if grammar is None:
        return ""
    if not isinstance(grammar, str):
        raise HttpError(400, "grammar must be a string (GBNF)", "grammar")
    if body.get("response_format") is not None and output_schema(body) is not None:
        raise HttpError(400, "give grammar or a JSON response_format, not both", "grammar")
    return grammar


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
    s.logit_bias.extend(logit_bias(body))
    s.grammar = grammar_text(body)  # response_format's grammar is the endpoint's to convert (off the event loop)
    seed = number(body, "seed", -(1 << 63), (1 << 64) - 1, integer=True)
    s.seed = (seed % 0xFFFFFFFF) if seed is not None else secrets.randbelow(0xFFFFFFFF)
    if not s.HasField("penalty_last_n"):  # llama.cpp's 64, on a context that may be shorter
        s.penalty_last_n = min(64, context_tokens)
    return s


def generate_request(
    body: dict, tokens: list[int], context_tokens: int, stop_token_ids: list[int], *, logprobs: bool, top: int
) -> pb.GenerateRequest:
    """The GenerateRequest of a body (its session and route are the endpoint's to fill in)."""
    max_tokens = number(body, "max_completion_tokens", 1, INT32_MAX, integer=True)
    if max_tokens is None:
        max_tokens = number(body, "max_tokens", 1, INT32_MAX, integer=True)
    ignore_eos = flag(body, "ignore_eos")  # llama.cpp's extension
    req = pb.GenerateRequest(
        prompt=tokens,
        sampling=sampling_from(body, context_tokens),
        max_tokens=max_tokens or 0,
        stop_token_ids=[] if ignore_eos else stop_token_ids,
        stop=stops(body),
        logprobs=logprobs,
        top_logprobs=top,
    )
    req.receipt = flag(body, "receipt")
    max_drafts = number(body, "max_drafts", 0, INT32_MAX, integer=True)  # speculation: 0 off, else up to k
    if max_drafts is not None:
        req.max_drafts = max_drafts
    return req
