"""Sampling at the tail: llama.cpp's sampler chain for each session, rebuilt from the step itself.

A step that asks the tail to sample carries the sampler's whole state (`SamplerState`: the params,
the draws made so far, the last penalty_last_n tokens; a grammar's tokens only where the tail must
replay them, else their digest: structured/replay.py), so the tail keeps nothing it could lose:
a retried step, or a session re-prefilled after a miss, samples exactly the token it would have
sampled anyway. `TailSamplers` only saves the rebuild: it keeps each session's sampler after a
step and uses it again when the next step's state is the one it has reached, otherwise it rebuilds
(`TokenSampler(history=recent, draws=draws)`, a replay of `draws` draws).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from .._native import SamplingParams, TokenSampler
from ..errors import InvalidInputError
from ..proto import shard_pb2 as pb
from ..proto.requests import check_top_logprobs, sampling_from_wire, sampling_key
from ..structured.checks import check_grammar
from ..structured.replay import GRAMMAR_DIGEST_BYTES, grammar_digest


class StepSamplingChecks:
    """The sampler state a step carries, checked before anything is computed: its parameters by the
    native check (the only statement of their ranges), once per session and parameters, not at every
    step: the last parameters checked for each session are kept by their wire bytes (bounded, least
    recently used dropped); the state itself (draws, recent tokens) is checked at every step."""

    def __init__(self, n_vocab: int, max_window: int, capacity: int, model=None):
        self.n_vocab, self.max_window, self.capacity = n_vocab, max_window, max(1, capacity)
        self.model = model  # the vocabulary a grammar is parsed over (a tail's ShardModel)
        self._checked: OrderedDict[tuple, tuple[bytes, SamplingParams]] = OrderedDict()
        self._lock = threading.Lock()
        self.native_checks = 0  # how often the native check ran (tests hold it to once per session)

    def params(self, key: tuple, req: pb.StepRequest) -> SamplingParams | None:
        """The checked params of a step's sampler state (None when the step does not sample);
        InvalidInputError names what is wrong, with the logprob request checked too."""
        check_top_logprobs(req.top_logprobs)
        if not req.HasField("sampler"):
            return None
        state = req.sampler
        wire = state.params.SerializeToString(deterministic=True)
        with self._lock:
            known = self._checked.get(key)
        if known is not None and known[0] == wire:
            params = known[1]
        else:
            params = sampling_from_wire(state.params, self.n_vocab, self.max_window)
            if self.model is not None:
                check_grammar(params, self.model)
            with self._lock:
                self.native_checks += 1
                self._checked[key] = (wire, params)
                self._checked.move_to_end(key)
                while len(self._checked) > self.capacity:
                    self._checked.popitem(last=False)
        n_vocab, max_window = self.n_vocab, self.max_window
        if len(state.recent) > params.penalty_last_n:
            raise InvalidInputError(
                f"the sampler state holds {len(state.recent)} recent tokens; the penalty window "
                f"is {params.penalty_last_n}"
            )
        if state.draws > max_window:
            raise InvalidInputError(
                f"the sampler state has {state.draws} draws; a session samples at most {max_window}"
            )
        if any(not 0 <= t < n_vocab for t in state.recent):
            raise InvalidInputError(f"a recent token of the sampler state is outside the vocabulary (0..{n_vocab - 1})")
        if (
            params.grammar
            and len(state.generated) != state.draws
            and not (not state.generated and len(state.generated_digest) == GRAMMAR_DIGEST_BYTES)
        ):
            raise InvalidInputError(
                f"a sampler state with a grammar carries every sampled token "
                f"({len(state.generated)} for {state.draws} draws), or none and their "
                f"{GRAMMAR_DIGEST_BYTES}-byte digest"
            )
        if (state.generated or state.generated_digest) and not params.grammar:
            raise InvalidInputError("a sampler state without a grammar carries no generated tokens or digest")
        if any(not 0 <= t < n_vocab for t in state.generated):
            raise InvalidInputError(
                f"a generated token of the sampler state is outside the vocabulary (0..{n_vocab - 1})"
            )
        return params

    def forget(self, key: tuple) -> None:
        with self._lock:
            self._checked.pop(key, None)


def log_softmax_of(logits: np.ndarray, token: int, top_n: int) -> tuple[float, list[tuple[int, float]]]:
    """The token's logprob under the model's distribution, and the top_n most likely (best first)."""
    x = logits.astype(np.float64)
    m = x.max()
    lse = m + np.log(np.exp(x - m).sum())
    top: list[tuple[int, float]] = []
    if top_n:
        idx = np.argpartition(-x, top_n - 1)[:top_n]
        idx = idx[np.lexsort((idx, -x[idx]))]  # best first; equal logits by token id
        top = [(int(i), float(x[i] - lse)) for i in idx]
    return float(x[token] - lse), top


#: how long a step naming its grammar's state waits for the session's sampler to be put back by the
#: step before it (pipelined windows reach the tail together)
SAMPLER_WAIT_S = 1.0


class SamplerStateMissing(Exception):
    """A step names its grammar's state by digest, and the tail keeps no such state for the session."""


class TailSamplers:
    """Each session's sampler, kept between its steps (bounded, least recently used dropped). With a
    grammar, a kept sampler is matched by the running digest of the tokens it sampled: a step that
    carries the digest alone continues it, or gets SamplerStateMissing (nothing is sampled) and
    comes again with the tokens to replay (structured/replay.py, the head's side)."""

    def __init__(self, n_vocab: int, max_window: int, capacity: int, model=None):
        self.n_vocab = n_vocab
        self.model = model  # a grammar's vocabulary (the tail's ShardModel)
        self.max_window = max_window
        self.capacity = max(1, capacity)
        # (key, epoch) -> (sampler, params, draws, recent, the digest of its grammar's tokens)
        self._kept: OrderedDict[tuple, tuple] = OrderedDict()
        self._lock = threading.Lock()
        self._returned = threading.Condition(self._lock)  # a sampler in use was put back
        self._in_use: set[tuple] = set()
        self.rebuilds = 0
        self.grammar_replays = 0  # grammar states rebuilt from a step's tokens

    def sample(self, key: tuple, params: SamplingParams, state: pb.SamplerState, logits: np.ndarray) -> int:
        return self.sample_rows(key, params, state, logits.reshape(1, -1), [])[0]

    def sample_rows(
        self, key: tuple, params: SamplingParams, state: pb.SamplerState, rows: np.ndarray, drafts: list[int]
    ) -> list[int]:
        """A verification (`verify`) with the session's sampler: row by row, each draw
        accepted as one step's would be, until a token is not the next draft."""
        pkey, recent, draws = sampling_key(params), tuple(state.recent), state.draws
        replay = params.grammar and len(state.generated) == draws  # every token (else their digest)
        digest = b""
        if params.grammar:
            digest = grammar_digest(state.generated) if replay else state.generated_digest
        with self._lock:  # taken out while in use: a concurrent step of the same session rebuilds its own
            if params.grammar and not replay:
                # a window sent ahead may sample before the step it follows has put the sampler back,
                # and it can continue only that one: it waits for it (a short while)
                self._returned.wait_for(lambda: key not in self._in_use, SAMPLER_WAIT_S)
            kept = self._kept.pop(key, None)
            self._in_use.add(key)
        try:
            return self._sample_with(key, kept, params, state, rows, drafts, pkey, recent, draws, replay, digest)
        finally:
            with self._lock:
                self._in_use.discard(key)
                self._returned.notify_all()

    def _sample_with(self, key, kept, params, state, rows, drafts, pkey, recent, draws, replay, digest) -> list[int]:
        if kept is not None and kept[1:] == (pkey, draws, recent, digest):
            sampler = kept[0]
        elif params.grammar and not replay:
            if kept is not None:  # still the session's latest state: a replay of this step may continue it
                with self._lock:
                    self._kept[key] = kept
            raise SamplerStateMissing(
                f"this tail keeps no grammar state of the session after {draws} tokens "
                "with that digest: send the step with its generated tokens"
            )
        else:
            sampler = TokenSampler(
                self.n_vocab,
                params,
                self.max_window,
                history=list(recent),
                draws=draws,
                model=self.model if params.grammar else None,
                generated=list(state.generated),
            )
            self.rebuilds += 1
            self.grammar_replays += bool(params.grammar)

        def draw(row):
            token = sampler.sample(np.ascontiguousarray(row))
            sampler.accept_sampled(token)
            return token

        tokens = verify(rows, drafts, draw)
        window = params.penalty_last_n
        after = (recent + tuple(tokens))[-window:] if window else ()
        with self._lock:
            self._kept[key] = (
                sampler,
                pkey,
                draws + len(tokens),
                after,
                grammar_digest(tokens, digest) if params.grammar else b"",
            )
            while len(self._kept) > self.capacity:
                self._kept.popitem(last=False)
        return tokens

    def forget(self, key: tuple) -> None:
        with self._lock:
            self._kept.pop(key, None)


def verify(rows: np.ndarray, drafts: list[int], draw) -> list[int]:
    """The tail's answer to a step with drafts (the rule and why it is exact: head/speculation.py): `draw(row_logits)` samples (and accepts) one token
    from a row, as one step would; the accepted drafts, then the first token drawn that was not the
    next draft (or the token after the last draft)."""
    out = []
    for i in range(len(drafts) + 1):
        token = draw(rows[i])
        out.append(token)
        if i == len(drafts) or token != drafts[i]:
            break
    return out
