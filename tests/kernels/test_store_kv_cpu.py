"""The C++ K/V store writes the same cache bits as kernels/reference.py, refuses slots
outside the cache, and steps aside where it does not apply."""
from __future__ import annotations

import pytest
import torch

from specdec.kernels import reference, store_kv_cpu
from specdec.kernels.attention_cpu import CppAttention
from specdec.kernels.kv_cache import FP8, PagedKV
from tests.helpers import single_request_meta, store

NUM_BLOCKS, BLOCK_SIZE, HEADS, DIM = 12, 16, 3, 20  # 60 floats a row: vector body and tail


def _rows(tokens: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as the model has them: strided views into one [T, (Hq + 2 Hkv) * D] output."""
    qkv = torch.randn(tokens, (5 + 2 * HEADS) * DIM, generator=gen) * 100
    qkv[0, 5 * DIM : 5 * DIM + 6] = torch.tensor([float("inf"), -float("inf"), 1e-7, -3e-8, 65519.0, 1e6])
    key = qkv[:, 5 * DIM : (5 + HEADS) * DIM].view(tokens, HEADS, DIM)
    value = qkv[:, (5 + HEADS) * DIM :].view(tokens, HEADS, DIM)
    return key, value


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 7, 150])
def test_same_bits_as_the_reference(dtype: torch.dtype, tokens: int) -> None:
    gen = torch.Generator().manual_seed(tokens)
    key, value = _rows(tokens, gen)
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=gen)[:tokens]
    ours, ref = (PagedKV.zeros(NUM_BLOCKS, BLOCK_SIZE, HEADS, DIM, dtype) for _ in range(2))
    assert store_kv_cpu.supports(key, value, ours, slots)
    store_kv_cpu.store_kv_cpu(key, value, ours, slots)
    reference.store_kv(key, value, ref, slots)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    for mine, theirs in ((ours.k, ref.k), (ours.v, ref.v)):
        assert torch.equal(mine.view(bits), theirs.view(bits))


def test_nan_stays_nan() -> None:
    key, value = torch.full((1, HEADS, DIM), float("nan")), torch.zeros(1, HEADS, DIM)
    for dtype in (torch.float16, torch.bfloat16):
        kv = PagedKV.zeros(NUM_BLOCKS, BLOCK_SIZE, HEADS, DIM, dtype)
        store_kv_cpu.store_kv_cpu(key, value, kv, torch.tensor([5]))
        assert kv.k.view(-1, HEADS, DIM)[5].isnan().all()


def test_a_slot_outside_the_cache_is_refused_before_any_write() -> None:
    key, value = _rows(2, torch.Generator().manual_seed(0))
    kv = PagedKV.zeros(NUM_BLOCKS, BLOCK_SIZE, HEADS, DIM, torch.float16)
    for bad in (NUM_BLOCKS * BLOCK_SIZE, -1):
        with pytest.raises(IndexError, match=f"slot {bad} of row 1 is outside the cache's 192 slots"):
            store_kv_cpu.store_kv_cpu(key, value, kv, torch.tensor([3, bad]))
        assert not kv.k.any() and not kv.v.any()


def test_fp8_and_other_layouts_are_left_to_the_torch_store() -> None:
    key, value = _rows(3, torch.Generator().manual_seed(1))
    slots = torch.tensor([0, 1, 2])
    fp8 = PagedKV.zeros(NUM_BLOCKS, BLOCK_SIZE, HEADS, DIM, FP8)
    assert not store_kv_cpu.supports(key, value, fp8, slots)  # scales to write too
    half = PagedKV.zeros(NUM_BLOCKS, BLOCK_SIZE, HEADS, DIM, torch.float16)
    d_major = torch.randn(3, DIM, HEADS).transpose(1, 2)  # [T, Hkv, D], a row's heads interleaved
    assert not store_kv_cpu.supports(d_major, value, half, slots)
    assert not store_kv_cpu.supports(key.double(), value.double(), half, slots)
    assert not store_kv_cpu.supports(key, value, half, slots.int())


@pytest.mark.parametrize("dtype", [torch.float16, FP8], ids=["fp16", "fp8"])
def test_the_cpp_backend_stores_the_reference_bits_either_way(dtype: torch.dtype) -> None:
    """fp16 through the C++ store, fp8 through the torch one: the same bits as the reference."""
    key, value = _rows(9, torch.Generator().manual_seed(2))
    meta = single_request_meta(3, 9, [4, 1, 7], BLOCK_SIZE)
    ours, ref = (PagedKV.zeros(NUM_BLOCKS, BLOCK_SIZE, HEADS, DIM, dtype) for _ in range(2))
    store(CppAttention(), key, value, ours, meta)
    reference.store_kv(key, value, ref, meta.slot_mapping)
    for mine, theirs in zip(ours.tensors(), ref.tensors(), strict=True):
        assert torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8))
