"""Linear backends: how the model's projections store their weights and multiply on CPU.

On these CPUs a default fp32 `F.linear` over a few rows costs several times a one-row
call (MKL switches from GEMV to a GEMM that packs the weight on every call), so a verify
forward of 1 + k tokens costs far more than a decode step. Backends that pack the weight
once, in a lower precision, are both faster per token (less memory to stream) and much
flatter in the number of rows; `evals/bench_kernels.py` measures them.

A backend turns each fp32 weight into an opaque packed object once (`prepare`) and then
multiplies fp32 activations by it (`apply`); activations stay fp32 everywhere else.
`apply_linear_backend(model, name)` repacks every projection of a LlamaForCausalLM (qkv,
o, gate_up, down in each layer, and the LM head). The fp32 parameters are kept: the
embedding table is still looked up in fp32 (also when tied to the LM head), a drafter
may share the embedding / LM head in fp32, and the model can be repacked later.
"""

from __future__ import annotations

import functools
import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor

from specdec.kernels import cpu_build, linear_cpu

if TYPE_CHECKING:
    from specdec.models.llama import LlamaForCausalLM

DEFAULT_LINEAR_BACKEND = "fp32"


class LinearBackend(ABC):
    """How y = x @ weight.T + bias is computed for one kind of packed weight.

    Contract:
    - `prepare(weight, bias)` runs once per projection, off the hot path, on an fp32
      `[out, in]` weight and an optional fp32 `[out]` bias. It returns an opaque packed
      object (a tensor or a torch ScriptObject) that owns what it needs; it must not
      modify `weight`, and the model may keep the fp32 weight alongside.
    - `apply(x, packed)` takes fp32 activations `[M, in]` (M >= 0, rows possibly strided)
      and returns a new, contiguous fp32 `[M, out]` tensor that the caller owns and may
      modify in place. It must not modify `x` or `packed`, nor any global state (such as
      `torch.backends.quantized.engine`), and must not need autograd.
    - The result approximates the fp32 product within `rel_tol` (relative Frobenius error
      for activations and weights of ordinary scale).
    - `batch_invariant` says whether each output row is bitwise equal to what `apply`
      gives for that row alone, for any M. Lossless greedy speculation needs it of the
      whole model: a verify forward over 1 + k rows must give every row the logits a
      one-row decode step would, or an argmax near a tie can flip. It is a measured
      property of the library kernels on x86 (tests/models/test_linear_backends.py), not
      a promise of the libraries.
    """

    name: str = ""
    rel_tol: float = 0.0
    batch_invariant: bool = False

    @classmethod
    def is_available(cls) -> bool:
        """Whether this torch build and CPU can run the backend."""
        return True

    @abstractmethod
    def prepare(self, weight: Tensor, bias: Tensor | None = None) -> Any:
        """fp32 weight [out, in] (+ bias [out]) -> packed weight."""

    @abstractmethod
    def apply(self, x: Tensor, packed: Any) -> Tensor:
        """fp32 x [M, in] -> fp32 [M, out]."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Fp32Linear(LinearBackend):
    """The reference: `F.linear` on the fp32 weight (MKL sgemm/sgemv).

    Not batch invariant: MKL's one-row path rounds differently from its multi-row one
    (differences ~1e-6 relative)."""

    name, rel_tol, batch_invariant = "fp32", 1e-6, False

    def prepare(self, weight: Tensor, bias: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        return weight, bias  # shares memory with the parameters

    def apply(self, x: Tensor, packed: tuple[Tensor, Tensor | None]) -> Tensor:
        out: Tensor = F.linear(x, packed[0], packed[1])
        return out


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
            return torch.ops.quantized.linear_prepack_fp16(_fp32(weight), _fp32_or_none(bias))

    def apply(self, x: Tensor, packed: Any) -> Tensor:
        out: Tensor = torch.ops.quantized.linear_dynamic_fp16(x, packed)
        return out


class CppFp16Linear(LinearBackend):
    """fp16 weights packed for specdec's own C++ kernel (kernels/linear_cpu.py), compiled
    on first use; activations and accumulation stay fp32. Batch invariant by
    construction: every output is one multiply-add chain in k order, whatever the rows.
    On the 2-core x86 CPU it beats fbgemm's fp16 on every projection at 1 to 256 rows
    (1.1-1.6x) and on the LM head from 16 rows; a 1-row LM head, bound by memory, is
    ~10% slower (evals/bench_kernels.py)."""

    name, rel_tol, batch_invariant = "cpp-fp16", 1e-2, True

    @classmethod
    def is_available(cls) -> bool:
        return linear_cpu.builds()

    def prepare(self, weight: Tensor, bias: Tensor | None = None) -> tuple[Tensor, Tensor | None, int]:
        return linear_cpu.pack_fp16(_fp32(weight)), _fp32_or_none(bias), weight.shape[0]

    def apply(self, x: Tensor, packed: tuple[Tensor, Tensor | None, int]) -> Tensor:
        return linear_cpu.linear_fp16(x, *packed)


class Int8Linear(_FbgemmLinear):
    """fbgemm dynamic int8: weights quantized once, symmetric per output channel;
    activations quantized per call with one (asymmetric, uint8) scale for the whole
    [M, in] input, int32 accumulation, fp32 output.

    Not batch invariant: the activation scale comes from all M rows, so a row's result
    depends on the other rows in the batch (differences ~5e-2 relative)."""

    name, rel_tol, batch_invariant = "int8", 5e-2, False

    def prepare(self, weight: Tensor, bias: Tensor | None = None) -> Any:
        engine = self.engine()
        weight = _fp32(weight)
        scales = (weight.abs().amax(dim=1) / 127.0).clamp_min(1e-12).double()
        zero_points = torch.zeros(weight.shape[0], dtype=torch.long)
        with warnings.catch_warnings(), _quantized_engine(engine):
            # quantize_per_channel warns that quantized tensors are deprecated; it is
            # still the only way into fbgemm's packed int8 linear.
            warnings.simplefilter("ignore", UserWarning)
            qweight = torch.quantize_per_channel(weight, scales, zero_points, 0, torch.qint8)
            return torch.ops.quantized.linear_prepack(qweight, _fp32_or_none(bias))

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
        weight = _fp32(weight)
        scales = (weight.abs().amax(dim=1) / 127.0).clamp_min(1e-12)  # [out]
        qweight = torch.round(weight / scales[:, None]).to(torch.int8)  # [out, in]
        # The [in, out] view of the [out, in] int8 weight: the faster layout for one row.
        return qweight.t(), scales, _fp32_or_none(bias)

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
        return _fp32(weight).to(torch.bfloat16), _fp32_or_none(bias)

    def apply(self, x: Tensor, packed: tuple[Tensor, Tensor | None]) -> Tensor:
        weight, bias = packed
        out = F.linear(x.to(torch.bfloat16), weight).float()
        return out if bias is None else out.add_(bias)


def _mkldnn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")  # type: ignore[no-untyped-call]


class OneDnnFp32Linear(LinearBackend):
    """oneDNN fp32 with the weight reordered once into oneDNN's blocked layout
    (`mkldnn::_linear_pointwise`): fp32 numerics (~1e-6 from F.linear), flatter in M."""

    name, rel_tol, batch_invariant = "onednn-fp32", 1e-5, False

    @classmethod
    def is_available(cls) -> bool:
        return _mkldnn_available()

    def prepare(self, weight: Tensor, bias: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        return torch.ops.mkldnn._reorder_linear_weight(_fp32(weight), None), _fp32_or_none(bias)

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
        packed = torch.ops.mkldnn._reorder_linear_weight(_fp32(weight).to(torch.bfloat16), None)
        return packed, _fp32_or_none(bias)

    def apply(self, x: Tensor, packed: tuple[Tensor, Tensor | None]) -> Tensor:
        weight, bias = packed
        out: Tensor = torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), weight, None, "none", [], "")
        out = out.float()
        return out if bias is None else out.add_(bias)


def _fp32(t: Tensor) -> Tensor:
    return t.detach().to(torch.float32).contiguous()


def _fp32_or_none(t: Tensor | None) -> Tensor | None:
    return None if t is None else _fp32(t)


LINEAR_BACKENDS: dict[str, type[LinearBackend]] = {
    cls.name: cls
    for cls in (Fp32Linear, Fp16Linear, CppFp16Linear, Int8Linear, Int8RowwiseLinear, Bf16Linear, OneDnnFp32Linear,
                OneDnnBf16Linear)
}


def available_linear_backends() -> list[str]:
    return [name for name, cls in LINEAR_BACKENDS.items() if cls.is_available()]


def default_linear_backend() -> str:
    """fp16 packed weights: our C++ kernel where it builds, else fbgemm's, else fp32.
    Measured on the 2-core x86 CPU (evals/bench_kernels.py), fbgemm's fp16 made a 1-token
    forward 0.41x fp32's and a 9-token verify 1.7x a 1-token one (fp32: 2.2x), with 100%
    top-1 agreement with fp32 logits; the C++ kernel is faster still, but for a 1-row LM head."""
    return next((name for name in ("cpp-fp16", "fp16") if LINEAR_BACKENDS[name].is_available()), "fp32")


def get_linear_backend(name: str) -> LinearBackend:
    """The backend called `name`; ValueError if unknown or unavailable here."""
    cls = LINEAR_BACKENDS.get(name)
    if cls is None:
        raise ValueError(f"linear backend {name!r} is not one of {sorted(LINEAR_BACKENDS)}")
    if not cls.is_available():
        raise ValueError(f"linear backend {name!r} is not available with this torch build/CPU; "
                         f"available: {available_linear_backends()}")
    return cls()


# ---- the model ----------------------------------------------------------------------

# Layer attribute of each projection: (fp32 weight, fp32 bias, packed weight).
_PROJECTIONS = (
    ("qkv_proj", "qkv_bias", "qkv_packed"),
    ("o_proj", "o_bias", "o_packed"),
    ("gate_up_proj", "gate_up_bias", "gate_up_packed"),
    ("down_proj", "down_bias", "down_packed"),
)


@dataclass
class PackedWeights:
    """Every projection of one model packed for one backend (see pack_model)."""

    backend: LinearBackend | None  # None: the model's built-in fp32 F.linear path
    layers: list[dict[str, Any]] = field(default_factory=list)  # packed attribute -> packed
    lm_head: Any = None


def pack_model(model: LlamaForCausalLM, name: str) -> PackedWeights:
    """Pack `model`'s fp32 projections and LM head for backend `name`, without
    installing them (install_packed_weights does), so a benchmark can hold several."""
    backend = get_linear_backend(name)
    if name == Fp32Linear.name:
        return PackedWeights(None)  # the model's own F.linear calls, bit for bit
    if model.dtype != torch.float32:
        raise ValueError(f"linear backend {name!r} needs a float32 model (its activations stay "
                         f"fp32), got dtype {model.dtype}; use dtype='float32'")
    with torch.no_grad():
        layers = [
            {packed: backend.prepare(getattr(layer, weight), getattr(layer, bias))
             for weight, bias, packed in _PROJECTIONS}
            for layer in model.layers
        ]
        lm_head = backend.prepare(model.lm_head_weight)
    return PackedWeights(backend, layers, lm_head)


def install_packed_weights(model: LlamaForCausalLM, packed: PackedWeights) -> None:
    """Make `model`'s forward and compute_logits use `packed` (from pack_model)."""
    if packed.backend is not None and len(packed.layers) != len(model.layers):
        raise ValueError(f"packed weights for {len(packed.layers)} layers, model has {len(model.layers)}")
    for i, layer in enumerate(model.layers):
        for _, _, attr in _PROJECTIONS:
            setattr(layer, attr, packed.layers[i][attr] if packed.backend is not None else None)
        setattr(layer, "linear", packed.backend)  # noqa: B010 (layers are typed as nn.Module)
    model.lm_head_packed = packed.lm_head
    model.linear = packed.backend


def apply_linear_backend(model: LlamaForCausalLM, name: str) -> None:
    """Repack every projection (qkv, o, gate_up, down) and the LM head of `model` for
    backend `name` and make its forward use them; "fp32" restores the plain F.linear
    path. The fp32 parameters (and the fp32 embedding lookup) are left as they are."""
    install_packed_weights(model, pack_model(model, name))


def linear_backend_name(model: LlamaForCausalLM) -> str:
    backend = model.linear
    return Fp32Linear.name if backend is None else backend.name
