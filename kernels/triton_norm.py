"""RMSNorm, and the residual add fused with it, as Triton kernels in the model dtype.

One program per row (a token, or a token's head for the Qwen3 q/k norm): the row's sum
of squares is one reduction over the whole row in registers, in fp32, the same whatever
else is in the batch, so a row's result is batch-invariant. Nothing is copied to float
in memory: rows are read in the model dtype, normalised in fp32, and written back in it.
The rounding follows the torch path (kernels/layer_ops.py, like HF): normalise in fp32,
round to the model dtype, multiply by the weight, round again (for fp32 models both
roundings are no-ops).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _normalise(x, w, eps, D: tl.constexpr, out_ty: tl.constexpr):
    """[D_P] fp32 row (zeros past D), [D_P] weight -> the normed row in out_ty."""
    rstd = tl.rsqrt(tl.sum(x * x, 0) / D + eps)
    normed = (x * rstd).to(out_ty).to(tl.float32)
    return (normed * w.to(tl.float32)).to(out_ty)


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [R, H, D]
    w_ptr,  # [H, D] or [D] (s_wh = 0)
    out_ptr,  # [R, H, D] contiguous
    s_xr, s_xh, s_wh,
    eps, H: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr,
):
    r, h = tl.program_id(0), tl.program_id(1)
    d = tl.arange(0, D_P)
    ok = d < D
    x = tl.load(x_ptr + r.to(tl.int64) * s_xr + h * s_xh + d, mask=ok, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + h * s_wh + d, mask=ok, other=0.0)
    out = _normalise(x, w, eps, D, out_ptr.dtype.element_ty)
    tl.store(out_ptr + (r.to(tl.int64) * H + h) * D + d, out, mask=ok)


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,  # [T, D]: the branch output; becomes the new residual
    res_ptr,  # [T, D]: the residual stream
    w_ptr,  # [D]
    out_ptr,  # [T, D] contiguous
    s_x, s_res,
    eps, D: tl.constexpr, D_P: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, D_P)
    ok = d < D
    x = tl.load(x_ptr + t * s_x + d, mask=ok, other=0.0)
    res = tl.load(res_ptr + t * s_res + d, mask=ok, other=0.0)
    total = (x.to(tl.float32) + res.to(tl.float32)).to(x_ptr.dtype.element_ty)  # rounded as torch's add
    tl.store(x_ptr + t * s_x + d, total, mask=ok)
    w = tl.load(w_ptr + d, mask=ok, other=0.0)
    tl.store(out_ptr + t * D + d, _normalise(total.to(tl.float32), w, eps, D, out_ptr.dtype.element_ty), mask=ok)


def rms_norm_triton(x: torch.Tensor,  # [T, D] or [T, H, D], last dim contiguous
                    weight: torch.Tensor,  # [D], or [H, D] per head
                    eps: float) -> torch.Tensor:  # x's shape, new and contiguous
    """RMSNorm over the last dim, each row by one program."""
    rows = x if x.dim() == 3 else x.unsqueeze(1)  # [R, H, D]
    R, H, D = rows.shape
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if R == 0:
        return out.view(x.shape)
    _check_rows(rows, weight, D)
    s_wh = weight.stride(0) if weight.dim() == 2 else 0
    _rms_norm_kernel[(R, H)](rows, weight, out, rows.stride(0), rows.stride(1), s_wh,
                             eps, H=H, D=D, D_P=triton.next_power_of_2(D))
    return out.view(x.shape)


def add_rms_norm_triton(x: torch.Tensor,  # [T, D]: the branch output, overwritten with x + residual
                        residual: torch.Tensor,  # [T, D]
                        weight: torch.Tensor,  # [D]
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:  # normed [T, D], x (the new residual)
    """x += residual (in the model dtype, in place), then RMSNorm of the sum: one pass."""
    T, D = x.shape
    out = torch.empty(T, D, dtype=x.dtype, device=x.device)
    if T == 0:
        return out, x
    _check_rows(x, weight, D)
    if residual.stride(-1) != 1:
        raise ValueError("add_rms_norm_triton needs the residual's last dim contiguous")
    _add_rms_norm_kernel[(T,)](x, residual, weight, out, x.stride(0), residual.stride(0),
                               eps, D=D, D_P=triton.next_power_of_2(D))
    return out, x


def _check_rows(x: torch.Tensor, weight: torch.Tensor, width: int) -> None:
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("the triton RMSNorm kernels need the last dim contiguous")
    if weight.shape[-1] != width:
        raise ValueError(f"RMSNorm weight of width {weight.shape[-1]} for rows of width {width}")
