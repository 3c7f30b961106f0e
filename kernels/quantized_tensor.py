"""A float32 weight that stays in GGUF blocks: `QuantizedTensor`, a torch.Tensor subclass
(the torchao pattern) that a model holds as a parameter where it would hold the float
weight, so a GGUF model runs on its own blocks with no float32 copy and no model code
aware of it.

It has the weight's shape, float32 dtype and CPU device; its only storage is one float
(a zero expanded to the shape) plus the blocks, in row segments of possibly different
block types (a fused q/k/v projection may mix them), each laid out for the kernel
(linear_quant.PackedQuant). What it does with each torch operation:
- `F.embedding(ids, table)` and row indexing `table[ids]` dequantize just those rows
  (exactly): embedding lookups cost one row's blocks per token;
- metadata (shape, dtype, device, size, dim, ...) and `detach` / `requires_grad_` (so it
  can be an nn.Parameter) work on the tensor itself;
- `data_ptr` and `untyped_storage` are a TypeError: there is no float32 data to point at;
- any other operation gets the exactly dequantized float32 weight instead (a full copy,
  logged once per tensor): correct, at the memory cost the blocks exist to avoid.
The linear backends of linear_gguf.py read the blocks straight from `parts`.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils._pytree import tree_map

from specdec.kernels.gguf_blocks import QuantizedMatrix, concat_rows
from specdec.kernels.linear_quant import PackedQuant, dequantize_rows, pack

logger = logging.getLogger(__name__)

# Metadata getters and methods, answered by the tensor itself; a getter whose answer is a
# tensor (.data, .T, .real, ...) would expose the placeholder, so those get the values.
_METADATA_METHODS = {Tensor.size, Tensor.dim, Tensor.numel, Tensor.nelement, Tensor.ndimension, Tensor.stride,
                     Tensor.element_size, Tensor.is_floating_point, Tensor.is_complex, Tensor.__len__,
                     Tensor.get_device}
_IDENTITY_METHODS = {Tensor.detach, Tensor.requires_grad_}
_NO_DATA_METHODS = {Tensor.data_ptr, Tensor.untyped_storage}


class QuantizedTensor(Tensor):
    """A [rows, cols] float32 weight held as GGUF blocks (see the module docstring)."""

    parts: tuple[PackedQuant, ...]  # row segments, top to bottom
    _warned: bool

    @staticmethod
    def __new__(cls, matrices: list[QuantizedMatrix], float_headers: bool = False) -> QuantizedTensor:
        """The rows of `matrices` stacked (runs of one block type merged into one part),
        packed for the kernel (float_headers: linear_quant.pack)."""
        if not matrices or len({m.cols for m in matrices}) != 1:
            raise ValueError("a QuantizedTensor needs one or more matrices of one width")
        rows, cols = sum(m.rows for m in matrices), matrices[0].cols
        placeholder = torch.zeros((), dtype=torch.float32).expand(rows, cols)
        tensor = Tensor._make_subclass(cls, placeholder, False)
        tensor.parts = tuple(pack(concat_rows(run), float_headers) for run in _runs_of_one_type(matrices))
        tensor._warned = False
        return tensor

    @property
    def qtypes(self) -> tuple[str, ...]:
        return tuple(part.qtype for part in self.parts)

    def rows_of(self, ids: Tensor) -> Tensor:  # ids [...] int -> [..., cols] float32
        """Rows `ids`, exactly dequantized."""
        if len(self.parts) == 1:
            return dequantize_rows(self.parts[0], ids)
        flat = ids.reshape(-1).to(torch.int64)
        out = torch.empty(flat.numel(), self.parts[0].cols, dtype=torch.float32)
        start = 0
        for part in self.parts:
            mine = (flat >= start) & (flat < start + part.rows)
            out[mine] = dequantize_rows(part, flat[mine] - start)
            start += part.rows
        if flat.numel() and not 0 <= int(flat.min()) <= int(flat.max()) < start:
            raise ValueError(f"row ids must be in [0, {start})")
        return out.reshape(*ids.shape, -1)

    def dequantize(self) -> Tensor:  # [rows, cols] float32
        """The whole weight, exactly dequantized (a new float32 tensor)."""
        rows = int(sum(part.rows for part in self.parts))
        return self.rows_of(torch.arange(rows))

    @classmethod
    def __torch_function__(cls, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.embedding and isinstance(args[1], QuantizedTensor) and _plain_lookup(args, kwargs):
            return args[1].rows_of(args[0])
        rows = _row_index(args[1]) if func is Tensor.__getitem__ and isinstance(args[0], QuantizedTensor) else None
        if rows is not None:
            return args[0].rows_of(rows)
        if func in _IDENTITY_METHODS:
            return args[0]
        if func is Tensor.__repr__:
            return f"QuantizedTensor(shape={tuple(args[0].shape)}, blocks={'+'.join(args[0].qtypes)})"
        if func in _NO_DATA_METHODS:
            raise TypeError(f"a QuantizedTensor has no float32 data for {func.__name__}; call dequantize() first")
        if func in _METADATA_METHODS or getattr(func, "__name__", "") == "__get__":
            with torch._C.DisableTorchFunctionSubclass():
                result = func(*args, **kwargs)
            if not isinstance(result, Tensor):
                return result
        args, kwargs = tree_map(_dequantized, (args, kwargs))
        return func(*args, **kwargs)


def _runs_of_one_type(matrices: list[QuantizedMatrix]) -> list[list[QuantizedMatrix]]:
    runs: list[list[QuantizedMatrix]] = []
    for matrix in matrices:
        if runs and runs[-1][-1].qtype == matrix.qtype:
            runs[-1].append(matrix)
        else:
            runs.append([matrix])
    return runs


def _plain_lookup(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether an F.embedding call is a plain row lookup (no max_norm renormalisation)."""
    return len(args) < 4 and kwargs.get("max_norm") is None and isinstance(args[0], Tensor)


def _row_index(index: Any) -> Tensor | None:
    """The rows an index selects when it selects whole rows by integer ids, else None."""
    if isinstance(index, Tensor) and not index.is_floating_point() and index.dtype != torch.bool:
        return index
    if isinstance(index, list) and all(isinstance(i, int) for i in index):
        return torch.tensor(index, dtype=torch.int64)
    return None


def _dequantized(value: Any) -> Any:
    if not isinstance(value, QuantizedTensor):
        return value
    if not value._warned:
        value._warned = True
        logger.info("dequantizing a %s [%d, %d] weight in full for an operation on float data",
                    "+".join(value.qtypes), *value.shape)
    return value.dequantize()
