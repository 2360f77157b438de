"""One rule, one place: the sampling parameters' ranges are the native check's alone, asked once per
session's parameters on each shard; the CLI's numeric flags are checked as they are parsed; the old
spellings of renamed flags still work and say so."""

from __future__ import annotations

import subprocess
import sys

import pytest

from llama_shard._native import SamplingParams
from llama_shard.errors import InvalidInputError
from llama_shard.proto import shard_pb2 as pb
from llama_shard.proto.requests import (
    SAMPLING_PARAMETERS,
    check_max_drafts,
    check_stops,
    check_top_logprobs,
    sampling_from_wire,
    sampling_to_wire,
)
from llama_shard.worker.sampling import StepSamplingChecks


def test_the_native_check_names_each_parameter_it_refuses():
    bad = {
        "temperature": -1.0,
        "top_k": 5000,
        "top_p": 0.0,
        "min_p": 2.0,
        "penalty_last_n": -1,
        "penalty_repeat": 0.0,
        "penalty_freq": 500.0,
        "penalty_present": -500.0,
    }
    assert {p.native for p in SAMPLING_PARAMETERS} == set(bad)
    for p in SAMPLING_PARAMETERS:
        params = SamplingParams(seed=1, **{p.native: bad[p.native]})
        field, why = params.problem(4096, 64)
        assert field == p.native and why
        with pytest.raises(InvalidInputError) as e:
            sampling_from_wire(sampling_to_wire(params), 4096, 64)
        assert e.value.param == p.wire
    assert SamplingParams(seed=1).problem(4096, 64) is None
    assert SamplingParams(seed=0xFFFFFFFF).problem(4096, 64)[0] == "seed"


def test_the_request_bounds_name_their_field():
    for call, field in (
        (lambda: check_top_logprobs(21), "top_logprobs"),
        (lambda: check_max_drafts(-1), "max_drafts"),
        (lambda: check_stops(["a"] * 17, [], 10), "stop"),
        (lambda: check_stops([""], [], 10), "stop"),
        (lambda: check_stops([], [10], 10), "stop_token_ids"),
    ):
        with pytest.raises(InvalidInputError) as e:
            call()
        assert e.value.param == field
    check_top_logprobs(20), check_max_drafts(0), check_stops(["x" * 256] * 16, list(range(10)), 10)


def test_a_sessions_parameters_are_checked_once_and_its_state_at_every_step():
    checks = StepSamplingChecks(n_vocab=100, max_window=64, capacity=2)
    wire = sampling_to_wire(SamplingParams(seed=3, temperature=0.7, penalty_last_n=4))
    step = pb.StepRequest(sampler=pb.SamplerState(params=wire, draws=0, recent=[1, 2]))
    for draws in range(5):
        step.sampler.draws = draws
        assert checks.params(("a", 0), step).temperature == pytest.approx(0.7)
    assert checks.native_checks == 1
    step.sampler.recent.extend([3, 4, 5])  # more recent tokens than the window: the state, checked every step
    with pytest.raises(InvalidInputError, match="recent tokens"):
        checks.params(("a", 0), step)
    del step.sampler.recent[2:]
    step.sampler.params.temperature = 0.9  # new parameters for the session: checked again
    checks.params(("a", 0), step)
    assert checks.native_checks == 2
    step.sampler.params.temperature = -3.0
    with pytest.raises(InvalidInputError) as e:
        checks.params(("a", 0), step)
    assert e.value.param == "temperature"
    for key in ("b", "c", "a"):  # bounded: the oldest is dropped, then checked again
        step.sampler.params.temperature = 0.9
        checks.params((key, 0), step)
    assert checks.native_checks == 5
    assert checks.params(("x", 0), pb.StepRequest()) is None


def test_a_grammar_verdict_counts_only_for_the_model_it_was_made_for(synthetic_model):
    """The parser's verdicts are kept per model, weakly: another model's verdict on the same text is
    not this one's, and a model that is gone takes its verdicts with it (an id reused by a new model
    finds none)."""
    import gc

    from llama_shard import ShardModel
    from llama_shard.structured import checks

    bad = SamplingParams(grammar='root ::= "a" (')
    model = ShardModel(str(synthetic_model), (0, 0), 1)
    with pytest.raises(InvalidInputError, match="grammar"):
        checks.check_grammar(bad, model)
    assert checks._verdicts[model][bad.grammar] is not None
    other = ShardModel(str(synthetic_model), (0, 0), 1)
    assert other not in checks._verdicts  # its own parse, when it is asked
    before = len(checks._verdicts)
    del model
    gc.collect()
    assert len(checks._verdicts) == before - 1


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llama_shard.cli", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--temperature", "-1"),
        ("--temperature", "nan"),
        ("--top-p", "0"),
        ("--repeat-last-n", "-3"),
        ("--top-k", "99999999999"),
        ("--repeat-penalty", "0"),
        ("--seed", "4294967295"),
    ],
)
def test_every_sampling_flag_is_checked_as_it_is_parsed(flag, value):
    res = _cli("generate", flag, value, "--model", "/nonexistent.gguf")
    assert res.returncode == 2 and flag in res.stderr, res.stderr
    assert "nonexistent" not in res.stderr  # refused before any model is looked for


@pytest.mark.parametrize(
    "args",
    [
        ("serve", "--warm-memory", "lots"),
        ("serve", "--kv-memory", "-1"),
        ("serve", "--prefix-memory", "1XB"),
        ("serve", "--gather-ms", "5000"),
        ("serve", "--max-drafts", "99"),
        ("inspect", "--kv-memory", "x"),
        ("generate", "--context-tokens", "99999999"),
    ],
)
def test_size_and_count_flags_are_checked_as_they_are_parsed(args):
    model = ("/nonexistent.gguf",) if args[0] == "inspect" else ("--model", "/nonexistent.gguf")
    res = _cli(*args, *model)
    assert res.returncode == 2 and args[1] in res.stderr, res.stderr
    assert "nonexistent" not in res.stderr  # refused before any model is looked for


def test_old_flag_spellings_work_and_warn():
    res = _cli("inspect", "--memory", "64MiB")
    assert res.returncode == 0 and "--memory is deprecated; use --kv-memory" in res.stderr
    assert "memory plan" in res.stdout
    res = _cli("serve", "--verify", "sideways")
    assert res.returncode == 2 and "sideways" in res.stderr
    res = _cli("generate", "--ctx", "0")
    assert res.returncode == 2 and "--ctx" in res.stderr
