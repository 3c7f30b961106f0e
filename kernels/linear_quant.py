"""float32 x GGUF-block matrix products on the CPU through the C++ kernel
(csrc/linear_quant.cpp), and exact row lookups in such matrices; the linear backends
built on them are in linear_gguf.py.

The weight stays in its GGUF blocks (kernels/gguf_blocks.py): 1.06 bytes per weight for
Q8_0, 0.56 for Q4_0, 0.63 for Q4_1, against 2 for cpp-fp16; the K-quants repacked into
32-weight blocks with float32 scales take 0.75 (Q4_K), 0.88 (Q5_K) and 1.0 (Q6_K). The kernel decodes each block
in registers to exactly gguf's dequantized values and multiplies in float32, every row of
a call sharing each decoded block; a fixed accumulation order makes it batch invariant
and makes its AVX2 and AVX-512 variants agree bit for bit. `isa` picks the variant:
"auto" (the widest the CPU and the build flags allow), "avx2" or "avx512".

`activations="int8"` (opt-in, lossy) quantizes each activation row to int8 per 32-value
block (one float32 scale each, as ggml's Q8_0 activations) and sums the byte products
exactly in integer SIMD, one float32 step per block: rows cost a fraction of float32's,
so a verify forward of several tokens costs much less more than a decode step. It is
batch invariant too, and its variants agree bit for bit: "avx2", "avx512" (with VNNI
where the CPU has it) and "avx512bw" (without VNNI, for tests); kernels/reference.py's
linear_gguf_int8 is its oracle.
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from specdec.kernels import cpu_build
from specdec.kernels.gguf_blocks import QuantizedMatrix, kernel_blocks

_LIBRARY = "linear_quant"
_ARGTYPES = [ctypes.c_int32, ctypes.c_int32, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
             ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32]
_DEQUANTIZE_ARGTYPES = [ctypes.c_int32, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                        ctypes.c_void_p]
ISAS = {"auto": 0, "avx2": 1, "avx512": 2, "avx512bw": 3}  # the exact kernel runs "avx512" for "avx512bw"
ACTIVATIONS = ("float32", "int8")
_SYMBOLS = {"float32": "specdec_linear_quant", "int8": "specdec_linear_quant_int8"}
GROUP = 4  # rows whose blocks the kernel reads interleaved (csrc/linear_quant_blocks.h)


@dataclass(frozen=True)
class PackedQuant:
    """A QuantizedMatrix laid out for the kernel (csrc/linear_quant_blocks.h): its rows in
    groups of GROUP, the last padded with zero blocks; for each block index in turn a
    group holds the headers of its rows' blocks, then their quants."""

    qtype: str
    format_id: int
    groups: Tensor  # [ceil(rows / GROUP), blocks per row * GROUP * block bytes] uint8
    rows: int
    cols: int
    padded_cols: int


def pack(matrix: QuantizedMatrix, float_headers: bool = False) -> PackedQuant:
    """The kernel's layout of `matrix` (a copy of its blocks, reordered; K-quants repacked,
    and Q4_1's headers widened to float32 with float_headers: see kernel_blocks)."""
    kernel = kernel_blocks(matrix, float_headers)
    rows, steps, width = kernel.blocks.shape
    padded = torch.zeros(-(-rows // GROUP) * GROUP, steps, width, dtype=torch.uint8)
    padded[:rows] = kernel.blocks
    blocks = padded.view(-1, GROUP, steps, width).transpose(1, 2)  # [groups, steps, GROUP, block bytes]
    parts = (blocks[..., : kernel.header_bytes].flatten(2), blocks[..., kernel.header_bytes :].flatten(2))
    groups = torch.cat(parts, dim=2).reshape(blocks.shape[0], -1)
    return PackedQuant(matrix.qtype, kernel.format_id, groups, rows, matrix.cols, matrix.padded_cols)


def builds() -> bool:
    """Whether the kernel builds and loads here (tried once per process)."""
    return cpu_build.builds(_LIBRARY, "no quantized linear backend")


@functools.cache
def auto_isa() -> str:
    """The variant "auto" runs here ("avx512" or "avx2"), or "" if none runs on this CPU."""
    code = int(cpu_build.function(_LIBRARY, "specdec_quant_auto_isa", [], ctypes.c_int32)())
    return next((name for name, value in ISAS.items() if value == code and code), "")


def cpu_runs(isa: str) -> bool:
    """Whether this CPU runs the kernel variant `isa` ("avx2", "avx512" or "avx512bw")."""
    has = cpu_build.function(_LIBRARY, "specdec_quant_cpu_has", [ctypes.c_int32], ctypes.c_int32)
    return bool(has(ISAS[isa]))


@functools.cache
def int8_uses_vnni() -> bool:
    """Whether the int8 kernel's "avx512" variant sums with AVX512-VNNI here."""
    return bool(cpu_build.function(_LIBRARY, "specdec_quant_int8_vnni", [], ctypes.c_int32)())


def linear_quant(
    x: Tensor,  # [M, K] float32
    weight: PackedQuant,  # [N, K] in GGUF blocks, packed
    bias: Tensor | None = None,  # [N] float32
    isa: str = "auto",
    out: Tensor | None = None,  # [M, >= column + N] float32, contiguous: written in place
    column: int = 0,
    activations: str = "float32",
) -> Tensor:  # [M, N] float32: out's columns [column, column + N), else new and contiguous
    """x @ weight.T (+ bias), with weight's exact dequantized values: float32 sums, or
    for activations "int8" x quantized per 32-value block and exact integer sums."""
    _check(x, weight, bias, isa, activations)
    if out is None:
        out = torch.empty(x.shape[0], weight.rows, dtype=torch.float32)
    elif not (out.dtype == torch.float32 and out.is_contiguous() and out.shape[0] == x.shape[0]
              and 0 <= column <= out.shape[1] - weight.rows):
        raise ValueError(f"out must be a contiguous float32 [{x.shape[0]}, >= {column + weight.rows}] tensor, "
                         f"got {out.dtype} {tuple(out.shape)}")
    if x.shape[0] == 0:
        return out[:, column : column + weight.rows]
    # Rows padded to whole blocks meet zero activations (see gguf_blocks).
    x = F.pad(x, (0, weight.padded_cols - weight.cols)) if weight.padded_cols != weight.cols else x.contiguous()
    multiply = cpu_build.function(_LIBRARY, _SYMBOLS[activations], _ARGTYPES, ctypes.c_int32)
    status = multiply(weight.format_id, ISAS[isa], x.data_ptr(), x.shape[0], x.shape[1], weight.groups.data_ptr(),
                      weight.rows, None if bias is None else bias.data_ptr(), out[:, column:].data_ptr(),
                      out.shape[1], torch.get_num_threads())
    if status != 0:
        raise ValueError(f"the quantized linear kernel has no {isa!r} variant for this CPU")
    return out[:, column : column + weight.rows]


def _check(x: Tensor, weight: PackedQuant, bias: Tensor | None, isa: str, activations: str) -> None:
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != weight.cols:
        raise ValueError(f"linear_quant needs float32 x of shape [M, {weight.cols}], got {x.dtype} "
                         f"{tuple(x.shape)}")
    if isa not in ISAS:
        raise ValueError(f"isa {isa!r} is not one of {sorted(ISAS)}")
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations {activations!r} is not one of {list(ACTIVATIONS)}")
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (weight.rows,)):
        raise ValueError(f"bias must be float32 of shape [{weight.rows}], got {bias.dtype} {tuple(bias.shape)}")


def dequantize_rows(weight: PackedQuant, rows: Tensor) -> Tensor:  # rows [...] int -> [..., cols] float32
    """Rows `rows` of `weight`, exactly dequantized: an embedding lookup in a quantized
    table, which costs one row's blocks per token instead of a float32 table."""
    flat = rows.to(torch.int64).reshape(-1).contiguous()
    if flat.numel() and not 0 <= int(flat.min()) <= int(flat.max()) < weight.rows:
        raise ValueError(f"row ids must be in [0, {weight.rows})")
    out = torch.empty(flat.numel(), weight.padded_cols, dtype=torch.float32)
    dequantize = cpu_build.function(_LIBRARY, "specdec_quant_dequantize_rows", _DEQUANTIZE_ARGTYPES, ctypes.c_int32)
    dequantize(weight.format_id, weight.groups.data_ptr(), weight.padded_cols, flat.data_ptr(), flat.numel(),
               out.data_ptr())
    return out[:, : weight.cols].reshape(*rows.shape, weight.cols)
