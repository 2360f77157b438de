"""The pure-numpy executable specification of shard execution.

`ReferenceModel` reads the same GGUF file as the native engine with the `gguf` package
(quantized tensors are dequantized) and implements llama, qwen2 (q/k/v biases), qwen3 (q/k norms)
and gemma3 (scaled embedding, sliding-window layers with their own RoPE base, GELU, post norms,
soft-capping): RMSNorm, grouped-query attention, llama.cpp's RoPE convention for the architecture
(adjacent pairs for `llama`, halves for the others), SwiGLU, tied or untied LM head, eps and rope
theta from the file. It has a stateless whole-model forward and, through
`ReferenceShard`, a KV-cached forward over a layer range with the same boundary contract as the
native engine: the head embeds tokens, non-tail shards return the unnormalized residual of every
token, the tail normalizes and returns logits.

Numerics: computation is float64; K and V are rounded through float16 when cached, as the native
engine's f16 KV cache does. The stated tolerance against llama.cpp is `NATIVE_LOGIT_ATOL`
(absolute, on logits); greedy tokens are identical wherever the reference's two best logits are
further apart than twice that (a difference within the tolerance cannot swap them).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

from .._native import kv_bytes_per_token
from ..errors import InvalidInputError, ModelLoadError, UncertifiedArchitectureError
from .engine import ReferenceHotKvEngine
from .sequences import SequenceKv
from .step_loop import ReferenceStepLoop

#: absolute tolerance on logits between the native engine and this reference on the synthetic
#: models. Measured (tests/test_native_vs_reference.py, 50 random prompts x 16 teacher-forced steps
#: each, 2 CPUs with AVX-512): worst 0.0069 (llama, F32), 0.0093 (llama, F16, untied), 0.0082
#: (qwen2), 0.0079 (qwen3, F16), 0.0051 (gemma3, a 4-token sliding window); the tolerance is about
#: twice the worst, for other CPUs' kernels (other SIMD paths sum in other orders).
NATIVE_LOGIT_ATOL = 2e-2

#: architectures this reference implements (their RoPE convention and tensor layout)
REFERENCE_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")
#: architectures whose RoPE rotates the two halves of each head (llama.cpp's NEOX convention);
#: llama rotates adjacent pairs
NEOX_ROPE = ("qwen2", "qwen3", "gemma3")


@dataclasses.dataclass(frozen=True)
class ReferenceHparams:
    architecture: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_vocab: int
    rms_eps: float
    rope_theta: float
    # Gemma 3: sliding-window layers (every 6th layer global unless the file says otherwise), their
    # own RoPE base, and the final logit soft-cap (0: none)
    sliding_window: int = 0
    swa_layers: tuple[bool, ...] = ()
    rope_theta_swa: float = 10000.0
    logit_softcap: float = 0.0
    swa_pattern: str = ""  # the file's pattern key as llama.cpp prints it ("": absent), part of the KV recipe


def _field_value(reader: GGUFReader, key: str, default=None):
    field = reader.get_field(key)
    if field is None:
        return default
    return field.contents()


@dataclasses.dataclass
class LayerWeights:
    attn_norm: np.ndarray
    wq: np.ndarray
    wk: np.ndarray
    wv: np.ndarray
    wo: np.ndarray
    ffn_norm: np.ndarray
    w_gate: np.ndarray
    w_up: np.ndarray
    w_down: np.ndarray
    bq: np.ndarray | None = None  # qwen2: projection biases
    bk: np.ndarray | None = None
    bv: np.ndarray | None = None
    q_norm: np.ndarray | None = None  # qwen3, gemma3: RMS norm over each head of q and k
    k_norm: np.ndarray | None = None
    post_attn_norm: np.ndarray | None = None  # gemma3: norms on the attention and MLP outputs
    post_ffn_norm: np.ndarray | None = None


def _gguf_text(value) -> str:
    """A GGUF value as llama.cpp's gguf_kv_to_str prints it (integers, booleans, arrays of them)."""
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_gguf_text(v) for v in value) + "]"
    if isinstance(value, (bool, np.bool_)):
        return "true" if value else "false"
    return str(int(value))


def _gemma3_hparams(reader: GGUFReader, n_layer: int) -> dict:
    """Gemma 3's sliding window as llama.cpp reads it: every 6th layer global unless the file
    gives a pattern (a period, or a per-layer list)."""
    window = int(_field_value(reader, "gemma3.attention.sliding_window", 0))
    written = _field_value(reader, "gemma3.attention.sliding_window_pattern")
    pattern = 6 if written is None else written
    if isinstance(pattern, (list, tuple)):
        swa = tuple(bool(x) for x in pattern)[:n_layer]
    else:
        period = int(pattern)
        swa = tuple(period == 0 or il % period < period - 1 for il in range(n_layer))
    return {
        "sliding_window": window,
        "swa_layers": swa if window > 0 else (),
        "rope_theta_swa": float(_field_value(reader, "gemma3.rope.freq_base_swa", 10000.0)),
        "logit_softcap": float(_field_value(reader, "gemma3.final_logit_softcapping", 0.0)),
        "swa_pattern": "" if written is None else _gguf_text(written),
    }


class ReferenceModel:
    """A dense Llama read from a GGUF file; weights as float64 numpy arrays (numpy row-major order)."""

    def __init__(
        self,
        hparams: ReferenceHparams,
        tok_embd: np.ndarray,
        layers: list[LayerWeights],
        output_norm: np.ndarray,
        output: np.ndarray,
    ):
        self.hparams = hparams
        self.tok_embd = tok_embd
        self.layers = layers
        self.output_norm = output_norm
        self.output = output
        self.path: Path | None = None  # the GGUF file, when read from one

    @classmethod
    def from_gguf(cls, path: str | Path) -> "ReferenceModel":
        path = Path(path)
        if not path.is_file():
            raise ModelLoadError(f"model file not found: {path}")
        reader = GGUFReader(str(path))
        arch = _field_value(reader, "general.architecture")
        if arch not in REFERENCE_ARCHITECTURES:
            raise UncertifiedArchitectureError(
                f"the numpy reference implements {REFERENCE_ARCHITECTURES}, not {arch!r}"
            )
        tensors = {t.name: t for t in reader.tensors}

        def get(name: str) -> np.ndarray:
            t = tensors[name]
            return np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float64)

        def maybe(name: str) -> np.ndarray | None:
            return get(name) if name in tensors else None

        n_layer = int(_field_value(reader, f"{arch}.block_count"))
        n_embd = int(_field_value(reader, f"{arch}.embedding_length"))
        n_head = int(_field_value(reader, f"{arch}.attention.head_count"))
        n_head_kv = int(_field_value(reader, f"{arch}.attention.head_count_kv", n_head))
        head_dim = int(_field_value(reader, f"{arch}.attention.key_length", n_embd // n_head))
        tok_embd = get("token_embd.weight")
        hp = ReferenceHparams(
            architecture=arch,
            n_layer=n_layer,
            n_embd=n_embd,
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            n_ff=int(_field_value(reader, f"{arch}.feed_forward_length")),
            n_vocab=tok_embd.shape[0],
            rms_eps=float(_field_value(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
            rope_theta=float(_field_value(reader, f"{arch}.rope.freq_base", 10000.0)),
            **(_gemma3_hparams(reader, n_layer) if arch == "gemma3" else {}),
        )
        layers = []
        for il in range(n_layer):
            p = f"blk.{il}."
            layers.append(
                LayerWeights(
                    attn_norm=get(p + "attn_norm.weight"),
                    wq=get(p + "attn_q.weight"),
                    wk=get(p + "attn_k.weight"),
                    wv=get(p + "attn_v.weight"),
                    wo=get(p + "attn_output.weight"),
                    ffn_norm=get(p + "ffn_norm.weight"),
                    w_gate=get(p + "ffn_gate.weight"),
                    w_up=get(p + "ffn_up.weight"),
                    w_down=get(p + "ffn_down.weight"),
                    bq=maybe(p + "attn_q.bias"),
                    bk=maybe(p + "attn_k.bias"),
                    bv=maybe(p + "attn_v.bias"),
                    q_norm=maybe(p + "attn_q_norm.weight"),
                    k_norm=maybe(p + "attn_k_norm.weight"),
                    post_attn_norm=maybe(p + "post_attention_norm.weight"),
                    post_ffn_norm=maybe(p + "post_ffw_norm.weight"),
                )
            )
        output = get("output.weight") if "output.weight" in tensors else tok_embd
        model = cls(hp, tok_embd, layers, get("output_norm.weight"), output)
        model.path = path
        return model

    # --- building blocks ---------------------------------------------------------------------

    def rms_norm(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.hparams.rms_eps) * weight

    def rope(self, x: np.ndarray, positions: np.ndarray, theta: float | None = None) -> np.ndarray:
        """llama.cpp's RoPE for the architecture: `llama` rotates adjacent pairs (x[2i], x[2i+1]),
        the NEOX convention (qwen2, qwen3) pairs x[i] with x[i + head_dim/2]."""
        hd = x.shape[-1]
        inv_freq = (theta or self.hparams.rope_theta) ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
        angles = positions[:, None].astype(np.float64) * inv_freq[None, :]  # (n, hd/2)
        cos = np.cos(angles)[:, None, :]
        sin = np.sin(angles)[:, None, :]
        first, second = (
            (slice(0, hd // 2), slice(hd // 2, hd))
            if self.hparams.architecture in NEOX_ROPE
            else (slice(0, hd, 2), slice(1, hd, 2))
        )
        x0, x1 = x[..., first], x[..., second]
        out = np.empty_like(x)
        out[..., first] = x0 * cos - x1 * sin
        out[..., second] = x0 * sin + x1 * cos
        return out

    def embed(self, tokens) -> np.ndarray:
        ids = np.asarray(tokens, dtype=np.int64)
        if ids.ndim != 1 or ids.size == 0 or ids.min() < 0 or ids.max() >= self.hparams.n_vocab:
            raise InvalidInputError("tokens must be a non-empty 1-D sequence of ids inside the vocabulary")
        if self.hparams.architecture == "gemma3":  # Gemma scales its embeddings by sqrt(n_embd)
            return self.tok_embd[ids] * np.sqrt(np.float32(self.hparams.n_embd))
        return self.tok_embd[ids]

    def layer(
        self,
        il: int,
        x: np.ndarray,
        positions: np.ndarray,
        past_k: np.ndarray | None = None,
        past_v: np.ndarray | None = None,
        kv_round=np.float16,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One transformer block over rows `x` at absolute `positions`.

        Attends to `past_k`/`past_v` (n_past, n_head_kv, head_dim) followed by the new rows, with a
        causal mask on absolute positions. Returns (x_out, k_new, v_new); k_new/v_new are the new
        rows' position-encoded K and V as cached (rounded through `kv_round`).
        """
        hp = self.hparams
        w = self.layers[il]
        n = x.shape[0]
        h = self.rms_norm(x, w.attn_norm)
        q, k, v = h @ w.wq.T, h @ w.wk.T, h @ w.wv.T
        if w.bq is not None:  # qwen2
            q, k, v = q + w.bq, k + w.bk, v + w.bv
        q = q.reshape(n, hp.n_head, hp.head_dim)
        k = k.reshape(n, hp.n_head_kv, hp.head_dim)
        v = v.reshape(n, hp.n_head_kv, hp.head_dim)
        if w.q_norm is not None:  # qwen3, gemma3: each head normalised before RoPE
            q, k = self.rms_norm(q, w.q_norm), self.rms_norm(k, w.k_norm)
        sliding = bool(hp.swa_layers) and hp.swa_layers[il]
        theta = hp.rope_theta_swa if sliding else hp.rope_theta
        q = self.rope(q, positions, theta)
        k = self.rope(k, positions, theta)
        if kv_round is not None:
            k = k.astype(kv_round).astype(np.float64)
            v = v.astype(kv_round).astype(np.float64)
        if past_k is not None and past_k.shape[0] > 0:
            keys = np.concatenate([past_k, k], axis=0)
            values = np.concatenate([past_v, v], axis=0)
            n_past = past_k.shape[0]
        else:
            keys, values, n_past = k, v, 0
        key_pos = np.concatenate([np.arange(n_past), positions])
        group = hp.n_head // hp.n_head_kv
        keys_h = np.repeat(keys, group, axis=1)  # (n_kv_total, n_head, hd)
        values_h = np.repeat(values, group, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, keys_h) / np.sqrt(hp.head_dim)
        mask = key_pos[None, :] > positions[:, None]  # (n, n_kv_total)
        if sliding:  # a sliding-window layer sees the last sliding_window positions only
            mask |= positions[:, None] - key_pos[None, :] >= hp.sliding_window
        scores = np.where(mask[None, :, :], -np.inf, scores)
        scores -= scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        attn = np.einsum("hqk,khd->qhd", probs, values_h).reshape(n, hp.n_head * hp.head_dim) @ w.wo.T
        if w.post_attn_norm is not None:  # gemma3
            attn = self.rms_norm(attn, w.post_attn_norm)
        x = x + attn
        h2 = self.rms_norm(x, w.ffn_norm)
        gate = h2 @ w.w_gate.T
        if hp.architecture == "gemma3":  # GELU (tanh form, as ggml's) instead of SiLU
            act = 0.5 * gate * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (gate + 0.044715 * gate**3)))
        else:
            act = gate / (1.0 + np.exp(-gate))
        ffn = (act * (h2 @ w.w_up.T)) @ w.w_down.T
        if w.post_ffn_norm is not None:
            ffn = self.rms_norm(ffn, w.post_ffn_norm)
        return x + ffn, k, v

    def lm_head(self, x: np.ndarray) -> np.ndarray:
        logits = self.rms_norm(x, self.output_norm) @ self.output.T
        cap = self.hparams.logit_softcap
        return np.tanh(logits / cap) * cap if cap else logits

    # --- whole-model, stateless ----------------------------------------------------------------

    def forward(self, tokens) -> np.ndarray:
        """Logits (n_tokens, n_vocab) of every position, recomputed from scratch (no cache)."""
        x = self.embed(tokens)
        positions = np.arange(x.shape[0])
        for il in range(self.hparams.n_layer):
            x, _, _ = self.layer(il, x, positions)
        return self.lm_head(x)

    def greedy(self, prompt, n_steps: int) -> list[int]:
        """Greedy continuation by stateless recompute: the slow, obviously-correct oracle."""
        seq = list(prompt)
        out = []
        for _ in range(n_steps):
            nxt = int(np.argmax(self.forward(seq)[-1]))
            out.append(nxt)
            seq.append(nxt)
        return out


@dataclasses.dataclass(frozen=True)
class ReferenceShardInfo:
    architecture: str
    n_layer: int
    first: int
    last: int
    is_head: bool
    is_tail: bool
    n_embd: int
    n_vocab: int
    n_head: int
    n_head_kv: int
    head_dim: int
    kv_dtype: str
    kv_bytes_per_token: int
    sliding_window: int
    swa_pattern: str


class ReferenceShard:
    """KV-cached execution of layers [first, last] with the native engine's boundary contract."""

    def hot_kv_engine(self, engine_config, max_step_sessions: int | None, prefill_chunk: int):
        """(engine, step loop) for a HotKvStateManager over this shard: the reference brings its own
        engine (the manager names none, so the engine package never imports the reference)."""
        engine = ReferenceHotKvEngine(self, engine_config)
        return engine, ReferenceStepLoop(engine, max_step_sessions, prefill_chunk)

    def __init__(self, model: ReferenceModel, first: int | None = None, last: int | None = None):
        n_layer = model.hparams.n_layer
        first = 0 if first is None else first
        last = n_layer - 1 if last is None else last
        if not 0 <= first <= last < n_layer:
            raise InvalidInputError(f"layer range [{first}, {last}] is not inside [0, {n_layer - 1}]")
        self.model = model
        self.first = first
        self.last = last
        self.is_head = first == 0
        self.is_tail = last == n_layer - 1

    @property
    def owned_layers(self) -> range:
        return range(self.first, self.last + 1)

    @property
    def info(self) -> "ReferenceShardInfo":
        """The same description the native `ShardModel.info` gives (fields used by the contract)."""
        hp = self.model.hparams
        return ReferenceShardInfo(
            architecture=hp.architecture,
            n_layer=hp.n_layer,
            first=self.first,
            last=self.last,
            is_head=self.is_head,
            is_tail=self.is_tail,
            n_embd=hp.n_embd,
            n_vocab=hp.n_vocab,
            n_head=hp.n_head,
            n_head_kv=hp.n_head_kv,
            head_dim=hp.head_dim,
            kv_dtype="f16",
            kv_bytes_per_token=kv_bytes_per_token(hp.n_head_kv, hp.head_dim, self.last - self.first + 1, "f16"),
            sliding_window=hp.sliding_window,
            swa_pattern=hp.swa_pattern,
        )

    def new_sequence(self) -> SequenceKv:
        hp = self.model.hparams
        return SequenceKv(hp.n_head_kv, hp.head_dim, self.owned_layers)

    def forward(self, seq: SequenceKv, tokens=None, hidden: np.ndarray | None = None, n_logits: int = 1) -> np.ndarray:
        """Appends the input to `seq` and returns residual rows (non-tail) or the last n_logits tokens'
        logits, flat (tail)."""
        if (tokens is None) == (hidden is None):
            raise InvalidInputError("pass exactly one of tokens or hidden")
        if tokens is not None:
            if not self.is_head:
                raise InvalidInputError("token ids sent to a non-head shard")
            x = self.model.embed(tokens)
        else:
            if self.is_head:
                raise InvalidInputError("hidden state sent to the head shard")
            x = np.asarray(hidden, dtype=np.float64)
            if x.ndim != 2 or x.shape[1] != self.model.hparams.n_embd or x.shape[0] == 0:
                raise InvalidInputError(f"hidden must have shape (n_tokens, {self.model.hparams.n_embd})")
        start = seq.seq_len
        positions = np.arange(start, start + x.shape[0])
        new_layers = {}
        for il in self.owned_layers:
            past_k, past_v = seq.layers[il]
            x, k, v = self.model.layer(il, x, positions, past_k, past_v)
            new_layers[il] = (np.concatenate([past_k, k]), np.concatenate([past_v, v]))
        seq.layers = new_layers  # committed only once every layer succeeded
        if self.is_tail:
            return self.model.lm_head(x[-n_logits:]).astype(np.float32).reshape(-1)
        return x.astype(np.float32)
