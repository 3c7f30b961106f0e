"""The decoder layer's elementwise and normalisation ops, chosen once per model with its
attention backend: RMSNorm, the residual add fused with it (also the add that ends a layer,
carried into the next norm by `residual_norm`), SiLU-and-multiply, and RoPE with the K/V
store. The model (specdec/models/llama.py) holds one `LayerOps` object and
calls it without any dispatch on devices.

- `LayerOps`: torch ops (the C++ RMSNorm on the CPU where it builds), the ones the CPU
  engine has always run; the store goes through the attention backend.
- `TritonLayerOps`: the fused Triton kernels of triton_norm.py, triton_act.py and
  triton_rope.py, in the model dtype and batch-invariant, for the triton attention
  backend (whose cache layout and store the rope kernel shares).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from specdec.kernels import rms_norm_cpu
from specdec.kernels.attention_base import AttentionBackend, AttentionPlan
from specdec.kernels.kv_cache import PagedKV


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim; weight is [D] or broadcastable like [H, D]."""
    if rms_norm_cpu.supports(x, weight):
        return rms_norm_cpu.rms_norm_cpu(x, weight, eps)
    if x.dtype == torch.float32 and weight.dim() == 1:
        return F.rms_norm(x, weight.shape, weight, eps)  # one fused op on the hot path
    # Like HF: normalise in fp32, cast back, then scale in the model dtype.
    normed = F.rms_norm(x.float(), (x.shape[-1],), None, eps)
    return normed.to(x.dtype) * weight


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [T, H, D]; cos, sin: [T, 1, D] from rope_cache (sin signed) -> [T, H, D]."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


class LayerOps:
    """The torch ops."""

    name = "torch"

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:  # [T, D] or [T, H, D]
        return rms_norm(x, weight, eps)

    def add_rms_norm(self,
                     x: Tensor,  # [T, D], overwritten with x + residual
                     residual: Tensor,  # [T, D]
                     weight: Tensor,  # [D]
                     eps: float) -> tuple[Tensor, Tensor]:  # normed [T, D], the new residual (x)
        total = x.add_(residual)
        return rms_norm(total, weight, eps), total

    def residual_norm(self,
                      x: Tensor,  # [T, D]: a block's output, overwritten with x + residual
                      residual: Tensor | None,  # [T, D] the residual stream; None: x is the stream
                      weight: Tensor,  # [D]
                      eps: float) -> tuple[Tensor, Tensor]:  # normed [T, D], the stream [T, D]
        """The norm in front of a block (a layer's input norm, the final norm): the residual
        stream carried beside the last block's output gets that output added here, as vLLM
        does, so that the add and the norm can be one kernel (add_rms_norm). Torch's ops
        run what they ran when each layer ended with its own add: x += residual in place,
        then the norm, bit for bit the same."""
        if residual is None:  # the first layer's input: the embedding, the stream itself
            return self.rms_norm(x, weight, eps), x
        return self.add_rms_norm(x, residual, weight, eps)

    def silu_mul(self, gate_up: Tensor) -> Tensor:  # [T, 2 I] -> [T, I]
        inter = gate_up.shape[1] // 2
        return F.silu(gate_up[:, :inter]).mul_(gate_up[:, inter:])

    def rope_store_kv(
        self,
        qk: Tensor,  # [T, Hq + Hkv, D]
        value: Tensor,  # [T, Hkv, D]
        cos: Tensor,  # [T, 1, D]
        sin: Tensor,  # [T, 1, D]
        num_heads: int,
        kv: PagedKV,
        attention: AttentionBackend[Any],
        plan: AttentionPlan,
    ) -> Tensor:  # [T, Hq, D] the rotated queries
        """RoPE on q and k, then k and v into the cache through `attention`."""
        qk = apply_rope(qk, cos, sin)
        attention.store_kv(qk[:, num_heads:], value, kv, plan)
        return qk[:, :num_heads]


class TritonLayerOps(LayerOps):
    """The fused Triton kernels (CUDA, or CPU tensors under TRITON_INTERPRET=1)."""

    name = "triton"

    def __init__(self) -> None:
        from specdec.kernels import triton_act, triton_norm, triton_rope  # import triton: only when chosen

        self._act, self._norm, self._rope = triton_act, triton_norm, triton_rope

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        return self._norm.rms_norm_triton(x, weight, eps)

    def add_rms_norm(self, x: Tensor, residual: Tensor, weight: Tensor,
                     eps: float) -> tuple[Tensor, Tensor]:
        """One kernel: x += residual in place, and the RMSNorm of the sum."""
        return self._norm.add_rms_norm_triton(x, residual, weight, eps)

    def silu_mul(self, gate_up: Tensor) -> Tensor:
        return self._act.silu_mul_triton(gate_up)

    def rope_store_kv(self, qk: Tensor, value: Tensor, cos: Tensor, sin: Tensor,
                      num_heads: int, kv: PagedKV, attention: AttentionBackend[Any], plan: AttentionPlan) -> Tensor:
        """One kernel: q rotated in place in qk, k rotated and stored with v at the plan's slots."""
        return self._rope.rope_store_kv_triton(qk, value, cos, sin, num_heads, kv, plan.meta.slot_mapping)


TORCH_OPS = LayerOps()


def layer_ops_for(attention: AttentionBackend[Any]) -> LayerOps:
    """The ops that go with `attention`: the Triton kernels with the triton backend, else torch's."""
    return TritonLayerOps() if attention.name == "triton" else TORCH_OPS
