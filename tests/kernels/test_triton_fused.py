"""The fused Triton kernels against kernels/reference.py (float64) and against the torch
op sequence they replace (kernels/layer_ops.py's LayerOps): residual add + RMSNorm (also
as the norm in front of a block, with the residual stream carried to it), SiLU(gate) * up,
RoPE with the paged K/V store, greedy argmax and Gumbel sampling.

On the CPU they run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1),
which rounds fp32 to bf16 by truncation, not to nearest as a GPU and torch do: there
bf16 results may differ from torch's by one bf16 step. The `cuda` variants run the
compiled kernels: `TRITON_INTERPRET=0 pytest -m cuda tests/kernels/test_triton_fused.py`.
"""
from __future__ import annotations

import pytest
import torch

from specdec.kernels import reference
from specdec.kernels.kv_cache import FP8, PagedKV, dequantize_fp8
from specdec.kernels.layer_ops import LayerOps, TritonLayerOps, apply_rope
from specdec.kernels.triton_act import silu_mul_triton
from specdec.kernels.triton_norm import add_rms_norm_triton
from specdec.kernels.triton_rope import rope_store_kv_triton
from specdec.kernels.triton_sample import argmax_triton, sample_triton
from tests.helpers import INTERPRETED, TRITON_DEVICES

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Relative (Frobenius) tolerance against float64, per dtype: a few of its rounding steps.
REL_TOL = {torch.float32: 1e-6, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}
TORCH = LayerOps()


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double().cpu() - want.double().cpu()).norm() / want.double().cpu().norm())


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_add_rms_norm(device: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    branch, residual = (torch.randn(2, 11, 96, generator=gen) * 3).to(dtype).to(device)
    weight = (1 + 0.2 * torch.randn(96, generator=gen)).to(dtype).to(device)
    buffer = branch.clone()
    normed, new_residual = add_rms_norm_triton(buffer, residual, weight, 1e-5)
    assert new_residual.data_ptr() == buffer.data_ptr()  # the sum is written over the branch output
    want, want_residual = reference.add_rms_norm(branch, residual, weight, 1e-5)
    torch_normed, torch_residual = TORCH.add_rms_norm(branch.clone(), residual, weight, 1e-5)
    assert rel_error(new_residual, want_residual) < REL_TOL[dtype]
    assert rel_error(normed, want) < REL_TOL[dtype] and rel_error(torch_normed, want) < REL_TOL[dtype]
    if not (INTERPRETED and dtype == torch.bfloat16):
        assert torch.equal(new_residual, torch_residual)  # the add rounds as torch's


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_residual_norm(device: str, dtype: torch.dtype) -> None:
    """The norm in front of a block: with the residual stream carried to it, the add and
    the norm (one kernel), the new stream in the block output's buffer; without one (the
    first layer's input), the norm of the input, which is the stream itself."""
    gen = torch.Generator().manual_seed(6)
    output, residual = (torch.randn(2, 9, 80, generator=gen) * 2).to(dtype).to(device)
    weight = (1 + 0.2 * torch.randn(80, generator=gen)).to(dtype).to(device)
    for ops in (TritonLayerOps(), TORCH):
        buffer = output.clone()
        normed, stream = ops.residual_norm(buffer, residual, weight, 1e-5)
        want, want_stream = reference.add_rms_norm(output, residual, weight, 1e-5)
        assert stream.data_ptr() == buffer.data_ptr()
        assert rel_error(stream, want_stream) < REL_TOL[dtype] and rel_error(normed, want) < REL_TOL[dtype]
        first, same = ops.residual_norm(output, None, weight, 1e-5)
        assert same is output and rel_error(first, reference.rms_norm(output, weight, 1e-5)) < REL_TOL[dtype]


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_mul(device: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    gate_up = (torch.randn(7, 2 * 1100, generator=gen) * 4).to(dtype).to(device)  # two column blocks, a tail
    got = silu_mul_triton(gate_up)
    assert got.shape == (7, 1100) and got.dtype == dtype
    want = reference.silu_mul(gate_up)
    assert rel_error(got, want) < REL_TOL[dtype]
    assert rel_error(TORCH.silu_mul(gate_up), want) < REL_TOL[dtype]
    assert silu_mul_triton(gate_up[:0]).shape == (0, 1100)


def rope_tables(positions: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:  # [T, D] each
    """cos and signed sin rows as specdec/models/llama.py's rope_cache makes them."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(positions.float(), inv_freq).repeat(1, 2)
    sin = angles.sin()
    sin[:, : head_dim // 2].neg_()
    return angles.cos(), sin


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.float16, torch.float16), (torch.bfloat16, FP8)],
                         ids=["fp32", "bf16", "fp16", "bf16-fp8"])
def test_rope_store_kv(device: str, dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    """q rotated in place in the fused projection's view; k rotated and v stored at the
    slots, a padding token (slot -1) storing nothing; heads Hq 6 / Hkv 2, D 32."""
    gen = torch.Generator().manual_seed(2)
    T, hq, hkv, d, block_size, num_blocks = 5, 6, 2, 32, 4, 4
    qkv = torch.randn(T, (hq + 2 * hkv) * d, generator=gen).to(dtype).to(device)
    qk, value = qkv[:, : (hq + hkv) * d].view(T, hq + hkv, d), qkv[:, (hq + hkv) * d :].view(T, hkv, d)
    cos, sin = (t.to(dtype).to(device) for t in rope_tables(torch.tensor([3, 9, 0, 17, 4]), d))
    slots = torch.tensor([5, 14, 0, -1, 9], device=device)
    kv = PagedKV.zeros(num_blocks, block_size, hkv, d, cache_dtype, device)
    expected = PagedKV(*(t.clone().cpu() for t in kv.tensors()))
    original = qk.clone()
    q = rope_store_kv_triton(qk, value, cos[:, None], sin[:, None], hq, kv, slots)
    assert q.data_ptr() == qkv.data_ptr()  # rotated in place
    want_q = reference.rope_store_kv(original[slots >= 0].cpu(), value[slots >= 0].cpu(), cos[slots >= 0].cpu(),
                                     sin[slots >= 0].cpu(), hq, expected, slots[slots >= 0].cpu())
    assert rel_error(q[slots >= 0], want_q) < REL_TOL[dtype]
    assert rel_error(q[3], reference.rope(original[3:4, :hq].cpu(), cos[3:4].cpu(), sin[3:4].cpu())[0]) < REL_TOL[dtype]
    # The torch ops it replaces (LayerOps.rope_store_kv rotates with them, then stores).
    rotated = reference.rope(original.cpu(), cos.cpu(), sin.cpu())
    assert rel_error(apply_rope(original, cos[:, None], sin[:, None]), rotated) < REL_TOL[dtype]
    for cache, scale, want, want_scale in ((kv.k, kv.k_scale, expected.k, expected.k_scale),
                                           (kv.v, kv.v_scale, expected.v, expected.v_scale)):
        if scale is None or want_scale is None:
            assert rel_error(cache, want) < REL_TOL[dtype]
        else:  # fp8: per-slot, per-head scales; within e4m3's 3-bit mantissa
            assert rel_error(dequantize_fp8(cache, scale), dequantize_fp8(want, want_scale)) < 0.07
    unused = [slot for slot in range(num_blocks * block_size) if slot not in (5, 14, 0, 9)]
    assert not kv.v.view(-1, hkv, d)[unused].float().any()  # the padding token stored nothing


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_argmax(device: str) -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 3000, generator=gen).to(device)  # three vocabulary chunks, a tail
    logits[1, 2500] = logits[1, 40] = 100.0  # a tie across chunks: the first index wins
    logits[2, 7] = logits[2, 9] = 100.0  # a tie within a chunk
    logits[3] = float("-inf")
    logits[3, 2999] = 0.0
    assert torch.equal(argmax_triton(logits).cpu(), torch.tensor([*logits[[0]].argmax(-1).tolist(), 40, 7, 2999,
                                                                  *logits[4:].argmax(-1).tolist()]))


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_sample_matches_reference(device: str) -> None:
    """The same noise gives the reference's token; temperature 0 rows are greedy."""
    gen = torch.Generator().manual_seed(4)
    logits = (torch.randn(8, 1500, generator=gen) * 2).to(device)
    temperature = torch.tensor([0.0, 0.5, 1.0, 1.7, 0.0, 1.0, 2.0, 0.9], device=device)
    noise = torch.rand(8, 1500, generator=gen).clamp_(1e-7, 1 - 1e-7).to(device)
    got = sample_triton(logits, temperature, noise)
    assert torch.equal(got.cpu(), reference.sample(logits.cpu(), temperature.cpu(), noise.cpu()))
    assert got[0] == logits[0].argmax() and got[4] == logits[4].argmax()


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_sample_follows_softmax(device: str) -> None:
    """Frequencies over 500 draws match softmax(logits / T) within 4 standard deviations;
    the greedy control (temperature 0) does not."""
    gen = torch.Generator().manual_seed(5)
    draws, temperature = 500, 1.5
    logits = torch.tensor([1.0, 0.0, -1.0, 0.5]).repeat(draws, 1).to(device)
    noise = torch.rand(draws, 4, generator=gen).clamp_(1e-7, 1 - 1e-7).to(device)
    for t, should_match in ((temperature, True), (0.0, False)):
        tokens = sample_triton(logits, torch.full((draws,), t, device=device), noise).cpu()
        freq = torch.bincount(tokens, minlength=4).double() / draws
        target = torch.softmax(logits[0].cpu().double() / temperature, 0)
        sigma = (target * (1 - target) / draws).sqrt()
        assert bool(((freq - target).abs() < 4 * sigma).all()) == should_match, (t, freq, target)
