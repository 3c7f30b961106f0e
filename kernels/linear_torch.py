"""Linear backends on plain torch ops: int8 with per-row activation scales, and bf16."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from specdec.kernels.linear_base import LinearBackend, as_fp32, as_fp32_or_none


class Int8RowwiseLinear(LinearBackend):
    """int8 with one scale per activation row: weights symmetric per output channel,
    each row of x quantized symmetrically by its own absmax, an exact int8 x int8 -> int32
    GEMM (`torch._int_mm`), then both scales applied in fp32.

    Batch invariant by construction: a row's quantization reads only that row and the
    integer GEMM is exact whatever its blocking. Per-token scales are also more accurate
    than one scale per call on LLM activations with outlier tokens; the extra elementwise
    ops make it slower than fbgemm's "int8"."""

    name, rel_tol, batch_invariant = "int8-rowwise", 5e-2, True

    @classmethod
    def is_available(cls) -> bool:
        try:
            ones = torch.ones(1, 8, dtype=torch.int8)
            return bool(torch._int_mm(ones, ones.t()).item() == 8)
        except (RuntimeError, AttributeError):
            return False

    def prepare(self, weight: Tensor, bias: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
        weight = as_fp32(weight)
        scales = (weight.abs().amax(dim=1) / 127.0).clamp_min(1e-12)  # [out]
        qweight = torch.round(weight / scales[:, None]).to(torch.int8)  # [out, in]
        # The [in, out] view of the [out, in] int8 weight: the faster layout for one row.
        return qweight.t(), scales, as_fp32_or_none(bias)

    def apply(self, x: Tensor, packed: tuple[Tensor, Tensor, Tensor | None]) -> Tensor:
        qweight_t, scales, bias = packed
        x_scales = x.abs().amax(dim=1, keepdim=True).clamp_min_(1e-12).div_(127.0)  # [M, 1]
        qx = torch.round(x / x_scales).to(torch.int8)
        out = torch._int_mm(qx, qweight_t).float().mul_(x_scales).mul_(scales)
        return out if bias is None else out.add_(bias)


class Bf16Linear(LinearBackend):
    """bf16 weights; `F.linear` on bf16-cast activations (oneDNN, reordering the weight
    on every call), output and bias in fp32."""

    name, rel_tol, batch_invariant = "bf16", 2e-2, False

    def prepare(self, weight: Tensor, bias: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        return as_fp32(weight).to(torch.bfloat16), as_fp32_or_none(bias)

    def apply(self, x: Tensor, packed: tuple[Tensor, Tensor | None]) -> Tensor:
        weight, bias = packed
        out = F.linear(x.to(torch.bfloat16), weight).float()
        return out if bias is None else out.add_(bias)
