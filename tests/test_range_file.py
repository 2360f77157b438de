"""A layer range of a GGUF as a file of its own (`llama-shard extract`, engine/range_file.py): it holds
only the range's layers and what they use, records where it came from, and a worker of that range
loaded from it computes the bytes a worker loaded from the whole file computes."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from llama_shard import ShardModel
from llama_shard._native import ShardContext, model_digest
from llama_shard.engine.models import gguf_shape
from llama_shard.engine.range_file import range_of, range_tensor_names, write_range_file
from llama_shard.errors import InvalidInputError


def test_a_range_keeps_its_layers_and_what_they_use():
    names = ["token_embd.weight", "rope_freqs.weight", "output_norm.weight", "output.weight"]
    names += [f"blk.{i}.attn_q.weight" for i in range(4)]
    assert range_tensor_names(names, 4, 0, 1) == [
        "token_embd.weight",
        "rope_freqs.weight",
        "blk.0.attn_q.weight",
        "blk.1.attn_q.weight",
    ]
    assert range_tensor_names(names, 4, 2, 3) == [
        "rope_freqs.weight",
        "output_norm.weight",
        "output.weight",
        "blk.2.attn_q.weight",
        "blk.3.attn_q.weight",
    ]
    tied = [n for n in names if n != "output.weight"]  # the tail's head is the embeddings
    assert "token_embd.weight" in range_tensor_names(tied, 4, 2, 3)
    assert range_tensor_names(names, 4, 1, 2) == ["rope_freqs.weight", "blk.1.attn_q.weight", "blk.2.attn_q.weight"]


def _forward(models: list[ShardModel], tokens: list[int]) -> np.ndarray:
    contexts = [ShardContext(m, n_ctx=128, n_seq_max=1, n_batch=32, n_threads=2) for m in models]
    out = contexts[0].forward(0, 0, tokens=tokens)
    for ctx in contexts[1:]:
        out = ctx.forward(0, 0, hidden=out)
    return out


@pytest.mark.model
def test_workers_of_range_files_compute_the_whole_files_bytes(tmp_path, embedded_model):
    shape = gguf_shape(embedded_model)
    n = shape.n_layer
    cut = n // 2
    head_file = write_range_file(embedded_model, 0, cut - 1, tmp_path / "head.gguf")
    tail_file = write_range_file(embedded_model, cut, n - 1, tmp_path / "tail.gguf")
    whole_bytes = embedded_model.stat().st_size
    assert head_file.stat().st_size < 0.75 * whole_bytes and tail_file.stat().st_size < 0.75 * whole_bytes
    assert range_of(head_file) == (0, cut - 1) and range_of(embedded_model) is None
    import gguf

    source = gguf.GGUFReader(str(head_file)).get_field("llama_shard.source.digest").contents()
    assert source == model_digest(str(embedded_model))
    tokens = [1, 504, 3458, 282, 5048, 314, 28]
    from_whole = _forward(
        [ShardModel(str(embedded_model), (0, cut - 1), 2), ShardModel(str(embedded_model), (cut, n - 1), 2)], tokens
    )
    from_ranges = _forward(
        [ShardModel(str(head_file), (0, cut - 1), 2), ShardModel(str(tail_file), (cut, n - 1), 2)], tokens
    )
    assert from_ranges.tobytes() == from_whole.tobytes()
    print(
        f"\n  layers 0-{cut - 1}: {head_file.stat().st_size / 2**20:.1f} MiB, {cut}-{n - 1}: "
        f"{tail_file.stat().st_size / 2**20:.1f} MiB, of {whole_bytes / 2**20:.1f} MiB"
    )


@pytest.mark.model
def test_a_range_file_loads_its_own_range_only_and_extract_refuses_bad_ranges(tmp_path, synthetic_model):
    n = gguf_shape(synthetic_model).n_layer
    middle = write_range_file(synthetic_model, 1, 2, tmp_path / "middle.gguf")
    ShardModel(str(middle), (1, 2), 1)  # loads
    code = "import sys; from llama_shard import ShardModel; ShardModel(sys.argv[1], (0, 2), 1)"
    res = subprocess.run([sys.executable, "-c", code, str(middle)], capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and "Traceback" in res.stderr and "Fatal" not in res.stderr  # refused, not aborted
    with pytest.raises(InvalidInputError):
        write_range_file(synthetic_model, 2, n, tmp_path / "x.gguf")
    with pytest.raises(InvalidInputError):
        write_range_file(synthetic_model, 0, 0, synthetic_model)
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "llama_shard.cli",
            "extract",
            "--model",
            str(synthetic_model),
            "--layers",
            f"0-{n - 1},0-1",
            "--out",
            str(tmp_path / "y.gguf"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode == 2 and "one range" in cli.stderr
