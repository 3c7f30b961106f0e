"""Linear backends over GGUF blocks, through the C++ kernel of linear_quant.py:

- "q8_0", "q4_0", "q4_1": one block type. `prepare` quantizes a float weight with gguf
  (quantize-at-load), or takes a QuantizedTensor whose blocks are all of its type, as
  they are (a GGUF's tensors).
- "gguf" (`quantization="gguf"`, not a `linear_backend` name): each weight as a GGUF
  stores it. A QuantizedTensor's blocks, whatever their types, a projection's row
  segments of different types (a fused q/k/v) each multiplied into its columns of the
  output; a float weight (an F16 tensor, a drafter's heads) on the C++ fp16 kernel.

All are batch invariant and exact over their blocks: each weight is gguf's dequantized
value and the sums are float32 (kernels/reference.py's linear_gguf is the oracle). Built
with `activations="int8"` (EngineConfig.quantized_activations, opt-in and lossy) they
quantize each activation row to int8 per 32-value block first and sum exactly in integer
SIMD (linear_quant.py; oracle: reference.linear_gguf_int8): still batch invariant, so
greedy speculation stays equal to plain decoding in that mode, and extra verified rows
cost much less. Float weights stay on the fp16 kernel either way.
"""
from __future__ import annotations

from typing import Any

from torch import Tensor

from specdec.kernels.gguf_blocks import quantize
from specdec.kernels.linear_base import LinearBackend, as_fp32_or_none
from specdec.kernels.linear_cpu import CppFp16Linear
from specdec.kernels.linear_quant import ACTIVATIONS, PackedQuant, auto_isa, builds, linear_quant, pack
from specdec.kernels.quantized_tensor import QuantizedTensor

Packed = tuple[tuple[PackedQuant, ...], Tensor | None]  # row segments, bias [out]
FloatPacked = tuple[None, Any]  # a float weight, as the fp16 kernel packs it


class GgufLinear(LinearBackend):
    """Each weight as a GGUF stores it: blocks segment by segment, floats in fp16."""

    name, rel_tol, batch_invariant = "gguf", 1e-5, True

    def __init__(self, activations: str = "float32") -> None:
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations {activations!r} is not one of {list(ACTIVATIONS)}")
        self.activations = activations
        self.floats = CppFp16Linear()

    @classmethod
    def is_available(cls) -> bool:
        return builds() and auto_isa() != "" and CppFp16Linear.is_available()

    @property
    def float_headers(self) -> bool:
        """Whether its weights are best packed with float32 headers (linear_quant.pack)."""
        return self.activations == "float32"

    def prepare(self, weight: Tensor, bias: Tensor | None = None) -> Packed | FloatPacked:
        if not isinstance(weight, QuantizedTensor):
            return None, self.floats.prepare(weight, bias)
        return weight.parts, as_fp32_or_none(bias)

    def apply(self, x: Tensor, packed: Packed | FloatPacked) -> Tensor:
        if packed[0] is None:
            return self.floats.apply(x, packed[1])
        parts, bias = packed
        if len(parts) == 1:
            return linear_quant(x, parts[0], bias, activations=self.activations)
        out = x.new_empty(x.shape[0], sum(part.rows for part in parts))
        column = 0
        for part in parts:
            part_bias = None if bias is None else bias[column : column + part.rows]
            linear_quant(x, part, part_bias, out=out, column=column, activations=self.activations)
            column += part.rows
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}(activations={self.activations!r})"


class QuantLinear(GgufLinear):
    """Blocks of type `qtype` only, from a float weight quantized here or a GGUF's own.

    `rel_tol` is the error of quantizing a float weight (the kernel adds only float32
    rounding to the dequantized product); with a GGUF's own blocks the product is exact."""

    qtype = ""

    @classmethod
    def is_available(cls) -> bool:
        return builds() and auto_isa() != ""

    def prepare(self, weight: Tensor, bias: Tensor | None = None) -> Packed:
        if isinstance(weight, QuantizedTensor):
            if weight.qtypes != (self.qtype,):
                raise ValueError(f"linear backend {self.name!r} reads {self.qtype} blocks, got "
                                 f"{'+'.join(weight.qtypes)}")
            return weight.parts, as_fp32_or_none(bias)
        return (pack(quantize(weight, self.qtype), self.float_headers),), as_fp32_or_none(bias)


class Q8_0Linear(QuantLinear):
    name, qtype, rel_tol = "q8_0", "q8_0", 1e-2


class Q4_0Linear(QuantLinear):
    name, qtype, rel_tol = "q4_0", "q4_0", 2e-1


class Q4_1Linear(QuantLinear):
    name, qtype, rel_tol = "q4_1", "q4_1", 1.5e-1


QUANT_BACKENDS: tuple[type[QuantLinear], ...] = (Q8_0Linear, Q4_0Linear, Q4_1Linear)
