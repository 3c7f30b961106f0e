"""The one matrix product every batch-invariant Triton kernel here uses (the GEMM of
triton_matmul.py, attention_triton.py's scores and values).

On a GPU it is `tl.dot` with fp32 accumulation: each output element is one row of `a`
against one column of `b`, in an order fixed by the MMA instruction (or, for fp32 with
input_precision="ieee", a plain FMA chain), whatever the row's place in the tile.

Under TRITON_INTERPRET=1 (tests on the CPU) `tl.dot` is numpy's matmul, whose BLAS kernel
rounds a row differently depending on where it sits in the tile, and which reads bf16
as raw integers. There the product is written out instead: fp32 products summed along
K by numpy in the same order for every element, so the interpreter checks what the
kernels control (tiling, masks, the order of K steps) bit for bit.
"""
from __future__ import annotations

import os

import triton
import triton.language as tl

# Fixed when the kernels are decorated, as triton's own interpreter switch is.
INTERPRETED: bool = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def dot_acc(a, b, acc, EXACT: tl.constexpr):
    """acc + a @ b: a [M, K], b [K, N], acc [M, N] float32."""
    if EXACT:
        return acc + tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], 1)
    else:
        return tl.dot(a, b, acc, input_precision="ieee")
