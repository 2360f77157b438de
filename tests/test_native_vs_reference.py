"""Native engine vs the numpy reference on synthetic F32 models: logits within the stated tolerance
(`reference.NATIVE_LOGIT_ATOL`), identical greedy tokens, whole-model and across a seam."""
from __future__ import annotations

import numpy as np
import pytest

from llama_shard.pipeline import LocalPipeline
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


@pytest.mark.parametrize("split", [None, [(0, 2), (3, 5)], [(0, 0), (1, 4), (5, 5)]],
                         ids=["whole", "seam-2", "seam-3"])
@pytest.mark.parametrize("prompt", [[1, 17, 42, 99, 5], [250, 3, 3, 8]])
def test_native_matches_numpy_reference(synthetic_model, reference, split, prompt):
    ref_shards = ([ReferenceShard(reference)] if split is None
                  else [ReferenceShard(reference, a, b) for a, b in split])
    ref_tokens, ref_logits = _reference_greedy(ref_shards, prompt, 16)

    pipe = LocalPipeline(synthetic_model, split, n_ctx=256, n_seq_max=1, n_batch=32, n_threads=2)
    got = list(pipe.generate(prompt, 16))
    assert [t for t, _ in got] == ref_tokens
    worst = max(float(np.abs(a - b).max()) for (_, a), b in zip(got, ref_logits))
    print(f"split {split}, prompt {prompt}: max |native - numpy| logit difference {worst:.4f}")
    assert worst < NATIVE_LOGIT_ATOL, f"max |native - numpy| = {worst}"


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
