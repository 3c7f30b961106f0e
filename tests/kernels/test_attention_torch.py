"""The torch attention backend against kernels/reference.py: dense attention over the
paged cache, its rows' invariance, and the K/V store bit for bit."""
from __future__ import annotations

import pytest
import torch

from specdec.kernels import reference
from specdec.kernels.attention_torch import TorchAttention
from specdec.kernels.kv_cache import FP8, PagedKV
from tests.helpers import (
    attend,
    make_meta,
    random_inputs,
    random_masks,
    random_parents,
    random_trees,
    store,
    tree_mask_from_parents,
)

ATOL = 1e-4
TORCH = TorchAttention()

BATCHES = [
    [(0, 5)],
    [(7, 1), (0, 9), (13, 4), (30, 1)],
    [(3, 70), (5, 2), (0, 1)],  # q_len > 64 takes the unpadded path
    [(60, 9), (130, 1), (127, 5), (64, 1)],  # rows whose keys cross padding buckets
]


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("specs", BATCHES)
@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2)])
def test_matches_the_reference(specs, tree, hq, hkv) -> None:
    gen = torch.Generator().manual_seed(0)
    block_size = 8
    trees = random_trees(specs, gen) if tree else None
    meta, num_blocks = make_meta(specs, block_size, gen, trees)
    q, kv = random_inputs(meta, num_blocks, block_size, hq, hkv, 16, gen)
    got = attend(TORCH, q, kv, meta, 0.25)
    torch.testing.assert_close(got.double(), reference.paged_attention(q, kv, meta, 0.25), atol=ATOL, rtol=0)


@pytest.mark.parametrize("tree", [False, True])
def test_rows_are_batch_invariant(tree: bool) -> None:
    """Each verify or tree row equals, bit for bit, a one-token decode of the same keys
    run alone and run among other requests: what lossless greedy speculation needs."""
    gen = torch.Generator().manual_seed(3)
    prefix, q_len, block_size = 61, 7, 8
    parents = random_parents(q_len, gen) if tree else list(range(-1, q_len - 1))
    mask = tree_mask_from_parents(parents)
    decode_mask = torch.ones(1, 1, dtype=torch.bool)
    meta, num_blocks = make_meta([(prefix, q_len), (100, 1)], block_size, gen, [mask, decode_mask])
    q, kv = random_inputs(meta, num_blocks, block_size, 6, 2, 16, gen)
    verify = attend(TORCH, q, kv, meta, 0.3)
    table = meta.block_tables[0]
    for i in range(q_len):
        path = [j for j in range(q_len) if mask[i, j]]  # ancestors, in order
        if path != list(range(len(path))):
            continue  # a decode only ever sees a contiguous path; off-path rows checked against the reference
        decode_meta, _ = make_meta([(prefix + i, 1), (37, 1), (prefix + i, 1)], block_size, gen)
        width = decode_meta.block_tables.shape[1]
        decode_meta.block_tables[0] = table[:width]
        decode_meta.block_tables[1] = meta.block_tables[1][:width]  # blocks that exist in kv
        decode_meta.block_tables[2] = table[:width]
        query = torch.stack([q[i], q[q_len], q[i]])  # the same row, alone-ish and among others
        out = attend(TORCH, query, kv, decode_meta, 0.3)
        assert torch.equal(out[0], verify[i]) and torch.equal(out[2], verify[i])


def test_arbitrary_mask_matches_the_reference() -> None:
    """The mask is taken literally, even when it is not a tree in topological order."""
    gen = torch.Generator().manual_seed(1)
    specs = [(4, 6), (9, 3)]
    meta, num_blocks = make_meta(specs, 8, gen, random_masks(specs, gen))
    q, kv = random_inputs(meta, num_blocks, 8, 2, 1, 16, gen)
    got = attend(TORCH, q, kv, meta, 0.3)
    torch.testing.assert_close(got.double(), reference.paged_attention(q, kv, meta, 0.3), atol=ATOL, rtol=0)


def test_one_plan_serves_every_layer() -> None:
    """plan reads the batch layout only: planned once, it gives each layer's cache what a
    plan of its own would."""
    gen = torch.Generator().manual_seed(8)
    meta, num_blocks = make_meta([(20, 1), (3, 70), (9, 4)], 8, gen)
    q, first = random_inputs(meta, num_blocks, 8, 4, 2, 16, gen)
    _, second = random_inputs(meta, num_blocks, 8, 4, 2, 16, gen)
    plan = TORCH.plan(meta, first)
    assert torch.equal(TORCH.forward(q, second, plan, 0.2), attend(TORCH, q, second, meta, 0.2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, FP8], ids=str)
def test_store_writes_the_reference_bits(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(9)
    meta, num_blocks = make_meta([(3, 5), (0, 1), (14, 4)], 8, gen)
    fused = torch.randn(len(meta.slot_mapping), 2, 3, 16, generator=gen) * 10  # fused-projection strides
    key, value = fused[:, 0], fused[:, 1]
    got, want = (PagedKV.zeros(num_blocks, 8, 3, 16, dtype) for _ in range(2))
    store(TORCH, key, value, got, meta)
    reference.store_kv(key, value, want, meta.slot_mapping)
    for g, w in zip(got.tensors(), want.tensors(), strict=True):
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))


def test_tree_mask_helper() -> None:
    assert tree_mask_from_parents([-1, 0, 0, 1]).int().tolist() == [
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [1, 0, 1, 0],
        [1, 1, 0, 1],
    ]
