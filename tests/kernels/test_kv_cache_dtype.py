"""KV caches stored in fp16, bf16 and fp8 (with per-slot, per-head scales): store, gather,
attention and slot moves, torch and Triton (in its CPU interpreter) against
kernels/reference.py."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported; see test_attention.py

import pytest  # noqa: E402

if os.environ["TRITON_INTERPRET"] != "1":  # a `-m cuda` run with compiled kernels: these run on CPU tensors
    pytest.skip("Triton interpreter tests; this session compiles Triton (TRITON_INTERPRET=0)", allow_module_level=True)

import torch  # noqa: E402

from specdec.kernels import reference  # noqa: E402
from specdec.kernels.attention import make_attention_backend  # noqa: E402
from specdec.kernels.attention_torch import TorchAttention, gather_kv, store_kv_torch  # noqa: E402
from specdec.kernels.kv_cache import FP8, FP8_MAX, PagedKV, dequantize_fp8  # noqa: E402
from specdec.kernels.kv_ops import move_kv  # noqa: E402
from tests.helpers import attend, make_meta, random_trees, store  # noqa: E402

LOW = [torch.float16, torch.bfloat16, FP8]
ALL = [torch.float32, *LOW]
IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", FP8: "fp8"}
# Max |attention output - fp32-cache output| for unit-variance K/V (measured over 5 seeds:
# fp16 1.1e-3, bf16 1.2e-2, fp8 0.11).
ATTN_ATOL = {torch.float16: 3e-3, torch.bfloat16: 3e-2, FP8: 0.25}
TORCH = TorchAttention()
TRITON = make_attention_backend("triton", "cpu")


def _kv_values(num: int, hkv: int, d: int, gen: torch.Generator) -> torch.Tensor:  # [num, Hkv, D]
    """Noise whose magnitude varies by orders of magnitude across tokens and heads."""
    magnitude = 10 ** (torch.rand(num, hkv, 1, generator=gen) * 5 - 3)
    return torch.randn(num, hkv, d, generator=gen) * magnitude


def _filled(dtype: torch.dtype, num_blocks: int, block_size: int, hkv: int, d: int,
            gen: torch.Generator) -> tuple[PagedKV, torch.Tensor, torch.Tensor]:
    """A cache with every slot written; also the fp32 K and V written, [slots, Hkv, D]."""
    kv = PagedKV.zeros(num_blocks, block_size, hkv, d, dtype)
    k, v = (torch.randn(num_blocks * block_size, hkv, d, generator=gen) for _ in range(2))
    reference.store_kv(k, v, kv, torch.arange(num_blocks * block_size))
    return kv, k, v


@pytest.mark.parametrize("dtype", ALL, ids=IDS.get)
def test_store_gather_round_trip(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    kv = PagedKV.zeros(4, 8, 3, 32, dtype)
    key, value = _kv_values(10, 3, 32, gen), _kv_values(10, 3, 32, gen)
    key[2, 1] = 0.0  # an all-zero vector: scale floor, no NaN
    slots = torch.randperm(32, generator=gen)[:10]
    store_kv_torch(key, value, kv, slots)
    for got, want in zip(gather_kv(kv, slots, torch.float32), (key, value)):
        _assert_round_trip(got, want, dtype)
    others = torch.tensor(sorted(set(range(32)) - set(slots.tolist())))
    assert all(not t.any() for t in gather_kv(kv, others, torch.float32))  # untouched slots


def _assert_round_trip(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype == torch.float32:
        assert torch.equal(got, want)
    elif dtype != FP8:  # half an ulp, or half a subnormal step (fp16's tiny values)
        info = torch.finfo(dtype)
        torch.testing.assert_close(got, want, rtol=info.eps / 2, atol=info.smallest_normal * info.eps / 2)
    else:  # e4m3: at most half a step of the top binade, 16 / 448 of the vector's amax
        amax = want.abs().amax(-1, keepdim=True)
        assert ((got - want).abs() <= amax * 16 / FP8_MAX).all()
        assert ((got - want).norm(dim=-1) <= 0.05 * want.norm(dim=-1)).all()


def test_fp8_scale_is_amax_over_448() -> None:
    gen = torch.Generator().manual_seed(1)
    kv = PagedKV.zeros(2, 4, 2, 16, FP8)
    key, value = _kv_values(3, 2, 16, gen), _kv_values(3, 2, 16, gen)
    store_kv_torch(key, value, kv, torch.tensor([5, 0, 2]))
    assert kv.k_scale is not None and kv.v_scale is not None
    torch.testing.assert_close(kv.k_scale.view(-1, 2)[[5, 0, 2]], key.abs().amax(-1) / 448)
    torch.testing.assert_close(kv.v_scale.view(-1, 2)[[5, 0, 2]], value.abs().amax(-1) / 448)
    assert kv.k.view(-1, 2, 16)[5].float().abs().amax(-1).eq(448).all()  # the full e4m3 range is used


def test_dequantize_fp8_is_exact() -> None:
    """The bit trick equals torch's cast times the scale for every finite e4m3 value."""
    values = torch.arange(256, dtype=torch.uint8).view(FP8)
    values = values[~values.float().isnan()].expand(2, 3, -1).contiguous()  # [2, 3, 254]
    scale = torch.tensor([[1.0, 3e-7, 0.37], [2.5e3, 1.1754944e-38, 1 / 448]])
    assert torch.equal(dequantize_fp8(values, scale), values.float() * scale[..., None])


def test_bytes_per_slot() -> None:
    assert PagedKV.bytes_per_slot(3, 64, torch.float32) == 2 * 3 * 64 * 4
    assert PagedKV.bytes_per_slot(3, 64, torch.float16) == 2 * 3 * 64 * 2
    assert PagedKV.bytes_per_slot(3, 64, torch.bfloat16) == 2 * 3 * 64 * 2
    assert PagedKV.bytes_per_slot(3, 64, FP8) == 2 * 3 * (64 + 4)  # one float32 scale per head
    for dtype in ALL:
        kv = PagedKV.zeros(5, 16, 3, 64, dtype)
        assert sum(t.nbytes for t in kv.tensors()) == 5 * 16 * PagedKV.bytes_per_slot(3, 64, dtype)


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("dtype", LOW, ids=IDS.get)
def test_paged_attention_close_to_fp32_cache(dtype: torch.dtype, tree: bool) -> None:
    gen = torch.Generator().manual_seed(2)
    specs = [(7, 1), (0, 9), (13, 4), (3, 70)]  # decodes, short queries and one long prefill
    meta, num_blocks = make_meta(specs, 8, gen, random_trees(specs, gen) if tree else None)
    low, k, v = _filled(dtype, num_blocks, 8, 2, 32, gen)
    full = PagedKV.zeros(num_blocks, 8, 2, 32, torch.float32)
    reference.store_kv(k, v, full, torch.arange(len(k)))
    q = torch.randn(int(meta.query_start_loc[-1]), 6, 32, generator=gen)
    got, want = (attend(TORCH, q, cache, meta, 32**-0.5) for cache in (low, full))
    torch.testing.assert_close(got, want, atol=ATTN_ATOL[dtype], rtol=0)


def _on_grid(num: int, hkv: int, d: int, gen: torch.Generator) -> torch.Tensor:  # [num, Hkv, D]
    """Values that every store rounds exactly: e4m3 numbers (so also fp16 and bf16 ones)
    times a power-of-two scale, each vector holding +-448 so that amax / 448 is exact."""
    grid = torch.randn(num, hkv, d, generator=gen).mul(40).to(FP8).float()
    grid[..., 0] = FP8_MAX * torch.where(torch.rand(num, hkv, generator=gen) < 0.5, -1.0, 1.0)
    return grid * 2.0 ** torch.randint(-12, 4, (num, hkv, 1), generator=gen).float()


@pytest.mark.parametrize("values", ["on_grid", "random"])
@pytest.mark.parametrize("dtype", LOW, ids=IDS.get)
def test_store_kv_triton_matches_reference(dtype: torch.dtype, values: str) -> None:
    """Bit for bit, except that the interpreter's own fp32 -> bf16/fp8 casts round wrongly
    (bf16 truncates; fp8 drops the carry when rounding up to the next power of two, 7.9 ->
    4). Values on the e4m3 grid need no rounding and check the kernel exactly; random values
    still check the scales exactly (and everything for fp16). GPUs cast in hardware."""
    gen = torch.Generator().manual_seed(3)
    meta, num_blocks = make_meta([(3, 5), (0, 1), (14, 4)], 8, gen)
    num_tokens = len(meta.slot_mapping)
    make = _on_grid if values == "on_grid" else _kv_values
    key_value = make(2 * num_tokens, 3, 64, gen).view(num_tokens, 2, 3, 64)  # fused-projection strides
    key, value = key_value[:, 0], key_value[:, 1]
    expected, got = (PagedKV.zeros(num_blocks, 8, 3, 64, dtype) for _ in range(2))
    reference.store_kv(key, value, expected, meta.slot_mapping)
    store(TRITON, key, value, got, meta)
    exact = values == "on_grid" or dtype == torch.float16
    for g, w in zip(got.tensors(), expected.tensors(), strict=True):
        if exact or g.dtype == torch.float32:  # data, or fp8 scales
            assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))
    if not exact and dtype == torch.bfloat16:
        torch.testing.assert_close(got.k.float(), expected.k.float(), rtol=2 * 2**-8, atol=0)


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("dtype", LOW, ids=IDS.get)
def test_triton_attention_matches_reference(dtype: torch.dtype, tree: bool) -> None:
    gen = torch.Generator().manual_seed(4)
    specs = [(9, 6), (0, 1), (33, 3)]
    meta, num_blocks = make_meta(specs, 16, gen, random_trees(specs, gen) if tree else None)
    kv, _, _ = _filled(dtype, num_blocks, 16, 2, 64, gen)
    q = torch.randn(int(meta.query_start_loc[-1]), 4, 64, generator=gen)
    got = attend(TRITON, q, kv, meta, 0.125)
    torch.testing.assert_close(got.double(), reference.paged_attention(q, kv, meta, 0.125), atol=1e-4, rtol=0)


def test_triton_fp16_query_over_fp8_cache() -> None:
    gen = torch.Generator().manual_seed(5)
    meta, num_blocks = make_meta([(20, 3), (5, 1)], 16, gen)
    kv, _, _ = _filled(FP8, num_blocks, 16, 1, 64, gen)
    q = torch.randn(int(meta.query_start_loc[-1]), 4, 64, generator=gen).half()
    got = attend(TRITON, q, kv, meta, 0.125)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.double(), reference.paged_attention(q, kv, meta, 0.125), atol=2e-3, rtol=0)


@pytest.mark.parametrize("dtype", ALL, ids=IDS.get)
def test_move_kv_moves_data_and_scales(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(6)
    layers = [_filled(dtype, 3, 4, 2, 16, gen)[0] for _ in range(2)]
    before = [[t.clone() for t in layer.tensors()] for layer in layers]
    # A chain: slot 9's destination 7 is itself moved to 5 (gathered before any write).
    src, dst = torch.tensor([7, 9, 2]), torch.tensor([5, 7, 11])
    move_kv(layers, src, dst)
    for layer, old in zip(layers, before):
        assert len(layer.tensors()) == (4 if dtype == FP8 else 2)
        for new_t, old_t in zip(layer.tensors(), old):
            new_flat, old_flat = new_t.view(12, -1).view(torch.uint8), old_t.view(12, -1).view(torch.uint8)
            assert torch.equal(new_flat[dst], old_flat[src])
            untouched = [s for s in range(12) if s not in dst.tolist()]
            assert torch.equal(new_flat[untouched], old_flat[untouched])


def _resident_bytes() -> int:
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(fields["VmRSS"].split()[0]) * 1024


@pytest.mark.parametrize("dtype", [torch.float16, FP8])
def test_an_unwritten_kv_pool_takes_no_resident_memory(dtype: torch.dtype) -> None:
    """The pool is all zeros, but its pages become resident only when a slot is written:
    an idle server does not hold its whole --kv-cache-memory."""
    before = _resident_bytes()
    cache = PagedKV.zeros(4096, 16, 4, 64, dtype)  # 2 x 16 or 32 MiB of K/V (+ scales for fp8)
    pool = sum(t.nbytes for t in cache.tensors())
    assert _resident_bytes() - before < pool // 4
    cache.k[3].view(torch.uint8).fill_(1)  # a written block reads back; the rest stays zero
    written = cache.k.view(torch.uint8).sum(dtype=torch.int64)
    assert written == cache.k[3].numel() * cache.k.element_size() and cache.v.view(torch.uint8).sum() == 0
    assert all(t.is_contiguous() and t.data_ptr() % 64 == 0 for t in cache.tensors())
