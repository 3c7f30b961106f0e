"""Linear backends on fbgemm's quantized ops (torch's x86 quantized engine): fp16 weights
and dynamic int8. Available where torch has that engine."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from specdec.kernels import cpu_build
from specdec.kernels.linear_base import LinearBackend, as_fp32, as_fp32_or_none


@contextmanager
def _quantized_engine(engine: str) -> Iterator[None]:
    """Pack under `engine`; packed params keep their engine, so apply needs no switch."""
    previous = torch.backends.quantized.engine
    torch.backends.quantized.engine = engine
    try:
        yield
    finally:
        torch.backends.quantized.engine = previous


def _fbgemm_engine() -> str | None:
    engines = torch.backends.quantized.supported_engines
    return next((e for e in ("x86", "fbgemm") if e in engines), None)


class _FbgemmLinear(LinearBackend):
    """Backends on fbgemm's quantized ops: available where torch has that engine."""

    @classmethod
    def is_available(cls) -> bool:
        return _fbgemm_engine() is not None

    @staticmethod
    def engine() -> str:
        engine = _fbgemm_engine()
        assert engine is not None, "no fbgemm quantized engine in this torch build"
        return engine


class Fp16Linear(_FbgemmLinear):
    """fbgemm packed fp16 weights (`quantized::linear_prepack_fp16`); activations stay
    fp32 and are multiplied in fp32 against the fp16 weight (converted in registers).
    Halves weight memory traffic. Batch invariant with AVX-512 only: on AVX2 fbgemm
    blocks the rows differently by row count, and a row's sums change with it."""

    name, rel_tol = "fp16", 1e-2
    batch_invariant = torch.backends.cpu.get_cpu_capability() == "AVX512"

    def prepare(self, weight: Tensor, bias: Tensor | None = None) -> Any:
        with _quantized_engine(self.engine()):
            return torch.ops.quantized.linear_prepack_fp16(as_fp32(weight), as_fp32_or_none(bias))

    def apply(self, x: Tensor, packed: Any) -> Tensor:
        out: Tensor = torch.ops.quantized.linear_dynamic_fp16(x, packed)
        return out


class Int8Linear(_FbgemmLinear):
    """fbgemm dynamic int8: weights quantized once, symmetric per output channel;
    activations quantized per call with one (asymmetric, uint8) scale for the whole
    [M, in] input, int32 accumulation, fp32 output.

    Not batch invariant: the activation scale comes from all M rows, so a row's result
    depends on the other rows in the batch (differences ~5e-2 relative)."""

    name, rel_tol, batch_invariant = "int8", 5e-2, False

    def prepare(self, weight: Tensor, bias: Tensor | None = None) -> Any:
        engine = self.engine()
        weight = as_fp32(weight)
        scales = (weight.abs().amax(dim=1) / 127.0).clamp_min(1e-12).double()
        zero_points = torch.zeros(weight.shape[0], dtype=torch.long)
        with warnings.catch_warnings(), _quantized_engine(engine):
            # quantize_per_channel warns that quantized tensors are deprecated; it is
            # still the only way into fbgemm's packed int8 linear.
            warnings.simplefilter("ignore", UserWarning)
            qweight = torch.quantize_per_channel(weight, scales, zero_points, 0, torch.qint8)
            return torch.ops.quantized.linear_prepack(qweight, as_fp32_or_none(bias))

    def apply(self, x: Tensor, packed: Any) -> Tensor:
        out: Tensor = torch.ops.quantized.linear_dynamic(x, packed, not _has_vnni())
        return out


@functools.cache
def _has_vnni() -> bool:
    """Whether the CPU has VNNI, which multiplies uint8 by int8 into int32 exactly.
    Without it fbgemm's u8 x s8 pairs sum into saturating int16, so activations must be
    quantized to 7 bits (reduce_range), or large products clip (~10% error, seen on AVX2)."""
    flags = cpu_build.cpu_flags().split()
    return "avx512_vnni" in flags or "avx_vnni" in flags
