"""Speculative decoding on the route (head/speculation.py): the head drafts from the session's own
tokens, one route step verifies, the tail accepts.

What is shown here:
- the engine's several rows of logits: a step with logit_rows k returns, for each of its last k
  tokens, the logits one-token steps give (within llama.cpp's rounding, the same greedy token; the
  reference engine: the same rows); out-of-range rows are refused before anything is computed;
- the head's parts on their own: prompt lookup, the number of drafts against acceptance and cost
  (down to none, with a probe), the tail's rule (greedy and sampled);
- on live workers: greedy Generate with drafts gives the tokens of Generate without them, for the
  whole SmolLM2, 2 and 3 shards, and 2 shards of Gemma 3, drafting and accepting on text that
  repeats itself; seeded sampling with drafts is deterministic and gives the tokens without them,
  seed by seed, and the token frequencies over many seeds pass a chi-square test against them;
- bad input (max_drafts out of range, drafts that do not fit the step) gets INVALID_ARGUMENT and
  changes nothing; a session truncated or released after a verification, or a tail restarted
  between a verification and the next step, gives a miss that the next Generate re-prefills, with
  the tokens a plain route gives.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from llama_shard import KvBoundaryAdapter, ShardModel, Step
from llama_shard._native import MAX_LOGIT_ROWS, SamplingParams
from llama_shard.engine.hot_kv import HotKvStateConfig
from llama_shard.engine.manager import HotKvStateManager
from llama_shard.errors import InvalidInputError
from llama_shard.head.speculation import (
    PRIOR_BETA,
    PROBE_EVERY,
    AheadTiming,
    DraftControl,
    NgramDrafter,
    StepCost,
)
from llama_shard.proto import shard_pb2 as pb
from llama_shard.proto.requests import MAX_DRAFTS
from llama_shard.proto.requests import sampling_to_wire as params_to_wire
from llama_shard.worker.sampling import verify

from support.prompts import REPEAT

OPEN = "Write a short story about a lighthouse keeper."


# --- the head's and the tail's parts ------------------------------------------------------------


def test_prompt_lookup_proposes_what_followed_the_longest_earlier_ngram():
    d = NgramDrafter()
    tokens = [1, 2, 3, 4, 5, 6, 9, 9, 2, 3, 4]
    assert d.propose(tokens, 3) == ([5, 6, 9], 3)  # [2, 3, 4] occurred before, then 5 6 9
    tokens += [7]
    assert d.propose(tokens, 3) == ([], 0)  # 7 never occurred before
    tokens += [4]
    assert d.propose(tokens, 3) == ([7, 4], 1)  # [7, 4] did not either; 4 alone did (latest: then 7)
    tokens += [1, 2]
    assert d.propose(tokens, 8) == ([3, 4, 5, 6, 9, 9, 2, 3], 2)  # [4, 1, 2] is new, [1, 2] is not
    assert NgramDrafter().propose([5, 5, 5], 4) == ([5], 2)  # [5, 5] was followed by one token
    assert NgramDrafter().propose([1, 2, 1, 2], 0) == ([], 0)


def test_the_number_of_drafts_follows_acceptance_and_cost_down_to_a_probe():
    flat = [1.0 + 0.05 * n for n in range(MAX_LOGIT_ROWS)]  # drafts nearly free (a slow link)
    steep = [1.0 + 1.0 * n for n in range(MAX_LOGIT_ROWS)]  # each token costs a whole step
    good = DraftControl(8)
    for _ in range(20):
        good.update(4, 4)
        good.update(4, 0, long=False)  # matches of one token: a rate of their own
    assert good.rate() > 0.9 and good.k(flat) == 8
    assert good.rate(long=False) < 0.1 and good.k(flat, long=False) in (0, 1)
    assert good.k(steep) == 0 or good.k(steep) == 1  # never worth it at that cost (a probe at most)
    bad = DraftControl(8)
    for _ in range(20):
        bad.update(2, 0)
    ks = [bad.k(flat) for _ in range(3 * PROBE_EVERY)]
    assert ks.count(1) == 3 and set(ks) == {0, 1}  # none, but one draft every PROBE_EVERY steps
    assert DraftControl(0).k(flat) == 0
    assert [bad.k(flat, probe=False) for _ in range(3 * PROBE_EVERY)] == [0] * 3 * PROBE_EVERY  # unsent drafts teach it
    # a new stream drafts where a draft costs little (a slow link), not where it costs most of a step
    # (loopback with exact verification), until its text shows it pays
    assert DraftControl(8).k(flat) > 0 and DraftControl(8).k(steep) == 0
    assert (bad.drafted, bad.accepted, good.drafted, good.accepted) == (40, 0, 160, 80)


def test_acceptance_in_runs_drafts_long_where_a_first_draft_often_fails():
    """A copied text: a step's first draft is right half the time, but a draft after a right one
    nearly always. One rate for both (0.5 per draft) would send a few; the run's own rate sends the
    longest step the cost allows, and prices a window ahead by one run."""
    flat = [1.0 + 0.05 * n for n in range(MAX_LOGIT_ROWS)]
    c = DraftControl(8)
    for i in range(40):
        c.update(8, 8 if i % 2 else 0)  # all accepted, or the first rejected
    assert 0.4 < c.rate() < 0.6 and c.run_rate() > 0.95
    assert c.k(flat) == 8
    assert c.all_accepted(1) == c.rate() and abs(c.all_accepted(9) - c.rate() * c.run_rate() ** 8) < 1e-12
    # drafts after a guessed token (a window sent ahead) are judged as a run: the first rate is untouched
    first, run = c.rate(), c.run_rate()
    c.update(3, 0, in_run=True)
    assert c.rate() == first and c.run_rate() < run
    # a short match's rates are its own
    assert c.rate(long=False) == 0.25 and c.run_rate(long=False) == 0.5


def test_a_new_streams_rates_start_where_the_last_one_ended():
    """A route loop hands the rates its last stream ended with to the next (`learn_rates_from`): one
    request meets few matches, and from the priors it would draft little where the text copies."""
    flat = [1.0 + 0.05 * n for n in range(MAX_LOGIT_ROWS)]
    done = DraftControl(15)
    for i in range(20):
        done.update(15, 15 if i % 4 else 2)
    fresh, seeded = DraftControl(15), DraftControl(15)
    seeded.learn_rates_from(done)
    assert fresh.observed == seeded.observed == 0 and done.observed == 20  # what a route loop checks
    assert fresh.k(flat) < seeded.k(flat) == done.k(flat) == 15
    assert (seeded.rate(), seeded.run_rate()) == (done.rate(), done.run_rate())
    assert seeded.rate(long=False) == fresh.rate(long=False)  # nothing learned of short matches there
    seeded.update(3, 0)  # the stream learns on its own from there: the one it started from is unchanged
    assert seeded.rate() < done.rate() and done.k(flat) == 15
    assert seeded.drafted == 3 and seeded.max_drafts == 15  # its counters and its cap are its own
    light = DraftControl(15)  # carried with a weight: the same rates, sooner unlearned
    light.learn_rates_from(done, weight=4.0)
    assert light.rate() == pytest.approx(done.rate()) and light.run_rate() == pytest.approx(done.run_rate())
    light.update(3, 0)
    assert light.rate() < seeded.rate()


def test_step_cost_prices_untimed_sizes_from_timed_ones():
    cost = StepCost()
    assert cost.relative()[0] == 1.0 and cost.relative()[1] > 1.0
    cost.observe(1, 0.010)
    cost.observe(4, 0.012)  # once, under the estimate from one token (1 + 3 x PRIOR_BETA): its own
    rel = cost.relative()
    assert rel[0] == 1.0 and rel[3] == pytest.approx(1.2) and rel[1] < rel[3] < rel[5]
    assert rel[5] == pytest.approx(1.2 + 2 * PRIOR_BETA)  # 4 timed once: not yet a cost a token
    cost.observe(4, 0.012)
    assert cost.relative()[5] == pytest.approx(1.2 + 2 * 0.2 / 3)  # timed twice: its cost a token (under PRIOR_BETA)
    slow_link = StepCost()  # most of a step is the link: a token costs far less than PRIOR_BETA of a step
    slow_link.observe(1, 0.110)
    slow_link.observe(3, 0.112)
    slow_link.observe(3, 0.112)
    assert slow_link.relative()[15] == pytest.approx((0.112 + 13 * 0.001) / 0.110)
    noisy = StepCost()  # one timing at or under a one-token step does not make every larger size free
    noisy.observe(1, 0.010)
    noisy.observe(3, 0.009)
    assert noisy.relative()[15] == pytest.approx(0.9 + 13 * PRIOR_BETA)
    steep = StepCost()  # where tokens cost more than PRIOR_BETA, untimed sizes stay optimistic
    steep.observe(1, 0.010)
    steep.observe(2, 0.010 * (1 + 2 * PRIOR_BETA))
    steep.observe(2, 0.010 * (1 + 2 * PRIOR_BETA))
    assert steep.relative()[4] == pytest.approx(1 + 5 * PRIOR_BETA)


def test_a_window_ahead_is_sent_at_the_odds_the_route_measured():
    """Before anything is measured: the priors (a kept window saves a one-token step, a dropped one
    costs its rows at the second token's cost). Measures like loopback's here (a kept window saved
    2.5 ms of a 7 ms step, a step with one behind it took 2 ms longer, a dropped window held the next
    step 5 ms a row): only a near-sure window goes. Over a slow link (a kept one saves about a round trip, a row
    costs about 1 ms): long windows at low odds."""
    step, row = 0.007, 0.006
    fresh = AheadTiming()
    for chance, rows in ((0.5, 1), (0.6, 1), (0.3, 2), (0.9, 9)):
        assert fresh.worth(chance, rows, step, row) == (chance * step >= (1 - chance) * rows * row)
    loopback = AheadTiming()
    loopback.kept(alone_s=0.007, between_replies_s=0.0045)
    loopback.slowed(alone_s=0.007, took_s=0.009)
    loopback.dropped(rows=2, waited_s=0.010)
    assert fresh.worth(0.6, 1, step, row) and not loopback.worth(0.6, 1, step, row)
    assert loopback.worth(0.99, 1, step, row) and not loopback.worth(0.9, 1, step, row)
    slow = AheadTiming()
    slow.kept(alone_s=0.112, between_replies_s=0.012)
    slow.slowed(alone_s=0.112, took_s=0.113)
    slow.dropped(rows=16, waited_s=0.016)
    assert slow.worth(0.2, 16, 0.112, 0.001) and not slow.worth(0.1, 16, 0.112, 0.001)
    slow.dropped(rows=0, waited_s=1.0)  # nothing dropped: nothing learned
    assert slow.worth(0.2, 16, 0.112, 0.001)
    for _ in range(20):  # exponential averages: the route's recent windows, not its first
        slow.kept(alone_s=0.112, between_replies_s=0.110)
    assert not slow.worth(0.5, 16, 0.112, 0.001)


def test_a_sizes_first_time_counts_at_most_the_estimate_until_its_second():
    """A size's first step may carry the workers' one-time comparison of its rows (computed twice):
    above the estimate it does not price the size out before a second time."""
    cost = StepCost()
    cost.observe(1, 0.010)
    cost.observe(4, 0.040)
    assert cost.relative()[3] == pytest.approx(1 + 3 * PRIOR_BETA)
    cost.observe(4, 0.020)  # the second replaces the first
    assert cost.relative()[3] == pytest.approx(2.0)
    cost.observe(4, 0.030)  # then an exponential average
    assert cost.relative()[3] == pytest.approx(0.8 * 2.0 + 0.2 * 3.0)


def test_the_tail_accepts_drafts_while_its_own_draw_equals_them():
    rows = np.zeros((4, 10), np.float32)
    for i, best in enumerate([3, 5, 7, 1]):
        rows[i, best] = 1.0
    argmax = lambda row: int(np.argmax(row))  # noqa: E731
    assert verify(rows, [3, 5, 7], argmax) == [3, 5, 7, 1]  # all accepted, then its own token
    assert verify(rows, [3, 6, 7], argmax) == [3, 5]  # the second rejected: its own token instead
    assert verify(rows, [2, 5, 7], argmax) == [3]
    assert verify(rows[:1], [], argmax) == [3]


# --- the engine's rows ----------------------------------------------------------------------------


def _manager(path, layers=None, **kw):
    model = ShardModel(str(path), layers, 1)
    config = HotKvStateConfig(max_sessions=2, context_tokens=256, budget_tokens=512, **kw)
    return model, HotKvStateManager(model, config, n_threads=1)


@pytest.mark.model
@pytest.mark.parametrize("flash_attn", [True, False], ids=["fa-on", "fa-off"])
def test_a_step_with_several_logit_rows_gives_each_rows_one_token_logits(embedded_model, flash_attn):
    model, mgr = _manager(embedded_model, flash_attn=flash_attn)
    try:
        ad = KvBoundaryAdapter(model, mgr)
        text = model.tokenize(REPEAT)  # text, not random ids: a flat row's argmax is a coin toss
        prompt, more = text[:40], text[40:46]
        ad.prefill("one", 0, prompt, start_pos=0)
        ad.prefill("rows", 0, prompt, start_pos=0)
        singles = [ad.decode("one", 0, [t]).logits.copy() for t in more]
        out = ad.prefill("rows", 0, more, start_pos=40, logit_rows=6)
        assert out.rows.shape == (6, model.info.n_vocab) and out.seq_len == 46
        # llama.cpp's rows of one step are one-token steps' up to its kernels' rounding, which
        # depends on the step's shape (byte-equal in most rows here, 0.4 apart in the worst seen,
        # flash attention off): the same greedy token, logits within 1
        for i in range(6):
            np.testing.assert_allclose(out.rows[i], singles[i], rtol=0, atol=1.0)
            assert int(np.argmax(out.rows[i])) == int(np.argmax(singles[i])), i
        assert out.logits.tobytes() == out.rows[-1].tobytes() and out.token_id == int(np.argmax(out.rows[-1]))
        # row by row (serve --verify exact): every row is a one-token step's, to the byte
        exact = ad.prefill("rows", 0, more, start_pos=40, logit_rows=6, row_by_row=True)
        assert exact.seq_len == 46
        for i in range(6):
            assert exact.rows[i].tobytes() == singles[i].tobytes(), i
        # a prefill at an earlier position cuts the rows after it (rejected drafts)
        again = ad.prefill("rows", 0, more[2:4], start_pos=42, logit_rows=2)
        assert again.seq_len == 44 and int(np.argmax(again.rows[1])) == int(np.argmax(singles[3]))
        for bad in (0, 7, MAX_LOGIT_ROWS + 1, 2.0):
            with pytest.raises(InvalidInputError):
                Step.prefill("rows", 0, more, start_pos=44, logit_rows=bad)
        assert mgr.resolve("rows", 0).seq_len == 44
    finally:
        mgr.close()


def test_the_reference_engine_returns_the_same_rows(synthetic_model):
    from llama_shard.reference import NATIVE_LOGIT_ATOL, ReferenceModel, ReferenceShard

    model, mgr = _manager(synthetic_model)
    shard = ReferenceShard(ReferenceModel.from_gguf(synthetic_model))
    ref = HotKvStateManager(shard, mgr.config)
    try:
        rng = np.random.default_rng(4)
        prompt = rng.integers(0, model.info.n_vocab, 12).tolist()
        outs = [
            KvBoundaryAdapter(m, g).prefill("s", 0, prompt, start_pos=0, logit_rows=5)
            for m, g in ((model, mgr), (shard, ref))
        ]
        assert outs[0].rows.shape == outs[1].rows.shape == (5, model.info.n_vocab)
        np.testing.assert_allclose(outs[0].rows, outs[1].rows, rtol=0, atol=NATIVE_LOGIT_ATOL)
        assert [int(np.argmax(r)) for r in outs[0].rows] == [int(np.argmax(r)) for r in outs[1].rows]
    finally:
        mgr.close()
        ref.close()


# --- on live workers ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol_spec_routes(embedded_model):
    from support.served_route import Route

    routes = {}
    try:
        routes["whole"] = Route(embedded_model, [(0, 29)])
        routes["2 shards"] = Route(embedded_model, [(0, 14), (15, 29)])
        routes["3 shards"] = Route(embedded_model, [(0, 9), (10, 19), (20, 29)])
        yield routes
    finally:
        for r in routes.values():
            r.stop()


def _tokens(route, sid, prompt, n, **kw):
    tokens, final = route.generate(sid, prompt, max_tokens=n, **kw)
    assert final.finish_reason == "length", final
    return tokens, final


@pytest.mark.model
@pytest.mark.grpc
@pytest.mark.parametrize("layout", ["whole", "2 shards", "3 shards"])
@pytest.mark.slow
def test_greedy_with_drafts_gives_the_tokens_without(smol_spec_routes, embedded_model, layout):
    route = smol_spec_routes[layout]
    vocab = ShardModel(str(embedded_model), (0, 0), 1)
    for i, text in enumerate((REPEAT, OPEN)):
        prompt = vocab.tokenize(text)
        plain, final0 = _tokens(route, f"plain-{i}", prompt, 48, max_drafts=0)
        spec, final = _tokens(route, f"spec-{i}", prompt, 48, max_drafts=MAX_DRAFTS)
        assert spec == plain, (layout, i)
        assert final0.drafted_tokens == 0 and final.accepted_tokens <= final.drafted_tokens
        if text is REPEAT:  # a rewrite repeats the prompt: drafts are made and most are right
            assert final.drafted_tokens > 0 and final.accepted_tokens > final.drafted_tokens // 2
        print(
            f"{layout}, {'repeat' if text is REPEAT else 'open'}: {final.accepted_tokens}/{final.drafted_tokens} "
            f"drafts accepted, {final.pipelined_windows} windows sent ahead, {final.pipelined_kept} kept"
        )
    info = route.info()
    assert info.draft_source == "ngram" and info.accepted_tokens <= info.drafted_tokens


@pytest.mark.model
@pytest.mark.grpc
def test_a_stop_among_accepted_drafts_ends_the_stream_there_and_counts_only_what_was_sent(
    smol_spec_routes, embedded_model
):
    route = smol_spec_routes["2 shards"]
    prompt = ShardModel(str(embedded_model), (0, 0), 1).tokenize(REPEAT)
    plain, _ = _tokens(route, "stop-plain", prompt, 48, max_drafts=0)
    j = next(i for i in range(20, 48) if plain[i] not in plain[:i])  # a token first generated late
    spec, final = route.generate("stop-spec", prompt, max_tokens=48, max_drafts=MAX_DRAFTS, stop_token_ids=[plain[j]])
    assert spec == plain[: j + 1] and final.finish_reason == "stop"
    assert final.drafted_tokens > 0 and final.accepted_tokens <= final.completion_tokens == j + 1


@pytest.mark.model
@pytest.mark.grpc
def test_the_generate_command_sets_max_drafts_and_reports_the_drafts(smol_spec_routes, embedded_model):
    import subprocess
    import sys

    route = smol_spec_routes["2 shards"]
    spec = ",".join(f"{a}-{b}@{addr}" for (a, b), addr in zip(route.ranges, route.addresses))
    cmd = [
        sys.executable,
        "-m",
        "llama_shard.cli",
        "generate",
        "--model",
        str(embedded_model),
        "--route",
        spec,
        "--prompt",
        REPEAT,
        "--max-tokens",
        "32",
    ]
    runs = {k: subprocess.run([*cmd, "--max-drafts", k], capture_output=True, text=True, timeout=300) for k in "08"}
    for res in runs.values():
        assert res.returncode == 0, res.stderr[-2000:]
    assert runs["0"].stdout == runs["8"].stdout and "drafts accepted" not in runs["0"].stderr
    assert "drafts accepted" in runs["8"].stderr, runs["8"].stderr[-500:]
    for bad in (["--max-drafts", "16"], ["--max-drafts", "-1"]):
        res = subprocess.run([*cmd, *bad], capture_output=True, text=True, timeout=300)
        assert res.returncode == 2 and "--max-drafts" in res.stderr, res.stderr[-500:]
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "llama_shard.cli",
            "generate",
            "--model",
            str(embedded_model),
            "--max-drafts",
            "4",
            "--max-tokens",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 2 and "needs --route" in res.stderr, res.stderr[-500:]


@pytest.mark.grpc
@pytest.mark.slow
def test_greedy_with_drafts_on_gemma3_in_two_shards_gives_the_tokens_without(gemma3_model):
    from support.served_route import Route

    vocab = ShardModel(str(gemma3_model), (0, 0), 1)
    n_layer = vocab.info.n_layer
    route = Route(gemma3_model, [(0, n_layer // 2 - 1), (n_layer // 2, n_layer - 1)])
    try:
        for i, text in enumerate((REPEAT, OPEN)):
            prompt = vocab.tokenize(text)
            plain, _ = _tokens(route, f"plain-{i}", prompt, 48, max_drafts=0)
            spec, final = _tokens(route, f"spec-{i}", prompt, 48)  # the worker's default: drafts on
            assert spec == plain, i
            if text is REPEAT:  # drafts were made and verified. Whether one is accepted depends on the
                # text this CPU's kernels give (0 of 5 on a Zen 3's haswell kernels); the embedded
                # model's drafts tests assert acceptance
                assert final.drafted_tokens > 0, final
    finally:
        route.stop()


@pytest.mark.model
@pytest.mark.grpc
@pytest.mark.slow
def test_seeded_sampling_with_drafts_is_deterministic_and_matches_without(smol_spec_routes, embedded_model):
    """Seed by seed the same tokens; over 40 seeds, the frequencies of the tokens sampled at each
    position pass a chi-square homogeneity test against generation without drafts (p > 0.01)."""
    route = smol_spec_routes["2 shards"]
    vocab = ShardModel(str(embedded_model), (0, 0), 1)
    prompt = vocab.tokenize(REPEAT)
    counts: dict[str, dict[int, int]] = {"on": {}, "off": {}}
    drafted = 0
    for seed in range(40):
        sampling = params_to_wire(SamplingParams(seed=seed, temperature=0.7, top_k=40, top_p=0.95))
        plain, _ = _tokens(route, f"s-plain-{seed}", prompt, 12, sampling=sampling, max_drafts=0)
        spec, final = _tokens(route, f"s-spec-{seed}", prompt, 12, sampling=sampling, max_drafts=MAX_DRAFTS)
        again, _ = _tokens(route, f"s-again-{seed}", prompt, 12, sampling=sampling, max_drafts=MAX_DRAFTS)
        assert spec == again, seed  # deterministic per seed
        assert spec == plain, seed  # and the tokens sampling gives without drafts
        drafted += final.drafted_tokens
        for side, toks in (("on", spec), ("off", plain)):
            for t in toks:
                counts[side][t] = counts[side].get(t, 0) + 1
    assert drafted > 0
    # chi-square homogeneity over the tokens seen (rare ones pooled)
    keys = sorted(set(counts["on"]) | set(counts["off"]))
    table = np.array([[counts[s].get(k, 0) for k in keys] for s in ("on", "off")], float)
    common = table.sum(0) >= 5
    table = np.column_stack([table[:, common], table[:, ~common].sum(1)]) if (~common).any() else table[:, common]
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    chi2 = float(((table - expected) ** 2 / np.where(expected > 0, expected, 1)).sum())
    dof = table.shape[1] - 1
    # the upper 1% point of chi-square (Wilson-Hilferty)
    z = 2.326
    critical = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    assert chi2 < critical, (chi2, critical, dof)


@pytest.mark.model
@pytest.mark.grpc
@pytest.mark.parametrize("max_drafts", [-1, MAX_DRAFTS + 1, 1000])
def test_max_drafts_out_of_range_is_refused_and_computes_nothing(smol_spec_routes, embedded_model, max_drafts):
    route = smol_spec_routes["2 shards"]
    before = route.info(1).tokens_computed
    tokens, final = route.generate("bad-k", [1, 2, 3], max_tokens=4, max_drafts=max_drafts)
    assert tokens == [] and final.outcome == pb.OUTCOME_INVALID_ARGUMENT and "max_drafts" in final.detail
    assert route.info(1).tokens_computed == before


def _prefill(route, sid, tokens, position, drafts=(), **kw):
    req = pb.StepRequest(
        session_id=sid,
        token_ids=tokens,
        position=position,
        draft_tokens=list(drafts),
        forward=[pb.Hop(address=a) for a in route.addresses[1:]],
        **kw,
    )
    return route.stub().Prefill(req, timeout=60)


@pytest.mark.model
@pytest.mark.grpc
def test_steps_with_drafts_that_do_not_fit_are_refused_and_change_nothing(smol_spec_routes):
    route = smol_spec_routes["2 shards"]
    prompt = list(range(100, 140))
    assert _prefill(route, "fit", prompt, 0).outcome == pb.OUTCOME_OK
    cases = {
        "too many": (list(range(200, 217)), list(range(201, 217))),
        "as many as the tokens": ([5, 6], [5, 6]),
        "more tokens than the last sampled one": ([4, 5, 6], [6]),  # would be a long row-by-row step
        "not the step's last tokens": ([5, 6, 7], [6, 8]),
        "outside the vocabulary": ([5, 6], [1 << 30]),
    }
    for name, (tokens, drafts) in cases.items():
        reply = _prefill(route, "fit", tokens, 40, drafts)
        assert reply.outcome == pb.OUTCOME_INVALID_ARGUMENT, name
    # a verification answers tokens (and, asked, its logit rows: a spot check's), not logprobs
    assert _prefill(route, "fit", [5, 6], 40, [6], logprobs=True).outcome == pb.OUTCOME_INVALID_ARGUMENT
    without_drafts = _prefill(route, "fit", [5, 6], 40, row_by_row=True)
    assert without_drafts.outcome == pb.OUTCOME_INVALID_ARGUMENT and "row_by_row" in without_drafts.detail
    decode = route.stub().Decode(
        pb.StepRequest(
            session_id="fit", token_ids=[5, 6], draft_tokens=[6], forward=[pb.Hop(address=route.addresses[1])]
        ),
        timeout=60,
    )
    assert decode.outcome == pb.OUTCOME_INVALID_ARGUMENT and "explicit position" in decode.detail
    for k in (0, 1):  # nothing changed on either worker
        assert route.stub(k).Resolve(pb.SessionRequest(session_id="fit"), timeout=10).seq_len == 40


@pytest.mark.model
@pytest.mark.grpc
@pytest.mark.parametrize("fault", ["truncated", "released", "tail restarted"])
@pytest.mark.slow
def test_a_fault_between_a_verification_and_the_next_step_is_a_miss_and_generation_goes_on(embedded_model, fault):
    from support.served_route import Route

    route = Route(embedded_model, [(0, 14), (15, 29)])
    try:
        vocab = ShardModel(str(embedded_model), (0, 0), 1)
        prompt = vocab.tokenize(REPEAT)
        plain, _ = _tokens(route, "plain", prompt, 24, max_drafts=0)
        # the route as the head's loop leaves it after a verification: the prompt, then the first
        # token with three drafts (the plain tokens, the last one wrong)
        n = len(prompt)
        assert _prefill(route, "s", prompt, 0).token_id == plain[0]
        drafts = [plain[1], plain[2], (plain[3] + 1) % 1000]
        reply = _prefill(route, "s", [plain[0], *drafts], n, drafts)
        assert reply.outcome == pb.OUTCOME_OK and list(reply.tokens) == plain[1:4]  # 2 accepted, then its own
        if fault == "truncated":
            route.stub(1).Truncate(pb.TruncateRequest(session_id="s", length=n - 5), timeout=10)
        elif fault == "released":
            route.stub(1).Release(pb.SessionRequest(session_id="s"), timeout=10)
        else:
            from llama_shard.local_workers import stop_worker

            stop_worker(route.procs[1])
            route.start(1)
        # the next step, at the position after the accepted drafts, finds the tail lacking them
        after = _prefill(route, "s", [plain[3]], n + 3)
        assert after.outcome == pb.OUTCOME_CACHE_MISS and after.stage == 1
        # a Generate of the conversation so far re-prefills and goes on with the plain tokens
        tokens, final = _tokens(route, "s", prompt + plain[:4], 20)
        assert tokens == plain[4:24]
    finally:
        route.stop()


# --- a draft model --------------------------------------------------------------------------------


@pytest.mark.model
@pytest.mark.slow
def test_a_draft_model_with_another_vocabulary_is_refused_at_start(embedded_model, gemma3_model):
    from llama_shard.head.draft_model import check_vocabulary
    from llama_shard.local_workers import start_worker

    check_vocabulary(embedded_model, embedded_model)  # the same tokenizer: fine
    with pytest.raises(InvalidInputError, match="different vocabulary"):
        check_vocabulary(gemma3_model, embedded_model)
    proc, _ = start_worker(embedded_model, 0, 29, extra=("--draft-model", str(gemma3_model)))
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "different vocabulary" in err and "gemma-3" in err
    tail, _ = start_worker(embedded_model, 15, 29, extra=("--draft-model", str(embedded_model)))
    _, err = tail.communicate(timeout=120)
    assert tail.returncode == 2 and "needs the head worker" in err
    off, _ = start_worker(embedded_model, 0, 29, extra=("--draft-model", str(embedded_model), "--draft", "off"))
    _, err = off.communicate(timeout=120)
    assert off.returncode == 2 and "--draft off and --draft-model" in err


@pytest.mark.model
@pytest.mark.grpc
@pytest.mark.slow
def test_drafts_from_a_draft_model_give_the_tokens_without(embedded_model):
    """The route's own model as its draft model: every greedy draft is the route's token (a cheap
    draft model would be a smaller one of the same tokenizer; the rule is the same)."""
    from llama_shard.local_workers import stop_worker

    from support.served_route import Route

    route = Route(embedded_model, [(0, 14), (15, 29)])
    drafting = Route(embedded_model, [(0, 14), (15, 29)])
    try:
        stop_worker(drafting.procs[0])  # the head again, with a draft model
        drafting.start(0, ("--draft-model", str(embedded_model)))
        vocab = ShardModel(str(embedded_model), (0, 0), 1)
        for i, text in enumerate((OPEN, REPEAT)):
            prompt = vocab.tokenize(text)
            plain, _ = _tokens(route, f"plain-{i}", prompt, 32, max_drafts=0)
            spec, final = _tokens(drafting, f"spec-{i}", prompt, 32)
            assert spec == plain, i
            assert final.drafted_tokens > 0 and final.accepted_tokens > final.drafted_tokens // 2
        assert drafting.info().draft_source == f"model {embedded_model.name}"
    finally:
        route.stop()
        drafting.stop()


# the draft engine of a head, built in a fresh process, its resident memory measured around it
DRAFT_PLANNED = """
import json
from llama_shard.engine.memory import draft_model_plan
from llama_shard.head.draft_model import DraftModel
from llama_shard.testing.process import resident_bytes as rss
plan = draft_model_plan({path!r}, 1024, {streams})
r0 = rss()
draft = DraftModel({path!r}, {path!r}, 1024, {streams}, threads=1)
assert draft.manager.config == plan.config(ttl_seconds=0), (draft.manager.config, plan)
draft.propose("a", [1, 2, 3], 2)
print(json.dumps(dict(rss=rss() - r0, hot_bytes=plan.hot_bytes, model_bytes=plan.model_bytes)))
"""


@pytest.mark.model
@pytest.mark.slow
def test_a_draft_model_is_in_the_memory_plan_and_its_engine_is_sized_by_it(embedded_model):
    """serve's memory plan names the draft model's weights and its KV (a slot per Generate stream);
    the draft engine is built from that plan and its KV grows with the streams as the plan says."""
    from llama_shard.cli import build_parser, serve_config

    from conftest import run_isolated

    flags = ["serve", "--model", str(embedded_model), "--max-sessions", "3", "--context-tokens", "1024"]
    _, plain = serve_config(build_parser().parse_args(flags), None)
    _, plan = serve_config(build_parser().parse_args([*flags, "--draft-model", str(embedded_model)]), None)
    assert plain.draft is None and plain.draft_bytes == 0
    assert plan.draft.hot_slots == 3 and plan.draft.context_tokens == 1024  # a slot per stream the head runs
    assert plan.draft_bytes == plan.draft.model_bytes + plan.draft.hot_bytes > plan.draft.hot_bytes > 0
    assert "draft:" in plan.describe() and "draft:" not in plain.describe()
    runs = []
    for streams in (2, 8):
        res = run_isolated(DRAFT_PLANNED.format(path=str(embedded_model), streams=streams))
        assert res.returncode == 0, res.stderr
        runs.append(json.loads(res.stdout.strip().splitlines()[-1]))
    grown, planned = runs[1]["rss"] - runs[0]["rss"], runs[1]["hot_bytes"] - runs[0]["hot_bytes"]
    assert 0.9 * planned <= grown <= 1.1 * planned, runs


# --- pipelining -----------------------------------------------------------------------------------


def test_a_step_that_overtakes_the_one_before_it_waits_for_it(monkeypatch):
    """SessionOrder: a step starting past the end of its session's last step queued here waits (at
    most ORDER_WAIT_S) until that step is queued; an unknown session, a step at or before that end,
    one far past it, or one while max_waiting others wait, never waits."""
    import threading
    import time

    from llama_shard.engine.hot_kv import Step
    from llama_shard.worker import session_order
    from llama_shard.worker.session_order import ORDER_GAP_MAX, SessionOrder

    monkeypatch.setattr(session_order, "ORDER_WAIT_S", 30.0)  # the waits below end by the steps queued, not by time
    order = SessionOrder(cap=4, max_waiting=1)
    far = time.monotonic() + 30
    a = Step.prefill("s", 0, [1, 2, 3], None, 10)
    b = Step.prefill("s", 0, [4, 5], None, 13)
    t0 = time.monotonic()
    order.wait_turn([b], far)  # a session not seen here: no wait
    assert time.monotonic() - t0 < 0.5
    order.queued([Step.prefill("s", 0, [9] * 10, None, 0)])  # the session ends at 10
    done = []
    waiter = threading.Thread(target=lambda: (order.wait_turn([b], far), done.append(time.monotonic())))
    waiter.start()
    time.sleep(0.3)
    assert not done  # b starts at 13: it waits for the step that ends there
    order.queued([a])
    waiter.join(5)
    assert done and done[0] - t0 >= 0.3
    t0 = time.monotonic()
    order.wait_turn([Step.prefill("s", 0, [7], None, 5)], far)  # before the end: at once
    order.wait_turn([Step.prefill("s", 0, [7], None, 15 + ORDER_GAP_MAX + 1)], far)  # far past it: at once
    assert time.monotonic() - t0 < 0.5
    # a prompt's chunks in flight: the third of 256 tokens may come before the first two
    chunks = [Step.prefill("p", 0, [1] * 256, None, 256 * i) for i in range(3)]
    order.queued([Step.prefill("p", 0, [1] * 5, None, 0)])  # the session's first 5 tokens, then a cut at 0
    waiter = threading.Thread(target=lambda: (order.wait_turn([chunks[2]], far), done.append("third")))
    waiter.start()
    order.queued([chunks[0]])
    time.sleep(0.2)
    assert "third" not in done
    order.queued([chunks[1]])
    waiter.join(5)
    assert "third" in done
    # one waits; a second, while it does, does not
    waiter = threading.Thread(
        target=lambda: (order.wait_turn([Step.prefill("p", 0, [1], None, 800)], far), done.append("waited"))
    )
    waiter.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    order.wait_turn([Step.prefill("p", 0, [1], None, 790)], far)
    assert time.monotonic() - t0 < 0.5 and "waited" not in done
    order.queued([Step.prefill("p", 0, [1] * 32, None, 768)])
    waiter.join(5)
    assert "waited" in done
    for i in range(6):  # bounded: the oldest sessions are forgotten
        order.queued([Step.prefill(f"o{i}", 0, [1], None, 0)])
    assert len(order._ends) == 4


@pytest.mark.model
@pytest.mark.grpc
def test_steps_sent_out_of_order_are_run_in_order_on_every_worker(smol_spec_routes):
    """Two steps of one session in separate calls, the later one first (as a pipelined stream's windows
    may arrive): every worker runs them in position order, and the answer is the one in-order steps get."""
    import threading
    import time

    route = smol_spec_routes["3 shards"]
    prompt = list(range(300, 340))
    for sid in ("in-order", "overtaken"):
        assert _prefill(route, sid, prompt, 0).outcome == pb.OUTCOME_OK
    first, second = [500, 501, 502], [503, 504]
    want = [_prefill(route, "in-order", first, 40), _prefill(route, "in-order", second, 43)]
    got = {}
    late = threading.Thread(target=lambda: got.update(second=_prefill(route, "overtaken", second, 43, follows=True)))
    late.start()
    time.sleep(0.1)
    got["first"] = _prefill(route, "overtaken", first, 40)
    late.join(30)
    for w, g in zip(want, (got["first"], got["second"])):
        assert g.outcome == pb.OUTCOME_OK, g
        assert g.token_id == w.token_id
    for k in range(3):
        held = route.stub(k).Resolve(pb.SessionRequest(session_id="overtaken"), timeout=10)
        assert held.seq_len == 45, k


@pytest.mark.model
@pytest.mark.grpc
@pytest.mark.parametrize("ranges", [[(0, 14), (15, 29)], [(0, 9), (10, 19), (20, 29)]], ids=["2 shards", "3 shards"])
@pytest.mark.slow
def test_a_long_prompts_chunks_are_pipelined_and_give_the_whole_models_tokens(embedded_model, ranges):
    from llama_shard.engine.pipeline import LocalPipeline

    from support.served_route import Route

    ids = ShardModel(str(embedded_model), (0, 0), 1).tokenize(REPEAT * 16)
    prompt, other = ids[:900], ids[:768] + ids[1000:1100]  # four chunks of 256 at most; the same first three
    whole = LocalPipeline(embedded_model, None, n_ctx=1024, n_seq_max=1, n_batch=256, n_threads=1)
    oracle = {id(p): [t for t, _ in whole.generate(p, 12)] for p in (prompt, other)}
    route = Route(
        embedded_model,
        ranges,
        extra=("--context-tokens", "1024", "--budget-tokens", "4096", "--prefix-memory", "64MiB"),
    )
    try:
        tokens, final = _tokens(route, "long", prompt, 12, max_drafts=0)
        assert tokens == oracle[id(prompt)]
        # the first chunk opens the session alone, the second starts the pipeline: the last two were
        # sent while another was in flight, and kept
        assert final.pipelined_windows == 2 and final.pipelined_kept == 2, final
        # a chunk that stores a prefix: nothing goes past it until it is back (each worker stores
        # after that step), so every worker stores, and a prompt that begins alike opens from it
        tokens, final = _tokens(route, "long-keep", prompt, 12, max_drafts=0, keep_prefix=768)
        assert tokens == oracle[id(prompt)] and final.pipelined_windows == 1, final
        assert [route.info(k).prefix_stores for k in range(len(ranges))] == [1] * len(ranges)
        tokens, final = _tokens(route, "long-open", other, 12, max_drafts=0, keep_prefix=768)
        assert tokens == oracle[id(other)] and final.prefix_tokens == 768, final
    finally:
        route.stop()


@pytest.mark.model
@pytest.mark.grpc
@pytest.mark.slow
def test_windows_sent_ahead_over_a_slow_link_keep_greedy_and_seeded_tokens(embedded_model):
    """Over a link of +20 ms each way (benchmarks/delay_proxy.py) the head keeps verification windows
    in flight (on loopback, where they seldom pay, it sends few or none): greedy and seeded streams
    give the tokens they give without drafts, with windows kept (and, as a rule, some dropped)."""
    import sys

    from conftest import REPO
    from support.served_route import Route

    sys.path.insert(0, str(REPO / "benchmarks"))
    from delay_proxy import DelayProxy

    tail = Route(embedded_model, [(15, 29)])
    try:
        with DelayProxy(tail.addresses[0], delay_s=0.02) as proxy:
            head = Route(embedded_model, [(0, 14)], extra=("--peer", proxy.address))
            head.addresses.append(proxy.address)  # its requests' forward: the tail, through the proxy
            head.ranges = [(0, 14), (15, 29)]
            try:
                vocab = ShardModel(str(embedded_model), (0, 0), 1)
                # a cycle the model goes on with (long runs accepted: windows kept), and a rewrite
                # (paraphrased in places: windows dropped)
                cycle = vocab.tokenize("Continue the list.\n" + ", ".join(["red", "green", "blue", "yellow"] * 9))
                seeded = params_to_wire(SamplingParams(seed=3, temperature=0.7, top_k=40, top_p=0.95))
                windows = kept = 0
                cases = ((cycle, None), (cycle, seeded), (vocab.tokenize(REPEAT), None))
                for i, (prompt, sampling) in enumerate(cases):
                    plain, _ = _tokens(head, f"slow-plain-{i}", prompt, 64, sampling=sampling, max_drafts=0)
                    for again in range(2):  # the second starts from the rates the first ended with
                        spec, final = _tokens(
                            head, f"slow-spec-{i}-{again}", prompt, 64, sampling=sampling, max_drafts=MAX_DRAFTS
                        )
                        assert spec == plain, (i, again)
                        assert final.accepted_tokens > 0
                        windows += final.pipelined_windows
                        kept += final.pipelined_kept
                print(f"over +20 ms each way: {windows} windows sent ahead, {kept} kept")
                assert 0 < kept <= windows, (windows, kept)  # (the rewrite's windows: some dropped, as a rule)
            finally:
                head.stop()
    finally:
        tail.stop()


def _head_loops():
    """A head's GenerationLoops on a host that runs nothing (its route loops' own parts only)."""
    import threading

    from prometheus_client import CollectorRegistry

    from llama_shard.head.generation import loops as generation
    from llama_shard.head.generation.host import HeadHost

    host = HeadHost(
        info=None,
        fingerprint="",
        context_tokens=64,
        max_sessions=2,
        warm_bytes=0,
        detokenize=None,
        security=None,
        prefixes=None,
        session_cap=None,
        stopping=threading.Event(),
        max_hop_s=1.0,
        forward_refusal=None,
        admit=None,
        caller_full=None,
        run_steps=None,
        sessions=list,
    )
    return generation, generation.GenerationLoops(host, CollectorRegistry(), max_drafts=15)


def test_a_routes_measures_outlive_its_loop():
    """A route loop ends IDLE_S after its last stream; the principal's next request down the same
    route starts from what the last one measured (step costs, windows ahead, rates), not the priors.
    The head keeps the measures of the MEASURES_KEPT most recently used routes."""
    generation, owner = _head_loops()
    route = [pb.Hop(address="127.0.0.1:1")]
    with owner.cond:
        first = owner.loop_for("alice", route, pb.DTYPE_FLOAT32)
        first.cost.observe(1, 0.110)
        first.cost.observe(1, 0.110)
        first.rates.update(4, 4)
        owner.drop_if_idle(first)
        assert not owner.loops
        again = owner.loop_for("alice", route, pb.DTYPE_FLOAT32)
        assert again is not first
        assert (again.cost, again.ahead, again.rates) == (first.cost, first.ahead, first.rates)
        assert again.cost.seconds(1) == 0.110
        other = owner.loop_for("bob", route, pb.DTYPE_FLOAT32)  # another principal's texts: its own
        assert other.cost.seconds(1) is None and other.rates.rate() < again.rates.rate()
        for i in range(generation.MEASURES_KEPT - 2):
            owner.loop_for(f"caller-{i}", route, pb.DTYPE_FLOAT32)
        owner.drop_if_idle(again)  # used last: not the oldest, though made before the others
        for i in range(2):
            owner.loop_for(f"later-{i}", route, pb.DTYPE_FLOAT32)
        owner.loops.clear()
        assert owner.loop_for("alice", route, pb.DTYPE_FLOAT32).cost.seconds(1) == 0.110
        assert owner.loop_for("bob", route, pb.DTYPE_FLOAT32).cost.seconds(1) is None  # bounded: the oldest went


def test_only_generation_steps_measure_windows_ahead():
    """A pipelined reply measures AheadTiming only for generation steps: a verification window sent
    ahead and kept (its gain), a step with one sent behind it (its slowdown). A prompt's chunks,
    whose time says nothing of a step's cost by drafts, measure nothing, and nothing counts before
    a one-token step is timed (twice: a size's first may carry the rows' comparison)."""
    from llama_shard.head.generation.positions import SentStep, Window

    _, owner = _head_loops()
    with owner.cond:
        loop = owner.loop_for("alice", [pb.Hop(address="127.0.0.1:1")], pb.DTYPE_FLOAT32)
    base = Window(10, 5, SentStep(3, True, [6, 7]), 13)
    guess = Window(13, 8, SentStep(3, True, [9, 10], in_run=True), 16, guess=True, ahead=True)
    chunk = Window(0, 1, SentStep(200, True, []), 200, ahead=True)  # a long prompt's last chunk
    for n in (1, 3):
        loop.cost.observe(n, 0.010)
    loop.pipeline.measure_ahead(guess, None, True, sent_at=0.0, arrived=0.004, arrived_before=0.001)
    loop.pipeline.measure_ahead(base, guess, True, sent_at=0.0, arrived=0.013, arrived_before=None)
    assert loop.ahead._gain is None and loop.ahead._slowdown is None  # timed once: not yet
    for n in (1, 3):
        loop.cost.observe(n, 0.010)
    loop.pipeline.measure_ahead(chunk, guess, True, sent_at=0.0, arrived=0.300, arrived_before=0.001)
    loop.pipeline.measure_ahead(base, chunk, True, sent_at=0.0, arrived=0.300, arrived_before=None)
    assert loop.ahead._gain is None and loop.ahead._slowdown is None
    loop.pipeline.measure_ahead(guess, None, True, sent_at=0.002, arrived=0.006, arrived_before=0.001)
    assert loop.ahead._gain == pytest.approx(0.010 - 0.004)  # from when it was sent, after the reply before
    loop.pipeline.measure_ahead(guess, None, False, sent_at=0.0, arrived=0.050, arrived_before=0.001)  # dropped
    assert loop.ahead._gain == pytest.approx(0.006)
    loop.pipeline.measure_ahead(base, guess, True, sent_at=0.0, arrived=0.013, arrived_before=None)
    assert loop.ahead._slowdown == pytest.approx(0.003)
