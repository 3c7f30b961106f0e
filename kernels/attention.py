"""Attention backends by name, resolved once per engine (the interface: attention_base.py).

- "torch": plain torch ops (attention_torch.py), on any device.
- "cpp": the C++ CPU kernels (attention_cpu.py, store_kv_cpu.py); the engine refuses to
  start if they cannot build. Shapes they lack take the torch code.
- "triton": Triton kernels (attention_triton.py) on CUDA, or on the CPU under
  TRITON_INTERPRET=1 (tests).
- "auto": on CUDA "triton"; on the CPU "cpp" if it builds here, else "torch" with one warning.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from specdec.kernels import attention_cpu
from specdec.kernels.attention_base import AttentionBackend, AttentionPlan
from specdec.kernels.attention_cpu import CppAttention
from specdec.kernels.attention_torch import TorchAttention

__all__ = ["BACKENDS", "AttentionBackend", "AttentionPlan", "check_attention_backend",
           "make_attention_backend"]

BACKENDS = ("auto", "cpp", "torch", "triton")


def check_attention_backend(name: str) -> None:
    """ValueError for an unknown name; KernelBuildError if "cpp" cannot build here."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend {name!r} is not one of {list(BACKENDS)}")
    if name == "cpp":
        attention_cpu.load()


def make_attention_backend(name: str, device: torch.device | str) -> AttentionBackend[Any]:
    """The backend `name` for tensors on `device`. ValueError for an unknown name or one
    that cannot run on `device`; KernelBuildError if "cpp" cannot build here."""
    check_attention_backend(name)
    device_type = torch.device(device).type
    if name == "auto":
        if device_type == "cuda":
            name = "triton"
        else:
            name = "cpp" if attention_cpu.builds() else "torch"
    if name == "torch":
        return TorchAttention()
    if name == "cpp":
        if device_type != "cpu":
            raise ValueError(f"attention_backend 'cpp' runs on the CPU, not on {device_type}")
        return CppAttention()
    if device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"attention_backend 'triton' needs CUDA (or TRITON_INTERPRET=1), not {device_type}")
    from specdec.kernels.attention_triton import TritonAttention  # imports triton: only when chosen

    return TritonAttention()
