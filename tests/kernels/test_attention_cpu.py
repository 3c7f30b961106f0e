"""The C++ CPU paged-attention kernel against kernels/reference.py, its row invariance,
and its build."""
from __future__ import annotations

import pytest
import torch

from specdec.kernels import attention_cpu, cpu_build, reference
from specdec.kernels.kv_cache import FP8, PagedKV
from specdec.kernels.metadata import AttentionMetadata
from tests.helpers import make_meta, random_inputs, random_masks, random_parents, random_trees, tree_mask_from_parents

ATOL = 2e-5

# (head_dim, Hq, Hkv, block_size): GQA ratios 1 / 3 / 4, head dims 64 / 128, block sizes 8 / 16 / 32.
SHAPES = [(d, 2 * ratio, 2, bs) for d in (64, 128) for ratio in (1, 3, 4) for bs in (8, 16, 32)]
# Decodes, verify chains and prefill chunks side by side, contexts off block boundaries
# and past several blocks.
BATCHES = [
    [(0, 1), (7, 1), (33, 1), (200, 1)],
    [(9, 6), (0, 1), (61, 9), (2, 18)],
    [(3, 70), (40, 17), (129, 1), (0, 64)],
]


def _cpp(query: torch.Tensor, kv: PagedKV, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """The kernel itself ([T, Hq, D] -> [T, Hq, D]), planned for this step and this many threads."""
    return attention_cpu.paged_attention_cpu(query, kv, attention_cpu.plan_rows(meta, kv.k.shape[2]), scale)


def _assert_matches_reference(got: torch.Tensor, query: torch.Tensor, kv: PagedKV, meta: AttentionMetadata,
                              scale: float) -> None:
    torch.testing.assert_close(got.double(), reference.paged_attention(query, kv, meta, scale), atol=ATOL, rtol=0)


def _check(specs, hq, hkv, d, block_size, seed, trees=None):
    gen = torch.Generator().manual_seed(seed)
    meta, num_blocks = make_meta(specs, block_size, gen, trees)
    q, kv = random_inputs(meta, num_blocks, block_size, hq, hkv, d, gen)
    _assert_matches_reference(_cpp(q, kv, meta, d**-0.5), q, kv, meta, d**-0.5)


@pytest.mark.parametrize("i", range(len(SHAPES)), ids=[f"d{d}-hq{hq}-hkv{hkv}-bs{bs}" for d, hq, hkv, bs in SHAPES])
def test_matches_reference(i):
    d, hq, hkv, block_size = SHAPES[i]
    for b, specs in enumerate(BATCHES):
        _check(specs, hq, hkv, d, block_size, seed=10 * i + b)


@pytest.mark.parametrize("d,hq,hkv", [(64, 9, 3), (128, 4, 2)])
def test_long_prefill_chunks_match_reference(d, hq, hkv):
    """Prefill chunks go through the kernel too, split into groups of rows: a first
    chunk, a chunk after a cached prefix, and one beside decodes."""
    _check([(0, 300), (45, 130), (200, 1), (7, 1)], hq, hkv, d, 16, seed=d)


@pytest.mark.parametrize("seed", range(4))
def test_random_trees_match_reference(seed):
    gen = torch.Generator().manual_seed(100 + seed)
    specs = [(13, 7), (0, 1), (21, 5), (6, 9), (45, 33)]
    trees = random_trees(specs, gen)
    _check(specs, 6, 2, 64, 16, seed, trees)


def test_arbitrary_mask_matches_reference():
    gen = torch.Generator().manual_seed(4)
    specs = [(3, 6), (10, 4)]
    trees = random_masks(specs, gen)
    _check(specs, 4, 2, 64, 8, seed=5, trees=trees)


def _cache_in(dtype: torch.dtype, source: PagedKV) -> PagedKV:
    """source's contents stored in a `dtype` cache (fp8 with its per-slot scales)."""
    num_blocks, block_size, hkv, d = source.k.shape
    kv = PagedKV.zeros(num_blocks, block_size, hkv, d, dtype)
    slots = torch.arange(num_blocks * block_size)
    reference.store_kv(source.k.view(-1, hkv, d), source.v.view(-1, hkv, d), kv, slots)
    return kv


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, FP8], ids=["fp16", "bf16", "fp8"])
@pytest.mark.parametrize("tree", [False, True])
def test_cache_dtypes_match_reference(dtype, tree):
    """The kernel dequantises as the reference does, so only fp32 rounding differs."""
    gen = torch.Generator().manual_seed(6)
    specs = [(9, 6), (20, 1), (57, 12)]
    trees = random_trees(specs, gen) if tree else None
    meta, num_blocks = make_meta(specs, 16, gen, trees)
    q, fp32 = random_inputs(meta, num_blocks, 16, 6, 2, 64, gen)
    kv = _cache_in(dtype, fp32)
    _assert_matches_reference(_cpp(q, kv, meta, 0.125), q, kv, meta, 0.125)


def test_work_split_does_not_change_results():
    """The planner splits kv heads and rows into work items by thread count; no split
    may change a single bit."""
    gen = torch.Generator().manual_seed(11)
    meta, num_blocks = make_meta([(70, 9)], 16, gen)  # one verify: rows and heads get split
    q, kv = random_inputs(meta, num_blocks, 16, 6, 3, 64, gen)
    previous = torch.get_num_threads()
    outputs = []
    try:
        for threads in (1, 2, 4):
            torch.set_num_threads(threads)
            outputs.append(_cpp(q, kv, meta, 0.125))  # planned anew for this many threads
    finally:
        torch.set_num_threads(previous)
    assert all(torch.equal(out, outputs[0]) for out in outputs)


def test_query_may_be_a_strided_view():
    """The model's query is a slice of a fused projection."""
    gen = torch.Generator().manual_seed(12)
    meta, num_blocks = make_meta([(20, 1), (5, 4)], 16, gen)
    q, kv = random_inputs(meta, num_blocks, 16, 4, 2, 64, gen)
    fused = torch.cat([q, torch.randn_like(q)], dim=1)  # [T, 2 * Hq, D]
    view = fused[:, : q.shape[1]]
    assert not view.is_contiguous()
    assert torch.equal(_cpp(view, kv, meta, 0.125), _cpp(q, kv, meta, 0.125))


def test_rows_never_read_past_their_keys():
    """Slots past a row's keys (never written, or stale) may hold NaN."""
    gen = torch.Generator().manual_seed(8)
    meta, num_blocks = make_meta([(5, 1), (17, 3)], 8, gen)
    q, kv = random_inputs(meta, num_blocks, 8, 4, 2, 64, gen)
    tables = meta.block_tables
    for b, seq_len in enumerate(meta.seq_lens_cpu):
        for pos in range(seq_len, tables.shape[1] * 8):
            kv.k[int(tables[b, pos // 8]), pos % 8] = float("nan")
            kv.v[int(tables[b, pos // 8]), pos % 8] = float("nan")
    assert torch.isfinite(_cpp(q, kv, meta, 0.125)).all()


def _decode_meta(tables: torch.Tensor,  # [B, max_blocks] int32
                 seq_lens: list[int]) -> AttentionMetadata:
    """One decode token per request, at the end of the given context lengths."""
    block_size = 8
    slots = [int(tables[b, (n - 1) // block_size]) * block_size + (n - 1) % block_size for b, n in enumerate(seq_lens)]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.arange(len(seq_lens) + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables,
        query_lens_cpu=[1] * len(seq_lens), seq_lens_cpu=seq_lens)


@pytest.mark.parametrize("threads", [1, 2])
def test_tree_rows_equal_decodes_bit_for_bit(threads):
    """Every tree node's output equals, bit for bit, a plain decode of its accepted path
    compacted into place (as the engine's KV move leaves it), run among other requests
    and with any thread count: lossless greedy tree speculation rests on this."""
    gen = torch.Generator().manual_seed(3)
    prefix, q_len, block_size = 61, 9, 8
    parents = random_parents(q_len, gen)
    mask = tree_mask_from_parents(parents)
    decode_mask = torch.ones(1, 1, dtype=torch.bool)
    meta, num_blocks = make_meta([(prefix, q_len), (100, 1)], block_size, gen, [mask, decode_mask])
    q, kv = random_inputs(meta, num_blocks, block_size, 6, 2, 64, gen)
    tree_out = _cpp(q, kv, meta, 0.3)
    table = meta.block_tables[0].long()
    slot = lambda pos: int(table[pos // block_size]) * block_size + pos % block_size  # noqa: E731
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for i in range(q_len):
            path = [j for j in range(q_len) if mask[i, j]]
            compacted = PagedKV(kv.k.clone(), kv.v.clone())
            for dst, j in enumerate(path):  # the path's K/V moved right after the prefix
                for cache, source in ((compacted.k, kv.k), (compacted.v, kv.v)):
                    cache.view(-1, 2, 64)[slot(prefix + dst)] = source.view(-1, 2, 64)[slot(prefix + j)]
            decode = _decode_meta(meta.block_tables, [prefix + len(path), 100])
            out = _cpp(torch.stack([q[i], q[q_len]]), compacted, decode, 0.3)
            assert torch.equal(out[0], tree_out[i]), f"node {i} (path {path})"
    finally:
        torch.set_num_threads(previous)


def test_missing_compiler_is_a_clear_error(monkeypatch, tmp_path, fresh_build):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-c++")
    with pytest.raises(cpu_build.KernelBuildError, match="no-such-c\\+\\+"):
        cpu_build.load("paged_attention")


def test_unwritable_cache_is_a_clear_error(monkeypatch, tmp_path, fresh_build):
    home = tmp_path / "not-a-directory"
    home.write_text("")
    monkeypatch.setenv("SPECDEC_HOME", str(home))
    with pytest.raises(cpu_build.KernelBuildError, match="cannot build"):
        cpu_build.load("paged_attention")
