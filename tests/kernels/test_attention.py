"""Paged attention: torch reference vs a naive dense computation, Triton vs the reference.

Triton runs in its CPU interpreter (no GPU here), so Triton cases stay small.
"""
import os

# Must precede any import of triton: @triton.jit picks interpreter mode at decoration time,
# for our kernels and for triton.language's own jit helpers (tl.max, tl.sum). If another
# module imported triton first, tests/conftest.py has already set it.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import triton.language as tl  # noqa: E402

from specdec.kernels import attention_triton  # noqa: E402
from specdec.kernels.attention_ref import paged_attention_ref, store_kv_ref  # noqa: E402
from specdec.kernels.kv_cache import PagedKV  # noqa: E402
from specdec.kernels.metadata import AttentionMetadata  # noqa: E402

assert type(tl.max).__name__ == "InterpretedFunction", (
    "triton was imported before TRITON_INTERPRET=1 was set; see tests/conftest.py"
)

ATOL = 1e-4


# ----------------------------------------------------------------------------- helpers


def make_meta(
    specs: list[tuple[int, int]],  # (prefix_len, q_len) per request
    block_size: int,
    gen: torch.Generator,
    trees: list[torch.Tensor] | None = None,  # per request [q_len, q_len] bool, or None
) -> tuple[AttentionMetadata, int]:
    """Metadata for the batch with randomly permuted block ids; also the block count."""
    seq_lens = [p + q for p, q in specs]
    n_blocks = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(n_blocks) + 3  # spare blocks hold garbage nobody should read
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(specs), max(n_blocks), dtype=torch.int32)
    used = 0
    for b, n in enumerate(n_blocks):
        tables[b, :n] = perm[used : used + n]
        used += n
    slots = [
        int(tables[b, pos // block_size]) * block_size + pos % block_size
        for b, (p, q) in enumerate(specs)
        for pos in range(p, p + q)
    ]
    q_lens = [q for _, q in specs]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        query_lens_cpu=q_lens,
        seq_lens_cpu=seq_lens,
        tree_mask=None if trees is None else _stack_trees(trees, max(q_lens)),
    )
    return meta, num_blocks


def _stack_trees(trees: list[torch.Tensor], width: int) -> torch.Tensor:  # [T, width]
    # Padding columns are True so a kernel that reads past q_len gets caught.
    rows = [torch.cat([t, torch.ones(len(t), width - len(t), dtype=torch.bool)], 1) for t in trees]
    return torch.cat(rows)


def random_parents(n: int, gen: torch.Generator) -> list[int]:
    """Parent of each node; node 0 is the root (-1), parents precede children."""
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]


def tree_mask_from_parents(parents: list[int]) -> torch.Tensor:  # [n, n] bool
    """Row i marks node i and all its ancestors."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def random_inputs(
    meta: AttentionMetadata, num_blocks: int, block_size: int, hq: int, hkv: int, d: int,
    gen: torch.Generator, dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, PagedKV]:
    """Query [T, Hq, D] and caches filled with noise everywhere, query K/V included."""
    T = int(meta.query_start_loc[-1])
    q = torch.randn(T, hq, d, generator=gen).to(dtype)
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(dtype)
    return q, PagedKV(k_cache, v_cache)


def dense_attention(
    query: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, Hq, D], float64
    """Naive per-request, per-query loop with an explicit softmax, in float64."""
    hq, hkv = query.shape[1], k_cache.shape[2]
    out = torch.empty(query.shape, dtype=torch.float64)
    for b, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        start, prefix = int(meta.query_start_loc[b]), seq_len - q_len
        k, v = (_gather(c, meta.block_tables[b], seq_len) for c in (k_cache, v_cache))
        for i in range(q_len):
            visible = [p < prefix or _sees(meta, start, i, p - prefix) for p in range(seq_len)]
            for h in range(hq):
                kh = h // (hq // hkv)
                scores = (k[visible, kh] @ query[start + i, h].double()) * scale
                out[start + i, h] = torch.softmax(scores, 0) @ v[visible, kh]
    return out


def _gather(cache: torch.Tensor, table: torch.Tensor, seq_len: int) -> torch.Tensor:
    block_size = cache.shape[1]
    rows = [cache[int(table[p // block_size]), p % block_size] for p in range(seq_len)]
    return torch.stack(rows).double()  # [seq_len, Hkv, D]


def _sees(meta: AttentionMetadata, start: int, i: int, j: int) -> bool:
    if meta.tree_mask is None:
        return j <= i
    return bool(meta.tree_mask[start + i, j])


def random_trees(specs: list[tuple[int, int]], gen: torch.Generator) -> list[torch.Tensor]:
    return [tree_mask_from_parents(random_parents(q, gen)) for _, q in specs]


def random_masks(specs: list[tuple[int, int]], gen: torch.Generator) -> list[torch.Tensor]:
    """Per request a [q_len, q_len] mask that is no tree: each token sees itself and a
    random half of the others."""
    masks = [torch.rand(q, q, generator=gen) < 0.5 for _, q in specs]
    for mask in masks:
        mask.fill_diagonal_(True)
    return masks


# ----------------------------------------------------------------------------- reference

REF_BATCHES = [
    [(0, 5)],
    [(7, 1), (0, 9), (13, 4), (30, 1)],
    [(3, 70), (5, 2), (0, 1)],  # q_len > 64 takes the reference's unpadded path
    [(60, 9), (130, 1), (127, 5), (64, 1)],  # rows whose keys cross padding buckets
]


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("specs", REF_BATCHES)
@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2)])
def test_reference_matches_dense(specs, tree, hq, hkv):
    gen = torch.Generator().manual_seed(0)
    block_size = 8
    trees = random_trees(specs, gen) if tree else None
    meta, num_blocks = make_meta(specs, block_size, gen, trees)
    q, kv = random_inputs(meta, num_blocks, block_size, hq, hkv, 16, gen)
    ref = paged_attention_ref(q, kv, meta, 0.25)
    dense = dense_attention(q, kv.k, kv.v, meta, 0.25)
    torch.testing.assert_close(ref.double(), dense, atol=ATOL, rtol=0)


@pytest.mark.parametrize("tree", [False, True])
def test_reference_rows_are_batch_invariant(tree):
    """Each verify or tree row equals, bit for bit, a one-token decode of the same keys
    run alone and run among other requests: what lossless greedy speculation needs."""
    gen = torch.Generator().manual_seed(3)
    prefix, q_len, block_size = 61, 7, 8
    parents = random_parents(q_len, gen) if tree else list(range(-1, q_len - 1))
    mask = tree_mask_from_parents(parents)
    meta, num_blocks = make_meta([(prefix, q_len), (100, 1)], block_size, gen, [mask, torch.ones(1, 1, dtype=torch.bool)])
    q, kv = random_inputs(meta, num_blocks, block_size, 6, 2, 16, gen)
    verify = paged_attention_ref(q, kv, meta, 0.3)
    table = meta.block_tables[0]
    for i in range(q_len):
        path = [j for j in range(q_len) if mask[i, j]]  # ancestors, in order
        if path != list(range(len(path))):
            continue  # a decode only ever sees a contiguous path; off-path rows checked by dense test
        decode_meta, _ = make_meta([(prefix + i, 1), (37, 1), (prefix + i, 1)], block_size, gen)
        width = decode_meta.block_tables.shape[1]
        decode_meta.block_tables[0] = table[:width]
        decode_meta.block_tables[1] = meta.block_tables[1][:width]  # blocks that exist in kv
        decode_meta.block_tables[2] = table[:width]
        query = torch.stack([q[i], q[q_len], q[i]])  # the same row, alone-ish and among others
        out = paged_attention_ref(query, kv, decode_meta, 0.3)
        assert torch.equal(out[0], verify[i]) and torch.equal(out[2], verify[i])


def test_reference_arbitrary_mask_matches_dense():
    """The mask is taken literally, even when it is not a tree in topological order."""
    gen = torch.Generator().manual_seed(1)
    specs = [(4, 6), (9, 3)]
    trees = random_masks(specs, gen)
    meta, num_blocks = make_meta(specs, 8, gen, trees)
    q, kv = random_inputs(meta, num_blocks, 8, 2, 1, 16, gen)
    ref = paged_attention_ref(q, kv, meta, 0.3)
    dense = dense_attention(q, kv.k, kv.v, meta, 0.3)
    torch.testing.assert_close(ref.double(), dense, atol=ATOL, rtol=0)


def test_tree_mask_helper():
    assert tree_mask_from_parents([-1, 0, 0, 1]).int().tolist() == [
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [1, 0, 1, 0],
        [1, 1, 0, 1],
    ]


# ----------------------------------------------------------------------------- triton

# (head_dim, Hq, Hkv, block_size): GQA ratios 1 / 3 / 4 with two kv heads (so the head
# mapping across kv groups is exercised), head dims 64 / 128, block sizes 8 / 16 / 32.
TRITON_SHAPES = [
    (d, 2 * ratio, 2, block_size)
    for d in (64, 128)
    for ratio in (1, 3, 4)
    for block_size in (8, 16, 32)
] + [(128, 4, 1, 16)]
SHAPE_IDS = [f"d{d}-hq{hq}-hkv{hkv}-bs{bs}" for d, hq, hkv, bs in TRITON_SHAPES]
# Prefill chunks with and without a cached prefix, decodes, lengths off block boundaries,
# contexts spanning several BLOCK_N tiles, queries spanning several query tiles.
TRITON_BATCHES = [
    [(0, 11), (5, 1), (17, 1)],
    [(9, 6), (0, 1), (33, 3), (2, 18)],
    [(61, 2), (40, 17), (70, 1)],
]


def _check_triton(specs, hq, hkv, d, block_size, seed, trees=None, dtype=torch.float32, atol=ATOL):
    gen = torch.Generator().manual_seed(seed)
    meta, num_blocks = make_meta(specs, block_size, gen, trees)
    q, kv = random_inputs(meta, num_blocks, block_size, hq, hkv, d, gen, dtype)
    scale = d**-0.5
    got = attention_triton.paged_attention_triton(q, kv, meta, scale)
    ref = paged_attention_ref(q, kv, meta, scale)
    torch.testing.assert_close(got, ref, atol=atol, rtol=0)


# The interpreter is slow: each shape runs one batch (rotating), every batch several shapes.
@pytest.mark.parametrize("i", range(len(TRITON_SHAPES)), ids=SHAPE_IDS)
def test_triton_causal(i):
    d, hq, hkv, block_size = TRITON_SHAPES[i]
    _check_triton(TRITON_BATCHES[i % len(TRITON_BATCHES)], hq, hkv, d, block_size, seed=i)


@pytest.mark.parametrize("i", range(len(TRITON_SHAPES)), ids=SHAPE_IDS)
def test_triton_random_trees(i):
    d, hq, hkv, block_size = TRITON_SHAPES[i]
    gen = torch.Generator().manual_seed(100 + i)  # a different forest for every shape
    specs = [(13, 7), (0, 1), (21, 5), (6, 9), (45, 17)]
    _check_triton(specs, hq, hkv, d, block_size, seed=i, trees=random_trees(specs, gen))


def test_triton_arbitrary_mask():
    gen = torch.Generator().manual_seed(4)
    specs = [(3, 6), (10, 4)]
    trees = random_masks(specs, gen)
    _check_triton(specs, 4, 2, 64, 8, seed=5, trees=trees)


def test_triton_fp16():
    _check_triton([(9, 6), (20, 1)], 4, 1, 64, 16, seed=6, dtype=torch.float16, atol=2e-3)


@pytest.mark.parametrize("use_triton", [False, True])
def test_chain_tree_equals_causal(use_triton):
    """A chain (parent = previous node) is the causal mask, in both implementations."""
    gen = torch.Generator().manual_seed(7)
    specs = [(5, 6), (0, 3), (12, 1)]
    chains = [tree_mask_from_parents(list(range(-1, q - 1))) for _, q in specs]
    meta, num_blocks = make_meta(specs, 8, gen, chains)
    q, kv = random_inputs(meta, num_blocks, 8, 4, 2, 64, gen)
    attend = attention_triton.paged_attention_triton if use_triton else paged_attention_ref
    tree_out = attend(q, kv, meta, 0.125)
    meta.tree_mask = None
    causal_out = attend(q, kv, meta, 0.125)
    torch.testing.assert_close(tree_out, causal_out, atol=ATOL, rtol=0)


@pytest.mark.parametrize("d,hkv,block_size", [(64, 1, 8), (128, 3, 16)])
def test_store_kv_triton(d, hkv, block_size):
    gen = torch.Generator().manual_seed(8)
    meta, num_blocks = make_meta([(3, 5), (0, 1), (14, 4)], block_size, gen)
    T = len(meta.slot_mapping)
    # Key/value as slices of a fused projection: token stride wider than Hkv * D.
    kv = torch.randn(T, 2, hkv, d, generator=gen)
    key, value = kv[:, 0], kv[:, 1]
    caches = [torch.randn(num_blocks, block_size, hkv, d, generator=gen) for _ in range(2)]
    expected = PagedKV(*(c.clone() for c in caches))
    store_kv_ref(key, value, expected, meta.slot_mapping)
    attention_triton.store_kv_triton(key, value, PagedKV(*caches), meta.slot_mapping)
    for got, want in zip(caches, expected.tensors()):
        assert torch.equal(got, want)
