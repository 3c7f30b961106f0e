"""One layer's paged K/V cache in its storage dtype; fp8 caches carry their scales.

fp8 is float8_e4m3fn with one float32 scale per (slot, kv head): scale = amax over
head_dim / 448, set when the slot is written, so the cache needs no calibration and a
slot's stored value depends on its own key alone. Reads dequantise: stored * scale.
"""
from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
SCALE_DTYPE = torch.float32
_MIN_SCALE = torch.finfo(SCALE_DTYPE).tiny  # all-zero vectors: 0 / tiny stays 0


@dataclass
class PagedKV:
    """k, v: [num_blocks, block_size, Hkv, D]; k_scale, v_scale: [num_blocks, block_size, Hkv]
    float32 for fp8 caches, else None."""

    k: Tensor
    v: Tensor
    k_scale: Tensor | None = None
    v_scale: Tensor | None = None

    @classmethod
    def zeros(cls, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
              dtype: torch.dtype, device: torch.device | str = "cpu") -> PagedKV:
        # Zeros, not empty: masked-out slots are still multiplied by zero weights.
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        k, v = (lazy_zeros(shape, dtype, device) for _ in range(2))
        if dtype != FP8:
            return cls(k, v)
        k_scale, v_scale = (lazy_zeros(shape[:3], SCALE_DTYPE, device) for _ in range(2))
        return cls(k, v, k_scale, v_scale)

    @staticmethod
    def bytes_per_slot(num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """K and V of one token in one layer, scales included."""
        per_head = head_dim * dtype.itemsize + (SCALE_DTYPE.itemsize if dtype == FP8 else 0)
        return 2 * num_kv_heads * per_head

    @property
    def block_size(self) -> int:
        return int(self.k.shape[1])

    @property
    def is_fp8(self) -> bool:
        return self.k_scale is not None

    def tensors(self) -> list[Tensor]:
        """Every tensor indexed by slot: k, v and, for fp8, their scales."""
        return [t for t in (self.k, self.v, self.k_scale, self.v_scale) if t is not None]


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> Tensor:
    """torch.zeros(shape), except that on the CPU it is an anonymous memory map: its pages
    come zeroed from the OS and become resident only when first written, so an idle engine's
    KV pool costs no memory and a busy one what its requests fill. (torch.zeros writes every
    page, and malloc's calloc may too.) Page aligned; the tensor keeps the map alive."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    pages = np.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=np.uint8)[:nbytes]
    return torch.from_numpy(pages).view(dtype).view(shape)


def slot_rows(cache: Tensor) -> Tensor:  # [num_blocks, block_size, ...] -> [num_slots, ...]
    """A flat-slot view; fp8 as raw bytes, since CPU index_copy_ has no fp8 kernel."""
    flat = cache.view(-1, *cache.shape[2:])
    return flat.view(torch.uint8) if flat.dtype == FP8 else flat


def quantize_fp8(x: Tensor) -> tuple[Tensor, Tensor]:  # [T, H, D] -> fp8 [T, H, D], scale [T, H]
    x = x.float()
    scale = (x.abs().amax(-1) / FP8_MAX).clamp(min=_MIN_SCALE)
    return (x / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize_fp8(data: Tensor, scale: Tensor) -> Tensor:  # fp8 [..., D], [...] -> float32 [..., D]
    """data * scale, exactly, about five times faster on CPU than torch's fp8 cast: e4m3
    bits moved into an fp16's sign, exponent and mantissa fields read as 2^-8 times the
    value (the exponent biases differ by 8; subnormals line up too), so the scale takes 2^8."""
    bits = data.view(torch.uint8).to(torch.int16)
    as_fp16 = (((bits & 0x80) << 8) | ((bits & 0x7F) << 7)).view(torch.float16)
    return as_fp16.float().mul_((scale * 256.0).unsqueeze(-1))
