"""The triton attention backend against kernels/reference.py.

Triton runs in its CPU interpreter (no GPU here), so cases stay small.
"""
import os

# Must precede any import of triton: @triton.jit picks interpreter mode at decoration time,
# for our kernels and for triton.language's own jit helpers (tl.max, tl.sum). If another
# module imported triton first, tests/conftest.py has already set it.
os.environ.setdefault("TRITON_INTERPRET", "1")  # an explicit 0 (`-m cuda` on a GPU) stands

import pytest  # noqa: E402

if os.environ["TRITON_INTERPRET"] != "1":  # a `-m cuda` run with compiled kernels: these run on CPU tensors
    pytest.skip("Triton interpreter tests; this session compiles Triton (TRITON_INTERPRET=0)", allow_module_level=True)

import torch  # noqa: E402
import triton.language as tl  # noqa: E402

from specdec.kernels import reference  # noqa: E402
from specdec.kernels.attention import make_attention_backend  # noqa: E402
from specdec.kernels.kv_cache import PagedKV  # noqa: E402
from tests.helpers import (  # noqa: E402
    attend,
    make_meta,
    random_inputs,
    random_masks,
    random_trees,
    store,
)

assert type(tl.max).__name__ == "InterpretedFunction", (
    "triton was imported before TRITON_INTERPRET=1 was set; see tests/conftest.py"
)

ATOL = 1e-4
TRITON = make_attention_backend("triton", "cpu")

# (head_dim, Hq, Hkv, block_size): GQA ratios 1 / 3 / 4 with two kv heads (so the head
# mapping across kv groups is exercised), head dims 64 / 128, block sizes 8 / 16 / 32.
SHAPES = [
    (d, 2 * ratio, 2, block_size)
    for d in (64, 128)
    for ratio in (1, 3, 4)
    for block_size in (8, 16, 32)
] + [(128, 4, 1, 16)]
SHAPE_IDS = [f"d{d}-hq{hq}-hkv{hkv}-bs{bs}" for d, hq, hkv, bs in SHAPES]
# Prefill chunks with and without a cached prefix, decodes, lengths off block boundaries,
# contexts spanning several BLOCK_N tiles, queries spanning several query tiles.
BATCHES = [
    [(0, 11), (5, 1), (17, 1)],
    [(9, 6), (0, 1), (33, 3), (2, 18)],
    [(61, 2), (40, 17), (70, 1)],
]


def _check(specs, hq, hkv, d, block_size, seed, trees=None, dtype=torch.float32, atol=ATOL):
    gen = torch.Generator().manual_seed(seed)
    meta, num_blocks = make_meta(specs, block_size, gen, trees)
    q, kv = random_inputs(meta, num_blocks, block_size, hq, hkv, d, gen, dtype)
    scale = d**-0.5
    got = attend(TRITON, q, kv, meta, scale)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), reference.paged_attention(q, kv, meta, scale), atol=atol, rtol=0)


# The interpreter is slow: each shape runs one batch (rotating), every batch several shapes.
@pytest.mark.parametrize("i", range(len(SHAPES)), ids=SHAPE_IDS)
def test_causal(i: int) -> None:
    d, hq, hkv, block_size = SHAPES[i]
    _check(BATCHES[i % len(BATCHES)], hq, hkv, d, block_size, seed=i)


@pytest.mark.parametrize("i", range(len(SHAPES)), ids=SHAPE_IDS)
def test_random_trees(i: int) -> None:
    d, hq, hkv, block_size = SHAPES[i]
    gen = torch.Generator().manual_seed(100 + i)  # a different forest for every shape
    specs = [(13, 7), (0, 1), (21, 5), (6, 9), (45, 17)]
    _check(specs, hq, hkv, d, block_size, seed=i, trees=random_trees(specs, gen))


def test_arbitrary_mask() -> None:
    gen = torch.Generator().manual_seed(4)
    specs = [(3, 6), (10, 4)]
    _check(specs, 4, 2, 64, 8, seed=5, trees=random_masks(specs, gen))


def test_fp16() -> None:
    _check([(9, 6), (20, 1)], 4, 1, 64, 16, seed=6, dtype=torch.float16, atol=2e-3)


@pytest.mark.parametrize("d,hkv,block_size", [(64, 1, 8), (128, 3, 16)])
def test_store_kv(d: int, hkv: int, block_size: int) -> None:
    gen = torch.Generator().manual_seed(8)
    meta, num_blocks = make_meta([(3, 5), (0, 1), (14, 4)], block_size, gen)
    num_tokens = len(meta.slot_mapping)
    # Key/value as slices of a fused projection: token stride wider than Hkv * D.
    fused = torch.randn(num_tokens, 2, hkv, d, generator=gen)
    key, value = fused[:, 0], fused[:, 1]
    caches = [torch.randn(num_blocks, block_size, hkv, d, generator=gen) for _ in range(2)]
    expected = PagedKV(*(c.clone() for c in caches))
    reference.store_kv(key, value, expected, meta.slot_mapping)
    store(TRITON, key, value, PagedKV(*caches), meta)
    for got, want in zip(caches, expected.tensors()):
        assert torch.equal(got, want)
