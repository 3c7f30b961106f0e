"""Linear backends by name (the interface: linear_base.py), one class family per file:
fp32 (linear_base.py), fbgemm fp16 / int8 (linear_fbgemm.py), the C++ fp16 kernel
(linear_cpu.py), int8 with per-row scales and bf16 on plain torch (linear_torch.py),
oneDNN fp32 / bf16 (linear_onednn.py), GGUF blocks q8_0 / q4_0 / q4_1 through the C++
quantized kernel (linear_gguf.py), and the batch-invariant Triton GEMM for CUDA
(linear_triton.py; the default there)."""

from __future__ import annotations

import torch

from specdec.kernels.linear_base import Fp32Linear, LinearBackend
from specdec.kernels.linear_cpu import CppFp16Linear
from specdec.kernels.linear_fbgemm import Fp16Linear, Int8Linear
from specdec.kernels.linear_gguf import QUANT_BACKENDS
from specdec.kernels.linear_onednn import OneDnnBf16Linear, OneDnnFp32Linear
from specdec.kernels.linear_torch import Bf16Linear, Int8RowwiseLinear
from specdec.kernels.linear_triton import TritonLinear

__all__ = ["LINEAR_BACKENDS", "Fp32Linear", "LinearBackend", "available_linear_backends", "default_linear_backend",
           "get_linear_backend", "resolve_linear_backend"]

_CLASSES: tuple[type[LinearBackend], ...] = (Fp32Linear, Fp16Linear, CppFp16Linear, Int8Linear, Int8RowwiseLinear,
                                             Bf16Linear, OneDnnFp32Linear, OneDnnBf16Linear, TritonLinear,
                                             *QUANT_BACKENDS)
LINEAR_BACKENDS: dict[str, type[LinearBackend]] = {cls.name: cls for cls in _CLASSES}


def available_linear_backends() -> list[str]:
    return [name for name, cls in LINEAR_BACKENDS.items() if cls.is_available()]


def default_linear_backend() -> str:
    """fp16 packed weights: our C++ kernel where it builds, else fbgemm's, else fp32.
    Measured on the 2-core x86 CPU (evals/bench_kernels.py), fbgemm's fp16 made a 1-token
    forward 0.41x fp32's and a 9-token verify 1.7x a 1-token one (fp32: 2.2x), with 100%
    top-1 agreement with fp32 logits; the C++ kernel is faster still, but for a 1-row LM head."""
    return next((name for name in ("cpp-fp16", "fp16") if LINEAR_BACKENDS[name].is_available()), "fp32")


def resolve_linear_backend(name: str, dtype: torch.dtype, device: torch.device | str = "cpu") -> str:
    """`name`, with "auto" made the default for a `dtype` model on `device`: on CUDA the
    batch-invariant Triton GEMM (cuBLAS, "fp32", rounds a row differently by the number
    of rows, which breaks lossless speculation); on the CPU packed backends need float32."""
    if name != "auto":
        return name
    if torch.device(device).type == "cuda":
        return TritonLinear.name
    return default_linear_backend() if dtype == torch.float32 else Fp32Linear.name


def get_linear_backend(name: str) -> LinearBackend:
    """The backend called `name`; ValueError if unknown or unavailable here."""
    cls = LINEAR_BACKENDS.get(name)
    if cls is None:
        raise ValueError(f"linear backend {name!r} is not one of {sorted(LINEAR_BACKENDS)}")
    if not cls.is_available():
        raise ValueError(f"linear backend {name!r} is not available with this torch build/CPU; "
                         f"available: {available_linear_backends()}")
    return cls()
