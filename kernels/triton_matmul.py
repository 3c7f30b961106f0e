"""A batch-invariant GEMM in Triton: y = x @ weight.T (+ bias) for the `triton` linear
backend (linear_triton.py), on CUDA tensors or CPU tensors under TRITON_INTERPRET=1.

Why not cuBLAS: cuBLAS picks its kernel (tile shape, split-K) from the number of rows
M, so a 17-row verify sums each output element in another order than a 1-row decode and
the logits differ in their last bits; near a tie the argmax flips and speculation stops
being lossless. Here every output element is reduced the same way whatever M is:
- one fixed tile configuration per dtype (never chosen by M or by the shapes);
- no split-K: one program owns a [BLOCK_M, BLOCK_N] tile and walks K from 0 upwards in
  BLOCK_K steps, accumulating in fp32 with one `tl.dot` per step;
- the bias is added after the reduction, in fp32, then the tile is rounded once to the
  output dtype.
A row's result depends only on that row and the weight, not on its neighbours in the
tile (rows of a tile are independent in `tl.dot`), so row i of an M-row call equals,
bit for bit, the same row computed alone. The same idea as vLLM's batch-invariant mode
and SGLang's deterministic inference (thinking-machines' batch_invariant_ops); unlike
them this is a plain (non-persistent) grid, as decode steps here are a few rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from specdec.kernels.triton_dot import INTERPRETED, dot_acc


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int


# One configuration per dtype, fixed: changing it changes every output's rounding (but
# never makes it depend on M). BLOCK_M is tl.dot's minimum, as decode and verify steps
# are 1-64 rows; BLOCK_N is small so a 1-row GEMV still spreads over many programs.
# fp32 uses input_precision="ieee" (no TF32), so its dot is a plain FMA chain over K.
CONFIGS: dict[torch.dtype, TileConfig] = {
    torch.float32: TileConfig(block_m=16, block_n=32, block_k=32, num_warps=4),
    torch.float16: TileConfig(block_m=16, block_n=32, block_k=64, num_warps=4),
    torch.bfloat16: TileConfig(block_m=16, block_n=32, block_k=64, num_warps=4),
}


# M is not specialised on (Triton would compile M == 1 and multiples of 16 apart): one
# compiled kernel serves every row count, and no new one is compiled under graph capture.
@triton.jit(do_not_specialize=["M"])
def _linear_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    b_ptr,  # [N] (unused unless HAS_BIAS)
    out_ptr,  # [M, N]
    M, N, K,
    s_xm, s_wn, s_om,  # row strides; the last dims are contiguous
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EXACT: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    ks = tl.arange(0, BLOCK_K)  # [BK]
    row_ok, col_ok = rows < M, cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        k_ok = k < K
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * s_xm + k[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
        w = tl.load(w_ptr + cols.to(tl.int64)[None, :] * s_wn + k[:, None],
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # [BK, BN]
        acc = dot_acc(x, w, acc, EXACT)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * s_om + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def linear_triton(x: torch.Tensor,  # [M, K], last dim contiguous (else copied)
                  weight: torch.Tensor,  # [N, K] contiguous, x's dtype
                  bias: torch.Tensor | None = None,  # [N]
                  ) -> torch.Tensor:  # [M, N] new, contiguous, x's dtype
    """x @ weight.T + bias, each row reduced in the same order for any M."""
    config = CONFIGS.get(x.dtype)
    if config is None:
        raise ValueError(f"the triton linear backend takes {sorted(map(str, CONFIGS))} activations, got {x.dtype}")
    if weight.dtype != x.dtype:
        raise ValueError(f"the triton linear backend needs the weight in the activations' dtype "
                         f"{x.dtype}, got {weight.dtype}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    M, K = x.shape
    N = weight.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    grid = (triton.cdiv(M, config.block_m), triton.cdiv(N, config.block_n))
    _linear_kernel[grid](
        x, weight, weight if bias is None else bias, out, M, N, K,
        x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        EXACT=INTERPRETED, num_warps=config.num_warps,
    )
    return out
