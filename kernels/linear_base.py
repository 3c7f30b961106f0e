"""The linear backend interface (vLLM's quant_method): how one projection stores its weight
and multiplies by it. The model's projection modules (specdec/models/linear.py) each hold
a backend object and their weight packed for it; the backends by name: kernels/linear.py.

On these CPUs a default fp32 `F.linear` over a few rows costs several times a one-row
call (MKL switches from GEMV to a GEMM that packs the weight on every call), so a verify
forward of 1 + k tokens costs far more than a decode step. Backends that pack the weight
once, in a lower precision, are both faster per token (less memory to stream) and much
flatter in the number of rows; `evals/bench_kernels.py` measures them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor


class LinearBackend(ABC):
    """How y = x @ weight.T + bias is computed for one kind of packed weight.

    Contract:
    - `prepare(weight, bias)` runs once per projection, off the hot path, on a `[out, in]`
      weight and an optional `[out]` bias (float32 unless `needs_fp32` is False). It
      returns an opaque packed object (a tensor, a tuple, a torch ScriptObject) that owns
      what it needs; it must not modify `weight`, and the model keeps the weight alongside.
    - `apply(x, packed)` takes activations `[M, in]` (M >= 0, rows possibly strided; fp32
      where `needs_fp32`) and returns a new, contiguous `[M, out]` tensor (fp32 where
      `needs_fp32`) that the caller owns and may modify in place. It must not modify `x` or
      `packed`, nor any global state (such as `torch.backends.quantized.engine`), and must
      not need autograd.
    - The result approximates the fp32 product within `rel_tol` (relative Frobenius error
      for activations and weights of ordinary scale).
    - `batch_invariant` says whether each output row is bitwise equal to what `apply`
      gives for that row alone, for any M. Lossless greedy speculation needs it of the
      whole model: a verify forward over 1 + k rows must give every row the logits a
      one-row decode step would, or an argmax near a tie can flip. It is a measured
      property of the library kernels on x86 (tests/models/test_linear_backends.py), not
      a promise of the libraries.
    - A new weight format is one new subclass, registered in kernels/linear.py.
    """

    name: str = ""
    rel_tol: float = 0.0
    batch_invariant: bool = False
    needs_fp32: bool = True  # float32 weights and activations; else any one floating dtype

    @classmethod
    def is_available(cls) -> bool:
        """Whether this torch build and CPU can run the backend."""
        return True

    @abstractmethod
    def prepare(self, weight: Tensor, bias: Tensor | None = None) -> Any:
        """weight [out, in] (+ bias [out]) -> packed weight."""

    @abstractmethod
    def apply(self, x: Tensor, packed: Any) -> Tensor:
        """x [M, in] -> [M, out]."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Fp32Linear(LinearBackend):
    """The default: `F.linear` on the weight as loaded (MKL sgemm/sgemv for an fp32 model;
    a bf16 or fp16 model multiplies in its own dtype).

    Not batch invariant: MKL's one-row path rounds differently from its multi-row one
    (differences ~1e-6 relative)."""

    name, rel_tol, batch_invariant, needs_fp32 = "fp32", 1e-6, False, False

    def prepare(self, weight: Tensor, bias: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        return weight, bias  # shares memory with the parameters

    def apply(self, x: Tensor, packed: tuple[Tensor, Tensor | None]) -> Tensor:
        out: Tensor = F.linear(x, packed[0], packed[1])
        return out


def as_fp32(t: Tensor) -> Tensor:
    """A detached, contiguous float32 copy (or t itself if it already is one)."""
    return t.detach().to(torch.float32).contiguous()


def as_fp32_or_none(t: Tensor | None) -> Tensor | None:
    return None if t is None else as_fp32(t)
