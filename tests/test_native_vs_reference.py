"""Native engine vs the numpy reference on synthetic models: logits within the stated tolerance
(`reference.NATIVE_LOGIT_ATOL`, set from the worst case measured here), identical greedy tokens,
whole-model and across a seam. The synthetic models' greedy text varies (most 16-token runs hold
6 to 8 different tokens), so equal tokens say something."""

from __future__ import annotations

import numpy as np
import pytest

from llama_shard.engine.pipeline import LocalPipeline
from llama_shard.reference import NATIVE_LOGIT_ATOL, ReferenceModel, ReferenceShard


@pytest.fixture(scope="module")
def reference(synthetic_model) -> ReferenceModel:
    return ReferenceModel.from_gguf(synthetic_model)


def _reference_greedy(ref_shards, prompt, n_steps):
    seqs = [s.new_sequence() for s in ref_shards]

    def run(tokens):
        out = ref_shards[0].forward(seqs[0], tokens=tokens)
        for shard, seq in zip(ref_shards[1:], seqs[1:]):
            out = shard.forward(seq, hidden=out)
        return out

    logits = run(prompt)
    tokens, all_logits = [], []
    for _ in range(n_steps):
        t = int(np.argmax(logits))
        tokens.append(t)
        all_logits.append(logits)
        logits = run([t])
    return tokens, all_logits


@pytest.mark.parametrize("split", [None, [(0, 2), (3, 5)], [(0, 0), (1, 4), (5, 5)]], ids=["whole", "seam-2", "seam-3"])
@pytest.mark.parametrize("prompt", [[1, 17, 42, 99, 5], [250, 3, 3, 8]])
def test_native_matches_numpy_reference(synthetic_model, reference, split, prompt):
    ref_shards = [ReferenceShard(reference)] if split is None else [ReferenceShard(reference, a, b) for a, b in split]
    ref_tokens, ref_logits = _reference_greedy(ref_shards, prompt, 16)

    pipe = LocalPipeline(synthetic_model, split, n_ctx=256, n_seq_max=1, n_batch=32, n_threads=2)
    got = list(pipe.generate(prompt, 16))
    assert [t for t, _ in got] == ref_tokens
    assert len(set(ref_tokens)) >= 5, f"the greedy text settles into a loop: {ref_tokens}"
    worst = max(float(np.abs(a - b).max()) for (_, a), b in zip(got, ref_logits))
    print(f"split {split}, prompt {prompt}: max |native - numpy| logit difference {worst:.4f}")
    assert worst < NATIVE_LOGIT_ATOL, f"max |native - numpy| = {worst}"


@pytest.mark.parametrize(
    "model", ["synthetic_model", "synthetic_untied_f16", "synthetic_qwen2", "synthetic_qwen3", "synthetic_gemma3"]
)
def test_native_vs_numpy_over_many_prompts_teacher_forced(model, request):
    """50 random prompts, 16 steps each, both engines fed the reference's greedy token: the worst
    logit difference (the figure NATIVE_LOGIT_ATOL is set from); tokens that differ only in near
    ties (the top two logits within 2 x NATIVE_LOGIT_ATOL), and rarely; text that varies."""
    path = request.getfixturevalue(model)
    reference = ReferenceModel.from_gguf(path)
    pipe = LocalPipeline(path, None, n_ctx=256, n_seq_max=1, n_batch=32, n_threads=2)
    rng = np.random.default_rng(0)
    worst, disagreements, distinct, steps = 0.0, 0, [], 0
    for _ in range(50):
        prompt = rng.integers(0, reference.hparams.n_vocab, int(rng.integers(3, 12))).tolist()
        shard = ReferenceShard(reference)
        seq = shard.new_sequence()
        ref = shard.forward(seq, tokens=prompt)
        pipe.seq_rm(0, 0)
        pipe_logits, pos, tokens = pipe.step(0, 0, prompt), len(prompt), []
        for _ in range(16):
            token = int(np.argmax(ref))
            top2 = np.sort(ref)[-2:]
            worst = max(worst, float(np.abs(pipe_logits - ref).max()))
            if int(np.argmax(pipe_logits)) != token:
                disagreements += 1
                assert top2[1] - top2[0] <= 2 * NATIVE_LOGIT_ATOL, "tokens differ where no tolerable error explains it"
            tokens.append(token)
            steps += 1
            ref, pipe_logits, pos = shard.forward(seq, tokens=[token]), pipe.step(0, pos, [token]), pos + 1
        distinct.append(len(set(tokens)))
    print(
        f"{model}: worst |native - numpy| logit {worst:.4f} over {steps} steps; {disagreements} greedy "
        f"disagreements (near ties); distinct tokens per 16: median {np.median(distinct)}"
    )
    assert worst < NATIVE_LOGIT_ATOL
    assert np.median(distinct) >= 4, distinct
    assert disagreements <= steps // 100  # measured: 1 in 800 (a gap of 0.0003), and 0 in 800


def test_cached_reference_matches_stateless_recompute(reference):
    prompt = [1, 17, 42, 99, 5]
    stateless = reference.greedy(prompt, 12)
    cached, _ = _reference_greedy([ReferenceShard(reference, 0, 2), ReferenceShard(reference, 3, 5)], prompt, 12)
    assert cached == stateless


def test_reference_forward_checks_its_inputs(reference):
    from llama_shard.errors import InvalidInputError

    head, tail = ReferenceShard(reference, 0, 2), ReferenceShard(reference, 3, 5)
    with pytest.raises(InvalidInputError):
        tail.forward(tail.new_sequence(), tokens=[1])
    with pytest.raises(InvalidInputError):
        head.forward(head.new_sequence(), hidden=np.zeros((1, 64), np.float32))
    with pytest.raises(InvalidInputError):
        ReferenceShard(reference, 4, 2)
