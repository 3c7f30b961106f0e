"""Rotary embedding of q and k fused with the paged KV store, as one Triton kernel: per
token, q is rotated in place, k is rotated and written to the cache with v, in place of
the torch path's rope ops (mul, roll, addcmul) and the store kernel.

RoPE is rotate-half with the model's tables (specdec/models/llama.py `rope_cache`): cos,
and sin with rotate_half's sign folded into its first half, so
rope(x) = x * cos + roll(x, D/2) * sin. The rounding follows the torch path
(kernels/layer_ops.py): x * cos rounded to the model dtype, then + roll(x) * sin in fp32
rounded once. The store is attention_triton.py's (`store_kv_row`): cast to the cache dtype,
or fp8 with per-slot, per-head scales; a negative slot (a CUDA-graph padding token)
stores nothing. Element-wise per token, so batch-invariant.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specdec.kernels.attention_triton import scale_tensors, store_kv_row
from specdec.kernels.kv_cache import PagedKV


@triton.jit
def _rotate(ptrs, partner_ptrs, cos, sin, mask):
    """[H_P, D_P] heads rotated: x * cos + x[(d + D/2) % D] * sin, in fp32."""
    x = tl.load(ptrs, mask=mask, other=0.0)
    partner = tl.load(partner_ptrs, mask=mask, other=0.0).to(tl.float32)
    first = (x.to(tl.float32) * cos[None, :]).to(x.dtype).to(tl.float32)
    return first + partner * sin[None, :]


@triton.jit
def _rope_store_kernel(
    qk_ptr,  # [T, Hq + Hkv, D]: q heads rotated in place
    v_ptr,  # [T, Hkv, D]
    cos_ptr,  # [T, D]
    sin_ptr,  # [T, D], rotate_half's sign folded in
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    k_scale_ptr,  # [num_blocks, block_size, Hkv] float32 (unused unless IS_FP8)
    v_scale_ptr,  # [num_blocks, block_size, Hkv] float32 (unused unless IS_FP8)
    slot_ptr,  # [T] int64
    s_qkt, s_qkh, s_vt, s_vh, s_cos, s_sin,
    s_cslot, s_ch, s_sslot,  # cache strides (flat slot, head), scale slot stride
    HQ: tl.constexpr, HKV: tl.constexpr, HQ_P: tl.constexpr, HKV_P: tl.constexpr,
    D: tl.constexpr, D_P: tl.constexpr, IS_FP8: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, D_P)
    d_ok = d < D
    partner = (d + D // 2) % D
    cos = tl.load(cos_ptr + t * s_cos + d, mask=d_ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + t * s_sin + d, mask=d_ok, other=0.0).to(tl.float32)
    row = qk_ptr + t * s_qkt

    hq = tl.arange(0, HQ_P)[:, None]
    q_mask = (hq < HQ) & d_ok[None, :]
    q = _rotate(row + hq * s_qkh + d[None, :], row + hq * s_qkh + partner[None, :], cos, sin, q_mask)
    tl.store(row + hq * s_qkh + d[None, :], q.to(qk_ptr.dtype.element_ty), mask=q_mask)

    slot = tl.load(slot_ptr + t)
    if slot >= 0:  # negative slots mark padding tokens that own no cache entry
        heads = tl.arange(0, HKV_P)
        h = heads[:, None]
        kv_mask = (h < HKV) & d_ok[None, :]
        k_row = row + (HQ + h) * s_qkh
        k = _rotate(k_row + d[None, :], k_row + partner[None, :], cos, sin, kv_mask).to(qk_ptr.dtype.element_ty)
        v = tl.load(v_ptr + t * s_vt + h * s_vh + d[None, :], mask=kv_mask, other=0.0)
        dst = slot * s_cslot + h * s_ch + d[None, :]
        scale_dst = slot * s_sslot + heads
        store_kv_row(k, k_cache_ptr + dst, k_scale_ptr + scale_dst, kv_mask, heads < HKV, IS_FP8)
        store_kv_row(v, v_cache_ptr + dst, v_scale_ptr + scale_dst, kv_mask, heads < HKV, IS_FP8)


def rope_store_kv_triton(
    qk: torch.Tensor,  # [T, Hq + Hkv, D], last dim contiguous: q heads rotated in place
    value: torch.Tensor,  # [T, Hkv, D], last dim contiguous
    cos: torch.Tensor,  # [T, 1, D] or [T, D] (rope_cache rows of the tokens' positions)
    sin: torch.Tensor,  # [T, 1, D] or [T, D], signed as rope_cache makes it
    num_heads: int,  # Hq
    kv: PagedKV,  # contiguous tensors
    slot_mapping: torch.Tensor,  # [T] int64
) -> torch.Tensor:  # [T, Hq, D]: the rotated q, a view of qk
    """q rotated in place; k rotated and stored with v at `slot_mapping`."""
    T, heads, D = qk.shape
    num_kv_heads = heads - num_heads
    q = qk[:, :num_heads]
    if T == 0:
        return q
    if D % 2 or qk.stride(2) != 1 or value.stride(2) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("rope_store_kv_triton needs an even head dim and contiguous last dims")
    if not all(t.is_contiguous() for t in kv.tensors()):
        raise ValueError("rope_store_kv_triton needs contiguous cache tensors")
    k_scale, v_scale = scale_tensors(kv)
    _rope_store_kernel[(T,)](
        qk, value, cos, sin, kv.k, kv.v, k_scale, v_scale, slot_mapping,
        qk.stride(0), qk.stride(1), value.stride(0), value.stride(1), cos.stride(0), sin.stride(0),
        kv.k.stride(1), kv.k.stride(2), k_scale.stride(1),
        HQ=num_heads, HKV=num_kv_heads, HQ_P=triton.next_power_of_2(num_heads),
        HKV_P=triton.next_power_of_2(num_kv_heads), D=D, D_P=triton.next_power_of_2(D), IS_FP8=kv.is_fp8,
    )
    return q
