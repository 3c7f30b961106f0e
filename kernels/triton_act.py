"""SiLU(gate) * up over the fused gate_up projection's output, as one Triton kernel (in
place of a SiLU kernel, a slice and a multiply). Element-wise, so batch-invariant. The
rounding follows torch's (kernels/layer_ops.py): SiLU in fp32 rounded to the model dtype,
then the product in fp32 rounded again."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _silu_mul_kernel(
    gate_up_ptr,  # [T, 2 I]: gate in the first half, up in the second
    out_ptr,  # [T, I] contiguous
    s_gu, INTER: tl.constexpr, BLOCK: tl.constexpr,
):
    t, blk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    i = blk * BLOCK + tl.arange(0, BLOCK)
    ok = i < INTER
    gate = tl.load(gate_up_ptr + t * s_gu + i, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + t * s_gu + INTER + i, mask=ok, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + t * INTER + i, (silu * up).to(out_ptr.dtype.element_ty), mask=ok)


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2 I] -> [T, I]
    T, width = gate_up.shape
    inter = width // 2
    out = torch.empty(T, inter, dtype=gate_up.dtype, device=gate_up.device)
    if T == 0:
        return out
    if gate_up.stride(1) != 1:
        raise ValueError("silu_mul_triton needs gate_up's last dim contiguous")
    _silu_mul_kernel[(T, triton.cdiv(inter, BLOCK))](gate_up, out, gate_up.stride(0), INTER=inter, BLOCK=BLOCK)
    return out
