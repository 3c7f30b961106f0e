"""Llama-family decoder (Llama/SmolLM2, Mistral, Qwen2, Qwen3) over a paged KV cache.

Written for batch-1 CPU decoding, where Python and per-op overhead rival the matmuls:
- q/k/v are one Linear and gate/up another (the loader fuses them), so a layer is four
  matmuls; we call F.linear on raw parameters rather than through nn.Linear modules.
- q and k sit next to each other in the fused projection, so the Qwen3 q/k norm and RoPE
  each run once on a [T, Hq + Hkv, D] view instead of separately on q and k.
- cos/sin are looked up once per forward and shared by every layer; sin carries
  rotate_half's sign, making RoPE three ops (mul, roll, addcmul).
- Residual adds happen in place on freshly produced outputs.
- Projections and the LM head can run on a packed CPU linear backend (fp16, int8, ...,
  see specdec/models/linear.py): `linear` is then set and each projection multiplies by
  its `*_packed` weight; with `linear` None (fp32, the default) they call F.linear on the
  parameters exactly as before.
Parameters have requires_grad=False: this is an inference engine, and it keeps autograd
out of the way even when a caller forgets torch.inference_mode().
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdec.kernels import AttentionMetadata, PagedKV, paged_attention, rms_norm_cpu, store_kv
from specdec.models.config import ModelConfig, RopeConfig

if TYPE_CHECKING:
    from specdec.models.linear import LinearBackend


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    # Uninitialised: the loader overwrites every parameter.
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def _optional_param(
    present: bool, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str
) -> nn.Parameter | None:
    return _param(shape, dtype, device) if present else None


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim; weight is [D] or broadcastable like [H, D]."""
    if rms_norm_cpu.supports(x, weight):
        return rms_norm_cpu.rms_norm_cpu(x, weight, eps)
    if x.dtype == torch.float32 and weight.dim() == 1:
        return F.rms_norm(x, weight.shape, weight, eps)  # one fused op on the hot path
    # Like HF: normalise in fp32, cast back, then scale in the model dtype.
    normed = F.rms_norm(x.float(), (x.shape[-1],), None, eps)
    return normed.to(x.dtype) * weight


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> Tensor:  # [D/2] float32
    """Per-pair rotation frequencies, computed in fp32 as the HF reference does."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope)
    return inv_freq


def _llama3_inv_freq(inv_freq: Tensor, rope: RopeConfig) -> Tensor:  # [D/2] -> [D/2]
    """Llama 3 scaling: slow frequencies are divided by `factor`, fast ones kept,
    and those in between interpolated linearly in 1/wavelength."""
    wavelen = 2 * math.pi / inv_freq
    context = rope.original_max_position_embeddings
    long_wavelen = context / rope.low_freq_factor  # longer than this: fully scaled
    short_wavelen = context / rope.high_freq_factor  # shorter than this: untouched
    smooth = (context / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    blended = (1 - smooth) * inv_freq / rope.factor + smooth * inv_freq
    kept_or_blended = torch.where(wavelen < short_wavelen, inv_freq, blended)
    return torch.where(wavelen > long_wavelen, inv_freq / rope.factor, kept_or_blended)


def rope_cache(
    rope: RopeConfig, head_dim: int, max_positions: int
) -> tuple[Tensor, Tensor]:  # cos, signed sin: [max_positions, D] float32 each
    """cos/sin tables for rotate-half RoPE; sin's first half is negated so that
    rope(x) = x * cos + roll(x, D/2) * sin  (roll(x) = [x2, x1], rotate_half = [-x2, x1])."""
    inv_freq = rope_inv_freq(rope, head_dim)
    positions = torch.arange(max_positions, dtype=torch.int64).float()
    freqs = torch.outer(positions, inv_freq)  # [P, D/2]
    angles = torch.cat((freqs, freqs), dim=-1)  # [P, D]
    cos, sin = angles.cos(), angles.sin()
    sin[:, : head_dim // 2].neg_()
    return cos, sin


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [T, H, D]; cos, sin: [T, 1, D] from rope_cache -> [T, H, D]."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU MLP block with fused projections."""

    qkv_bias: nn.Parameter | None
    o_bias: nn.Parameter | None
    qk_norm: nn.Parameter | None
    gate_up_bias: nn.Parameter | None
    down_bias: nn.Parameter | None
    # Set by specdec.models.linear.apply_linear_backend; None: F.linear on the parameters.
    linear: LinearBackend | None = None
    qkv_packed: Any = None
    o_packed: Any = None
    gate_up_packed: Any = None
    down_packed: Any = None

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.qk_width = (config.num_heads + config.num_kv_heads) * config.head_dim
        self.intermediate_size = config.intermediate_size
        self.eps = config.rms_norm_eps
        self.scale = config.head_dim**-0.5
        self._init_attention(config, dtype, device)
        self._init_mlp(config, dtype, device)

    def _init_attention(
        self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        hidden, q_width = config.hidden_size, config.num_heads * config.head_dim
        qkv_width = self.qk_width + config.num_kv_heads * config.head_dim
        self.input_norm = _param((hidden,), dtype, device)
        self.qkv_proj = _param((qkv_width, hidden), dtype, device)
        self.qkv_bias = _optional_param(config.attention_bias, (qkv_width,), dtype, device)
        qk_heads = config.num_heads + config.num_kv_heads
        self.qk_norm = _optional_param(config.qk_norm, (qk_heads, config.head_dim), dtype, device)
        self.o_proj = _param((hidden, q_width), dtype, device)
        self.o_bias = _optional_param(config.o_proj_bias, (hidden,), dtype, device)

    def _init_mlp(
        self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        hidden, inter = config.hidden_size, config.intermediate_size
        self.post_attn_norm = _param((hidden,), dtype, device)
        self.gate_up_proj = _param((2 * inter, hidden), dtype, device)
        self.gate_up_bias = _optional_param(config.mlp_bias, (2 * inter,), dtype, device)
        self.down_proj = _param((hidden, inter), dtype, device)
        self.down_bias = _optional_param(config.mlp_bias, (hidden,), dtype, device)

    def forward(
        self,
        hidden: Tensor,  # [T, hidden]
        cos: Tensor,  # [T, 1, D]
        sin: Tensor,  # [T, 1, D]
        kv_cache: PagedKV,
        meta: AttentionMetadata,
    ) -> Tensor:  # [T, hidden]
        attn_in = rms_norm(hidden, self.input_norm, self.eps)
        hidden = self._attention(attn_in, cos, sin, kv_cache, meta).add_(hidden)
        mlp_in = rms_norm(hidden, self.post_attn_norm, self.eps)
        return self._mlp(mlp_in).add_(hidden)

    def _attention(
        self,
        x: Tensor,  # [T, hidden], normalised
        cos: Tensor,  # [T, 1, D]
        sin: Tensor,  # [T, 1, D]
        kv_cache: PagedKV,
        meta: AttentionMetadata,
    ) -> Tensor:  # [T, hidden]
        num_tokens = x.shape[0]
        if self.linear is None:
            qkv = F.linear(x, self.qkv_proj, self.qkv_bias)  # [T, (Hq + 2 Hkv) * D]
        else:
            qkv = self.linear.apply(x, self.qkv_packed)
        qk = qkv[:, : self.qk_width].view(num_tokens, -1, self.head_dim)  # [T, Hq + Hkv, D]
        v = qkv[:, self.qk_width :].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm is not None:
            qk = rms_norm(qk, self.qk_norm, self.eps)
        qk = apply_rope(qk, cos, sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        store_kv(k, v, kv_cache, meta.slot_mapping)
        out = paged_attention(q, kv_cache, meta, self.scale)  # [T, Hq, D]
        if self.linear is None:
            return F.linear(out.reshape(num_tokens, -1), self.o_proj, self.o_bias)
        return self.linear.apply(out.reshape(num_tokens, -1), self.o_packed)

    def _mlp(self, x: Tensor) -> Tensor:  # [T, hidden] -> [T, hidden]
        if self.linear is None:
            gate_up = F.linear(x, self.gate_up_proj, self.gate_up_bias)  # [T, 2 I]
        else:
            gate_up = self.linear.apply(x, self.gate_up_packed)
        gate, up = gate_up[:, : self.intermediate_size], gate_up[:, self.intermediate_size :]
        if self.linear is None:
            return F.linear(F.silu(gate).mul_(up), self.down_proj, self.down_bias)
        return self.linear.apply(F.silu(gate).mul_(up), self.down_packed)


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM reading and writing a paged KV cache.

    Construct with `specdec.models.load_model`; a bare constructor leaves weights
    uninitialised. Call under torch.inference_mode().
    """

    lm_head: nn.Parameter | None  # None when tied to embed_tokens
    rope_cos: Tensor
    rope_sin: Tensor
    # Set by specdec.models.linear.apply_linear_backend (the LM head's packed weight).
    linear: LinearBackend | None = None
    lm_head_packed: Any = None

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        max_positions: int | None = None,
    ):
        super().__init__()
        self.config = config
        self.dtype = dtype
        hidden, vocab = config.hidden_size, config.vocab_size
        self.embed_tokens = _param((vocab, hidden), dtype, device)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, dtype, device) for _ in range(config.num_layers)
        )
        self.norm = _param((hidden,), dtype, device)
        self.lm_head = _optional_param(
            not config.tie_word_embeddings, (vocab, hidden), dtype, device
        )
        self._init_rope(config, max_positions or config.max_position_embeddings, dtype, device)

    def _init_rope(
        self,
        config: ModelConfig,
        max_positions: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        # Tables in the model dtype, as HF casts cos/sin to the activations' dtype.
        cos, sin = rope_cache(config.rope, config.head_dim, max_positions)
        self.register_buffer("rope_cos", cos.to(device=device, dtype=dtype), persistent=False)
        self.register_buffer("rope_sin", sin.to(device=device, dtype=dtype), persistent=False)

    @property
    def max_positions(self) -> int:
        return int(self.rope_cos.shape[0])

    @property
    def lm_head_weight(self) -> Tensor:  # [vocab, hidden]
        return self.embed_tokens if self.lm_head is None else self.lm_head

    def forward(
        self,
        input_ids: Tensor,  # [T] int64
        positions: Tensor,  # [T] int64, RoPE positions (tree nodes: prefix_len + depth)
        kv_caches: list[PagedKV],  # one per layer
        meta: AttentionMetadata,
    ) -> Tensor:  # [T, hidden], after the final norm
        hidden = F.embedding(input_ids, self.embed_tokens)
        cos = F.embedding(positions, self.rope_cos).unsqueeze(1)  # [T, 1, D]
        sin = F.embedding(positions, self.rope_sin).unsqueeze(1)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(hidden, cos, sin, kv_cache, meta)
        return rms_norm(hidden, self.norm, self.config.rms_norm_eps)

    def compute_logits(self, hidden: Tensor) -> Tensor:  # [N, hidden] -> [N, vocab] float32
        if self.linear is None:
            return F.linear(hidden, self.lm_head_weight).float()
        return self.linear.apply(hidden, self.lm_head_packed)

    def hf_embedding_weights(self) -> dict[str, Tensor]:
        """Embedding and LM head under their HF names, e.g. as `fallback_weights` for a
        draft model checkpoint stored without them."""
        return {
            "model.embed_tokens.weight": self.embed_tokens,
            "lm_head.weight": self.lm_head_weight,
        }
