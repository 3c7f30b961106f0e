"""Weights kept in GGUF blocks: the block types the C++ kernels run (csrc/linear_quant*), a
matrix of such blocks, quantizing a float weight into one with the gguf package, and the
exact repack of the K-quants into the kernels' 32-weight blocks.

A `QuantizedMatrix` holds a [rows, cols] weight as GGUF stores it: each row is whole
blocks, contiguous; `blocks` is the [rows, row_bytes] uint8 tensor of them. Its rows can
be sliced and concatenated freely (a block never spans rows), which is how the loader
fuses q/k/v and reorders q/k rows. When `cols` is not a multiple of 32 (only
quantize-at-load makes such a matrix: GGUF rows are whole blocks) each row's last block is
quantized from the row padded with zeros, and the kernels read the activations padded
with zeros to match, so the padding adds nothing to any output.

The kernels read 32-weight blocks (`kernel_blocks`): Q8_0, Q4_0 and Q4_1 as they are;
Q4_K, Q5_K and Q6_K (256-weight super-blocks) repacked, each 32-weight sub-block with its
own float32 scale (the super-block's fp16 d times the sub-block's integer scale, exact in
float32) and min, and its quants in the 4-bit layout of Q4_0 plus high bits (layouts:
csrc/linear_quant_blocks.h). Q4_1 can take that layout too, its fp16 d and m widened to
float32 (`float_headers`: faster for the float32 kernel). Every weight keeps gguf's
dequantized value exactly.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import Q4_K
from gguf.quants import quantize as gguf_quantize
from torch import Tensor

BLOCK = 32  # weights per kernel block
T = GGMLQuantizationType
# GGUF block types the kernels run, by name.
BLOCK_TYPES: dict[str, GGMLQuantizationType] = {"q8_0": T.Q8_0, "q4_0": T.Q4_0, "q4_1": T.Q4_1, "q4_k": T.Q4_K,
                                                "q5_k": T.Q5_K, "q6_k": T.Q6_K}
QUANTIZABLE = ("q8_0", "q4_0", "q4_1")  # the ones gguf quantizes (quantize-at-load)
# The kernel formats (csrc/linear_quant_blocks.h): block type -> (format id, header bytes).
_Q4X = (3, 8)
_KERNEL_FORMATS = {"q8_0": (0, 2), "q4_0": (1, 2), "q4_1": (2, 4), "q4_k": _Q4X, "q5_k": (4, 8), "q6_k": (5, 8)}


@dataclass(frozen=True)
class QuantizedMatrix:
    """A [rows, cols] weight in GGUF blocks of type `qtype` (a key of BLOCK_TYPES)."""

    qtype: str
    blocks: Tensor  # [rows, row_bytes] uint8, contiguous
    cols: int

    def __post_init__(self) -> None:
        if self.qtype not in BLOCK_TYPES:
            raise ValueError(f"block type {self.qtype!r} is not one of {sorted(BLOCK_TYPES)}")
        expected = row_bytes(self.qtype, self.cols)
        if self.blocks.dtype != torch.uint8 or self.blocks.dim() != 2 or self.blocks.shape[1] != expected:
            raise ValueError(f"{self.qtype} blocks of a {self.cols}-column matrix must be a [rows, {expected}] uint8 "
                             f"tensor, got {self.blocks.dtype} {tuple(self.blocks.shape)}")
        if not self.blocks.is_contiguous():
            raise ValueError("the blocks of a QuantizedMatrix must be contiguous")

    @property
    def rows(self) -> int:
        return int(self.blocks.shape[0])

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.cols

    @property
    def padded_cols(self) -> int:
        """cols rounded up to whole blocks: the activations' width the kernels read."""
        return -(-self.cols // BLOCK) * BLOCK

    @property
    def ggml_type(self) -> GGMLQuantizationType:
        return BLOCK_TYPES[self.qtype]


def row_bytes(qtype: str, cols: int) -> int:
    """Bytes of one row of `cols` weights in blocks of `qtype`."""
    block_size, type_size = GGML_QUANT_SIZES[BLOCK_TYPES[qtype]]
    return -(-cols // block_size) * type_size


def quantize(weight: Tensor, qtype: str) -> QuantizedMatrix:  # weight [rows, cols] -> blocks of qtype
    """`weight` quantized to `qtype` by gguf (llama.cpp's reference quantizer), each row
    padded with zeros to whole blocks."""
    if qtype not in QUANTIZABLE:
        raise ValueError(f"cannot quantize to {qtype!r}; block types: {list(QUANTIZABLE)}")
    if weight.dim() != 2:
        raise ValueError(f"only a 2-D weight can be quantized, got shape {tuple(weight.shape)}")
    rows, cols = weight.shape
    padded = np.zeros((rows, -(-cols // BLOCK) * BLOCK), dtype=np.float32)
    padded[:, :cols] = weight.detach().to(torch.float32).cpu().numpy()
    blocks = gguf_quantize(padded, BLOCK_TYPES[qtype])
    return QuantizedMatrix(qtype, torch.from_numpy(np.ascontiguousarray(blocks)), cols)


def concat_rows(parts: list[QuantizedMatrix]) -> QuantizedMatrix:
    """The matrices stacked along their rows (all of one type and width)."""
    kinds = {(p.qtype, p.cols) for p in parts}
    if len(kinds) != 1:
        raise ValueError(f"cannot stack matrices of different block types or widths: {sorted(kinds)}")
    return QuantizedMatrix(parts[0].qtype, torch.cat([p.blocks for p in parts]), parts[0].cols)


@dataclass(frozen=True)
class KernelBlocks:
    """A matrix's 32-weight blocks in a kernel format: header (scales) first in each."""

    format_id: int
    header_bytes: int
    blocks: Tensor  # [rows, padded_cols / 32, block bytes] uint8


def kernel_blocks(matrix: QuantizedMatrix, float_headers: bool = False) -> KernelBlocks:
    """`matrix`'s blocks as the kernels read them (the K-quants repacked, exactly). With
    float_headers, Q4_1's fp16 d and m are widened to float32 (exactly: the K-quants'
    layout): the float32 kernel then broadcasts each column's d and m straight from memory
    instead of shuffling them out of converted fp16 headers, ~10% faster per decoded
    block for 20% more bytes, which the int8 kernel, nearer the memory bound, does not
    win back."""
    rows, steps = matrix.rows, matrix.padded_cols // BLOCK
    raw = matrix.blocks.numpy()
    if float_headers and matrix.qtype == "q4_1":
        format_id, header = _Q4X
        blocks = torch.from_numpy(_widen_q4_1(raw.reshape(rows * steps, -1)))
    elif matrix.qtype in _REPACKS:
        format_id, header = _KERNEL_FORMATS[matrix.qtype]
        blocks = torch.from_numpy(_REPACKS[matrix.qtype](raw.reshape(rows * steps // 8, -1)))
    else:
        format_id, header = _KERNEL_FORMATS[matrix.qtype]
        blocks = matrix.blocks
    return KernelBlocks(format_id, header, blocks.reshape(rows, steps, -1))


def _floats_as_bytes(values: np.ndarray) -> np.ndarray:  # [..., k] float32 -> [..., 4 k] uint8
    return np.ascontiguousarray(values, dtype=np.float32).view(np.uint8)


def _halves(raw: np.ndarray, at: int) -> np.ndarray:  # fp16 at byte `at` of each super-block -> [n, 1] float32
    return raw[:, at : at + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(q: np.ndarray) -> np.ndarray:  # [..., 32] quants -> [..., 16] bytes: j's low nibble, j + 16's high
    return ((q[..., :16] & 15) | ((q[..., 16:] & 15) << 4)).astype(np.uint8)


def _k_scales(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # Q4_K / Q5_K -> scale, min: [n, 8] float32
    """Each sub-block's float32 scale d * sc and min -dmin * m (both products exact)."""
    sc, mn = Q4_K.get_scale_min(raw[:, 4:16])
    return _halves(raw, 0) * sc.astype(np.float32), -(_halves(raw, 2) * mn.astype(np.float32))


def _low_quants(qs: np.ndarray) -> np.ndarray:  # Q4_K / Q5_K qs [n, 128] -> 4-bit quants [n, 8, 32]
    """Chunk c of 32 bytes holds sub-block 2c in its low nibbles and 2c + 1 in its high ones."""
    chunks = qs.reshape(-1, 4, 1, 32)
    return ((chunks >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 15).reshape(-1, 8, 32)


def _widen_q4_1(raw: np.ndarray) -> np.ndarray:  # [n, 20] -> [n, 24]: Q4X (fp32 d, m)
    headers = raw[:, :4].copy().view(np.float16).astype(np.float32)  # [n, 2]: d, m
    return np.concatenate((_floats_as_bytes(headers), raw[:, 4:]), axis=-1)


def _repack_q4_k(raw: np.ndarray) -> np.ndarray:  # [n, 144] -> [n * 8, 24]
    scale, minimum = _k_scales(raw)
    quants = _nibbles(_low_quants(raw[:, 16:]))
    parts = (_floats_as_bytes(scale[..., None]), _floats_as_bytes(minimum[..., None]), quants)
    return np.concatenate(parts, axis=-1).reshape(-1, 24)


def _repack_q5_k(raw: np.ndarray) -> np.ndarray:  # [n, 176] -> [n * 8, 28]
    scale, minimum = _k_scales(raw)
    low = _low_quants(raw[:, 48:])
    # Bit i of qh byte j is the fifth bit of sub-block i's element j.
    high = (raw[:, None, 16:48] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # [n, 8, 32]
    high_words = np.packbits(high, axis=-1, bitorder="little")  # [n, 8, 4]: bit j of the u32 = element j
    parts = (_floats_as_bytes(scale[..., None]), _floats_as_bytes(minimum[..., None]), _nibbles(low), high_words)
    return np.concatenate(parts, axis=-1).reshape(-1, 28)


def _repack_q6_k(raw: np.ndarray) -> np.ndarray:  # [n, 210] -> [n * 8, 32]
    ql, qh = raw[:, :128], raw[:, 128:192]
    scales = raw[:, 192:208].copy().view(np.int8).astype(np.float32)  # one per 16 weights
    d = _halves(raw, 208) * scales  # [n, 16], exact
    # Each half of the super-block: ql's 64 bytes give 64 low and 64 high nibbles, qh's 32
    # bytes four 2-bit fields each, in the order of the 128 weights.
    low = ((ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 15).reshape(-1, 256)
    high = ((qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3)
    q = low.reshape(-1, 8, 32)  # 4-bit part per 32-weight block
    fields = high.reshape(-1, 8, 2, 16).astype(np.uint32) << (2 * np.arange(16, dtype=np.uint32))
    high_words = np.ascontiguousarray(fields.sum(axis=-1, dtype=np.uint32)).view(np.uint8)  # [n, 8, 8]
    parts = (_floats_as_bytes(d.reshape(-1, 8, 2)), _nibbles(q), high_words.reshape(-1, 8, 8))
    return np.concatenate(parts, axis=-1).reshape(-1, 32)


_REPACKS = {"q4_k": _repack_q4_k, "q5_k": _repack_q5_k, "q6_k": _repack_q6_k}  # [n, super-block] -> [8 n, block]
