"""The sampler a route's tail will use: llama.cpp's own samplers in stock llama.cpp's order
(logit_bias -> penalties -> top_k -> top_p -> min_p -> temperature -> dist(seed)), one per session.

What is shown here, on rows of logits (no model needed):
- temperature 0 without penalties is today's greedy token (the first of equal maxima);
- the state is (params, tokens accepted, draws): a sampler rebuilt from those samples exactly what
  the running one samples, step by step, so a retried step or a re-prefilled session is exact;
- a seed fixes the tokens; temperature 1 with everything else off samples the softmax;
- every parameter outside its range, a row of the wrong length or with a NaN, and a token outside
  the vocabulary are InvalidInputError before llama.cpp sees them (risky ones in a subprocess)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from llama_shard._native import SamplingParams, TokenSampler
from llama_shard.errors import InvalidInputError

N_VOCAB = 512


def rows(n: int, seed: int = 0, scale: float = 3.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((n, N_VOCAB)) * scale).astype(np.float32)


def run(params: SamplingParams, logits: np.ndarray, prompt: list[int]) -> list[int]:
    s = TokenSampler(N_VOCAB, params, 4096)
    for t in prompt:
        s.accept(t)
    out = []
    for row in logits:
        t = s.sample(row)
        s.accept(t)
        out.append(t)
    return out


def test_temperature_zero_without_penalties_is_the_greedy_token():
    logits = rows(200)
    logits[:50, 7] = logits[:50, 300] = 50.0  # ties: the first of equal maxima, as np.argmax
    s = TokenSampler(N_VOCAB, SamplingParams(temperature=0.0, seed=1), 4096)
    for row in logits:
        t = s.sample(row)
        assert t == int(np.argmax(row))
        s.accept(t)
    assert s.draws == 200


@pytest.mark.parametrize(
    "penalties",
    [dict(), dict(penalty_last_n=8, penalty_repeat=1.6, penalty_freq=0.3, penalty_present=0.5)],
    ids=["plain", "penalised"],
)
def test_temperature_zero_takes_the_argmax_path_and_picks_what_the_whole_chain_picks(penalties):
    """temperature 0 with top_k/top_p/min_p off skips the chain over the whole row (what an OpenAI
    request with temperature 0 asks for: ~100 us instead of ~570 us on a 49,152-token row). The
    reference runs the whole row: min_p 1e-30 keeps every token, in id order, unsorted (llama.cpp's
    unsorted min_p path), so ties go to the first id as without it. (dist's draw of exactly 0,
    which picks token 0 from the whole row, has a probability near 2^-64: not tested.)"""
    logits = rows(300, seed=4, scale=0.5)  # close logits: the penalties change the winner often
    logits[::7, 20] = logits[::7, 21] = 9.0  # ties: the first id wins
    prompt = [7, 7, 100, 3]
    fast = run(SamplingParams(temperature=0.0, seed=9, **penalties), logits, prompt)
    whole = run(SamplingParams(temperature=0.0, min_p=1e-30, seed=9, **penalties), logits, prompt)
    assert fast == whole
    if penalties:
        assert fast != run(SamplingParams(temperature=0.0, seed=9), logits, prompt)  # the window counted
    s = TokenSampler(N_VOCAB, SamplingParams(temperature=0.0, seed=9, **penalties), 4096, history=prompt, draws=0)
    assert [s.sample(r) for r in logits[:1]] == fast[:1] and s.draws == 1


@pytest.mark.parametrize("in_window", [40, 10])
def test_a_tie_made_by_the_repeat_penalty_goes_to_the_first_id_on_the_argmax_path(in_window):
    row = np.full(N_VOCAB, -5.0, dtype=np.float32)
    row[10] = row[40] = -2.0
    row[in_window] = -1.0  # penalised: -1.0 x 2 = -2.0 exactly, tied with the other
    for min_p in (0.0, 1e-30):  # the argmax path, and the whole row
        s = TokenSampler(
            N_VOCAB,
            SamplingParams(temperature=0.0, min_p=min_p, penalty_last_n=4, penalty_repeat=2.0, seed=1),
            4096,
            history=[in_window],
            draws=0,
        )
        assert s.sample(row) == 10


PARAMS = [
    SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=42),
    SamplingParams(
        temperature=1.1,
        top_k=0,
        top_p=0.9,
        min_p=0.0,
        penalty_last_n=16,
        penalty_repeat=1.3,
        penalty_freq=0.2,
        penalty_present=0.4,
        seed=7,
    ),
    SamplingParams(temperature=0.0, penalty_last_n=8, penalty_repeat=1.5, seed=3),
]


@pytest.mark.parametrize("params", PARAMS, ids=["top-k-p-min-p", "penalties", "greedy-penalised"])
def test_a_sampler_rebuilt_from_its_history_and_draws_samples_the_same_tokens(params):
    logits = rows(120, seed=5, scale=2.0)
    prompt = [3, 3, 9, 200, 3]
    running = TokenSampler(N_VOCAB, params, 4096)
    for t in prompt:
        running.accept(t)
    history = list(prompt)
    for i, row in enumerate(logits):
        rebuilt = TokenSampler(N_VOCAB, params, 4096, history=history, draws=running.draws)
        t = running.sample(row)
        assert rebuilt.sample(row) == t, f"step {i}"
        running.accept(t)
        history.append(t)
    assert run(params, logits, prompt) == history[len(prompt) :]


def test_a_seed_fixes_the_tokens_and_another_seed_changes_them():
    logits = rows(100, seed=9, scale=1.0)
    a = run(SamplingParams(temperature=1.0, seed=11), logits, [1])
    assert a == run(SamplingParams(temperature=1.0, seed=11), logits, [1])
    assert a != run(SamplingParams(temperature=1.0, seed=12), logits, [1])


def test_temperature_one_with_everything_else_off_samples_the_softmax():
    row = np.zeros(N_VOCAB, dtype=np.float32)
    row[:4] = np.log(np.array([0.5, 0.25, 0.15, 0.1], dtype=np.float32)) + 20.0
    s = TokenSampler(N_VOCAB, SamplingParams(temperature=1.0, seed=5), 4096)
    counts = np.bincount([s.sample(row) for _ in range(4000)], minlength=N_VOCAB)
    assert counts[4:].sum() == 0
    assert np.allclose(counts[:4] / 4000, [0.5, 0.25, 0.15, 0.1], atol=0.03), counts[:4]


def test_the_repeat_penalty_sees_the_window_of_accepted_tokens():
    row = np.zeros(N_VOCAB, dtype=np.float32)
    row[5], row[6] = 2.0, 1.5
    s = TokenSampler(N_VOCAB, SamplingParams(temperature=0.0, penalty_last_n=4, penalty_repeat=2.0, seed=1), 4096)
    assert s.sample(row) == 5
    s.accept(5)  # 2.0 / 2 = 1.0 < 1.5
    assert s.sample(row) == 6
    for t in (1, 2, 3, 4):  # 5 leaves the 4-token window
        s.accept(t)
    assert s.sample(row) == 5


BAD = [
    (dict(temperature=-0.5), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=1e-6), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(top_k=-1), "top_k"),
    (dict(top_k=N_VOCAB + 1), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(min_p=-0.1), "min_p"),
    (dict(min_p=float("nan")), "min_p"),
    (dict(penalty_last_n=-1), "penalty_last_n"),
    (dict(penalty_last_n=1 << 30), "penalty_last_n"),
    (dict(penalty_repeat=0.0), "repeat penalty"),
    (dict(penalty_repeat=float("inf")), "repeat penalty"),
    (dict(penalty_freq=float("nan")), "frequency"),
    (dict(penalty_present=1e9), "presence"),
    (dict(seed=0xFFFFFFFF), "seed"),
    (dict(logit_bias=[(512, 1.0)]), "outside the vocabulary"),
    (dict(logit_bias=[(-1, 1.0)]), "outside the vocabulary"),
    (dict(logit_bias=[(3, 100.5)]), "bias must be"),
    (dict(logit_bias=[(3, float("nan"))]), "bias must be"),
    (dict(logit_bias=[(3, float("-inf"))]), "bias must be"),
    (dict(logit_bias=[(3, 1.0), (3, 2.0)]), "twice"),
    (dict(logit_bias=[(i % 512, 0.0) for i in range(1025)]), "at most 1024"),
]


@pytest.mark.parametrize("kwargs,word", BAD, ids=[f"{k}={v}" for k, v in (next(iter(b[0].items())) for b in BAD)])
def test_every_parameter_outside_its_range_is_refused_before_llama_cpp_sees_it(kwargs, word):
    params = SamplingParams(**kwargs)
    with pytest.raises(InvalidInputError, match=word):
        params.check(N_VOCAB, 4096)
    with pytest.raises(InvalidInputError, match=word):
        TokenSampler(N_VOCAB, params, 4096)


def test_logit_bias_is_added_first_and_a_rebuilt_sampler_keeps_it():
    """logit_bias is llama.cpp's logit-bias sampler first in the chain: a bias moves the argmax
    (temperature 0 then takes the whole chain, not the argmax path), -100 takes a token out of a
    seeded draw's reach, and a sampler rebuilt from (params, history, draws) samples the same."""
    logits = rows(24, seed=5)
    greedy = run(SamplingParams(temperature=0.0), logits, [1, 2])
    forced = run(SamplingParams(temperature=0.0, logit_bias=[(7, 100.0)]), logits, [1, 2])
    assert forced == [7] * 24 and greedy != forced
    banned = run(SamplingParams(temperature=0.0, logit_bias=[(greedy[0], -100.0)]), logits[:1], [1, 2])
    assert banned[0] != greedy[0]
    expected = logits[0].copy()
    expected[greedy[0]] -= 100.0
    assert banned[0] == int(np.argmax(expected))
    assert run(SamplingParams(temperature=0.0, logit_bias=[(3, 0.0)]), logits, [1, 2]) == greedy
    seeded = SamplingParams(
        temperature=1.0, top_k=40, seed=9, logit_bias=[(t, -100.0) for t in range(0, 512, 2)] + [(11, 2.5)]
    )
    tokens = run(seeded, logits, [4, 5])
    assert all(t % 2 == 1 for t in tokens)  # no even token in any draw
    assert seeded.logit_bias[-1] == (11, 2.5)
    for k in (1, 7, 13):
        s = TokenSampler(N_VOCAB, seeded, 4096, history=[4, 5] + tokens[:k], draws=k)
        assert s.sample(logits[k]) == tokens[k]


RISKY = """
import numpy as np
from llama_shard._native import SamplingParams, TokenSampler
from llama_shard.errors import InvalidInputError
s = TokenSampler(512, SamplingParams(temperature=0.7, top_p=0.9, penalty_repeat=1.2, seed=2), 4096)
refused = 0
cases = [np.full(512, np.nan, np.float32), np.full(512, np.inf, np.float32), np.zeros(511, np.float32),
         np.zeros(0, np.float32), np.zeros((2, 512), np.float32), np.zeros(512, np.float64), np.zeros(1024, np.float32)[::2]]
for logits in cases:
    try:
        s.sample(logits)
    except InvalidInputError:
        refused += 1
for token in (-1, 512, 2**31 - 1):
    try:
        s.accept(token)
    except InvalidInputError:
        refused += 1
for kwargs in ({"history": [600]}, {"draws": -1}):
    try:
        TokenSampler(512, SamplingParams(seed=2), 4096, **kwargs)
    except (InvalidInputError, TypeError):
        refused += 1
assert s.draws == 0
row = np.zeros(512, np.float32); row[9] = 5.0
print("refused", refused, "then", TokenSampler(512, SamplingParams(temperature=0.0, seed=2), 4096).sample(row))
"""


def test_bad_rows_and_tokens_are_refused_and_change_nothing():
    res = subprocess.run([sys.executable, "-c", RISKY], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["refused", "12", "then", "9"]


def test_a_history_or_draw_count_no_session_can_have_is_refused_at_once():
    """A resume replays its draws: 2^40 of them would hold the caller for hours. No session holds
    more than 2^20 tokens, so more draws (or history), or a wider penalty window, is refused."""
    import time

    t = time.perf_counter()
    with pytest.raises(InvalidInputError, match="draws"):
        TokenSampler(N_VOCAB, SamplingParams(seed=1), 4096, draws=1 << 40)
    with pytest.raises(InvalidInputError, match="penalty_last_n"):
        TokenSampler(N_VOCAB, SamplingParams(penalty_last_n=(1 << 20) + 1, seed=1), 1 << 30)
    assert time.perf_counter() - t < 5
