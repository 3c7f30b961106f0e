"""RMSNorm on the CPU through the C++ kernel (csrc/rms_norm.cpp): one call where torch's
CPU rms_norm dispatches eight small ops, about a millisecond of every decode step of the
default model. Inference only (no autograd); anything else keeps torch's rms_norm."""
from __future__ import annotations

import ctypes

import torch

from specdec.kernels import cpu_build

_LIBRARY = "rms_norm"
_ARGTYPES = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
             ctypes.c_int32]


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel can normalise x by weight here (and it builds)."""
    return (x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32 and weight.dim() == 1
            and x.shape[-1] == weight.shape[0] and x.is_contiguous() and weight.is_contiguous()
            and not (x.requires_grad or weight.requires_grad)
            and cpu_build.builds(_LIBRARY, "torch's rms_norm"))


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # [..., D], [D] -> [..., D]
    out = torch.empty_like(x)
    dim = weight.shape[0]
    normalize = cpu_build.function(_LIBRARY, "specdec_rms_norm", _ARGTYPES)
    normalize(x.data_ptr(), weight.data_ptr(), eps, out.data_ptr(), x.numel() // max(dim, 1), dim,
              torch.get_num_threads())
    return out
