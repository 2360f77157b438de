"""Synthetic random GGUF files of the mixture-of-experts and hybrid families: download-free, tiny.

No small real MoE or hybrid GGUF is on the package index, so the certification tests write their own. Each
family's tensor names, shapes and metadata keys are the ones the pinned llama.cpp's loader asks for
(`src/models/<family>.cpp`, `load_arch_hparams` / `load_arch_tensors`): a file that disagreed would
be refused at load, so loading one is the check that this module is right.

| family      | what it exercises                                                                  |
| ----------- | ---------------------------------------------------------------------------------- |
| `mixtral`   | llama with experts (`llama.expert_count`): every layer MoE, softmax gating         |
| `qwen3moe`  | q/k norms, every layer MoE, softmax gating, top-k renormalised                     |
| `gpt-oss`   | alternating sliding-window / full layers, attention sinks, biased experts (SwiGLU-OAI) |
| `deepseek2` | latent attention (MLA: a K-only cache), dense lead layers, a shared expert, sigmoid gating with expert biases, an MTP block |
| `glm4moe`   | dense lead layers, shared experts, sigmoid gating, q/k norms, an MTP block         |
| `nemotron_h`| a hybrid: Mamba-2 (recurrent) layers, attention layers and FFN-only layers, by per-layer arrays of KV heads and FFN widths |
| `qwen35`    | a hybrid: gated delta-net (linear attention, recurrent) layers and every 4th a gated full-attention layer with M-RoPE (four positions a token) |

The MTP (nextn) block is written after the trunk (`block_count` counts it, as converters do) and
loaded by no shard. Like `synthetic.py`, the tokenizer is `none`: token ids only.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
from gguf import ExpertGatingFuncType, GGUFWriter, RopeScalingType

#: family name -> GGUF architecture
FAMILY_ARCH = {
    "mixtral": "llama",
    "qwen3moe": "qwen3moe",
    "gpt-oss": "gpt-oss",
    "deepseek2": "deepseek2",
    "glm4moe": "glm4moe",
    "nemotron_h": "nemotron_h",
    "qwen35": "qwen35",
    "qwen35moe": "qwen35moe",
    "granitehybrid": "granitehybrid",
    "llama4": "llama4",
    "mistral3": "mistral3",
    "minimax-m2": "minimax-m2",
    "phi3": "phi3",
    "qwen3next": "qwen3next",
    "nemotron_h_moe": "nemotron_h_moe",
    "gemma4": "gemma4",
}


@dataclasses.dataclass(frozen=True)
class MoeSpec:
    """Shape of a synthetic MoE model. Families ignore what they do not have."""

    family: str = "qwen3moe"
    n_layer: int = 6  # the trunk; an MTP block comes after it when n_nextn > 0
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 16
    n_expert: int = 8
    n_expert_used: int = 2
    n_ff_exp: int = 32  # one expert's FFN width
    n_ff: int = 96  # a dense (lead) layer's FFN width
    n_dense_lead: int = 0  # deepseek2 / glm4moe: leading dense layers
    n_shared: int = 0  # deepseek2 / glm4moe: shared experts
    n_nextn: int = 0  # deepseek2 / glm4moe / qwen35moe / qwen3next / nemotron_h_moe: MTP blocks after the trunk
    sliding_window: int = 4  # gpt-oss: the window of its sliding layers (even layers)
    kv_lora_rank: int = 32  # deepseek2: the latent K/V width (the cache's row)
    q_lora_rank: int = 32  # deepseek2
    rope_dim: int = 8  # deepseek2: the roped part of a head (the rest is the "nope" part)
    layer_kinds: str = (
        "MMAFMMAF"  # nemotron_h: Mamba-2 (M), attention (A) or FFN (F: MoE in nemotron_h_moe); granitehybrid: M or A
    )
    ssm_heads: int = 4  # nemotron_h: Mamba-2 heads (d_inner = n_embd, split among them)
    ssm_groups: int = 2
    ssm_state: int = 16
    ssm_conv: int = 4
    ssm_conv_f16: bool = False  # a bad file: llama.cpp's conv kernel takes f32 only (the load refuses it)
    n_ff_shexp: int = 64  # qwen35moe / qwen3next / granitehybrid / nemotron_h_moe: the shared expert's width (granitehybrid: 0 = none)
    moe_layer_step: int = 2  # llama4: every step-th layer is MoE (routed + a shared expert), the others dense
    n_embd_per_layer: int = 0  # gemma4: per-layer token-embedding inputs (E2B/E4B); > 0 cannot be split
    n_kv_shared: int = 0  # gemma4: the last n_kv_shared layers reuse earlier layers' KV; > 0 cannot be split
    n_vocab: int = 320
    n_ctx_train: int = 2048
    rms_eps: float = 1e-5
    seed: int = 2024
    f16: bool = False
    embd_scale: float = 0.1

    @property
    def architecture(self) -> str:
        return FAMILY_ARCH[self.family]

    @property
    def n_blocks(self) -> int:
        return self.n_layer + self.n_nextn


class _Weights:
    """Random weights of one model: matrices scaled by their input width (f16 with spec.f16), f32
    vectors around `base` (norms at 1, biases at 0)."""

    def __init__(self, spec: "MoeSpec"):
        self.rng = np.random.default_rng(spec.seed)
        self.dtype = np.float16 if spec.f16 else np.float32

    def mat(self, *shape: int, scale: float | None = None) -> np.ndarray:
        """A weight of numpy `shape` (ggml's ne reversed): the last axis is the input."""
        s = scale if scale is not None else 1.0 / np.sqrt(shape[-1])
        return (self.rng.standard_normal(shape) * s).astype(self.dtype)

    def vec(self, *shape: int, scale: float = 0.1, base: float = 0.0) -> np.ndarray:
        return (base + scale * self.rng.standard_normal(shape)).astype(np.float32)


def _start(path: Path, spec: "MoeSpec", name: str) -> GGUFWriter:
    """A writer with the keys every family shares (the caller adds its own)."""
    w = GGUFWriter(str(path), spec.architecture)
    w.add_name(name)
    w.add_block_count(spec.n_blocks)
    w.add_context_length(spec.n_ctx_train)
    w.add_embedding_length(spec.n_embd)
    w.add_head_count(spec.n_head)
    w.add_layer_norm_rms_eps(spec.rms_eps)
    w.add_vocab_size(spec.n_vocab)
    w.add_file_type(1 if spec.f16 else 0)
    w.add_tokenizer_model("none")
    return w


def _finish(w: GGUFWriter, path: Path) -> Path:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_moe_gguf(path: str | Path, spec: MoeSpec = MoeSpec()) -> Path:
    """Write a random GGUF of `spec.family` to `path` and return the path."""
    if spec.family not in FAMILY_ARCH:
        raise ValueError(f"unknown family {spec.family!r} (known: {', '.join(FAMILY_ARCH)})")
    if spec.n_nextn and spec.family not in ("deepseek2", "glm4moe", "qwen35moe", "qwen3next", "nemotron_h_moe"):
        raise ValueError(f"{spec.family} has no MTP blocks")
    path = Path(path)
    own_writer = {
        "nemotron_h": _write_nemotron_h,
        "nemotron_h_moe": _write_nemotron_h,
        "qwen35": _write_qwen35,
        "qwen35moe": _write_qwen35moe,
        "qwen3next": _write_qwen35moe,
        "granitehybrid": _write_granitehybrid,
        "llama4": _write_llama4,
        "mistral3": _write_mistral3,
        "minimax-m2": _write_minimax_m2,
        "phi3": _write_phi3,
        "gemma4": _write_gemma4,
    }.get(spec.family)
    if own_writer is not None:
        return own_writer(path, spec)
    arch, fam = spec.architecture, spec.family
    E, H, Hkv, hd = spec.n_embd, spec.n_head, spec.n_head_kv, spec.head_dim
    weights = _Weights(spec)
    mat = weights.mat

    def vec(n: int, scale: float = 0.1, base: float = 0.0) -> np.ndarray:
        return weights.vec(n, scale=scale, base=base)

    def norm(n: int) -> np.ndarray:
        return vec(n, 0.1, 1.0)

    w = _start(path, spec, f"synthetic-{fam}-{spec.n_layer}L-{spec.n_expert}x{spec.n_expert_used}")
    w.add_feed_forward_length(spec.n_ff)
    w.add_rope_freq_base(10000.0)
    w.add_expert_count(spec.n_expert)
    w.add_expert_used_count(spec.n_expert_used)
    if fam != "mixtral":
        w.add_expert_feed_forward_length(spec.n_ff_exp)
    if fam == "deepseek2":
        rank = spec.kv_lora_rank
        w.add_head_count_kv(1)  # MLA: one latent "head" cached per token
        w.add_key_length(rank + spec.rope_dim)
        w.add_value_length(rank)
        w.add_uint32(f"{arch}.attention.key_length_mla", hd + spec.rope_dim)
        w.add_uint32(f"{arch}.attention.value_length_mla", hd)
        w.add_rope_dimension_count(spec.rope_dim)
        w.add_q_lora_rank(spec.q_lora_rank)
        w.add_kv_lora_rank(rank)
    else:
        w.add_head_count_kv(Hkv)
        w.add_key_length(hd)
        w.add_value_length(hd)
        w.add_rope_dimension_count(hd)
    if fam in ("deepseek2", "glm4moe"):
        w.add_leading_dense_block_count(spec.n_dense_lead)
        w.add_expert_shared_count(spec.n_shared)
        w.add_expert_weights_scale(1.0)
        w.add_expert_weights_norm(True)
        w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
        if spec.n_nextn:
            w.add_uint32(f"{arch}.nextn_predict_layers", spec.n_nextn)
    if fam == "gpt-oss":
        w.add_sliding_window(spec.sliding_window)

    n_kv = 1 if fam == "deepseek2" else Hkv
    w.add_tensor("token_embd.weight", mat(spec.n_vocab, E, scale=spec.embd_scale))
    for il in range(spec.n_blocks):
        p = f"blk.{il}."
        w.add_tensor(p + "attn_norm.weight", norm(E))
        if fam == "deepseek2":
            rank, rope, qk = spec.kv_lora_rank, spec.rope_dim, hd + spec.rope_dim
            w.add_tensor(p + "attn_q_a_norm.weight", norm(spec.q_lora_rank))
            w.add_tensor(p + "attn_kv_a_norm.weight", norm(rank))
            w.add_tensor(p + "attn_q_a.weight", mat(spec.q_lora_rank, E))
            w.add_tensor(p + "attn_q_b.weight", mat(H * qk, spec.q_lora_rank))
            w.add_tensor(p + "attn_kv_a_mqa.weight", mat(rank + rope, E))
            w.add_tensor(p + "attn_k_b.weight", mat(H, rank, hd))  # ne {nope, rank, n_head}
            w.add_tensor(p + "attn_v_b.weight", mat(H, hd, rank))  # ne {rank, v_head, n_head}
            w.add_tensor(p + "attn_output.weight", mat(E, H * hd))
        else:
            w.add_tensor(p + "attn_q.weight", mat(H * hd, E))
            w.add_tensor(p + "attn_k.weight", mat(n_kv * hd, E))
            w.add_tensor(p + "attn_v.weight", mat(n_kv * hd, E))
            if fam in ("gpt-oss", "glm4moe"):  # biased q/k/v
                for name, rows in (("q", H * hd), ("k", n_kv * hd), ("v", n_kv * hd)):
                    w.add_tensor(p + f"attn_{name}.bias", vec(rows))
            if fam in ("qwen3moe", "glm4moe"):
                w.add_tensor(p + "attn_q_norm.weight", norm(hd))
                w.add_tensor(p + "attn_k_norm.weight", norm(hd))
            w.add_tensor(p + "attn_output.weight", mat(E, H * hd))
        if fam == "gpt-oss":
            w.add_tensor(p + "attn_output.bias", vec(E))
            w.add_tensor(p + "attn_sinks.weight", vec(H, 0.5))
            w.add_tensor(p + "post_attention_norm.weight", norm(E))
        elif fam == "glm4moe":
            w.add_tensor(p + "post_attention_norm.weight", norm(E))
        else:
            w.add_tensor(p + "ffn_norm.weight", norm(E))

        dense = il < spec.n_dense_lead
        if dense:
            w.add_tensor(p + "ffn_gate.weight", mat(spec.n_ff, E))
            w.add_tensor(p + "ffn_up.weight", mat(spec.n_ff, E))
            w.add_tensor(p + "ffn_down.weight", mat(E, spec.n_ff))
        else:
            ff = spec.n_ff if fam == "mixtral" else spec.n_ff_exp
            X = spec.n_expert
            w.add_tensor(p + "ffn_gate_inp.weight", mat(X, E, scale=1.0))  # a router that separates experts
            w.add_tensor(p + "ffn_gate_exps.weight", mat(X, ff, E))
            w.add_tensor(p + "ffn_up_exps.weight", mat(X, ff, E))
            w.add_tensor(p + "ffn_down_exps.weight", mat(X, E, ff))
            if fam == "gpt-oss":
                w.add_tensor(p + "ffn_gate_inp.bias", vec(X))
                w.add_tensor(p + "ffn_gate_exps.bias", weights.vec(X, ff))
                w.add_tensor(p + "ffn_up_exps.bias", weights.vec(X, ff))
                w.add_tensor(p + "ffn_down_exps.bias", weights.vec(X, E))
            if fam in ("deepseek2", "glm4moe"):
                w.add_tensor(p + "exp_probs_b.bias", vec(X))
                if spec.n_shared:
                    sh = spec.n_ff_exp * spec.n_shared
                    w.add_tensor(p + "ffn_gate_shexp.weight", mat(sh, E))
                    w.add_tensor(p + "ffn_up_shexp.weight", mat(sh, E))
                    w.add_tensor(p + "ffn_down_shexp.weight", mat(E, sh))
        if il >= spec.n_layer:  # an MTP block: its own projections on top of a normal layer
            w.add_tensor(p + "nextn.eh_proj.weight", mat(E, 2 * E))
            w.add_tensor(p + "nextn.enorm.weight", norm(E))
            w.add_tensor(p + "nextn.hnorm.weight", norm(E))
            w.add_tensor(p + "nextn.shared_head_norm.weight", norm(E))
    w.add_tensor("output_norm.weight", norm(E))
    w.add_tensor("output.weight", mat(spec.n_vocab, E))
    return _finish(w, path)


def _write_nemotron_h(path: Path, spec: MoeSpec) -> Path:
    """Nemotron-H: a layer is Mamba-2 when its KV heads and FFN width are both 0, attention when
    only its FFN width is, an FFN (squared ReLU, no gate) otherwise (the per-layer arrays
    `attention.head_count_kv` and `feed_forward_length` say which). nemotron_h_moe (Nemotron 3):
    every FFN layer is a sigmoid-routed MoE with expert biases beside a shared expert, all squared
    ReLU without gates; with n_nextn = 1 an MTP block (attention + the same MoE + nextn projections)
    follows the trunk."""
    kinds = spec.layer_kinds
    if len(kinds) != spec.n_layer or set(kinds) - set("MAF"):
        raise ValueError(f"layer_kinds {kinds!r} must give M, A or F for each of {spec.n_layer} layers")
    moe = spec.family == "nemotron_h_moe"
    if moe and not (spec.n_expert > 0 and 0 < spec.n_expert_used <= spec.n_expert and spec.n_ff_shexp > 0):
        raise ValueError(
            "nemotron_h_moe: every FFN layer is MoE with a shared expert (n_expert, n_expert_used, n_ff_shexp > 0)"
        )
    if spec.n_nextn not in (0, 1):
        raise ValueError("nemotron_h_moe: at most one MTP block (graph_mtp asserts n_layer_nextn == 1)")
    X, ff, sh = spec.n_expert, spec.n_ff_exp, spec.n_ff_shexp
    blocks = kinds + "A" * spec.n_nextn  # the MTP block: attention (its FFN width 0) and a MoE
    E, H, Hkv, hd = spec.n_embd, spec.n_head, spec.n_head_kv, spec.head_dim
    d_inner, groups, state, heads = E, spec.ssm_groups, spec.ssm_state, spec.ssm_heads
    conv_dim = d_inner + 2 * groups * state

    weights = _Weights(spec)
    mat, vec = weights.mat, weights.vec

    w = _start(path, spec, f"synthetic-{spec.family}-{kinds}")
    w.add_feed_forward_length([spec.n_ff if k == "F" else 0 for k in blocks])
    w.add_head_count_kv([Hkv if k == "A" else 0 for k in blocks])
    if moe:
        w.add_expert_count(X)
        w.add_expert_used_count(spec.n_expert_used)
        w.add_expert_feed_forward_length(ff)
        w.add_expert_shared_feed_forward_length(sh)
        w.add_expert_weights_norm(True)
        w.add_expert_weights_scale(2.5)
    if spec.n_nextn:
        w.add_uint32(f"{spec.architecture}.nextn_predict_layers", spec.n_nextn)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_layer_norm_eps(spec.rms_eps)
    w.add_ssm_conv_kernel(spec.ssm_conv)
    w.add_ssm_inner_size(d_inner)
    w.add_ssm_state_size(state)
    w.add_ssm_time_step_rank(heads)
    w.add_ssm_group_count(groups)

    def attention(p: str) -> None:
        w.add_tensor(p + "attn_q.weight", mat(H * hd, E))
        w.add_tensor(p + "attn_k.weight", mat(Hkv * hd, E))
        w.add_tensor(p + "attn_v.weight", mat(Hkv * hd, E))
        w.add_tensor(p + "attn_output.weight", mat(E, H * hd))

    def routed_experts(p: str) -> None:  # no gate tensors: squared ReLU on up alone
        w.add_tensor(p + "ffn_gate_inp.weight", mat(X, E, scale=1.0))  # a router that separates experts
        w.add_tensor(p + "exp_probs_b.bias", vec(X))
        w.add_tensor(p + "ffn_up_exps.weight", mat(X, ff, E))
        w.add_tensor(p + "ffn_down_exps.weight", mat(X, E, ff))
        w.add_tensor(p + "ffn_up_shexp.weight", mat(sh, E))
        w.add_tensor(p + "ffn_down_shexp.weight", mat(E, sh))

    w.add_tensor("token_embd.weight", mat(spec.n_vocab, E, scale=spec.embd_scale))
    for il, kind in enumerate(kinds):
        p = f"blk.{il}."
        w.add_tensor(p + "attn_norm.weight", vec(E, base=1.0))
        if kind == "M":
            w.add_tensor(p + "ssm_in.weight", mat(2 * d_inner + 2 * groups * state + heads, E))
            w.add_tensor(
                p + "ssm_conv1d.weight",
                vec(conv_dim, spec.ssm_conv, scale=0.5).astype(np.float16 if spec.ssm_conv_f16 else np.float32),
            )
            w.add_tensor(p + "ssm_conv1d.bias", vec(conv_dim))
            w.add_tensor(p + "ssm_dt.bias", vec(heads, scale=0.5))
            w.add_tensor(p + "ssm_a", -np.exp(vec(heads, 1, scale=0.5)))  # A = -exp(A_log): decaying
            w.add_tensor(p + "ssm_d", vec(heads, 1, scale=0.5, base=1.0))
            w.add_tensor(p + "ssm_norm.weight", vec(groups, d_inner // groups, base=1.0))
            w.add_tensor(p + "ssm_out.weight", mat(E, d_inner))
        elif kind == "A":
            attention(p)
        elif moe:
            routed_experts(p)
        else:
            w.add_tensor(p + "ffn_up.weight", mat(spec.n_ff, E))
            w.add_tensor(p + "ffn_down.weight", mat(E, spec.n_ff))
    for il in range(spec.n_layer, spec.n_blocks):  # the MTP block
        p = f"blk.{il}."
        w.add_tensor(p + "attn_norm.weight", vec(E, base=1.0))
        attention(p)
        w.add_tensor(p + "post_attention_norm.weight", vec(E, base=1.0))
        routed_experts(p)
        w.add_tensor(p + "nextn.eh_proj.weight", mat(E, 2 * E))
        w.add_tensor(p + "nextn.enorm.weight", vec(E, base=1.0))
        w.add_tensor(p + "nextn.hnorm.weight", vec(E, base=1.0))
        w.add_tensor(p + "nextn.shared_head_norm.weight", vec(E, base=1.0))
    w.add_tensor("output_norm.weight", vec(E, base=1.0))
    w.add_tensor("output.weight", mat(spec.n_vocab, E))
    return _finish(w, path)


def _write_qwen35(path: Path, spec: MoeSpec) -> Path:
    """Qwen 3.5: every `full_attention_interval`-th layer (4) is full attention (a joint query and
    output gate, q/k norms, M-RoPE), the others gated delta-net: q/k/v mixed by a short conv, a
    state of ssm_state x ssm_state per value head (ssm_heads of them; ssm_groups key heads)."""
    arch = spec.architecture
    E, H, Hkv, hd = spec.n_embd, spec.n_head, spec.n_head_kv, spec.head_dim
    state, k_heads, v_heads = spec.ssm_state, spec.ssm_groups, spec.ssm_heads
    key_dim, value_dim = state * k_heads, state * v_heads
    conv_dim = 2 * key_dim + value_dim
    interval = 4

    weights = _Weights(spec)
    mat, vec = weights.mat, weights.vec

    w = _start(path, spec, f"synthetic-qwen35-{spec.n_layer}L")
    w.add_feed_forward_length(spec.n_ff)
    w.add_head_count_kv(Hkv)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(hd)
    w.add_rope_dimension_sections([3, 3, 2, 0])  # text: the three sections take the same position
    w.add_rope_freq_base(10000.0)
    w.add_ssm_conv_kernel(spec.ssm_conv)
    w.add_ssm_inner_size(value_dim)
    w.add_ssm_state_size(state)
    w.add_ssm_time_step_rank(v_heads)
    w.add_ssm_group_count(k_heads)
    w.add_uint32(f"{arch}.full_attention_interval", interval)

    w.add_tensor("token_embd.weight", mat(spec.n_vocab, E, scale=spec.embd_scale))
    for il in range(spec.n_layer):
        p = f"blk.{il}."
        w.add_tensor(p + "attn_norm.weight", vec(E, base=1.0))
        w.add_tensor(p + "post_attention_norm.weight", vec(E, base=1.0))
        if (il + 1) % interval == 0:  # full attention
            w.add_tensor(p + "attn_q.weight", mat(2 * H * hd, E))  # the query and its output gate
            w.add_tensor(p + "attn_k.weight", mat(Hkv * hd, E))
            w.add_tensor(p + "attn_v.weight", mat(Hkv * hd, E))
            w.add_tensor(p + "attn_output.weight", mat(E, H * hd))
            w.add_tensor(p + "attn_q_norm.weight", vec(hd, base=1.0))
            w.add_tensor(p + "attn_k_norm.weight", vec(hd, base=1.0))
        else:  # gated delta-net
            w.add_tensor(p + "attn_qkv.weight", mat(conv_dim, E))
            w.add_tensor(p + "attn_gate.weight", mat(value_dim, E))
            w.add_tensor(
                p + "ssm_conv1d.weight",
                vec(conv_dim, spec.ssm_conv, scale=0.5).astype(np.float16 if spec.ssm_conv_f16 else np.float32),
            )
            w.add_tensor(p + "ssm_dt.bias", vec(v_heads, scale=0.5))
            w.add_tensor(p + "ssm_a", -np.exp(vec(v_heads, scale=0.5)))
            w.add_tensor(p + "ssm_beta.weight", mat(v_heads, E))
            w.add_tensor(p + "ssm_alpha.weight", mat(v_heads, E))
            w.add_tensor(p + "ssm_norm.weight", vec(state, base=1.0))
            w.add_tensor(p + "ssm_out.weight", mat(E, value_dim))
        w.add_tensor(p + "ffn_gate.weight", mat(spec.n_ff, E))
        w.add_tensor(p + "ffn_up.weight", mat(spec.n_ff, E))
        w.add_tensor(p + "ffn_down.weight", mat(E, spec.n_ff))
    w.add_tensor("output_norm.weight", vec(E, base=1.0))
    w.add_tensor("output.weight", mat(spec.n_vocab, E))
    return _finish(w, path)


def _write_qwen35moe(path: Path, spec: MoeSpec) -> Path:
    """Qwen 3.5 MoE: qwen35's layers (every 4th full attention with a query gate, q/k norms and
    M-RoPE; the others gated delta-net) with every FFN a softmax-routed, top-k renormalised MoE plus
    one shared expert scaled by its own sigmoid gate (`ffn_gate_inp_shexp`, one value a token).
    With n_nextn = 1 an MTP block (full attention + the same MoE + nextn projections) follows.
    qwen3next (Qwen3-Next, qwen35moe's predecessor) has the same layers with a plain rope instead of
    M-RoPE and one fused beta/alpha projection (`ssm_ba`)."""
    if spec.n_nextn not in (0, 1):
        raise ValueError(f"{spec.family}: at most one MTP block (graph_mtp asserts n_layer_nextn == 1)")
    next_ = spec.family == "qwen3next"
    if spec.n_expert <= 0 or not 0 < spec.n_expert_used <= spec.n_expert:
        raise ValueError(f"{spec.family}: every layer is MoE: n_expert > 0 and 0 < n_expert_used <= n_expert")
    if spec.n_ff_shexp <= 0:
        raise ValueError(f"{spec.family}: the shared expert is required (n_ff_shexp > 0)")
    if spec.ssm_heads % spec.ssm_groups:
        raise ValueError(f"{spec.family}: ssm_heads (value heads) must be a multiple of ssm_groups (key heads)")
    arch = spec.architecture
    E, H, Hkv, hd = spec.n_embd, spec.n_head, spec.n_head_kv, spec.head_dim
    X, ff, sh = spec.n_expert, spec.n_ff_exp, spec.n_ff_shexp
    state, k_heads, v_heads = spec.ssm_state, spec.ssm_groups, spec.ssm_heads
    key_dim, value_dim = state * k_heads, state * v_heads
    conv_dim = 2 * key_dim + value_dim
    interval = 4

    weights = _Weights(spec)
    mat, vec = weights.mat, weights.vec

    w = _start(path, spec, f"synthetic-{spec.family}-{spec.n_layer}L-{X}x{spec.n_expert_used}")
    w.add_feed_forward_length(spec.n_ff)  # unused by the graph (experts / shexp have their own)
    w.add_expert_count(X)
    w.add_expert_used_count(spec.n_expert_used)
    w.add_expert_feed_forward_length(ff)  # absent: n_ff / n_expert_used
    w.add_expert_shared_feed_forward_length(sh)  # absent: n_ff
    w.add_head_count_kv(Hkv)
    w.add_key_length(hd)
    w.add_value_length(hd)  # the graph asserts key_length == value_length
    w.add_rope_dimension_count(hd)
    if not next_:
        w.add_rope_dimension_sections([3, 3, 2, 0])  # required by qwen35moe's loader; text: sections take one position
    w.add_rope_freq_base(10000.0)
    w.add_ssm_conv_kernel(spec.ssm_conv)
    w.add_ssm_inner_size(value_dim)  # head_v_dim = inner / time_step_rank must equal state
    w.add_ssm_state_size(state)
    w.add_ssm_time_step_rank(v_heads)
    w.add_ssm_group_count(k_heads)
    w.add_uint32(f"{arch}.full_attention_interval", interval)
    if spec.n_nextn:
        w.add_uint32(f"{arch}.nextn_predict_layers", spec.n_nextn)

    def full_attention(p: str) -> None:
        w.add_tensor(p + "attn_q.weight", mat(2 * H * hd, E))  # the query and its output gate
        w.add_tensor(p + "attn_k.weight", mat(Hkv * hd, E))
        w.add_tensor(p + "attn_v.weight", mat(Hkv * hd, E))
        w.add_tensor(p + "attn_output.weight", mat(E, H * hd))
        w.add_tensor(p + "attn_q_norm.weight", vec(hd, base=1.0))
        w.add_tensor(p + "attn_k_norm.weight", vec(hd, base=1.0))

    def moe(p: str) -> None:
        w.add_tensor(p + "ffn_gate_inp.weight", mat(X, E, scale=1.0))  # a router that separates experts
        w.add_tensor(p + "ffn_gate_exps.weight", mat(X, ff, E))
        w.add_tensor(p + "ffn_up_exps.weight", mat(X, ff, E))
        w.add_tensor(p + "ffn_down_exps.weight", mat(X, E, ff))
        w.add_tensor(p + "ffn_gate_inp_shexp.weight", mat(E, scale=1.0 / np.sqrt(E)))  # ne {n_embd}: one logit a token
        w.add_tensor(p + "ffn_gate_shexp.weight", mat(sh, E))
        w.add_tensor(p + "ffn_up_shexp.weight", mat(sh, E))
        w.add_tensor(p + "ffn_down_shexp.weight", mat(E, sh))

    w.add_tensor("token_embd.weight", mat(spec.n_vocab, E, scale=spec.embd_scale))
    for il in range(spec.n_blocks):
        p = f"blk.{il}."
        w.add_tensor(p + "attn_norm.weight", vec(E, base=1.0))
        w.add_tensor(p + "post_attention_norm.weight", vec(E, base=1.0))
        if il >= spec.n_layer or (il + 1) % interval == 0:  # full attention (the MTP block always is)
            full_attention(p)
        else:  # gated delta-net
            w.add_tensor(p + "attn_qkv.weight", mat(conv_dim, E))  # NOT_REQUIRED in the loader, needed by the graph
            w.add_tensor(p + "attn_gate.weight", mat(value_dim, E))  # likewise (z)
            w.add_tensor(
                p + "ssm_conv1d.weight",
                vec(conv_dim, spec.ssm_conv, scale=0.5).astype(np.float16 if spec.ssm_conv_f16 else np.float32),
            )
            w.add_tensor(p + "ssm_dt.bias", vec(v_heads, scale=0.5))
            w.add_tensor(
                p + "ssm_a", -np.exp(vec(v_heads, scale=0.5))
            )  # ne {dt_rank} (1-D, unlike Mamba-2's {1, heads})
            if next_:
                w.add_tensor(p + "ssm_ba.weight", mat(2 * v_heads, E))
            else:
                w.add_tensor(p + "ssm_beta.weight", mat(v_heads, E))
                w.add_tensor(p + "ssm_alpha.weight", mat(v_heads, E))
            w.add_tensor(p + "ssm_norm.weight", vec(state, base=1.0))
            w.add_tensor(p + "ssm_out.weight", mat(E, value_dim))
        moe(p)
        if il >= spec.n_layer:  # the MTP block's own projections (embed_tokens / shared_head_* are optional)
            w.add_tensor(p + "nextn.eh_proj.weight", mat(E, 2 * E))
            w.add_tensor(p + "nextn.enorm.weight", vec(E, base=1.0))
            w.add_tensor(p + "nextn.hnorm.weight", vec(E, base=1.0))
            w.add_tensor(p + "nextn.shared_head_norm.weight", vec(E, base=1.0))
    w.add_tensor("output_norm.weight", vec(E, base=1.0))
    w.add_tensor("output.weight", mat(spec.n_vocab, E))
    return _finish(w, path)


def _write_phi3(path: Path, spec: MoeSpec) -> Path:
    """Phi-3: fused attn_qkv (Q, K, V rows in that order), fused ffn_up (gate and up: 2*n_ff rows,
    SwiGLU), RMS norms, an untied LM head; per-layer rope factors (long/short, longrope). The file's sliding window is read and ignored (phi3.cpp: SWA disabled)."""
    E, H, Hkv = spec.n_embd, spec.n_head, spec.n_head_kv
    hd = E // H
    if hd * H != E or spec.head_dim != hd:
        raise ValueError(f"phi3 needs head_dim == n_embd / n_head ({E}/{H}), not {spec.head_dim}")
    weights = _Weights(spec)
    mat, vec = weights.mat, weights.vec

    w = _start(path, spec, f"synthetic-phi3-{spec.n_layer}L")
    w.add_feed_forward_length(spec.n_ff)
    w.add_head_count_kv(Hkv)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(10000.0)
    if spec.sliding_window:
        w.add_sliding_window(spec.sliding_window)  # read, warned about, switched off by the loader

    w.add_tensor("token_embd.weight", mat(spec.n_vocab, E, scale=spec.embd_scale))
    # one tensor each; the loader requests them per layer (duplicated after layer 0), as llama's rope_freqs
    w.add_tensor("rope_factors_long.weight", vec(hd // 2, scale=0.5, base=2.0))
    w.add_tensor("rope_factors_short.weight", vec(hd // 2, scale=0.2, base=1.0))
    for il in range(spec.n_layer):
        p = f"blk.{il}."
        w.add_tensor(p + "attn_norm.weight", vec(E, base=1.0))
        w.add_tensor(p + "attn_qkv.weight", mat(E + 2 * Hkv * hd, E))
        w.add_tensor(p + "attn_output.weight", mat(E, E))
        w.add_tensor(p + "ffn_norm.weight", vec(E, base=1.0))
        w.add_tensor(p + "ffn_up.weight", mat(2 * spec.n_ff, E))
        w.add_tensor(p + "ffn_down.weight", mat(E, spec.n_ff))
    w.add_tensor("output_norm.weight", vec(E, base=1.0))
    w.add_tensor("output.weight", mat(spec.n_vocab, E))
    return _finish(w, path)


def gemma4_swa_layers(spec: MoeSpec) -> list[bool]:
    """Which layers of `spec` are sliding-window (every 3rd layer is full attention)."""
    return [(il + 1) % 3 != 0 for il in range(spec.n_layer)]


def _write_gemma4(path: Path, spec: MoeSpec) -> Path:
    """Gemma 4: sliding (head_dim, n_head_kv KV heads, rope base 1e4) and full layers (2*head_dim,
    one KV head, K used as V, proportional rope through rope_freqs, base 1e6); q/k norms, V RMS-normed,
    norms after attention and after the FFN, a layer output scale, a dense GELU MLP and, with
    n_expert > 0, a routed MoE beside it in every layer (26B-A4B); logit soft-capping; tied embeddings.
    With n_embd_per_layer > 0 the per-layer token embeddings and their projections (E2B/E4B), with
    n_kv_shared > 0 the KV-sharing tail (E2B/E4B): the two things a shard range must refuse."""
    E, H, Hkv, hd = spec.n_embd, spec.n_head, spec.n_head_kv, spec.head_dim
    hd_full, Hkv_full = 2 * hd, 1
    L, npl = spec.n_layer, spec.n_embd_per_layer
    swa = gemma4_swa_layers(spec)
    kv_from = L - spec.n_kv_shared
    if spec.n_kv_shared and not (kv_from >= 2 and swa[kv_from - 2] and not swa[kv_from - 1]):
        # create_memory's reuse: a shared sliding layer reads layer kv_from-2, a full one kv_from-1
        raise ValueError(
            f"n_kv_shared={spec.n_kv_shared}: layers {kv_from - 2} and {kv_from - 1} must be sliding and full"
        )
    weights = _Weights(spec)
    mat, vec = weights.mat, weights.vec

    def norm(n: int) -> np.ndarray:
        return vec(n, base=1.0)

    w = _start(
        path,
        spec,
        f"synthetic-gemma4-{L}L"
        + (f"-ple{npl}" if npl else "")
        + (f"-kvshared{spec.n_kv_shared}" if spec.n_kv_shared else ""),
    )
    w.add_feed_forward_length(spec.n_ff)
    w.add_head_count_kv([Hkv if s else Hkv_full for s in swa])
    w.add_key_length(hd_full)
    w.add_value_length(hd_full)
    w.add_key_length_swa(hd)
    w.add_value_length_swa(hd)
    w.add_rope_dimension_count(hd_full)  # full layers: all dims, rope_freqs leaves 3/4 unrotated
    w.add_rope_dimension_count_swa(hd)
    w.add_rope_freq_base(1000000.0)
    w.add_rope_freq_base_swa(10000.0)
    w.add_sliding_window(spec.sliding_window)
    w.add_sliding_window_pattern(swa)
    w.add_shared_kv_layers(spec.n_kv_shared)
    w.add_embedding_length_per_layer_input(npl)  # required key (0: no per-layer inputs)
    w.add_final_logit_softcapping(30.0)
    if spec.n_expert:
        w.add_expert_count(spec.n_expert)
        w.add_expert_used_count(spec.n_expert_used)
        w.add_expert_feed_forward_length(spec.n_ff_exp)

    w.add_tensor("token_embd.weight", mat(spec.n_vocab, E, scale=spec.embd_scale))
    if npl:
        w.add_tensor("per_layer_token_embd.weight", mat(spec.n_vocab, npl * L, scale=spec.embd_scale))
        w.add_tensor("per_layer_model_proj.weight", mat(npl * L, E))
        w.add_tensor("per_layer_proj_norm.weight", norm(npl))
    n_rot_prop = hd_full // 8  # partial_rotary_factor 0.25 over hd_full/2 frequency pairs
    w.add_tensor(
        "rope_freqs.weight", np.array([1.0] * n_rot_prop + [1e30] * (hd_full // 2 - n_rot_prop), dtype=np.float32)
    )
    for il in range(L):
        p, d = f"blk.{il}.", (hd if swa[il] else hd_full)
        kv = Hkv if swa[il] else Hkv_full
        has_kv = il < kv_from
        w.add_tensor(p + "attn_norm.weight", norm(E))
        w.add_tensor(p + "attn_q.weight", mat(H * d, E))
        if has_kv:
            w.add_tensor(p + "attn_k.weight", mat(kv * d, E))
            if swa[il]:  # full layers: no V projection, K serves as V (attention_k_eq_v)
                w.add_tensor(p + "attn_v.weight", mat(kv * d, E))
            w.add_tensor(p + "attn_k_norm.weight", norm(d))
        w.add_tensor(p + "attn_q_norm.weight", norm(d))
        w.add_tensor(p + "attn_output.weight", mat(E, H * d))
        w.add_tensor(p + "post_attention_norm.weight", norm(E))
        w.add_tensor(p + "layer_output_scale.weight", vec(1, scale=0.1, base=0.8))
        w.add_tensor(p + "ffn_norm.weight", norm(E))
        w.add_tensor(p + "ffn_gate.weight", mat(spec.n_ff, E))
        w.add_tensor(p + "ffn_up.weight", mat(spec.n_ff, E))
        w.add_tensor(p + "ffn_down.weight", mat(E, spec.n_ff))
        w.add_tensor(p + "post_ffw_norm.weight", norm(E))
        if spec.n_expert:
            X, ff = spec.n_expert, spec.n_ff_exp
            w.add_tensor(p + "ffn_gate_inp.weight", mat(X, E, scale=1.0))
            w.add_tensor(p + "ffn_gate_inp.scale", norm(E))
            w.add_tensor(p + "pre_ffw_norm_2.weight", norm(E))
            w.add_tensor(p + "post_ffw_norm_1.weight", norm(E))
            w.add_tensor(p + "post_ffw_norm_2.weight", norm(E))
            w.add_tensor(p + "ffn_gate_exps.weight", mat(X, ff, E))
            w.add_tensor(p + "ffn_up_exps.weight", mat(X, ff, E))
            w.add_tensor(p + "ffn_down_exps.weight", mat(X, E, ff))
            w.add_tensor(p + "ffn_down_exps.scale", vec(X, base=1.0))
        if npl:
            w.add_tensor(p + "inp_gate.weight", mat(npl, E))
            w.add_tensor(p + "proj.weight", mat(E, npl))
            w.add_tensor(p + "post_norm.weight", norm(E))
    w.add_tensor("output_norm.weight", norm(E))
    return _finish(w, path)


def _write_granitehybrid(path: Path, spec: MoeSpec) -> Path:
    """Granite 4.0-H: Mamba-2 (M) and attention (A) layers by `layer_kinds` -- written as the per-layer
    array attention.head_count_kv, 0 marking a recurrent layer --, each followed by an RMS-normed FFN:
    a softmax-routed MoE (top-k renormalised) with an optional ungated shared expert when n_expert > 0,
    a dense SwiGLU otherwise. Granite multipliers: embeddings x embedding_scale, each sub-layer's
    output x residual_scale, logits / logit_scale. Mamba-2 d_inner is 2 * n_embd (the loader asserts it)."""
    kinds = spec.layer_kinds
    if len(kinds) != spec.n_layer or set(kinds) - set("MA"):
        raise ValueError(f"layer_kinds {kinds!r} must give M or A for each of {spec.n_layer} layers")
    if spec.n_nextn:
        raise ValueError("granitehybrid has no MTP blocks")
    E, H, Hkv, hd = spec.n_embd, spec.n_head, spec.n_head_kv, spec.head_dim
    d_inner, groups, state, heads = 2 * E, spec.ssm_groups, spec.ssm_state, spec.ssm_heads
    if d_inner % heads or d_inner % groups:
        raise ValueError("granitehybrid: 2*n_embd must be a multiple of ssm_heads and of ssm_groups")
    if Hkv <= 0:
        raise ValueError("granitehybrid: n_head_kv must be > 0 (0 marks a Mamba-2 layer)")
    conv_dim = d_inner + 2 * groups * state
    moe = spec.n_expert > 0
    if moe and not 0 < spec.n_expert_used <= spec.n_expert:
        raise ValueError("granitehybrid MoE: 0 < n_expert_used <= n_expert")
    ff = spec.n_ff_exp if moe else spec.n_ff  # granite sizes experts by feed_forward_length
    sh = spec.n_ff_shexp if moe else 0

    weights = _Weights(spec)
    mat, vec = weights.mat, weights.vec

    w = _start(
        path, spec, f"synthetic-granitehybrid-{kinds}" + (f"-{spec.n_expert}x{spec.n_expert_used}" if moe else "")
    )
    w.add_feed_forward_length(ff)
    w.add_head_count_kv([Hkv if k == "A" else 0 for k in kinds])  # 0: a recurrent (Mamba-2) layer
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(10000.0)
    w.add_rope_scaling_finetuned(True)  # granite's rope switch: on, so positions matter in the attention layers
    w.add_ssm_conv_kernel(spec.ssm_conv)
    w.add_ssm_inner_size(d_inner)
    w.add_ssm_state_size(state)
    w.add_ssm_time_step_rank(heads)
    w.add_ssm_group_count(groups)
    w.add_embedding_scale(12.0)  # Granite's multipliers (the logit scale at 1: no near-ties by it)
    w.add_residual_scale(0.22)
    w.add_logit_scale(1.0)
    if moe:
        w.add_expert_count(spec.n_expert)
        w.add_expert_used_count(spec.n_expert_used)
        if sh:
            w.add_expert_shared_feed_forward_length(sh)

    w.add_tensor("token_embd.weight", mat(spec.n_vocab, E, scale=spec.embd_scale))
    for il, kind in enumerate(kinds):
        p = f"blk.{il}."
        w.add_tensor(p + "attn_norm.weight", vec(E, base=1.0))
        if kind == "M":
            w.add_tensor(p + "ssm_in.weight", mat(2 * d_inner + 2 * groups * state + heads, E))
            w.add_tensor(
                p + "ssm_conv1d.weight",
                vec(conv_dim, spec.ssm_conv, scale=0.5).astype(np.float16 if spec.ssm_conv_f16 else np.float32),
            )
            w.add_tensor(
                p + "ssm_conv1d.bias", vec(conv_dim)
            )  # NOT_REQUIRED in the loader, but the graph adds it unchecked
            w.add_tensor(p + "ssm_dt.bias", vec(heads, scale=0.5))
            w.add_tensor(p + "ssm_a", -np.exp(vec(heads, 1, scale=0.5)))  # ne {1, heads}; A = -exp(A_log)
            w.add_tensor(p + "ssm_d", vec(heads, 1, scale=0.5, base=1.0))
            w.add_tensor(p + "ssm_norm.weight", vec(groups, d_inner // groups, base=1.0))
            w.add_tensor(p + "ssm_out.weight", mat(E, d_inner))
        else:
            w.add_tensor(p + "attn_q.weight", mat(H * hd, E))
            w.add_tensor(p + "attn_k.weight", mat(Hkv * hd, E))
            w.add_tensor(p + "attn_v.weight", mat(Hkv * hd, E))
            w.add_tensor(p + "attn_output.weight", mat(E, H * hd))
        w.add_tensor(p + "ffn_norm.weight", vec(E, base=1.0))
        if moe:
            X = spec.n_expert
            w.add_tensor(p + "ffn_gate_inp.weight", mat(X, E, scale=1.0))
            w.add_tensor(
                p + "ffn_gate_exps.weight", mat(X, ff, E)
            )  # separate gate/up: granite never looks for gate_up_exps
            w.add_tensor(p + "ffn_up_exps.weight", mat(X, ff, E))
            w.add_tensor(p + "ffn_down_exps.weight", mat(X, E, ff))
            if sh:
                w.add_tensor(p + "ffn_gate_shexp.weight", mat(sh, E))
                w.add_tensor(p + "ffn_up_shexp.weight", mat(sh, E))
                w.add_tensor(p + "ffn_down_shexp.weight", mat(E, sh))
        else:
            w.add_tensor(p + "ffn_gate.weight", mat(ff, E))
            w.add_tensor(p + "ffn_up.weight", mat(ff, E))
            w.add_tensor(p + "ffn_down.weight", mat(E, ff))
    w.add_tensor("output_norm.weight", vec(E, base=1.0))
    w.add_tensor("output.weight", mat(spec.n_vocab, E))
    return _finish(w, path)


def _write_llama4(path: Path, spec: MoeSpec) -> Path:
    """Llama 4: every `moe_layer_step`-th layer MoE (sigmoid router over top-k, the router weight
    applied to the input before the experts, plus one shared expert of the same width), the others
    dense; 3 chunked-attention layers then 1 full layer (the loader's default pattern), and the full
    layers are also the NoPE layers (hard-coded: (il + 1) % 4 == 0), whose Q is scaled by the
    temperature input instead of roped. Roped layers take an unweighted L2 (rms) norm of Q and K.

    No `attention.sliding_window` key: 0 would mean "no chunking" and then the decode aborts (the
    graph always builds the temperature input, whose scale the loader leaves 0); any other value is
    overwritten with 8192 by the loader."""
    step = spec.moe_layer_step
    if spec.n_expert <= 0 or not 0 < spec.n_expert_used <= spec.n_expert:
        raise ValueError("llama4 needs experts (the loader refuses n_expert == 0)")
    if spec.n_expert == 128:
        raise ValueError("n_expert 128 is Maverick's type: the loader then drops the Q/K L2 norm")
    E, H, Hkv, hd, X = spec.n_embd, spec.n_head, spec.n_head_kv, spec.head_dim, spec.n_expert
    weights = _Weights(spec)
    mat, vec = weights.mat, weights.vec

    w = _start(path, spec, f"synthetic-llama4-{spec.n_layer}L-{X}x{spec.n_expert_used}")
    w.add_feed_forward_length(spec.n_ff)  # the dense layers' width
    w.add_expert_feed_forward_length(spec.n_ff_exp)  # required (routed and shared experts' width)
    w.add_interleave_moe_layer_step(step)  # required
    w.add_expert_count(X)
    w.add_expert_used_count(spec.n_expert_used)
    w.add_head_count_kv(Hkv)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(hd)  # the graph asserts n_rot == head_dim
    w.add_rope_freq_base(10000.0)

    w.add_tensor("token_embd.weight", mat(spec.n_vocab, E, scale=spec.embd_scale))
    for il in range(spec.n_layer):
        p = f"blk.{il}."
        w.add_tensor(p + "attn_norm.weight", vec(E, base=1.0))
        w.add_tensor(p + "attn_q.weight", mat(H * hd, E))
        w.add_tensor(p + "attn_k.weight", mat(Hkv * hd, E))
        w.add_tensor(p + "attn_v.weight", mat(Hkv * hd, E))
        w.add_tensor(p + "attn_output.weight", mat(E, H * hd))
        w.add_tensor(p + "ffn_norm.weight", vec(E, base=1.0))
        if step > 0 and (il + 1) % step == 0:
            ff = spec.n_ff_exp
            w.add_tensor(p + "ffn_gate_inp.weight", mat(X, E, scale=1.0))
            w.add_tensor(p + "ffn_gate_exps.weight", mat(X, ff, E))
            w.add_tensor(p + "ffn_up_exps.weight", mat(X, ff, E))
            w.add_tensor(p + "ffn_down_exps.weight", mat(X, E, ff))
            w.add_tensor(p + "ffn_gate_shexp.weight", mat(ff, E))
            w.add_tensor(p + "ffn_up_shexp.weight", mat(ff, E))
            w.add_tensor(p + "ffn_down_shexp.weight", mat(E, ff))
        else:
            w.add_tensor(p + "ffn_gate.weight", mat(spec.n_ff, E))
            w.add_tensor(p + "ffn_up.weight", mat(spec.n_ff, E))
            w.add_tensor(p + "ffn_down.weight", mat(E, spec.n_ff))
    w.add_tensor("output_norm.weight", vec(E, base=1.0))
    w.add_tensor("output.weight", mat(spec.n_vocab, E))
    return _finish(w, path)


def _write_mistral3(path: Path, spec: MoeSpec) -> Path:
    """Mistral 3 (Ministral 3 / Mistral Small 3.x text): llama-shaped and dense (n_expert is ignored:
    no expert_count is written), NORM rope with YaRN scaling, and the "llama 4" attention
    temperature: after RoPE, Q *= 1 + beta * log(1 + floor(pos / original_context_length)) in every
    layer (inputs built once before the layer loop)."""
    arch = spec.architecture
    # YaRN over an original context of 8 tokens and the temperature's beta: a 12-token prompt has
    # scaled (pos >= 8) and unscaled rows
    temp, yarn, orig, log_mul = 0.1, 4.0, 8, 1.0
    E, H, Hkv, hd = spec.n_embd, spec.n_head, spec.n_head_kv, spec.head_dim
    weights = _Weights(spec)
    mat, vec = weights.mat, weights.vec

    w = _start(path, spec, f"synthetic-mistral3-{spec.n_layer}L")
    w.add_feed_forward_length(spec.n_ff)
    w.add_head_count_kv(Hkv)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(hd)  # the graph asserts n_rot == head_dim
    w.add_rope_freq_base(10000.0)
    if yarn:
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(yarn)
        w.add_rope_scaling_yarn_log_mul(log_mul)
        w.add_float32(f"{arch}.rope.scaling.yarn_beta_fast", 32.0)
        w.add_float32(f"{arch}.rope.scaling.yarn_beta_slow", 1.0)
    if yarn or temp:
        w.add_rope_scaling_orig_ctx_len(orig)  # n_ctx_orig_yarn (else n_ctx_train)
    if temp:
        w.add_attn_temperature_scale(temp)

    w.add_tensor("token_embd.weight", mat(spec.n_vocab, E, scale=spec.embd_scale))
    for il in range(spec.n_layer):
        p = f"blk.{il}."
        w.add_tensor(p + "attn_norm.weight", vec(E, base=1.0))
        w.add_tensor(p + "attn_q.weight", mat(H * hd, E))
        w.add_tensor(p + "attn_k.weight", mat(Hkv * hd, E))
        w.add_tensor(p + "attn_v.weight", mat(Hkv * hd, E))
        w.add_tensor(p + "attn_output.weight", mat(E, H * hd))
        w.add_tensor(p + "ffn_norm.weight", vec(E, base=1.0))
        w.add_tensor(p + "ffn_gate.weight", mat(spec.n_ff, E))
        w.add_tensor(p + "ffn_up.weight", mat(spec.n_ff, E))
        w.add_tensor(p + "ffn_down.weight", mat(E, spec.n_ff))
    w.add_tensor("output_norm.weight", vec(E, base=1.0))
    w.add_tensor("output.weight", mat(spec.n_vocab, E))
    return _finish(w, path)


def _write_minimax_m2(path: Path, spec: MoeSpec) -> Path:
    """MiniMax-M2: every layer MoE with sigmoid gating and a selection bias (exp_probs_b), top-k
    renormalised; Q and K rms-normed over all heads at once (weights of H*hd and Hkv*hd), then a
    partial NEOX rope (rope_dim of head_dim). The expert width is `feed_forward_length` (the loader
    shapes the experts by n_ff), and `expert_feed_forward_length` is required too: both n_ff_exp."""
    if spec.n_expert <= 0 or not 0 < spec.n_expert_used <= spec.n_expert:
        raise ValueError("minimax-m2 is MoE in every layer")
    if spec.rope_dim > spec.head_dim or spec.rope_dim % 2:
        raise ValueError("rope_dim must be even and at most head_dim")
    E, H, Hkv, hd, X, ff = spec.n_embd, spec.n_head, spec.n_head_kv, spec.head_dim, spec.n_expert, spec.n_ff_exp
    weights = _Weights(spec)
    mat, vec = weights.mat, weights.vec

    w = _start(path, spec, f"synthetic-minimax-m2-{spec.n_layer}L-{X}x{spec.n_expert_used}")
    w.add_feed_forward_length(ff)  # the experts' shape comes from this key
    w.add_expert_feed_forward_length(ff)  # required by load_arch_hparams
    w.add_expert_count(X)
    w.add_expert_used_count(spec.n_expert_used)
    w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)  # optional key, but 0 (none) aborts the graph build
    w.add_head_count_kv(Hkv)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(spec.rope_dim)
    w.add_rope_freq_base(10000.0)

    w.add_tensor("token_embd.weight", mat(spec.n_vocab, E, scale=spec.embd_scale))
    for il in range(spec.n_layer):
        p = f"blk.{il}."
        w.add_tensor(p + "attn_norm.weight", vec(E, base=1.0))
        w.add_tensor(p + "attn_q.weight", mat(H * hd, E))
        w.add_tensor(p + "attn_k.weight", mat(Hkv * hd, E))
        w.add_tensor(p + "attn_v.weight", mat(Hkv * hd, E))
        w.add_tensor(p + "attn_q_norm.weight", vec(H * hd, base=1.0))
        w.add_tensor(p + "attn_k_norm.weight", vec(Hkv * hd, base=1.0))
        w.add_tensor(p + "attn_output.weight", mat(E, H * hd))
        w.add_tensor(p + "ffn_norm.weight", vec(E, base=1.0))
        w.add_tensor(p + "ffn_gate_inp.weight", mat(X, E, scale=1.0))
        w.add_tensor(p + "ffn_gate_exps.weight", mat(X, ff, E))
        w.add_tensor(p + "ffn_up_exps.weight", mat(X, ff, E))
        w.add_tensor(p + "ffn_down_exps.weight", mat(X, E, ff))
        w.add_tensor(p + "exp_probs_b.bias", vec(X))
    w.add_tensor("output_norm.weight", vec(E, base=1.0))
    w.add_tensor("output.weight", mat(spec.n_vocab, E))  # required: no tied-embedding fallback
    return _finish(w, path)


#: the certification fixtures: small, with every kind of layer each family has
CERTIFICATION_SPECS = {
    "mixtral": MoeSpec(family="mixtral", n_ff=48, seed=31),
    "qwen3moe": MoeSpec(family="qwen3moe", seed=32),
    "gpt-oss": MoeSpec(family="gpt-oss", n_expert=8, n_expert_used=2, sliding_window=4, seed=33),
    "deepseek2": MoeSpec(family="deepseek2", n_dense_lead=1, n_shared=1, n_nextn=1, seed=34),
    "glm4moe": MoeSpec(family="glm4moe", n_dense_lead=1, n_shared=1, n_nextn=1, seed=35),
    "nemotron_h": MoeSpec(family="nemotron_h", n_layer=8, n_expert=0, n_expert_used=0, seed=36),
    "qwen35": MoeSpec(family="qwen35", n_layer=8, n_expert=0, n_expert_used=0, seed=37),
    # attention 3 and 7, gated delta-net elsewhere; every layer MoE with a gated shared expert; an MTP block
    "qwen35moe": MoeSpec(family="qwen35moe", n_layer=8, n_nextn=1, seed=38),
    # attention 2 and 6, Mamba-2 elsewhere; every layer MoE with a shared expert
    "granitehybrid": MoeSpec(family="granitehybrid", n_layer=8, layer_kinds="MMAMMMAM", seed=39),
    # MoE (with a shared expert) on odd layers, dense on even; chunked attention, and layer 3 full with no rope
    "llama4": MoeSpec(family="llama4", seed=40),
    "mistral3": MoeSpec(family="mistral3", n_expert=0, n_expert_used=0, seed=41),
    "minimax-m2": MoeSpec(family="minimax-m2", rope_dim=8, seed=42),
    # fused QKV and gate/up, long/short rope factors (its sliding window is read and switched off)
    "phi3": MoeSpec(family="phi3", n_expert=0, n_expert_used=0, seed=43),
    # qwen35moe's layers with a plain rope and a fused beta/alpha projection; an MTP block
    "qwen3next": MoeSpec(family="qwen3next", n_layer=8, n_nextn=1, seed=44),
    # Mamba-2, attention and MoE layers (sigmoid routing, a shared expert); an MTP block
    "nemotron_h_moe": MoeSpec(family="nemotron_h_moe", n_layer=8, n_nextn=1, seed=45),
    # sliding layers and every 3rd full (other head size, K as V), a dense MLP beside routed experts
    # in every layer (26B-A4B's shape); no per-layer inputs, no shared KV (those files are refused)
    "gemma4": MoeSpec(family="gemma4", n_expert=4, n_expert_used=2, sliding_window=4, seed=46),
    # the same without experts (31B's shape)
    "gemma4-dense": MoeSpec(family="gemma4", n_expert=0, n_expert_used=0, sliding_window=4, seed=47),
}


def recurrent_layers(spec: MoeSpec) -> list[int]:
    """The layers of `spec` whose state is recurrent (none for a MoE family)."""
    if spec.family in ("nemotron_h", "nemotron_h_moe", "granitehybrid"):
        return [il for il, kind in enumerate(spec.layer_kinds) if kind == "M"]
    if spec.family in ("qwen35", "qwen35moe", "qwen3next"):
        return [il for il in range(spec.n_layer) if (il + 1) % 4 != 0]
    return []


def moe_layers(spec: MoeSpec) -> list[int]:
    """The layers of `spec` with routed experts (none for a dense family)."""
    if not spec.n_expert or spec.family in ("nemotron_h", "qwen35", "mistral3", "phi3"):
        return []
    if spec.family == "nemotron_h_moe":
        return [il for il, kind in enumerate(spec.layer_kinds) if kind == "F"]
    if spec.family == "llama4":
        return [il for il in range(spec.n_layer) if (il + 1) % spec.moe_layer_step == 0]
    return list(range(spec.n_dense_lead, spec.n_layer))


#: models for benchmarks (docs/benchmarks.md), not tests: a MoE of 64 experts, top-8, about 1 GB (f16),
#: and a hybrid of about the same compute per token
BENCHMARK_SPECS = {
    "bench-moe": MoeSpec(
        family="qwen3moe",
        n_layer=8,
        n_embd=1024,
        n_head=16,
        n_head_kv=4,
        head_dim=64,
        n_expert=64,
        n_expert_used=8,
        n_ff_exp=256,
        n_vocab=32000,
        f16=True,
        seed=101,
    ),
    "bench-hybrid": MoeSpec(
        family="nemotron_h",
        n_layer=16,
        n_embd=1024,
        n_head=16,
        n_head_kv=4,
        head_dim=64,
        n_ff=4096,
        n_expert=0,
        n_expert_used=0,
        layer_kinds="MMAFMMAFMMAFMMAF",
        ssm_heads=16,
        ssm_groups=4,
        ssm_state=64,
        n_vocab=32000,
        f16=True,
        seed=102,
    ),
}


def main(argv: list[str] | None = None) -> int:
    """`python synthetic_families.py OUT.gguf --family F`: the family's certification model (the CTest
    fixture runs it; it imports nothing from llama_shard), or a benchmark model (bench-moe, bench-hybrid)."""
    import argparse

    specs = {**CERTIFICATION_SPECS, **BENCHMARK_SPECS}
    ap = argparse.ArgumentParser(description="write a synthetic random MoE or hybrid GGUF")
    ap.add_argument("out")
    ap.add_argument("--family", choices=sorted(specs), required=True)
    a = ap.parse_args(argv)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    write_moe_gguf(a.out, specs[a.family])
    print(a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
