"""The KV recipe: what a session's KV was computed with (architecture, owned layers, head shapes, K/V
type, attention kernel) and its fingerprint, which a replica, a resumed file and a hand-over must
match; the certified architectures and their aliases; the K/V types and bytes per token (the native
module's)."""

from __future__ import annotations

import dataclasses
import hashlib
import json

from .._native import certified_architectures, kv_types
from .._native import kv_bytes_per_token as native_kv_bytes_per_token
from ..errors import InvalidInputError, UncertifiedArchitectureError

# ---------------------------------------------------------------------------------------------

#: other names of certified architectures (Hugging Face class names, GGUF variants) -> the GGUF
#: name; which architectures are certified is the native module's list, certified_architectures()
ARCHITECTURE_ALIASES = {
    "llamaforcausallm": "llama",
    "dense-llama": "llama",
    "mistral": "llama",
    "mistralforcausallm": "llama",
    "qwen2forcausallm": "qwen2",
    "qwen3forcausallm": "qwen3",
    "gemma3forcausallm": "gemma3",
}

#: the K/V element types a shard's cache may use (llama.cpp's type_k/type_v; the quantized ones
#: run flash attention): the native module's list
KV_TYPES: tuple[str, ...] = tuple(kv_types())
KV_DTYPE_CANONICAL = {"float16": "f16"}


def kv_bytes_per_token(n_kv_heads: int, head_dim: int, n_layers: int, kv_type: str = "f16") -> int:
    """K and V bytes one cached token takes over n_layers (the native module's formula, with
    ggml's row sizes)."""
    kv_type = KV_DTYPE_CANONICAL.get(kv_type, kv_type)
    if kv_type not in KV_TYPES:
        raise InvalidInputError(f"kv_type must be one of {', '.join(KV_TYPES)}, got {kv_type!r}")
    return native_kv_bytes_per_token(int(n_kv_heads), int(head_dim), int(n_layers), kv_type)


def certified_architecture(name: str) -> str:
    """The canonical certified architecture for `name`, or UncertifiedArchitectureError."""
    key = str(name).strip().lower()
    canonical = ARCHITECTURE_ALIASES.get(key, key)
    if canonical not in certified_architectures():
        raise UncertifiedArchitectureError(
            f"architecture {name!r} is not certified for shard KV state (certified: "
            f"{', '.join(certified_architectures())} and their aliases)"
        )
    return canonical


@dataclasses.dataclass(frozen=True)
class KvCacheRecipe:
    """The identity of a shard's KV layout; two shards can share cached state only if compatible."""

    architecture_adapter: str
    kv_dtype: str
    n_kv_heads: int
    head_dim: int
    total_layers: int
    start_layer: int
    end_layer: int
    sliding_window: int = 0  # sliding-window layers' span (Gemma 3); 0: none
    swa_pattern: str = ""  # which layers slide, as the GGUF writes it ("": the architecture's default)
    flash_attn: bool = True  # off: V is stored transposed, another layout (and other rounding)

    def __post_init__(self):
        certified_architecture(self.architecture_adapter)  # fails closed
        if KV_DTYPE_CANONICAL.get(self.kv_dtype, self.kv_dtype) not in KV_TYPES:
            raise InvalidInputError(f"unknown kv dtype {self.kv_dtype!r}")
        if (
            not (0 <= self.start_layer <= self.end_layer < self.total_layers)
            or self.n_kv_heads < 1
            or self.head_dim < 1
        ):
            raise InvalidInputError(f"inconsistent KV recipe {self}")

    @property
    def owned_layers(self) -> tuple[int, ...]:
        return tuple(range(self.start_layer, self.end_layer + 1))

    def canonical(self) -> dict:
        return {
            "architecture": certified_architecture(self.architecture_adapter),
            "kv_dtype": KV_DTYPE_CANONICAL.get(self.kv_dtype, self.kv_dtype),
            "n_kv_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "total_layers": self.total_layers,
            "start_layer": self.start_layer,
            "end_layer": self.end_layer,
            # only models with sliding-window layers carry these: others keep their fingerprints
            **({"sliding_window": self.sliding_window, "swa_pattern": self.swa_pattern} if self.sliding_window else {}),
            # only without flash attention (the default keeps its fingerprints)
            **({} if self.flash_attn else {"flash_attn": False}),
        }

    def fingerprint(self) -> str:
        blob = json.dumps(self.canonical(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()

    def is_compatible(self, other: "KvCacheRecipe") -> bool:
        return self.fingerprint() == other.fingerprint()

    def bytes_per_token(self) -> int:
        """K and V bytes per cached token over the owned layers."""
        return kv_bytes_per_token(self.n_kv_heads, self.head_dim, len(self.owned_layers), self.kv_dtype)


def kv_recipe_for(shard, kv_type: str | None = None, flash_attn: bool = True) -> KvCacheRecipe:
    """The recipe of a native `ShardModel` or a reference shard (anything with the same info)
    whose cache uses `kv_type` (None: the model's default, f16), with or without flash attention."""
    info = shard.info
    return KvCacheRecipe(
        architecture_adapter=info.architecture,
        kv_dtype=kv_type or info.kv_dtype,
        n_kv_heads=info.n_head_kv,
        head_dim=info.head_dim,
        total_layers=info.n_layer,
        start_layer=info.first,
        end_layer=info.last,
        sliding_window=info.sliding_window,
        swa_pattern=info.swa_pattern,
        flash_attn=flash_attn,
    )


# ---------------------------------------------------------------------------------------------
# argument checks shared by every manager (before anything reaches an engine)
# ---------------------------------------------------------------------------------------------
