"""What a generation request may ask, stated once for every entry point (the CLI's flags, the wire's
`GenerateRequest` and `StepRequest`, the OpenAI endpoint's JSON).

- The sampling parameters: one table of their names on each surface (`SAMPLING_PARAMETERS`). Their
  ranges are the native module's alone (`SamplingParams.problem`, token_sampler.cpp): Python states
  none of them, it asks and names the parameter on the caller's surface.
- The bounds of what else a request asks: stop strings and tokens, top logprobs, drafts per step,
  and the re-prefills a stream or a client makes in a row after misses.

Each check raises InvalidInputError with `param` set to the wire's name of what it refuses, so an
entry point can say which of its own parameters was wrong without reading the message.
"""

from __future__ import annotations

from typing import NamedTuple

from .._native import MAX_LOGIT_BIAS, MAX_LOGIT_ROWS, SamplingParams
from ..errors import InvalidInputError
from ..structured.checks import check_grammar_size
from . import shard_pb2 as pb

#: the most alternatives a caller may ask for per token (OpenAI's top_logprobs bound)
MAX_TOP_LOGPROBS = 20
#: stop sequences (OpenAI allows 4; llama-server any number) and stop tokens a request may give
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKENS = 64
#: re-prefills in a row after misses before a stream (the head's loop, or a client's) ends with an error
MAX_REPREFILLS = 3
#: drafts one verification step carries: the tail returns one logit row per draft and one more
MAX_DRAFTS = MAX_LOGIT_ROWS - 1
#: drafts per step a Generate stream gets unless it says (serve --max-drafts)
DEFAULT_MAX_DRAFTS = 15
#: a worker's smallest batch (serve --batch): a verification of MAX_DRAFTS drafts is one step of this many tokens
MIN_BATCH_TOKENS = MAX_DRAFTS + 1


class SamplingParameter(NamedTuple):
    wire: str  # the pb.Sampling field, and the OpenAI endpoint's key unless `request` differs
    native: str  # the SamplingParams attribute (what SamplingParams.problem names)
    flag: str  # the CLI's flag
    request: str  # the OpenAI endpoint's key (llama-server's where OpenAI has none)
    integer: bool


#: every sampling parameter, with its name on each surface (the seed is apart: it is always set)
SAMPLING_PARAMETERS = (
    SamplingParameter("temperature", "temperature", "--temperature", "temperature", False),
    SamplingParameter("top_k", "top_k", "--top-k", "top_k", True),
    SamplingParameter("top_p", "top_p", "--top-p", "top_p", False),
    SamplingParameter("min_p", "min_p", "--min-p", "min_p", False),
    SamplingParameter("penalty_last_n", "penalty_last_n", "--repeat-last-n", "repeat_last_n", True),
    SamplingParameter("repeat_penalty", "penalty_repeat", "--repeat-penalty", "repeat_penalty", False),
    SamplingParameter("frequency_penalty", "penalty_freq", "--frequency-penalty", "frequency_penalty", False),
    SamplingParameter("presence_penalty", "penalty_present", "--presence-penalty", "presence_penalty", False),
)
_BY_NATIVE = {p.native: p for p in SAMPLING_PARAMETERS} | {
    "seed": SamplingParameter("seed", "seed", "--seed", "seed", True)
}


def sampling_problem(params: SamplingParams, n_vocab: int, max_window: int) -> tuple[SamplingParameter, str] | None:
    """The first parameter of `params` out of range (the native check) with why, or None."""
    problem = params.problem(n_vocab, max_window)
    if problem is None:
        return None
    field, why = problem
    return _BY_NATIVE.get(field, SamplingParameter(field, field, f"--{field}", field, False)), why


def check_sampling(params: SamplingParams, n_vocab: int, max_window: int) -> SamplingParams:
    problem = sampling_problem(params, n_vocab, max_window)
    if problem is not None:
        raise InvalidInputError(f"sampling: {problem[1]}", param=problem[0].wire)
    return params


def sampling_from_wire(s: pb.Sampling, n_vocab: int, max_window: int) -> SamplingParams:
    """The checked SamplingParams of a wire Sampling (unset fields: off)."""
    kwargs = {p.native: getattr(s, p.wire) for p in SAMPLING_PARAMETERS if s.HasField(p.wire)}
    if len(s.logit_bias) > MAX_LOGIT_BIAS:  # counted before a list is built (the native check says the same)
        raise InvalidInputError(
            f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens, got {len(s.logit_bias)}", param="logit_bias"
        )
    check_grammar_size(s.grammar)
    bias = [(b.token_id, b.bias) for b in s.logit_bias]
    return check_sampling(
        SamplingParams(seed=s.seed, logit_bias=bias, grammar=s.grammar, **kwargs), n_vocab, max_window
    )


def sampling_to_wire(p: SamplingParams) -> pb.Sampling:
    return pb.Sampling(
        seed=p.seed,
        logit_bias=[pb.TokenBias(token_id=t, bias=b) for t, b in p.logit_bias],
        grammar=p.grammar,
        **{q.wire: getattr(p, q.native) for q in SAMPLING_PARAMETERS},
    )


def sampling_key(p: SamplingParams) -> tuple:
    """The parameters as a value (what a kept sampler is compared by)."""
    return tuple(getattr(p, q.native) for q in SAMPLING_PARAMETERS) + (p.seed, tuple(p.logit_bias), p.grammar)


#: InfoReply.features of this version: a tail that keeps a grammar's state named by digest, and a
#: worker that forwards and checks StepRequest.handed_from
FEATURE_GRAMMAR_DIGEST = "grammar_digest"
FEATURE_HANDED_FROM = "handed_from"
FEATURES = (FEATURE_GRAMMAR_DIGEST, FEATURE_HANDED_FROM)


def check_top_logprobs(n: int) -> None:
    if not 0 <= n <= MAX_TOP_LOGPROBS:
        raise InvalidInputError(f"top_logprobs is {n}; it must be 0..{MAX_TOP_LOGPROBS}", param="top_logprobs")


def check_max_drafts(n: int) -> None:
    if not 0 <= n <= MAX_DRAFTS:
        raise InvalidInputError(f"max_drafts is {n}; it must be 0 (off) to {MAX_DRAFTS}", param="max_drafts")


def check_stops(stop: list[str], stop_token_ids: list[int], n_vocab: int) -> None:
    if len(stop_token_ids) > MAX_STOP_TOKENS or any(not 0 <= t < n_vocab for t in stop_token_ids):
        raise InvalidInputError(
            f"stop_token_ids takes at most {MAX_STOP_TOKENS} tokens of the vocabulary", param="stop_token_ids"
        )
    if len(stop) > MAX_STOP_STRINGS or any(not s or len(s) > MAX_STOP_CHARS for s in stop):
        raise InvalidInputError(
            f"stop takes at most {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_CHARS} characters",
            param="stop",
        )
