"""The command line: generate through a split and verify against the whole model; inspect."""
from __future__ import annotations

import subprocess
import sys

import pytest


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llama_shard.cli", *args], capture_output=True, text=True, timeout=300)


def test_inspect_synthetic_model(synthetic_model):
    res = run_cli("inspect", str(synthetic_model))
    assert res.returncode == 0, res.stderr
    assert "architecture:  llama" in res.stdout
    assert "suggested 2-shard split: 0-2,3-5" in res.stdout
    assert "KV bytes/token (f16): 128 per layer, 768 for the whole model" in res.stdout


@pytest.mark.model
def test_compute_balanced_cut_counts_weight_elements_not_bytes(embedded_model):
    """SmolLM2 Q4_1 keeps its tied 49152 x 576 embedding in Q8_0: by bytes the LM head looks like
    14 layers and the cut lands at 22; by elements (multiply-adds per token) it is 8 layers, and
    the cut is 19 (`python -m llama_shard.bench --pipeline-study N` times both stages there)."""
    from llama_shard.models import compute_balanced_cut

    assert compute_balanced_cut(embedded_model) == 19
    res = run_cli("inspect", str(embedded_model))
    assert "compute-balanced 2-shard split (the tail also runs the LM head): 0-18,19-29" in res.stdout


def test_generate_reports_a_missing_model_clearly(tmp_path):
    res = run_cli("generate", "--model", str(tmp_path / "missing.gguf"))
    assert res.returncode == 2
    assert "error:" in res.stderr and "missing.gguf" in res.stderr


@pytest.mark.model
def test_generate_split_matches_whole_model(embedded_model):
    res = run_cli("generate", "--split", "0-9,10-19,20-29", "--prompt", "The capital of France is",
                  "--max-tokens", "16", "--verify", "--threads", "2")
    assert res.returncode == 0, res.stderr
    assert "tokens identical: True; logits bit-identical: True" in res.stderr
    assert "Paris" in res.stdout


def test_serve_reports_bad_flags_and_a_busy_port_clearly(synthetic_model):
    import socket
    res = run_cli("serve", "--model", str(synthetic_model), "--layers", "two-five")
    assert res.returncode == 2 and "bad layer range" in res.stderr
    res = run_cli("serve", "--model", str(synthetic_model), "--layers", "0-9")
    assert res.returncode == 2 and "not inside" in res.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        res = run_cli("serve", "--model", str(synthetic_model), "--port", str(port))
    assert res.returncode == 2 and "cannot bind" in res.stderr
    env_res = subprocess.run([sys.executable, "-m", "llama_shard.cli", "serve", "--model", str(synthetic_model)],
                             capture_output=True, text=True, timeout=120,
                             env={**__import__("os").environ, "MESHNET_HOT_KV_MAX_SESSIONS": "lots"})
    assert env_res.returncode == 2 and "MESHNET_HOT_KV_MAX_SESSIONS" in env_res.stderr
