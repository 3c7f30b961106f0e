"""Dispatch: Triton kernels on CUDA tensors; on the CPU, the C++ kernels (attention_cpu.py,
store_kv_cpu.py) where they build, else the torch reference.

The engine's attention_backend, carried by AttentionMetadata.backend, picks the CPU path:
"auto" (the C++ kernel if it builds here, with one warning if not), "cpp" (the C++
kernel; the engine refuses to start if it cannot build), "torch" (the reference only).
Shapes the C++ kernel lacks (a head dim it is not built for, non-fp32 queries) take the
reference whatever the backend.
"""
from __future__ import annotations

import torch

from specdec.kernels import attention_cpu, store_kv_cpu
from specdec.kernels.attention_ref import paged_attention_ref, store_kv_ref
from specdec.kernels.kv_cache import PagedKV
from specdec.kernels.metadata import AttentionMetadata

BACKENDS = ("auto", "cpp", "torch")


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda


def check_backend(backend: str) -> None:
    """ValueError for an unknown backend; KernelBuildError if "cpp" cannot build here."""
    if backend not in BACKENDS:
        raise ValueError(f"attention_backend {backend!r} is not one of {list(BACKENDS)}")
    if backend == "cpp":
        attention_cpu.load()


def store_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    kv: PagedKV,
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    if _use_triton(key):
        from specdec.kernels.attention_triton import store_kv_triton

        store_kv_triton(key, value, kv, slot_mapping)
    elif store_kv_cpu.supports(key, value, kv, slot_mapping):
        store_kv_cpu.store_kv_cpu(key, value, kv, slot_mapping)
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
    if _use_cpp(meta.backend) and attention_cpu.supports(query, kv):
        return attention_cpu.paged_attention_cpu(query, kv, meta, scale)
    return paged_attention_ref(query, kv, meta, scale)


def _use_cpp(backend: str) -> bool:
    return backend == "cpp" or (backend == "auto" and attention_cpu.builds())
