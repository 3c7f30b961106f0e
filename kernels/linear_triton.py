"""The `triton` linear backend: the batch-invariant Triton GEMM (triton_matmul.py), for
CUDA tensors in fp16 / bf16 / fp32, and CPU tensors under TRITON_INTERPRET=1 (tests).

The default on CUDA: cuBLAS ("fp32", F.linear in the model dtype) chooses its kernel by
the number of rows, so a verify step's rows round differently from a decode step's and
greedy speculation is not lossless there. What the fixed tiling costs against cuBLAS is
not measured yet (no GPU was at hand when it was written).
"""
from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable

import torch
from torch import Tensor

from specdec.kernels.linear_base import LinearBackend

Packed = tuple[Tensor, Tensor | None]


class TritonLinear(LinearBackend):
    """y = x @ weight.T + bias on the weight as loaded (shared, not copied), in the model
    dtype with fp32 accumulation; every row reduced in one fixed order whatever M is."""

    name, rel_tol, batch_invariant, needs_fp32 = "triton", 1e-6, True, False

    def __init__(self) -> None:
        from specdec.kernels.triton_matmul import linear_triton  # imports triton: only when chosen

        self._linear: Callable[[Tensor, Tensor, Tensor | None], Tensor] = linear_triton

    @classmethod
    def is_available(cls) -> bool:
        """Triton installed, and a GPU or the interpreter to run it."""
        if importlib.util.find_spec("triton") is None:
            return False
        return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"

    def prepare(self, weight: Tensor, bias: Tensor | None = None) -> Packed:
        weight = weight.detach()
        if weight.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"linear backend 'triton' takes float32/float16/bfloat16 weights, got {weight.dtype}")
        # Shares memory with the parameter where it already is contiguous (a tied LM head too).
        return weight.contiguous(), None if bias is None else bias.detach().contiguous()

    def apply(self, x: Tensor, packed: Packed) -> Tensor:
        return self._linear(x, packed[0], packed[1])
