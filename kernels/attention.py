"""Dispatch: Triton kernels on CUDA tensors, the torch reference elsewhere."""
from __future__ import annotations

import torch

from specdec.kernels.attention_ref import paged_attention_ref, store_kv_ref
from specdec.kernels.kv_cache import PagedKV
from specdec.kernels.metadata import AttentionMetadata


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda


def store_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    kv: PagedKV,
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    if _use_triton(key):
        from specdec.kernels.attention_triton import store_kv_triton

        store_kv_triton(key, value, kv, slot_mapping)
    else:
        store_kv_ref(key, value, kv, slot_mapping)


def paged_attention(
    query: torch.Tensor,  # [T, Hq, D]
    kv: PagedKV,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, Hq, D]
    if _use_triton(query):
        from specdec.kernels.attention_triton import paged_attention_triton

        return paged_attention_triton(query, kv, meta, scale)
    return paged_attention_ref(query, kv, meta, scale)
