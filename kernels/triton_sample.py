"""Greedy argmax and temperature sampling over logits rows as Triton kernels that need
no host sync, so a CUDA graph can capture them with the forward.

Sampling is the Gumbel-max trick on noise drawn beforehand (on the device, by torch):
argmax(logits / T + g) with g = -log(-log(u)), u uniform in (0, 1), is a sample of
softmax(logits / T). A row with temperature 0 takes the plain argmax. Ties go to the
lowest index, as torch.argmax's. One program per row, walking the vocabulary in fixed
BLOCK_V chunks: batch-invariant. Top-k / top-p are not done here (they need a sort or a
threshold search per row); rows that ask for them take the torch sampler.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 1024
_BIG = tl.constexpr(2**31 - 1)  # "no index yet"


@triton.jit
def _sample_kernel(
    logits_ptr,  # [N, V] float32
    noise_ptr,  # [N, V] float32 uniform in (0, 1) (unused unless SAMPLE)
    temperature_ptr,  # [N] float32 (unused unless SAMPLE)
    out_ptr,  # [N] int64
    s_l, s_n, V, SAMPLE: tl.constexpr, BLOCK_V: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    inv_t = 1.0
    greedy = True
    if SAMPLE:
        temperature = tl.load(temperature_ptr + n)
        greedy = temperature == 0.0
        inv_t = 1.0 / tl.where(greedy, 1.0, temperature)
    best = tl.full([BLOCK_V], float("-inf"), tl.float32)
    best_i = tl.full([BLOCK_V], _BIG, tl.int32)
    for v0 in range(0, V, BLOCK_V):
        i = v0 + tl.arange(0, BLOCK_V)
        ok = i < V
        score = tl.load(logits_ptr + n * s_l + i, mask=ok, other=float("-inf"))
        if SAMPLE:
            u = tl.load(noise_ptr + n * s_n + i, mask=ok, other=0.5)
            gumbel = -tl.log(-tl.log(u))
            score = tl.where(greedy, score, score * inv_t + gumbel)
        better = ok & (score > best)  # strict: the earlier chunk keeps a tie
        best_i = tl.where(better, i, best_i)
        best = tl.where(better, score, best)
    top = tl.max(best, 0)
    winner = tl.min(tl.where(best == top, best_i, _BIG), 0)
    tl.store(out_ptr + n, tl.where(winner == _BIG, 0, winner).to(tl.int64))


def argmax_triton(logits: torch.Tensor) -> torch.Tensor:  # [N, V] float32 -> [N] int64
    """torch.argmax(logits, -1), without a host sync."""
    # The noise and temperature arguments are never read without SAMPLE.
    return _launch(logits, logits[:, 0], logits, sample=False)


def sample_triton(logits: torch.Tensor,  # [N, V] float32
                  temperature: torch.Tensor,  # [N] float32; 0: greedy
                  noise: torch.Tensor,  # [N, V] float32 uniform in (0, 1)
                  ) -> torch.Tensor:  # [N] int64
    """A token per row from softmax(logits / temperature) (argmax where temperature is 0),
    driven by the given uniform noise."""
    if noise.shape != logits.shape or temperature.shape != logits.shape[:1]:
        raise ValueError(f"noise {tuple(noise.shape)} and temperature {tuple(temperature.shape)} must match "
                         f"logits {tuple(logits.shape)} and its rows")
    if noise.dtype != torch.float32 or noise.stride(1) != 1 or temperature.dtype != torch.float32:
        raise ValueError("the triton sampler takes float32 noise (contiguous last dim) and temperatures")
    return _launch(logits, temperature, noise, sample=True)


def _launch(logits: torch.Tensor,  # [N, V]
            temperature: torch.Tensor,  # [N]
            noise: torch.Tensor,  # [N, V]
            sample: bool) -> torch.Tensor:  # [N] int64
    N, V = logits.shape
    out = torch.empty(N, dtype=torch.int64, device=logits.device)
    if N == 0:
        return out
    if logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError("the triton samplers take float32 logits with a contiguous last dim")
    _sample_kernel[(N,)](logits, noise, temperature, out, logits.stride(0), noise.stride(0), V,
                         SAMPLE=sample, BLOCK_V=BLOCK_V)
    return out
