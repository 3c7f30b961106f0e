"""Linear backends on oneDNN (mkldnn) with the weight reordered once into its blocked layout."""

from __future__ import annotations

import torch
from torch import Tensor

from specdec.kernels.linear_base import LinearBackend, as_fp32, as_fp32_or_none


def _mkldnn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class OneDnnFp32Linear(LinearBackend):
    """oneDNN fp32 with the weight reordered once into oneDNN's blocked layout
    (`mkldnn::_linear_pointwise`): fp32 numerics (~1e-6 from F.linear), flatter in M."""

    name, rel_tol, batch_invariant = "onednn-fp32", 1e-5, False

    @classmethod
    def is_available(cls) -> bool:
        return _mkldnn_available()

    def prepare(self, weight: Tensor, bias: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        return torch.ops.mkldnn._reorder_linear_weight(as_fp32(weight), None), as_fp32_or_none(bias)

    def apply(self, x: Tensor, packed: tuple[Tensor, Tensor | None]) -> Tensor:
        out: Tensor = torch.ops.mkldnn._linear_pointwise(x, packed[0], packed[1], "none", [], "")
        return out


class OneDnnBf16Linear(LinearBackend):
    """oneDNN bf16 (AVX512-BF16/AMX) with the bf16 weight reordered once; activations
    cast to bf16 per call, output back to fp32, bias added in fp32."""

    name, rel_tol, batch_invariant = "onednn-bf16", 2e-2, False

    @classmethod
    def is_available(cls) -> bool:
        return _mkldnn_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())

    def prepare(self, weight: Tensor, bias: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        packed = torch.ops.mkldnn._reorder_linear_weight(as_fp32(weight).to(torch.bfloat16), None)
        return packed, as_fp32_or_none(bias)

    def apply(self, x: Tensor, packed: tuple[Tensor, Tensor | None]) -> Tensor:
        weight, bias = packed
        out: Tensor = torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), weight, None, "none", [], "")
        out = out.float()
        return out if bias is None else out.add_(bias)
