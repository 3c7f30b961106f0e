"""The slow, obviously correct oracles every backend is tested against.

Each computes what its kernels mean in the plainest way, element by element where that
is clearest, in float64 (stores write the cache's own dtype). None of it is on any hot
path, and none of it shares code with the backends beyond the storage format's
definition (kv_cache.quantize_fp8: scale = amax / 448 per slot and head).
"""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from specdec.kernels.kv_cache import PagedKV, quantize_fp8
from specdec.kernels.metadata import AttentionMetadata


def linear(x: torch.Tensor,  # [M, in]
           weight: torch.Tensor,  # [out, in]
           bias: torch.Tensor | None = None,  # [out]
           ) -> torch.Tensor:  # [M, out] float64
    """x @ weight.T + bias, in float64."""
    out = x.double() @ weight.double().T
    return out if bias is None else out + bias.double()


def dequantize_gguf(blocks: torch.Tensor,  # [rows, row bytes] uint8: each row's GGUF blocks
                    ggml_type: GGMLQuantizationType,
                    cols: int) -> torch.Tensor:  # [rows, cols] float32
    """A matrix stored in GGUF blocks, dequantized by the gguf package (llama.cpp's
    definition of every block type); each row's weights past `cols` (padding) dropped."""
    rows = blocks.shape[0]
    values = dequantize(blocks.numpy().astype(np.uint8, copy=False), ggml_type).reshape(rows, -1)
    return torch.from_numpy(np.ascontiguousarray(values[:, :cols], dtype=np.float32))


def linear_gguf(x: torch.Tensor,  # [M, in]
                blocks: torch.Tensor,  # [out, row bytes] uint8 GGUF blocks of an [out, in] weight
                ggml_type: GGMLQuantizationType,
                bias: torch.Tensor | None = None,  # [out]
                ) -> torch.Tensor:  # [M, out] float64
    """x @ W.T + bias for W the dequantized GGUF weight, in float64."""
    return linear(x, dequantize_gguf(blocks, ggml_type, x.shape[1]), bias)


def quantize_activations_int8(x: torch.Tensor,  # [M, K] float32, K a multiple of 32
                              ) -> tuple[torch.Tensor, torch.Tensor]:  # [M, K] int8, [M, K / 32] float32
    """Each row's 32-value blocks in int8 with one float32 scale d each, as ggml quantizes
    activations: d = max |x| / 127, q = x * (1 / d) rounded to nearest, ties to even (d = 0,
    q = 0 for a block of zeros). Each step is computed in float64 and rounded to float32,
    which is exactly the float32 operation (float64 holds float32 products and quotients
    with room to round once)."""
    blocks = x.float().reshape(x.shape[0], -1, 32).double()
    scale = (blocks.abs().amax(-1) / 127).float()
    inverse = torch.where(scale != 0, 1 / scale.double(), 0.0).float()
    quants = torch.round((blocks * inverse.double()[..., None]).float())
    return quants.to(torch.int8).reshape(x.shape), scale


def linear_gguf_int8(x: torch.Tensor,  # [M, in]
                     blocks: torch.Tensor,  # [out, row bytes] uint8 GGUF blocks of an [out, in] weight
                     ggml_type: GGMLQuantizationType,
                     bias: torch.Tensor | None = None,  # [out]
                     ) -> torch.Tensor:  # [M, out] float64
    """What the int8-activation kernel computes, in float64: x quantized to int8 blocks
    (x padded with zeros to whole blocks), dequantized (q * d) and multiplied by the
    dequantized GGUF weight, + bias. The kernel differs only by its float32 step per block."""
    cols = x.shape[1]
    padded = -(-cols // 32) * 32
    quants, scale = quantize_activations_int8(torch.nn.functional.pad(x.float(), (0, padded - cols)))
    dequantized = quants.double().reshape(x.shape[0], -1, 32) * scale.double()[..., None]
    return linear(dequantized.reshape(x.shape[0], padded)[:, :cols], dequantize_gguf(blocks, ggml_type, cols), bias)


def rms_norm(x: torch.Tensor,  # [..., D]
             weight: torch.Tensor,  # [D]
             eps: float) -> torch.Tensor:  # [..., D] float64
    """x / sqrt(mean(x^2) + eps) * weight over the last dim, in float64."""
    x = x.double()
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * weight.double()


def store_kv(key: torch.Tensor,  # [T, Hkv, D]
             value: torch.Tensor,  # [T, Hkv, D]
             kv: PagedKV,
             slot_mapping: torch.Tensor,  # [T] int64 flat slots
             ) -> None:
    """Token t's K and V into slot slot_mapping[t], one token at a time: cast to the
    cache dtype, or for fp8 divided by a per-(slot, head) scale stored beside it."""
    for t, slot in enumerate(slot_mapping.tolist()):
        block, offset = divmod(slot, kv.block_size)
        for x, cache, scale in ((key, kv.k, kv.k_scale), (value, kv.v, kv.v_scale)):
            if scale is None:
                cache[block, offset] = x[t].to(cache.dtype)
                continue
            data, row_scale = quantize_fp8(x[t : t + 1])  # [1, Hkv, D] fp8, [1, Hkv]
            cache[block, offset].view(torch.uint8).copy_(data[0].view(torch.uint8))
            scale[block, offset] = row_scale[0]


def read_kv(cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
            scale: torch.Tensor | None,  # [num_blocks, block_size, Hkv] float32 for fp8, else None
            table: torch.Tensor,  # [max_blocks] the request's block ids
            length: int) -> torch.Tensor:  # [length, Hkv, D] float64
    """Positions 0..length-1 of one request, read slot by slot through its block table
    (fp8: the stored value times its scale)."""
    block_size = cache.shape[1]
    rows = []
    for pos in range(length):
        block, offset = int(table[pos // block_size]), pos % block_size
        row = cache[block, offset].double()
        rows.append(row if scale is None else row * scale[block, offset].double()[:, None])
    return torch.stack(rows) if rows else cache.new_zeros(0, *cache.shape[2:], dtype=torch.float64)


def paged_attention(query: torch.Tensor,  # [T, Hq, D]
                    kv: PagedKV,
                    meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:  # [T, Hq, D] float64
    """Dense masked attention, per request, query row and head, with an explicit softmax:
    row i of request b sees the context before its query tokens and, among them, the
    causal prefix (or exactly what meta.tree_mask marks). Query head h reads kv head
    h // (Hq / Hkv)."""
    hq, hkv = query.shape[1], kv.k.shape[2]
    out = torch.empty(query.shape, dtype=torch.float64)
    for b, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        start, prefix = int(meta.query_start_loc[b]), seq_len - q_len
        table = meta.block_tables[b]
        k, v = read_kv(kv.k, kv.k_scale, table, seq_len), read_kv(kv.v, kv.v_scale, table, seq_len)
        for i in range(q_len):
            visible = [p < prefix or _sees(meta, start, i, p - prefix) for p in range(seq_len)]
            for h in range(hq):
                kh = h // (hq // hkv)
                scores = (k[visible, kh] @ query[start + i, h].double()) * scale
                out[start + i, h] = torch.softmax(scores, 0) @ v[visible, kh]
    return out


def _sees(meta: AttentionMetadata, start: int, i: int, j: int) -> bool:
    """Whether query token i of the request starting at row `start` sees its query token j."""
    if meta.tree_mask is None:
        return j <= i
    return bool(meta.tree_mask[start + i, j])


def add_rms_norm(x: torch.Tensor,  # [T, D] the branch output
                 residual: torch.Tensor,  # [T, D]
                 weight: torch.Tensor,  # [D]
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:  # [T, D] float64, [T, D] x's dtype
    """The residual add (rounded to the model dtype, as the model keeps its residual
    stream) and the RMSNorm of the sum, in float64."""
    total = x + residual
    return rms_norm(total, weight, eps), total


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2 I] -> [T, I] float64
    """SiLU of the first half times the second half, in float64."""
    gate, up = gate_up.double().chunk(2, dim=-1)
    return gate * torch.sigmoid(gate) * up


def rope(x: torch.Tensor,  # [T, H, D]
         cos: torch.Tensor,  # [T, D]
         sin: torch.Tensor,  # [T, D], rotate_half's sign folded into its first half
         ) -> torch.Tensor:  # [T, H, D] float64
    """Rotate-half RoPE: x * cos + [x2, x1] * sin, in float64."""
    x = x.double()
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return x * cos.double()[:, None] + swapped * sin.double()[:, None]


def rope_store_kv(qk: torch.Tensor,  # [T, Hq + Hkv, D]
                  value: torch.Tensor,  # [T, Hkv, D]
                  cos: torch.Tensor,  # [T, D]
                  sin: torch.Tensor,  # [T, D]
                  num_heads: int,
                  kv: PagedKV,
                  slot_mapping: torch.Tensor,  # [T] int64
                  ) -> torch.Tensor:  # [T, Hq, D] float64: the rotated q
    """RoPE on q and k; k (rounded to the model dtype) and v stored as store_kv does."""
    rotated = rope(qk, cos, sin)
    store_kv(rotated[:, num_heads:].to(qk.dtype), value, kv, slot_mapping)
    return rotated[:, :num_heads]


def sample(logits: torch.Tensor,  # [N, V]
           temperature: torch.Tensor,  # [N]; 0: greedy
           noise: torch.Tensor,  # [N, V] uniform in (0, 1)
           ) -> torch.Tensor:  # [N] int64
    """Gumbel-max sampling, in float64: argmax(logits / T - log(-log u)) per row, or
    argmax(logits) where T is 0 (ties: the lowest index)."""
    logits, t = logits.double(), temperature.double()[:, None]
    perturbed = logits / torch.where(t == 0, 1.0, t) - torch.log(-torch.log(noise.double()))
    return torch.where(t[:, 0] == 0, logits.argmax(-1), perturbed.argmax(-1))
