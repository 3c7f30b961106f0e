"""Batch invariance of the Triton kernels a verify row passes through on CUDA: the GEMM
(every projection and the LM head), RMSNorm, the residual add fused with it, and paged
attention (chains and trees). A row computed alone equals, bit for bit (`torch.equal`),
the same row computed among others (1 to 64 rows, the others random), and each kernel
agrees with kernels/reference.py within its dtype's rounding.

On the CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, which
tests/conftest.py sets), whose dot products are written out in a fixed order
(kernels/triton_dot.py): there the tests check the kernels' own tiling, masks and
reduction order. The `cuda` variants run the compiled kernels, tensor-core dots included:
`TRITON_INTERPRET=0 pytest -m cuda tests/kernels/test_triton_batch_invariant.py`.
The interpreter reads bf16 correctly only through conversions, which these kernels use,
so bf16 is tested here too; but it rounds fp32 to bf16 by truncation where a GPU (and
torch) rounds to nearest, so bf16 results agree with torch's rounding exactly only on a
GPU (`assert_rounded_as_torch`).
"""
from __future__ import annotations

import pytest
import torch

from specdec.kernels import reference
from specdec.kernels.attention import make_attention_backend
from specdec.kernels.kv_cache import PagedKV
from specdec.kernels.linear_triton import TritonLinear
from specdec.kernels.metadata import AttentionMetadata
from specdec.kernels.triton_norm import add_rms_norm_triton, rms_norm_triton
from specdec.models.linear import PackedLinear
from tests.helpers import (
    INTERPRETED,
    TRITON_DEVICES,
    attend,
    make_meta,
    random_inputs,
    random_parents,
    tree_mask_from_parents,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Relative tolerance against the float64 reference, per dtype of inputs and output.
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}
ROW_COUNTS = [1, 2, 7, 16, 17, 33, 64]


def others_around(row: torch.Tensor,  # [...]: the row under test
                  count: int, gen: torch.Generator) -> tuple[torch.Tensor, int]:  # [count, ...], its index
    """`count` rows of noise with `row` at a random place among them."""
    rows = torch.randn(count, *row.shape, generator=gen).to(row.dtype).to(row.device)
    at = int(torch.randint(0, count, (1,), generator=gen))
    rows[at] = row
    return rows, at


def assert_rounded_as_torch(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal to what torch computes in the same dtype; within the interpreter's truncating
    bf16 rounding (one bf16 step) there."""
    if INTERPRETED and got.dtype == torch.bfloat16:
        torch.testing.assert_close(got, want, rtol=2**-7, atol=0)
    else:
        assert torch.equal(got, want)


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm())


# ---- the GEMM and the LM head ----------------------------------------------------------------


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_linear_row_alone_equals_row_among_others(device: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    # K and N off the tile sizes, so masked tails are part of every reduction.
    weight = torch.randn(72, 100, generator=gen).to(dtype).to(device)
    bias = torch.randn(72, generator=gen).to(dtype).to(device)
    linear = TritonLinear()
    packed = linear.prepare(weight, bias)
    row = torch.randn(100, generator=gen).to(dtype).to(device)
    alone = linear.apply(row[None], packed)[0]
    for count in ROW_COUNTS:
        rows, at = others_around(row, count, gen)
        assert torch.equal(linear.apply(rows, packed)[at], alone), f"row {at} of {count}"
    assert rel_error(alone, reference.linear(row[None], weight, bias)[0]) < REL_TOL[dtype]


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_linear_matches_reference(device: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(37, 96, generator=gen).to(dtype).to(device)
    weight = torch.randn(40, 96, generator=gen).to(dtype).to(device)
    # Strided rows (a slice of a wider activation) and no bias.
    wide = torch.randn(37, 130, generator=gen).to(dtype).to(device)
    wide[:, 7:103] = x
    linear = TritonLinear()
    got = linear.apply(wide[:, 7:103], linear.prepare(weight))
    assert got.dtype == dtype and got.is_contiguous() and got.shape == (37, 40)
    assert rel_error(got, reference.linear(x, weight)) < REL_TOL[dtype]
    assert linear.apply(x[:0], linear.prepare(weight)).shape == (0, 40)


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_lm_head_row_alone_equals_row_among_others(device: str, dtype: torch.dtype) -> None:
    """The LM head as the model holds it: a PackedLinear sharing the embedding table."""
    gen = torch.Generator().manual_seed(2)
    embed = torch.nn.Parameter(torch.randn(384, 64, generator=gen).to(dtype).to(device), requires_grad=False)
    head = PackedLinear(64, 384, False, dtype, device, weight=embed)
    head.use_backend(TritonLinear())
    assert head.packed[0].data_ptr() == embed.data_ptr()  # shared, not copied
    hidden = torch.randn(64, generator=gen).to(dtype).to(device)
    alone = head(hidden[None]).float()[0]
    for count in ROW_COUNTS:
        rows, at = others_around(hidden, count, gen)
        assert torch.equal(head(rows).float()[at], alone), f"row {at} of {count}"
    assert torch.equal(alone.argmax(), reference.linear(hidden[None], embed)[0].argmax())


# ---- RMSNorm and the fused residual add ------------------------------------------------------


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_row_alone_equals_row_among_others(device: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    weight = (1 + 0.1 * torch.randn(80, generator=gen)).to(dtype).to(device)
    row = (3 * torch.randn(80, generator=gen)).to(dtype).to(device)
    alone = rms_norm_triton(row[None], weight, 1e-6)[0]
    for count in ROW_COUNTS:
        rows, at = others_around(row, count, gen)
        assert torch.equal(rms_norm_triton(rows, weight, 1e-6)[at], alone), f"row {at} of {count}"
    assert rel_error(alone, reference.rms_norm(row, weight, 1e-6)) < REL_TOL[dtype]


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_per_head_matches_reference(device: str, dtype: torch.dtype) -> None:
    """The Qwen3 q/k norm: [T, H, D] heads of a strided fused projection, a weight per head."""
    gen = torch.Generator().manual_seed(4)
    qkv = torch.randn(9, 7 * 16, generator=gen).to(dtype).to(device)
    heads = qkv[:, : 6 * 16].view(9, 6, 16)
    weight = torch.randn(6, 16, generator=gen).to(dtype).to(device)
    got = rms_norm_triton(heads, weight, 1e-5)
    assert got.shape == heads.shape and got.dtype == dtype
    want = torch.stack([reference.rms_norm(heads[:, h], weight[h], 1e-5) for h in range(6)], 1)
    assert rel_error(got, want) < REL_TOL[dtype]


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_add_rms_norm_row_alone_equals_row_among_others(device: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    weight = (1 + 0.1 * torch.randn(64, generator=gen)).to(dtype).to(device)
    branch, residual = (torch.randn(2, 64, generator=gen) * 2).to(dtype).to(device)
    alone, alone_residual = add_rms_norm_triton(branch[None].clone(), residual[None], weight, 1e-6)
    for count in ROW_COUNTS:
        both, at = others_around(torch.stack([branch, residual]), count, gen)
        normed, new_residual = add_rms_norm_triton(both[:, 0].clone(), both[:, 1], weight, 1e-6)
        assert torch.equal(normed[at], alone[0]) and torch.equal(new_residual[at], alone_residual[0])
    want, want_residual = reference.add_rms_norm(branch, residual, weight, 1e-6)
    assert_rounded_as_torch(alone_residual[0], want_residual)
    assert rel_error(alone[0], want) < REL_TOL[dtype]


# ---- attention: verify rows against the decode rows they stand for ---------------------------

# (Hq, Hkv, dtype): query tiles of 16, 8 and 4 tokens (GQA groups of 1, 2 and 3 padded to
# 4), each dtype on two of them (the interpreter is slow).
CHAIN_CASES = [(2, 2, torch.float32), (4, 2, torch.bfloat16), (6, 2, torch.float32)]
TREE_CASES = [(2, 2, torch.bfloat16), (4, 2, torch.float32), (6, 2, torch.bfloat16)]
BLOCK_SIZE, HEAD_DIM = 8, 16


def decode_meta(table: torch.Tensor,  # [max_blocks] int32: the request's block table
                seq_len: int, device: str) -> AttentionMetadata:
    """One request decoding its last token, alone in the step."""
    last = seq_len - 1
    return AttentionMetadata(
        slot_mapping=torch.tensor([int(table[last // BLOCK_SIZE]) * BLOCK_SIZE + last % BLOCK_SIZE], device=device),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([seq_len], dtype=torch.int32, device=device),
        block_tables=table[None].to(device), query_lens_cpu=[1], seq_lens_cpu=[seq_len])


def slot_of(table: torch.Tensor, pos: int) -> int:  # table: [max_blocks] int32
    return int(table[pos // BLOCK_SIZE]) * BLOCK_SIZE + pos % BLOCK_SIZE


def to_device(meta: AttentionMetadata, device: str) -> AttentionMetadata:
    return AttentionMetadata(meta.slot_mapping.to(device), meta.query_start_loc.to(device), meta.seq_lens.to(device),
                             meta.block_tables.to(device), meta.query_lens_cpu, meta.seq_lens_cpu,
                             None if meta.tree_mask is None else meta.tree_mask.to(device))


def other_requests(rows: int, gen: torch.Generator) -> list[tuple[int, int]]:
    """(prefix, q_len) of requests with `rows` query tokens in all: decodes and chunks."""
    specs = []
    while rows > 0:
        q_len = min(rows, int(torch.randint(1, 12, (1,), generator=gen)))
        specs.append((int(torch.randint(0, 40, (1,), generator=gen)), q_len))
        rows -= q_len
    return specs


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("hq,hkv,dtype", CHAIN_CASES, ids=[f"hq{hq}-hkv{hkv}-{t}" for hq, hkv, t in CHAIN_CASES])
def test_chain_rows_equal_decodes(device: str, hq: int, hkv: int, dtype: torch.dtype) -> None:
    """Every row of a verify chain (1 + k tokens, causal) equals, bit for bit, a decode of
    that token alone, whatever else shares the step (up to 64 rows)."""
    triton_attention = make_attention_backend("triton", device)
    gen = torch.Generator().manual_seed(hq)
    for q_len, others in ((1, 0), (5, 3), (12, 52)):
        prefix = int(torch.randint(0, 50, (1,), generator=gen))
        meta, num_blocks = make_meta([(prefix, q_len), *other_requests(others, gen)], BLOCK_SIZE, gen)
        q, kv = random_inputs(meta, num_blocks, BLOCK_SIZE, hq, hkv, HEAD_DIM, gen, dtype)
        q, kv = q.to(device), PagedKV(kv.k.to(device), kv.v.to(device))
        verify = attend(triton_attention, q, kv, to_device(meta, device), 0.25)
        for i in range(q_len):
            decode = decode_meta(meta.block_tables[0], prefix + i + 1, device)
            alone = attend(triton_attention, q[i : i + 1], kv, decode, 0.25)
            assert torch.equal(alone[0], verify[i]), f"row {i} of a {q_len}-token chain among {others} rows"


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("hq,hkv,dtype", TREE_CASES, ids=[f"hq{hq}-hkv{hkv}-{t}" for hq, hkv, t in TREE_CASES])
def test_tree_rows_equal_decodes(device: str, hq: int, hkv: int, dtype: torch.dtype) -> None:
    """Every node of a verify tree equals, bit for bit, a decode of its path compacted into
    place (as the engine's KV move leaves an accepted path), run alone."""
    triton_attention = make_attention_backend("triton", device)
    gen = torch.Generator().manual_seed(10 + hq)
    for q_len, others in ((6, 0), (10, 30)):
        prefix = int(torch.randint(1, 45, (1,), generator=gen))
        mask = tree_mask_from_parents(random_parents(q_len, gen))
        specs = [(prefix, q_len), *other_requests(others, gen)]
        trees = [mask] + [torch.ones(q, q, dtype=torch.bool).tril() for _, q in specs[1:]]
        meta, num_blocks = make_meta(specs, BLOCK_SIZE, gen, trees)
        q, kv = random_inputs(meta, num_blocks, BLOCK_SIZE, hq, hkv, HEAD_DIM, gen, dtype)
        verify = attend(triton_attention, q.to(device), PagedKV(kv.k.to(device), kv.v.to(device)),
                        to_device(meta, device), 0.25)
        table = meta.block_tables[0]
        for i in range(q_len):
            path = [j for j in range(q_len) if mask[i, j]]
            compacted = PagedKV(kv.k.clone(), kv.v.clone())
            for dst, j in enumerate(path):  # the path's K/V moved right after the prefix
                for cache, source in ((compacted.k, kv.k), (compacted.v, kv.v)):
                    rows, from_rows = cache.view(-1, hkv, HEAD_DIM), source.view(-1, hkv, HEAD_DIM)
                    rows[slot_of(table, prefix + dst)] = from_rows[slot_of(table, prefix + j)]
            alone = attend(triton_attention, q[i : i + 1].to(device),
                           PagedKV(compacted.k.to(device), compacted.v.to(device)),
                           decode_meta(table, prefix + len(path), device), 0.25)
            assert torch.equal(alone[0], verify[i]), f"node {i} (path {path}) among {others} rows"
