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
    assert "suggested 2-shard split (by bytes): 0-2,3-5" in res.stdout
    assert "KV bytes/token (f16): 128 per layer, 768 for the whole model" in res.stdout


@pytest.mark.model
def test_compute_balanced_cut_counts_weight_elements_not_bytes(embedded_model):
    """SmolLM2 Q4_1 keeps its tied 49152 x 576 embedding in Q8_0: by bytes the LM head looks like
    14 layers and the cut lands at 22; by elements (multiply-adds per token) it is 8 layers, and
    the cut is 19 (`python benchmarks/pipeline_study.py N` times both stages there)."""
    from llama_shard.engine.models import compute_balanced_cut

    assert compute_balanced_cut(embedded_model) == 19
    res = run_cli("inspect", str(embedded_model))
    assert "compute-balanced 2-shard split (the tail also runs the LM head): 0-18,19-29" in res.stdout


def test_generate_reports_a_missing_model_clearly(tmp_path):
    res = run_cli("generate", "--model", str(tmp_path / "missing.gguf"))
    assert res.returncode == 2
    assert "error:" in res.stderr and "missing.gguf" in res.stderr


@pytest.mark.model
def test_generate_split_matches_whole_model(embedded_model):
    res = run_cli(
        "generate",
        "--split",
        "0-9,10-19,20-29",
        "--prompt",
        "The capital of France is",
        "--max-tokens",
        "16",
        "--compare-whole",
        "--threads",
        "2",
    )
    assert res.returncode == 0, res.stderr
    assert "tokens identical: True; logits bit-identical: True" in res.stderr
    assert res.stdout.strip()  # the text is the model's choice on this CPU's kernels: compared above, not named


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
    env_res = subprocess.run(
        [sys.executable, "-m", "llama_shard.cli", "serve", "--model", str(synthetic_model)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, "LLAMA_SHARD_MAX_SESSIONS": "lots"},
    )
    assert env_res.returncode == 2 and "LLAMA_SHARD_MAX_SESSIONS" in env_res.stderr


def test_a_second_worker_on_a_port_a_worker_serves_fails_to_start_and_the_first_answers_alone(synthetic_model):
    """gRPC sets SO_REUSEPORT unless told not to: a second worker bound beside the first and took a
    share of its connections (a spot check's replay then reached the other process). Now each worker
    holds its port alone, and a second start on it names the port."""
    import grpc

    from llama_shard.local_workers import start_worker, stop_worker, wait_serving
    from llama_shard.proto import shard_pb2 as pb
    from llama_shard.proto import shard_pb2_grpc as pb_grpc

    proc, address = start_worker(synthetic_model, 0, 2)
    try:
        wait_serving(proc, address)
        port = address.rsplit(":", 1)[1]
        try:  # one that binds serves on: stopped here
            res = subprocess.run(
                [sys.executable, "-m", "llama_shard.cli", "serve", "--model", str(synthetic_model), "--layers", "3-5"]
                + ["--port", port],
                capture_output=True,
                text=True,
                timeout=60,
            )
        except subprocess.TimeoutExpired:
            pytest.fail(f"a second worker started serving on port {port}, a port a worker serves")
        assert res.returncode == 2 and f"cannot bind 127.0.0.1:{port}" in res.stderr, res.stderr[-2000:]
        assert "in use by another process" in res.stderr
        # by name: where localhost names [::1] too, gRPC would bind that alone and start (check_port_free
        # tries each address first; here localhost may name 127.0.0.1 only)
        res = run_cli(
            "serve", "--model", str(synthetic_model), "--layers", "3-5", "--host", "localhost", "--port", port
        )
        assert res.returncode == 2 and f"cannot bind localhost:{port}" in res.stderr, res.stderr[-2000:]
        ranges = set()
        for _ in range(8):  # a new connection each: with a shared port some would reach the other process
            with grpc.insecure_channel(address) as ch:
                info = pb_grpc.ShardServiceStub(ch).Info(pb.InfoRequest(), timeout=10)
                ranges.add((info.first, info.last))
        assert ranges == {(0, 2)}
    finally:
        stop_worker(proc)


def test_inspect_prints_the_memory_plan(synthetic_model):
    res = run_cli(
        "inspect",
        str(synthetic_model),
        "--kv-memory",
        "1MiB",
        "--layers",
        "0-2",
        "--context-tokens",
        "300",
        "--warm-memory",
        "2MiB",
    )
    assert res.returncode == 0, res.stderr
    # 3 layers x 128 B/token (f16); a slot is padded to 512 cells (192 KiB), so 1 MiB holds 5
    assert "hot KV:   5 slots x 512 cells x 384 B/token (f16)" in res.stdout
    assert "warm KV:  2.0 MiB in host memory" in res.stdout


def test_serve_refuses_a_memory_plan_that_does_not_fit(synthetic_model):
    res = run_cli("serve", "--model", str(synthetic_model), "--kv-memory", "1KiB", "--port", "0")
    assert res.returncode == 2 and "does not fit one session of 2048 tokens" in res.stderr
    res = run_cli("serve", "--model", str(synthetic_model), "--kv-memory", "1MiB", "--max-sessions", "2", "--port", "0")
    assert res.returncode == 2 and "not both" in res.stderr
    res = run_cli("serve", "--model", str(synthetic_model), "--kv-memory", "lots", "--port", "0")
    assert res.returncode == 2 and "not a size" in res.stderr


def test_the_shipped_demo_imports_nothing_from_testing():
    """The demo is part of the product: it starts workers through llama_shard.local_workers, not the
    test helpers."""
    res = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, llama_shard.demo; print([m for m in sys.modules if m.startswith('llama_shard.testing')])",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0 and res.stdout.strip() == "[]", res.stdout + res.stderr


def test_serve_flash_attention_flag_and_its_environment_default(synthetic_model, monkeypatch, tmp_path):
    from llama_shard.cli import build_parser, serve_config
    from llama_shard.testing.synthetic import SyntheticSpec, write_synthetic_gguf

    def config(*flags):
        return serve_config(build_parser().parse_args(["serve", "--model", str(synthetic_model), *flags]), None)[0]

    assert config().flash_attn is True
    assert config("--flash-attn", "off").flash_attn is False
    monkeypatch.setenv("LLAMA_SHARD_FLASH_ATTN", "off")
    assert config().flash_attn is False and config("--flash-attn", "on").flash_attn is True
    monkeypatch.delenv("LLAMA_SHARD_FLASH_ATTN")
    head32 = write_synthetic_gguf(tmp_path / "head32.gguf", SyntheticSpec(n_layer=3, n_embd=64, n_head=2, n_head_kv=1))
    res = run_cli("serve", "--model", str(head32), "--flash-attn", "off", "--kv-type", "q8_0")
    assert res.returncode == 2 and "needs flash_attn" in res.stderr, res.stderr
