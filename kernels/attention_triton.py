"""The `triton` attention backend: paged attention and the KV-cache store as Triton
kernels, for CUDA tensors (and CPU tensors under TRITON_INTERPRET=1, for tests).

The attention kernel runs one program per (query tile, kv head). A query tile is up to
BLOCK_Q consecutive query tokens of one request; its rows are those tokens times the
GQA group of query heads sharing the kv head, so K/V are read once per group and the
tile is big enough for tl.dot even at decode (q_len=1). Each program walks the request's
context in tiles of BLOCK_N positions read through the block table, with online softmax.
Caches may be fp32, fp16, bf16 or fp8 (e4m3 with per-slot, per-head scales, see
kv_cache.py): K/V tiles are upcast (fp8: times their scales) as they are loaded.

Batch-invariant, as lossless speculation needs: a row's result does not depend on the
other rows of its tile or step. Context tiles start at fixed multiples of BLOCK_N, so a
key sits in the same lane whatever the query tile; keys a row does not see get weight
exactly 0 and whole tiles of them leave the running max, sum and accumulator exactly as
they were. A causal row's keys are a prefix of the context, so it matches the decode
step of its token. A tree node's keys are not: in a tree step each verify request's
query token gets its own tile, which reads its keys compacted (see the kernel). The dot
products go through triton_dot.dot_acc.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from specdec.kernels.attention_base import AttentionBackend, AttentionPlan
from specdec.kernels.kv_cache import PagedKV
from specdec.kernels.metadata import AttentionMetadata
from specdec.kernels.triton_dot import INTERPRETED, dot_acc

BLOCK_M = 16  # rows per program (tokens x heads); tl.dot needs at least 16
BLOCK_N = 32  # context positions per inner-loop tile
# In a tree step, requests of up to this many query tokens (every verify: trees have at
# most 64 nodes) get one query token per tile, to read its keys compacted (see the kernel).
GATHER_MAX = tl.constexpr(128)
FP8_MAX = tl.constexpr(448.0)  # float8_e4m3fn's largest finite value (kv_cache.FP8_MAX)
MIN_SCALE = tl.constexpr(1.1754943508222875e-38)  # float32 tiny (kv_cache._MIN_SCALE)


@triton.jit
def _store_kv_kernel(
    key_ptr,  # [T, Hkv, D]
    value_ptr,  # [T, Hkv, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    k_scale_ptr,  # [num_blocks, block_size, Hkv] float32 (unused unless IS_FP8)
    v_scale_ptr,  # [num_blocks, block_size, Hkv] float32 (unused unless IS_FP8)
    slot_ptr,  # [T] int64
    s_kt, s_kh, s_vt, s_vh,  # key/value strides (token, head); last dim contiguous
    s_cslot, s_ch, s_sslot,  # cache strides (flat slot, head), scale slot stride; heads contiguous
    H: tl.constexpr, D: tl.constexpr, H_P: tl.constexpr, D_P: tl.constexpr, IS_FP8: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:  # negative slots mark padding tokens that own no cache entry
        heads = tl.arange(0, H_P)
        h = heads[:, None]
        d = tl.arange(0, D_P)[None, :]
        m = (h < H) & (d < D)
        k = tl.load(key_ptr + t * s_kt + h * s_kh + d, mask=m, other=0.0)
        v = tl.load(value_ptr + t * s_vt + h * s_vh + d, mask=m, other=0.0)
        dst = slot * s_cslot + h * s_ch + d
        scale_dst = slot * s_sslot + heads
        store_kv_row(k, k_cache_ptr + dst, k_scale_ptr + scale_dst, m, heads < H, IS_FP8)
        store_kv_row(v, v_cache_ptr + dst, v_scale_ptr + scale_dst, m, heads < H, IS_FP8)


@triton.jit
def store_kv_row(x, ptrs, scale_ptrs, mask, head_ok, IS_FP8: tl.constexpr):
    """Store [H_P, D_P] values; fp8 as x / scale with scale = amax over D / 448 per head."""
    if IS_FP8:
        scale = tl.maximum(tl.max(tl.abs(x.to(tl.float32)), 1) / FP8_MAX, MIN_SCALE)  # [H_P]
        x = tl.clamp(x.to(tl.float32) / scale[:, None], -FP8_MAX, FP8_MAX)
        tl.store(scale_ptrs, scale, mask=head_ok)
    tl.store(ptrs, x.to(ptrs.dtype.element_ty), mask=mask)


def store_kv_triton(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    kv: PagedKV,  # contiguous tensors
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    T, H, D = key.shape
    if T == 0:
        return
    assert all(t.is_contiguous() for t in kv.tensors())
    assert key.stride(2) == 1 and value.stride(2) == 1
    k_scale, v_scale = scale_tensors(kv)
    _store_kv_kernel[(T,)](
        key, value, kv.k, kv.v, k_scale, v_scale, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv.k.stride(1), kv.k.stride(2), k_scale.stride(1),
        H=H, D=D, H_P=triton.next_power_of_2(H), D_P=triton.next_power_of_2(D), IS_FP8=kv.is_fp8,
    )


def scale_tensors(kv: PagedKV) -> tuple[torch.Tensor, torch.Tensor]:
    """The scale tensors, or (for unscaled caches) the data as never-read placeholders."""
    if kv.k_scale is None or kv.v_scale is None:
        return kv.k, kv.v
    return kv.k_scale, kv.v_scale


@triton.jit
def _paged_attention_kernel(
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    k_scale_ptr,  # [num_blocks, block_size, Hkv] float32 (unused unless IS_FP8)
    v_scale_ptr,  # [num_blocks, block_size, Hkv] float32 (unused unless IS_FP8)
    out_ptr,  # [T, Hq, D]
    block_tables_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    query_start_loc_ptr,  # [B + 1] int32
    tree_mask_ptr,  # [T, max_query_len] uint8 (unused unless IS_TREE)
    tile_req_ptr,  # [num_tiles] int32: request of each query tile
    tile_q0_ptr,  # [num_tiles] int32: first query index of the tile within its request
    s_qt, s_qh, s_ot, s_oh,  # query/output strides (token, head)
    s_cb, s_cs, s_ch,  # cache strides (block, slot in block, head); both caches alike
    s_sb, s_ss,  # scale strides (block, slot in block); heads contiguous
    s_bt, s_tm,  # block-table row stride, tree-mask row stride
    qk_scale,  # softmax scale * log2(e): scores go through exp2
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr, KV_BLOCK: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr,
    IS_TREE: tl.constexpr, W_P: tl.constexpr, IS_FP8: tl.constexpr, EXACT: tl.constexpr,
):
    tile, kvh = tl.program_id(0), tl.program_id(1)
    req = tl.load(tile_req_ptr + tile)
    q0 = tl.load(tile_q0_ptr + tile)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)
    prefix = seq_len - q_len

    # Row r is query token q0 + r // GROUP_P with query head kvh * GROUP + r % GROUP_P.
    r = tl.arange(0, BLOCK_Q * GROUP_P)
    qi = q0 + r // GROUP_P  # [M] query index within the request
    head = kvh * GROUP + r % GROUP_P
    row_ok = (qi < q_len) & (r % GROUP_P < GROUP)
    if IS_TREE:
        gather = q_len <= GATHER_MAX  # one query token per tile, keys read compacted (_tile_index)
        row_ok = row_ok & (r // GROUP_P < tl.where(gather, 1, BLOCK_Q))
    tok = q_start + qi  # [M] flattened token index
    d = tl.arange(0, D_P)
    d_ok = d < D
    io_mask = row_ok[:, None] & d_ok[None, :]
    q_ptrs = q_ptr + tok[:, None] * s_qt + head[:, None] * s_qh + d[None, :]
    q = tl.load(q_ptrs, mask=io_mask, other=0.0)

    # Causal tiles never look past their last query. A tree step's one-token tile walks
    # its token's keys compacted: the context before the query tokens, then the query
    # tokens its mask row marks, in order, at the logical positions after it, which is
    # where the engine's KV move puts an accepted path. So each key sits in the same tile
    # lane as in the decode that follows acceptance, and every reduction (max, sum, the
    # dot over keys) runs in the same order: a tree row equals that decode bit for bit.
    # Other tiles of a tree step (long prefill chunks) see any query token, masked.
    if IS_TREE:
        jj = tl.arange(0, W_P)
        seen = tl.load(tree_mask_ptr + (q_start + q0).to(tl.int64) * s_tm + jj, mask=jj < tl.where(gather, q_len, 0),
                       other=0) != 0  # [W_P] the tile's token's mask row
        rank = tl.cumsum(seen.to(tl.int32), 0) - 1  # [W_P] logical slot of each marked query token
        ctx_end = tl.where(gather, prefix + tl.sum(seen.to(tl.int32), 0), seq_len)
    else:
        ctx_end = tl.minimum(seq_len, prefix + q0 + BLOCK_Q)

    # Finite floor instead of -inf so fully-masked tiles give exp2(-inf - m) = 0, not NaN.
    m_i = tl.full([BLOCK_Q * GROUP_P], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_P], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_P, D_P], tl.float32)
    for n0 in range(0, ctx_end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)  # [N] context positions (logical, in a gathering tile)
        pos_ok = pos < ctx_end
        if IS_TREE:
            hit = seen[None, :] & (rank[None, :] == (pos - prefix)[:, None])  # [N, W_P]
            marked = tl.sum(tl.where(hit, jj[None, :], 0), 1)  # [N] the query token at each logical slot
            pos = tl.where(gather & (pos >= prefix), prefix + marked, pos)  # physical positions
        blk = tl.load(block_tables_ptr + req * s_bt + pos // KV_BLOCK, mask=pos_ok, other=0)
        kv_off = blk.to(tl.int64) * s_cb + (pos % KV_BLOCK) * s_cs + kvh * s_ch
        scale_off = blk.to(tl.int64) * s_sb + (pos % KV_BLOCK) * s_ss + kvh
        kv_mask = pos_ok[:, None] & d_ok[None, :]
        offs = kv_off[:, None] + d[None, :]
        k = _load_kv(k_cache_ptr + offs, k_scale_ptr + scale_off, kv_mask, pos_ok, IS_FP8)
        v = _load_kv(v_cache_ptr + offs, v_scale_ptr + scale_off, kv_mask, pos_ok, IS_FP8)

        no_acc = tl.zeros([BLOCK_Q * GROUP_P, BLOCK_N], tl.float32)
        s = dot_acc(q, tl.trans(k.to(q.dtype)), no_acc, EXACT) * qk_scale  # [M, N]
        visible = _visible(pos, qi, tok, row_ok, prefix, q_len, tree_mask_ptr, s_tm, IS_TREE)
        s = tl.where(visible & pos_ok[None, :], s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        pv = dot_acc(p.to(q.dtype), v.to(q.dtype), tl.zeros([BLOCK_Q * GROUP_P, D_P], tl.float32), EXACT)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_ptrs = out_ptr + tok[:, None] * s_ot + head[:, None] * s_oh + d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit
def _load_kv(ptrs, scale_ptrs, mask, pos_ok, IS_FP8: tl.constexpr):
    """[N, D_P] keys or values; fp8 dequantised to float32 with each position's scale."""
    x = tl.load(ptrs, mask=mask, other=0.0)
    if IS_FP8:
        x = x.to(tl.float32) * tl.load(scale_ptrs, mask=pos_ok, other=0.0)[:, None]
    return x


@triton.jit
def _visible(pos, qi, tok, row_ok, prefix, q_len, tree_mask_ptr, s_tm, IS_TREE: tl.constexpr):
    """[M, N] bool: may query row (qi, tok) see context position pos."""
    if IS_TREE:
        j = pos[None, :] - prefix  # query-token index of the position
        in_q = row_ok[:, None] & (j >= 0) & (j < q_len)
        tm = tl.load(tree_mask_ptr + tok[:, None] * s_tm + j, mask=in_q, other=0)
        return (pos[None, :] < prefix) | (tm != 0)
    else:
        return pos[None, :] <= prefix + qi[:, None]


def _tile_index(meta: AttentionMetadata, block_q: int, tree: bool) -> tuple[torch.Tensor, torch.Tensor]:  # [n], [n]
    """Request and first query index of every query tile, from the device's copy of the
    layout by device ops alone: no host copy, no sync, and a CUDA graph captures it (the
    tile count, the grid size, comes from the host's query lengths). A tile holds
    block_q query tokens; in a tree step, a request of up to GATHER_MAX tokens gets one
    per tile."""
    limit = int(GATHER_MAX.value) if tree else 0
    num_tiles = sum(n if n <= limit else -(-n // block_q) for n in meta.query_lens_cpu)
    starts = meta.query_start_loc  # [B + 1]
    q_lens = starts[1:] - starts[:-1]  # [B]
    per_tile = torch.where(q_lens <= limit, 1, block_q)  # [B] query tokens per tile
    tiles = (q_lens + per_tile - 1) // per_tile  # [B] tiles per request
    ends = torch.cumsum(tiles, 0)  # [B] int64: one past each request's last tile
    tile = torch.arange(num_tiles, device=starts.device)  # [n]
    req = torch.searchsorted(ends, tile, right=True)  # [n] the request whose tiles cover it
    q0 = (tile - (ends - tiles)[req]) * per_tile[req]  # [n]
    return req.to(torch.int32), q0.to(torch.int32)


@dataclass
class TritonPlan(AttentionPlan):
    """The tree mask as the kernel reads it (None: causal), and the query tiles by tile
    height, made by the step's first layer and reused by the others."""

    tree_mask: torch.Tensor | None  # [T, max_query_len] uint8
    tiles: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def tile_index(self, block_q: int) -> tuple[torch.Tensor, torch.Tensor]:  # [n], [n] int32
        if block_q not in self.tiles:
            self.tiles[block_q] = _tile_index(self.meta, block_q, self.tree_mask is not None)
        return self.tiles[block_q]


class TritonAttention(AttentionBackend[TritonPlan]):
    """Triton kernels on the cache's device (the query tiles of a step are indexed by
    its first layer and reused by the others)."""

    name = "triton"

    def plan(self, meta: AttentionMetadata, kv: PagedKV) -> TritonPlan:
        # bool -> uint8 is a free reinterpretation.
        tree = None if meta.tree_mask is None else meta.tree_mask.contiguous().view(torch.uint8)
        return TritonPlan(meta, tree)

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, kv: PagedKV, plan: TritonPlan) -> None:
        store_kv_triton(key, value, kv, plan.meta.slot_mapping)

    def forward(self, query: torch.Tensor, kv: PagedKV, plan: TritonPlan, scale: float) -> torch.Tensor:
        return paged_attention_triton(query, kv, plan, scale)


def paged_attention_triton(
    query: torch.Tensor,  # [T, Hq, D]
    kv: PagedKV,
    plan: TritonPlan,
    scale: float,
) -> torch.Tensor:  # [T, Hq, D]
    meta = plan.meta
    T, Hq, D = query.shape
    k_cache, v_cache = kv.k, kv.v
    Hkv, kv_block = k_cache.shape[2], k_cache.shape[1]
    out = torch.empty_like(query)
    if T == 0:
        return out
    assert query.stride(2) == 1 and k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
    k_scale, v_scale = scale_tensors(kv)
    assert k_scale.stride() == v_scale.stride() and (not kv.is_fp8 or k_scale.stride(2) == 1)
    group_p = triton.next_power_of_2(Hq // Hkv)
    block_q = max(1, BLOCK_M // group_p)
    tile_req, tile_q0 = plan.tile_index(block_q)
    # A causal step passes any int tensor where the kernel never reads it.
    tree = tile_req if plan.tree_mask is None else plan.tree_mask
    s_tm = 0 if plan.tree_mask is None else tree.stride(0)
    _paged_attention_kernel[(tile_req.numel(), Hkv)](
        query, k_cache, v_cache, k_scale, v_scale, out,
        meta.block_tables, meta.seq_lens, meta.query_start_loc, tree, tile_req, tile_q0,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_scale.stride(0), k_scale.stride(1),
        meta.block_tables.stride(0), s_tm, scale * 1.4426950408889634,
        GROUP=Hq // Hkv, GROUP_P=group_p, BLOCK_Q=block_q, BLOCK_N=BLOCK_N,
        KV_BLOCK=kv_block, D=D, D_P=triton.next_power_of_2(D), IS_TREE=plan.tree_mask is not None,
        W_P=triton.next_power_of_2(min(max(1, meta.max_query_len), int(GATHER_MAX.value))), IS_FP8=kv.is_fp8,
        EXACT=INTERPRETED,
    )
    return out
