"""Projection modules that hold their linear backend (vLLM's LinearBase + quant_method).

Each projection of the model (qkv, o, gate_up, down in each layer, and the LM head) is a
`PackedLinear`: its weight (and bias) as loaded, the backend object that multiplies by it
(kernels/linear.py; `Fp32Linear`, F.linear on the weight itself, by default) and the
weight packed for that backend. The parameters stay whatever the backend: the embedding
table is still looked up in the model dtype (also when tied to the LM head), a drafter may
share the embedding / LM head, and the model can be repacked for another backend later.
A GGUF model on its own blocks (or a model quantized at load) holds each weight as a
QuantizedTensor (kernels/quantized_tensor.py): still a float32 [out, in] parameter to
everything here, but stored as blocks, which its backend (kernels/linear_gguf.py) reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from specdec.kernels.linear_base import Fp32Linear, LinearBackend


class PackedLinear(nn.Module):
    """y = x @ weight.T + bias, computed by `backend` on `packed`, its form of the weight.

    Contract:
    - `weight` [out, in] and `bias` [out] (or None) are parameters, filled in place by the
      loader (or `weight` shared with another module, as a tied LM head shares the
      embedding table). After replacing or refilling them, call `use_backend` again.
    - `use_backend(backend)` packs them for `backend` and makes `forward` use it;
      `pack` and `install` do the two halves (a benchmark holds several packings). A
      backend with `needs_fp32` refuses a non-float32 weight (ValueError).
    - `forward(x)`: x [M, in] -> [M, out], a new tensor, as `backend.apply` returns it.
    """

    weight: nn.Parameter
    bias: nn.Parameter | None

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 device: torch.device | str, weight: nn.Parameter | None = None):
        super().__init__()
        # Uninitialised: the loader overwrites every parameter.
        self.weight = weight if weight is not None else _param((out_features, in_features), dtype, device)
        self.register_parameter("bias", _param((out_features,), dtype, device) if bias else None)
        self.backend: LinearBackend = Fp32Linear()
        self.packed: Any = self.backend.prepare(self.weight, self.bias)

    def pack(self, backend: LinearBackend) -> Any:
        """The weight (and bias) packed for `backend`, not installed."""
        if backend.needs_fp32 and self.weight.dtype != torch.float32:
            raise ValueError(f"linear backend {backend.name!r} needs a float32 model (its activations stay "
                             f"fp32), got dtype {self.weight.dtype}; use dtype='float32'")
        with torch.no_grad():
            return backend.prepare(self.weight, self.bias)

    def install(self, backend: LinearBackend, packed: Any) -> None:
        """Make `forward` use `packed`, from `pack(backend)` of this module. A holder of
        pointers into the old packing (the C++ layer loop of specdec/executor.py) must be
        told: install through it."""
        self.backend, self.packed = backend, packed

    def use_backend(self, backend: LinearBackend) -> None:
        self.install(backend, self.pack(backend))

    def forward(self, x: Tensor) -> Tensor:  # [M, in] -> [M, out]
        return self.backend.apply(x, self.packed)

    # Called straight, without nn.Module's hook dispatch: ~2.5 us a call on the 2-core CPU,
    # and a decode step of the default model makes 121 of them.
    __call__ = forward

    def extra_repr(self) -> str:
        return f"in={self.weight.shape[1]}, out={self.weight.shape[0]}, backend={self.backend.name}"


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


@dataclass
class PackedWeights:
    """Every PackedLinear of one model packed for one backend (pack_linears)."""

    backend: LinearBackend
    packed: dict[str, Any]  # module name -> packed weight


def pack_linears(model: nn.Module, backend: LinearBackend) -> PackedWeights:
    """Pack every PackedLinear of `model` for `backend`, without installing them."""
    return PackedWeights(backend, {name: module.pack(backend) for name, module in _linears(model)})


def install_linears(model: nn.Module, weights: PackedWeights) -> None:
    """Make every PackedLinear of `model` use `weights` (from pack_linears of this model)."""
    linears = dict(_linears(model))
    if linears.keys() != weights.packed.keys():
        raise ValueError(f"packed weights for {sorted(weights.packed)}, the model has {sorted(linears)}")
    for name, module in linears.items():
        module.install(weights.backend, weights.packed[name])


def _linears(model: nn.Module) -> list[tuple[str, PackedLinear]]:
    return [(name, module) for name, module in model.named_modules() if isinstance(module, PackedLinear)]
