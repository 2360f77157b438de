"""Synthetic random dense-Llama GGUF files for tests: download-free, fast, deterministic.

Written with the `gguf` package. The tokenizer model is `none` with `llama.vocab_size` dummy tokens,
so llama.cpp accepts token ids in [0, n_vocab) but cannot tokenize text.

Also runnable as a script (the CTest fixture uses it; it imports nothing from llama_shard):

    python synthetic.py OUT.gguf [--layers 6 --embd 64 --heads 4 --kv-heads 2 --vocab 320 --f16 --untied]
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import numpy as np
from gguf import GGUFWriter


@dataclasses.dataclass(frozen=True)
class SyntheticSpec:
    """Shape of a synthetic dense-Llama model."""

    n_layer: int = 6
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2  # GQA ratio n_head / n_head_kv
    n_ff: int = 128
    n_vocab: int = 320
    n_ctx_train: int = 2048
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    tied_embeddings: bool = True
    f16: bool = False  # store matrices as F16 (norms stay F32, as converters do)
    seed: int = 1234
    embd_scale: float = 0.1  # small next to the layers' contributions, so greedy text is not a copy of its input
    architecture: str = "llama"  # qwen2 adds q/k/v biases, qwen3 q/k norms, gemma3 its own block (below);
    #                              another name writes llama's tensors
    sliding_window: int = 4  # gemma3: the window of its sliding-window layers (every 6th layer is global)
    logit_softcap: float = 0.0  # gemma3: final logit soft-capping (0: none)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


def write_synthetic_gguf(path: str | Path, spec: SyntheticSpec = SyntheticSpec()) -> Path:
    """Write a random GGUF described by `spec` to `path` and return the path: a dense Llama, or
    with spec.architecture qwen2 / qwen3 the tensors those architectures add."""
    if spec.n_embd % spec.n_head or spec.n_head % spec.n_head_kv:
        raise ValueError("n_embd must divide by n_head and n_head by n_head_kv")
    path = Path(path)
    rng = np.random.default_rng(spec.seed)
    hd = spec.head_dim
    arch = spec.architecture
    mat_dtype = np.float16 if spec.f16 else np.float32

    def mat(rows: int, cols: int, scale: float | None = None) -> np.ndarray:
        s = scale if scale is not None else 1.0 / np.sqrt(cols)
        return (rng.standard_normal((rows, cols)) * s).astype(mat_dtype)

    def norm_weight(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w = GGUFWriter(str(path), arch)
    w.add_name(f"synthetic-{arch}-{spec.n_layer}L")
    w.add_block_count(spec.n_layer)
    w.add_context_length(spec.n_ctx_train)
    w.add_embedding_length(spec.n_embd)
    w.add_feed_forward_length(spec.n_ff)
    w.add_head_count(spec.n_head)
    w.add_head_count_kv(spec.n_head_kv)
    w.add_layer_norm_rms_eps(spec.rms_eps)
    w.add_rope_freq_base(spec.rope_theta)
    w.add_rope_dimension_count(hd)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_vocab_size(spec.n_vocab)
    if arch == "gemma3":
        w.add_sliding_window(spec.sliding_window)
        w.add_float32(f"{arch}.rope.freq_base_swa", 10000.0)
        if spec.logit_softcap:
            w.add_final_logit_softcapping(spec.logit_softcap)
    w.add_file_type(1 if spec.f16 else 0)
    w.add_tokenizer_model("none")

    # tensors in the order converters write them: token_embd first, output last
    w.add_tensor("token_embd.weight", mat(spec.n_vocab, spec.n_embd, scale=spec.embd_scale))
    for il in range(spec.n_layer):
        p = f"blk.{il}."
        w.add_tensor(p + "attn_norm.weight", norm_weight(spec.n_embd))
        w.add_tensor(p + "attn_q.weight", mat(spec.n_head * hd, spec.n_embd))
        w.add_tensor(p + "attn_k.weight", mat(spec.n_head_kv * hd, spec.n_embd))
        w.add_tensor(p + "attn_v.weight", mat(spec.n_head_kv * hd, spec.n_embd))
        if arch == "qwen2":  # Qwen2: biases on the q, k and v projections
            for name, rows in (("q", spec.n_head * hd), ("k", spec.n_head_kv * hd), ("v", spec.n_head_kv * hd)):
                w.add_tensor(p + f"attn_{name}.bias", (0.1 * rng.standard_normal(rows)).astype(np.float32))
        if arch in ("qwen3", "gemma3"):  # RMS norms over each head of q and k, before RoPE
            w.add_tensor(p + "attn_q_norm.weight", norm_weight(hd))
            w.add_tensor(p + "attn_k_norm.weight", norm_weight(hd))
        w.add_tensor(p + "attn_output.weight", mat(spec.n_embd, spec.n_head * hd))
        if arch == "gemma3":  # Gemma 3: norms after attention and after the MLP too
            w.add_tensor(p + "post_attention_norm.weight", norm_weight(spec.n_embd))
            w.add_tensor(p + "post_ffw_norm.weight", norm_weight(spec.n_embd))
        w.add_tensor(p + "ffn_norm.weight", norm_weight(spec.n_embd))
        w.add_tensor(p + "ffn_gate.weight", mat(spec.n_ff, spec.n_embd))
        w.add_tensor(p + "ffn_up.weight", mat(spec.n_ff, spec.n_embd))
        w.add_tensor(p + "ffn_down.weight", mat(spec.n_embd, spec.n_ff))
    w.add_tensor("output_norm.weight", norm_weight(spec.n_embd))
    if not spec.tied_embeddings:
        w.add_tensor("output.weight", mat(spec.n_vocab, spec.n_embd))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="write a synthetic random dense-Llama GGUF")
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=SyntheticSpec.n_layer)
    ap.add_argument("--embd", type=int, default=SyntheticSpec.n_embd)
    ap.add_argument("--heads", type=int, default=SyntheticSpec.n_head)
    ap.add_argument("--kv-heads", type=int, default=SyntheticSpec.n_head_kv)
    ap.add_argument("--ff", type=int, default=SyntheticSpec.n_ff)
    ap.add_argument("--vocab", type=int, default=SyntheticSpec.n_vocab)
    ap.add_argument("--f16", action="store_true")
    ap.add_argument("--untied", action="store_true")
    ap.add_argument("--arch", default="llama")
    ap.add_argument("--seed", type=int, default=SyntheticSpec.seed)
    ap.add_argument("--window", type=int, default=SyntheticSpec.sliding_window, help="gemma3's sliding window")
    a = ap.parse_args(argv)
    spec = SyntheticSpec(
        n_layer=a.layers,
        n_embd=a.embd,
        n_head=a.heads,
        n_head_kv=a.kv_heads,
        n_ff=a.ff,
        n_vocab=a.vocab,
        f16=a.f16,
        tied_embeddings=not a.untied,
        architecture=a.arch,
        seed=a.seed,
        sliding_window=a.window,
    )
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    write_synthetic_gguf(a.out, spec)
    print(a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
