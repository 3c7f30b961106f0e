"""Writing a step's K and V into the paged cache on the CPU through the C++ kernel
(csrc/store_kv.cpp): one call per layer, the same bits as the torch backend's casts and
index_copy_. fp32, fp16 and bf16 caches; fp8 (which also writes scales) keeps the
torch backend's store."""
from __future__ import annotations

import ctypes

import torch

from specdec.kernels import cpu_build
from specdec.kernels.kv_cache import PagedKV

_LIBRARY = "store_kv"
CACHE_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # csrc/store_kv.cpp's dtype codes
_ARGTYPES = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
             ctypes.c_int32, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int32]


def supports(key: torch.Tensor, value: torch.Tensor, kv: PagedKV, slot_mapping: torch.Tensor) -> bool:
    """Whether the kernel can store these rows here (and it builds)."""
    return (key.device.type == "cpu" and key.dtype == value.dtype == torch.float32
            and kv.k.dtype in CACHE_DTYPES and kv.k_scale is None and slot_mapping.dtype == torch.int64
            and key.shape[1:] == value.shape[1:] == kv.k.shape[2:]
            and _rows_dense(key) and _rows_dense(value) and kv.k.is_contiguous() and kv.v.is_contiguous()
            and slot_mapping.is_contiguous() and cpu_build.builds(_LIBRARY, "torch's index_copy_"))


def _rows_dense(x: torch.Tensor) -> bool:  # [T, Hkv, D] with each token's Hkv * D floats contiguous
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def store_kv_cpu(
    key: torch.Tensor,  # [T, Hkv, D] float32, rows possibly strided
    value: torch.Tensor,  # [T, Hkv, D] float32, rows possibly strided
    kv: PagedKV,
    slot_mapping: torch.Tensor,  # [T] int64 flat slots
) -> None:
    store = cpu_build.function(_LIBRARY, "specdec_store_kv", _ARGTYPES, ctypes.c_int64)
    tokens, heads, dim = key.shape
    num_slots = kv.k.shape[0] * kv.k.shape[1]
    bad = store(key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), kv.k.data_ptr(), kv.v.data_ptr(),
                CACHE_DTYPES[kv.k.dtype], slot_mapping.data_ptr(), tokens, heads * dim, num_slots,
                torch.get_num_threads())
    if bad >= 0:
        raise IndexError(f"slot {int(slot_mapping[bad])} of row {bad} is outside the cache's {num_slots} slots")
