"""Split vs whole on the patched llama.cpp is bit-exact (synthetic models and SmolLM2)."""

from __future__ import annotations

import numpy as np
import pytest

from llama_shard import ShardContext, ShardModel
from llama_shard.engine.pipeline import LocalPipeline


def layouts(n_layer: int) -> list[list[tuple[int, int]]]:
    L = n_layer
    return [
        [(0, 0), (1, L - 1)],  # one-layer head
        [(0, L // 2 - 1), (L // 2, L - 1)],  # half / half
        [(0, L - 2), (L - 1, L - 1)],  # one-layer tail
        [(0, 0), (1, L - 2), (L - 1, L - 1)],  # one-layer shards at both ends
        [(0, 1), (2, 3), (4, L - 1)],  # three even-ish shards
    ]


def _probe_hidden(path, last, seq_calls):
    """Hidden state after layer `last`, computed by a head shard that ends there, for the same calls."""
    head = ShardModel(str(path), (0, last), 2)
    ctx = ShardContext(head, n_ctx=256, n_seq_max=2, n_batch=32)
    return [ctx.forward(seq, pos, tokens=toks) for seq, pos, toks in seq_calls]


@pytest.mark.parametrize(
    "model_fixture",
    ["synthetic_model", "synthetic_untied_f16", "synthetic_qwen2", "synthetic_qwen3", "synthetic_gemma3"],
)
def test_split_matches_whole_bit_for_bit(request, model_fixture):
    path = request.getfixturevalue(model_fixture)
    whole = LocalPipeline(path, None, n_ctx=256, n_seq_max=2, n_batch=32, n_threads=2)
    n_layer = whole.head.info.n_layer
    prompts = {0: [1, 17, 42, 99, 5, 250, 3], 1: [7, 300, 12, 64, 128]}

    # the whole model's calls: two sequences interleaved, prefill then 16 greedy decode steps
    calls, ref_logits = [], []
    pending, pos = dict(prompts), {0: 0, 1: 0}
    for _ in range(17):
        for seq in (0, 1):
            logits = whole.step(seq, pos[seq], pending[seq])
            calls.append((seq, pos[seq], pending[seq]))
            ref_logits.append(logits)
            pos[seq] += len(pending[seq])
            pending[seq] = [int(np.argmax(logits))]

    for layout in layouts(n_layer):
        pipe = LocalPipeline(path, layout, n_ctx=256, n_seq_max=2, n_batch=32, n_threads=2)
        got_boundaries: list[list[np.ndarray]] = []
        for (seq, p, toks), ref in zip(calls, ref_logits):
            b: list[np.ndarray] = []
            got = pipe.step(seq, p, toks, boundaries=b)
            assert got.tobytes() == ref.tobytes(), f"tail logits differ for layout {layout}"
            got_boundaries.append(b)
        for i, (_, last) in enumerate(layout[:-1]):
            probe = _probe_hidden(path, last, calls)
            for step, (exp, got) in enumerate(zip(probe, (b[i] for b in got_boundaries))):
                assert exp.dtype == np.float32 and exp.shape == got.shape
                assert exp.tobytes() == got.tobytes(), f"boundary after layer {last} differs at call {step} ({layout})"


@pytest.mark.model
@pytest.mark.parametrize(
    "split, flash_attn",
    [([(0, 14), (15, 29)], True), ([(0, 9), (10, 19), (20, 29)], True), ([(0, 14), (15, 29)], False)],
    ids=["2-shard", "3-shard", "2-shard-flash-attn-off"],
)
def test_smollm2_split_generates_the_whole_models_tokens(embedded_model, split, flash_attn):
    whole = LocalPipeline(embedded_model, None, n_ctx=512, n_seq_max=1, n_batch=128, n_threads=2, flash_attn=flash_attn)
    pipe = LocalPipeline(embedded_model, split, n_ctx=512, n_seq_max=1, n_batch=128, n_threads=2, flash_attn=flash_attn)
    prompts = [
        "The capital of France is",
        "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
        "def fibonacci(n):",
    ]
    for text in prompts:
        ids = whole.head.tokenize(text)
        ref = list(whole.generate(ids, 32))
        got = list(pipe.generate(ids, 32))
        assert [t for t, _ in got] == [t for t, _ in ref], text
        for (_, a), (_, b) in zip(ref, got):
            assert a.tobytes() == b.tobytes(), "logits are not bit-identical"


@pytest.mark.parametrize("model_fixture", ["synthetic_model", "synthetic_gemma3"])
def test_without_flash_attention_split_matches_whole_bit_for_bit(request, model_fixture):
    """`--flash-attn off` (V stored transposed, llama.cpp's plain attention kernels) keeps split
    equal to whole at equal settings; the setting reaches llama.cpp (the logits round differently
    from flash attention's, within float noise)."""
    path = request.getfixturevalue(model_fixture)
    n_layer = LocalPipeline(path, None, n_ctx=256, n_seq_max=1, n_batch=32).head.info.n_layer
    flash = LocalPipeline(path, None, n_ctx=256, n_seq_max=1, n_batch=32, n_threads=2)
    whole = LocalPipeline(path, None, n_ctx=256, n_seq_max=1, n_batch=32, n_threads=2, flash_attn=False)
    split = LocalPipeline(
        path,
        [(0, n_layer // 2 - 1), (n_layer // 2, n_layer - 1)],
        n_ctx=256,
        n_seq_max=1,
        n_batch=32,
        n_threads=2,
        flash_attn=False,
    )
    pos, pending, differs = 0, [1, 17, 42, 99, 5, 250, 3, 8, 19, 77], False
    for _ in range(24):
        ref, got, fa = (p.step(0, pos, pending) for p in (whole, split, flash))
        assert got.tobytes() == ref.tobytes(), f"split logits differ from whole at position {pos}"
        np.testing.assert_allclose(fa, ref, rtol=0, atol=1e-2 * float(np.abs(ref).max()))
        differs |= fa.tobytes() != ref.tobytes()
        pos += len(pending)
        pending = [int(np.argmax(ref))]
    assert differs, "flash attention on and off gave the same bytes: the setting did not reach llama.cpp"
