"""Llama-family decoder (Llama/SmolLM2, Mistral, Qwen2, Qwen3) over a paged KV cache.

Written for batch-1 CPU decoding, where Python and per-op overhead rival the matmuls:
- q/k/v are one projection and gate/up another (the loader fuses them), so a layer is
  four matmuls.
- q and k sit next to each other in the fused projection, so the Qwen3 q/k norm and RoPE
  each run once on a [T, Hq + Hkv, D] view instead of separately on q and k.
- cos/sin are looked up once per forward and shared by every layer; sin carries
  rotate_half's sign, making RoPE three ops (mul, roll, addcmul).
- Residual adds happen in place on freshly produced outputs. As in vLLM, the residual
  stream is carried beside each layer's output: a layer returns its MLP's output without
  adding it, and the next norm (the next layer's input norm, the final norm) adds it, so
  that on the Triton ops every residual add is fused with the norm after it.
- Each projection and the LM head is a PackedLinear (specdec/models/linear.py) holding
  its linear backend (kernels/linear.py: fp32 F.linear by default, fp16, int8, ...) and
  its weight packed for it; `use_linear_backend` repacks them all.
- Attention goes through the model's attention backend (kernels/attention.py), chosen
  once: it plans each step once (`plan`), then every layer stores its K/V and attends.
- The norms with the residual adds, SiLU-and-multiply and RoPE with the K/V store go
  through the model's layer ops (kernels/layer_ops.py), chosen once with the
  attention backend: torch's ops, or with the triton backend fused Triton kernels.
- This module's forward is the Python layer code; what runs a forward (these layers, the
  C++ layer loop of kernels/decoder_cpu.py over the same kernels, CUDA graphs) is an
  executor the engine chooses (specdec/executor.py), which this class does not know.
Parameters have requires_grad=False: this is an inference engine, and it keeps autograd
out of the way even when a caller forgets torch.inference_mode().
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdec.kernels import AttentionBackend, AttentionMetadata, AttentionPlan, PagedKV
from specdec.kernels.layer_ops import TORCH_OPS, LayerOps, apply_rope, layer_ops_for, rms_norm
from specdec.kernels.linear_base import LinearBackend
from specdec.models.config import ModelConfig, RopeConfig
from specdec.models.linear import PackedLinear, install_linears, pack_linears


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    # Uninitialised: the loader overwrites every parameter.
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def _optional_param(
    present: bool, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str
) -> nn.Parameter | None:
    return _param(shape, dtype, device) if present else None


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


# apply_rope and rms_norm (the torch ops, kernels/layer_ops.py) stay importable from here.
__all__ = ["LlamaDecoderLayer", "LlamaForCausalLM", "apply_rope", "rms_norm", "rope_cache", "rope_inv_freq"]


def _copy_features(
    residual: Tensor,  # [T, hidden]: the residual stream entering layer `index`
    index: int,
    capture: tuple[Sequence[int], Tensor],  # (layer ids, out [T, len(ids) * hidden])
) -> None:
    """The stream into every column block of out whose layer id is `index`."""
    width = residual.shape[1]
    for k in (k for k, layer_id in enumerate(capture[0]) if layer_id == index):
        capture[1][:, k * width : (k + 1) * width].copy_(residual)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU MLP block with fused projections; `ops` (torch's by
    default) computes its norms, activation and RoPE with the K/V store. The residual
    stream is carried outside: `norm_input` forms the stream entering the layer (adding
    the previous layer's output) and its normed input, `forward` runs the rest and
    leaves its output to the next norm to add."""

    qk_norm: nn.Parameter | None

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                 ops: LayerOps = TORCH_OPS):
        super().__init__()
        self.ops = ops
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
        self.qkv_proj = PackedLinear(hidden, qkv_width, config.attention_bias, dtype, device)
        qk_heads = config.num_heads + config.num_kv_heads
        self.qk_norm = _optional_param(config.qk_norm, (qk_heads, config.head_dim), dtype, device)
        self.o_proj = PackedLinear(q_width, hidden, config.o_proj_bias, dtype, device)

    def _init_mlp(
        self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        hidden, inter = config.hidden_size, config.intermediate_size
        self.post_attn_norm = _param((hidden,), dtype, device)
        self.gate_up_proj = PackedLinear(hidden, 2 * inter, config.mlp_bias, dtype, device)
        self.down_proj = PackedLinear(inter, hidden, config.mlp_bias, dtype, device)

    def norm_input(
        self,
        hidden: Tensor,  # [T, hidden]: the previous layer's output (overwritten), or the embedding
        residual: Tensor | None,  # [T, hidden]: the stream it adds to; None for the first layer
    ) -> tuple[Tensor, Tensor]:  # the normed input [T, hidden], the residual stream entering this layer
        return self.ops.residual_norm(hidden, residual, self.input_norm, self.eps)

    def forward(
        self,
        attn_in: Tensor,  # [T, hidden]: norm_input's normed input
        residual: Tensor,  # [T, hidden]: the residual stream entering this layer
        cos: Tensor,  # [T, 1, D]
        sin: Tensor,  # [T, 1, D]
        kv_cache: PagedKV,
        attention: AttentionBackend[Any],
        plan: AttentionPlan,  # attention.plan of this step
    ) -> tuple[Tensor, Tensor]:  # the MLP's output [T, hidden], not yet added; the residual stream
        attn_out = self._attention(attn_in, cos, sin, kv_cache, attention, plan)
        mlp_in, residual = self.ops.add_rms_norm(attn_out, residual, self.post_attn_norm, self.eps)
        return self._mlp(mlp_in), residual

    def _attention(
        self,
        x: Tensor,  # [T, hidden], normalised
        cos: Tensor,  # [T, 1, D]
        sin: Tensor,  # [T, 1, D]
        kv_cache: PagedKV,
        attention: AttentionBackend[Any],
        plan: AttentionPlan,
    ) -> Tensor:  # [T, hidden]
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (Hq + 2 Hkv) * D]
        qk = qkv[:, : self.qk_width].view(num_tokens, -1, self.head_dim)  # [T, Hq + Hkv, D]
        v = qkv[:, self.qk_width :].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm is not None:
            qk = self.ops.rms_norm(qk, self.qk_norm, self.eps)
        q = self.ops.rope_store_kv(qk, v, cos, sin, self.num_heads, kv_cache, attention, plan)
        out = attention.forward(q, kv_cache, plan, self.scale)  # [T, Hq, D]
        return self.o_proj(out.reshape(num_tokens, -1))

    def _mlp(self, x: Tensor) -> Tensor:  # [T, hidden] -> [T, hidden]
        gate_up = self.gate_up_proj(x)  # [T, 2 I]
        return self.down_proj(self.ops.silu_mul(gate_up))


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM reading and writing a paged KV cache.

    Construct with `specdec.models.load_model`; a bare constructor leaves weights
    uninitialised. Call under torch.inference_mode().

    `attention_backend` (a plain attribute; an executor chosen for the model assumes it
    stays) computes attention; `layer_ops`, chosen with it at construction and shared by
    every layer, the norms, activation and RoPE (kernels/layer_ops.py). Every projection
    starts on the fp32 linear backend until `use_linear_backend`.
    """

    rope_cos: Tensor
    rope_sin: Tensor

    def __init__(
        self,
        config: ModelConfig,
        attention_backend: AttentionBackend[Any],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        max_positions: int | None = None,
    ):
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.attention_backend = attention_backend
        self.layer_ops = layer_ops_for(attention_backend)
        hidden, vocab = config.hidden_size, config.vocab_size
        self.embed_tokens = _param((vocab, hidden), dtype, device)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, dtype, device, self.layer_ops) for _ in range(config.num_layers)
        )
        self.norm = _param((hidden,), dtype, device)
        tied = self.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = PackedLinear(hidden, vocab, False, dtype, device, weight=tied)
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
        return self.lm_head.weight

    @property
    def linear_backend(self) -> LinearBackend:
        """The linear backend every projection runs on."""
        return self.lm_head.backend

    def use_linear_backend(self, backend: LinearBackend) -> None:
        """Repack every projection (qkv, o, gate_up, down) and the LM head for `backend`
        and make the forward use them; the parameters are left as they are. ValueError if
        `backend` needs float32 and the model is not. Once an executor runs the model,
        repack through it (Executor.use_linear_backend): it may hold the packings."""
        install_linears(self, pack_linears(self, backend))

    def tie_weights(self) -> None:
        """Point a tied LM head at the current embedding table (after the loader replaced
        it) and repack it for its backend."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens
            self.lm_head.use_backend(self.lm_head.backend)

    def forward(
        self,
        input_ids: Tensor,  # [T] int64
        positions: Tensor,  # [T] int64, RoPE positions (tree nodes: prefix_len + depth)
        kv_caches: list[PagedKV],  # one per layer
        meta: AttentionMetadata,
        # (layer ids, out [T, len(ids) * hidden]): the residual stream entering each of those
        # layers is copied into its column block of out (EAGLE-3's target features)
        capture: tuple[Sequence[int], Tensor] | None = None,
    ) -> Tensor:  # [T, hidden], after the final norm
        attention = self.attention_backend
        plan = attention.plan(meta, kv_caches[0])  # once per step, for every layer
        hidden = F.embedding(input_ids, self.embed_tokens)
        residual: Tensor | None = None  # the residual stream, carried beside each layer's output
        cos = F.embedding(positions, self.rope_cos).unsqueeze(1)  # [T, 1, D]
        sin = F.embedding(positions, self.rope_sin).unsqueeze(1)
        layers = cast("Sequence[LlamaDecoderLayer]", self.layers)  # an nn.ModuleList holds plain Modules
        for index, (layer, kv_cache) in enumerate(zip(layers, kv_caches, strict=True)):
            attn_in, residual = layer.norm_input(hidden, residual)
            if capture is not None and index in capture[0]:
                _copy_features(residual, index, capture)
            hidden, residual = layer(attn_in, residual, cos, sin, kv_cache, attention, plan)
        return self.layer_ops.residual_norm(hidden, residual, self.norm, self.config.rms_norm_eps)[0]

    def compute_logits(self, hidden: Tensor) -> Tensor:  # [N, hidden] -> [N, vocab] float32
        return self.lm_head(hidden).float()

    def hf_embedding_weights(self) -> dict[str, Tensor]:
        """Embedding and LM head under their HF names, e.g. as `fallback_weights` for a
        draft model checkpoint stored without them."""
        return {
            "model.embed_tokens.weight": self.embed_tokens,
            "lm_head.weight": self.lm_head_weight,
        }
