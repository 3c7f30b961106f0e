"""fp32 x fp16-weight linear layers on the CPU through the C++ kernel (csrc/linear_fp16.cpp).

The weight is packed once into tiles of `tile()` output columns (a vector register's
float32 lanes: 16 with AVX-512, else 8), k-major inside each tile, so the kernel streams
it in one pass per block of rows. Each output is one fused
multiply-add chain in k order: batch invariant, so a verify over 1 + k rows gives each
row exactly what a one-row decode would. `CppFp16Linear` is its linear backend.
"""
from __future__ import annotations

import ctypes
import functools

import torch
from torch import Tensor

from specdec.kernels import cpu_build
from specdec.kernels.linear_base import LinearBackend, as_fp32, as_fp32_or_none

_LIBRARY = "linear_fp16"
_ARGTYPES = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
             ctypes.c_void_p, ctypes.c_int32]


def builds() -> bool:
    """Whether the kernel builds and loads here (tried once per process; if not, one
    warning says fbgemm's fp16 linear is used instead)."""
    return cpu_build.builds(_LIBRARY, "fbgemm's fp16 linear")


@functools.cache
def tile() -> int:
    """Output columns per packed tile, as the kernel built here reads them."""
    return int(cpu_build.function(_LIBRARY, "specdec_linear_tile", [], ctypes.c_int64)())


def pack_fp16(weight: torch.Tensor) -> torch.Tensor:  # [N, K] -> [ceil(N / T), K, T] fp16, T = tile()
    """The kernel's layout of a weight: zero-padded to whole tiles of output columns."""
    n, k = weight.shape
    width = tile()
    padded = torch.zeros(-(-n // width) * width, k, dtype=torch.float16)
    padded[:n] = weight.detach()
    return padded.view(-1, width, k).transpose(1, 2).contiguous()


def linear_fp16(
    x: torch.Tensor,  # [M, K] float32
    packed: torch.Tensor,  # [ceil(N / T), K, T] fp16 from pack_fp16
    bias: torch.Tensor | None,  # [N] float32
    out_features: int,  # N
) -> torch.Tensor:  # [M, N] float32, new and contiguous
    x = x.contiguous()
    if x.dtype != torch.float32 or x.shape[-1] != packed.shape[1] or packed.shape[2] != tile():
        raise ValueError(f"linear_fp16 needs float32 x with {packed.shape[1]} features and a weight packed "
                         f"in tiles of {tile()}, got {x.dtype} {tuple(x.shape)} and {tuple(packed.shape)}")
    out = torch.empty(x.shape[0], out_features, dtype=torch.float32)
    if x.shape[0] == 0:
        return out
    multiply = cpu_build.function(_LIBRARY, "specdec_linear_fp16", _ARGTYPES)
    multiply(x.data_ptr(), x.shape[0], x.shape[1], packed.data_ptr(), out_features,
             None if bias is None else bias.data_ptr(), out.data_ptr(), torch.get_num_threads())
    return out


class CppFp16Linear(LinearBackend):
    """fp16 weights packed for specdec's own C++ kernel (above), compiled on first use;
    activations and accumulation stay fp32. Batch invariant by construction: every output
    is one multiply-add chain in k order, whatever the rows. On the 2-core x86 CPU it
    beats fbgemm's fp16 on every projection at 1 to 256 rows (1.1-1.6x) and on the LM
    head from 16 rows; a 1-row LM head, bound by memory, is ~10% slower
    (evals/bench_kernels.py)."""

    name, rel_tol, batch_invariant = "cpp-fp16", 1e-2, True

    @classmethod
    def is_available(cls) -> bool:
        return builds()

    def prepare(self, weight: Tensor, bias: Tensor | None = None) -> tuple[Tensor, Tensor | None, int]:
        return pack_fp16(as_fp32(weight)), as_fp32_or_none(bias), weight.shape[0]

    def apply(self, x: Tensor, packed: tuple[Tensor, Tensor | None, int]) -> Tensor:
        return linear_fp16(x, *packed)
