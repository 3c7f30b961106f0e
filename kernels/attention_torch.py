"""The `torch` attention backend: paged attention and the K/V store in plain torch ops.

Portable (any device torch runs on) and the fallback of the `cpp` backend for shapes its
kernel lacks. Short queries (decodes, verifies, tree nodes) are computed
row-invariantly: each query row sees exactly its visible keys, in position order, padded
to a multiple of _BUCKET keys under a mask, in an SDPA batch element of its own. A
row's result then depends only on its keys (their count fixes the padded length), not
on what else is in the batch or on how many drafts follow it, so a verify step
reproduces plain decoding bit for bit (given row-invariant linears, e.g. the fp16
backend): greedy speculation stays token-identical. Rows with the same padded length
share one SDPA call: decodes of different requests gather their own keys; the rows of a
verify (or a short prefill chunk) attend to one gathered copy of their request's keys,
expanded without copying; tree rows off the first path gather their own key set. Each long prefill
chunk runs on its own with a causal mask. Index tensors are built once per step
(`TorchAttention.plan`) and reused by every layer. The cache may hold fp16, bf16 or fp8 (with per-slot
scales, see kv_cache.py); gathered keys are dequantised into the query's dtype, slot by
slot, so row invariance holds for every cache dtype.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdec.kernels.attention_base import AttentionBackend, AttentionPlan
from specdec.kernels.kv_cache import FP8, PagedKV, dequantize_fp8, quantize_fp8, slot_rows
from specdec.kernels.metadata import AttentionMetadata

_SHORT_QUERY = 64  # queries up to this long are computed row by row
_BUCKET = 64  # a short row's keys are padded to a multiple of this


@dataclass
class _Group:
    query_index: torch.Tensor  # [G, Qmax] rows of the flattened query (padded rows repeat one)
    slots: torch.Tensor  # [G, Lmax] flat cache slots of every context position
    mask: torch.Tensor  # [G, 1, Qmax, Lmax] bool
    valid: torch.Tensor  # [G * Qmax] bool, which padded rows are real
    out_rows: torch.Tensor  # [num real rows] destination rows in the output


def store_kv_torch(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    kv: PagedKV,
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    for x, cache, scale in ((key, kv.k, kv.k_scale), (value, kv.v, kv.v_scale)):
        if scale is None:
            slot_rows(cache).index_copy_(0, slot_mapping, x.to(cache.dtype))
            continue
        data, x_scale = quantize_fp8(x)
        slot_rows(cache).index_copy_(0, slot_mapping, data.view(torch.uint8))
        slot_rows(scale).index_copy_(0, slot_mapping, x_scale)


def gather_kv(kv: PagedKV,
                  slots: torch.Tensor,  # [...] flat slots
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:  # k, v: [..., Hkv, D]
    """K and V of the given slots in `dtype`, fp8 dequantised (in fp32, then cast)."""
    return _read_kv(kv, lambda cache: _gather(cache, slots), dtype)


def _read_kv(kv: PagedKV, gather: Callable[[torch.Tensor], torch.Tensor],
             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V through `gather` (applied alike to the data and, for fp8, to its scales)."""
    return _dequant(kv.k, kv.k_scale, gather, dtype), _dequant(kv.v, kv.v_scale, gather, dtype)


def _dequant(cache: torch.Tensor, scale: torch.Tensor | None, gather: Callable[[torch.Tensor], torch.Tensor],
             dtype: torch.dtype) -> torch.Tensor:
    data = gather(cache)
    if scale is None:
        return data.to(dtype)
    return dequantize_fp8(data, gather(scale)).to(dtype)


@dataclass
class _Keys:
    """Which cache entries some rows read, in position order: whole blocks when the keys
    are a prefix of a request's context (a block copy is about twice as fast as copying
    its slots one by one), else single slots. Keys past a row's real ones are masked out,
    but a masked key still meets a zero weight, and a slot never written (or holding a
    stale inf) would make that NaN: gathered block entries past the real keys are zeroed."""

    index: torch.Tensor  # [..., n]: block ids (by_block) or flat slots
    length: int  # keys kept per row after gathering (a multiple of _BUCKET)
    by_block: bool
    unwritten: torch.Tensor | None = None  # [U] by_block: flat gathered positions to zero


@dataclass
class _OwnRows:
    """Rows that gathered their own keys (decodes, tree rows off the first path), across
    requests, all padded to one length."""

    rows: torch.Tensor  # [G] query rows
    keys: _Keys  # index [G, n]
    mask: torch.Tensor  # [G, 1, 1, Lpad] bool: the row's real keys


@dataclass
class _SharedRows:
    """Rows of one request whose keys are each a prefix of the request's keys."""

    keys: _Keys  # index [n]: the request's blocks up to its longest row's padded length
    groups: list[tuple[torch.Tensor, int, torch.Tensor]]  # (rows [G], Lpad, mask [G, 1, 1, Lpad])


@dataclass
class TorchPlan(AttentionPlan):
    """The step's query rows sorted into SDPA calls, with the cache entries each reads."""

    own: list[_OwnRows]
    shared: list[_SharedRows]
    prefill: list[_Group]


class TorchAttention(AttentionBackend[TorchPlan]):
    """Plain torch: portable, row-invariant (see the module docstring)."""

    name = "torch"

    def plan(self, meta: AttentionMetadata, kv: PagedKV) -> TorchPlan:
        return plan_torch(meta, kv.block_size, kv.k.device)

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, kv: PagedKV, plan: TorchPlan) -> None:
        store_kv_torch(key, value, kv, plan.meta.slot_mapping)

    def forward(self, query: torch.Tensor, kv: PagedKV, plan: TorchPlan, scale: float) -> torch.Tensor:
        return paged_attention_torch(query, kv, plan, scale)


def paged_attention_torch(
    query: torch.Tensor,  # [T, Hq, D]
    kv: PagedKV,
    plan: TorchPlan,
    scale: float,
) -> torch.Tensor:  # [T, Hq, D]
    out = torch.empty_like(query)
    for own in plan.own:
        k, v = _gather_keys(kv, own.keys, query.dtype)  # [G, Lpad, Hkv, D]
        out[own.rows] = _attend_padded(query[own.rows], k, v, own.mask, scale)
    for shared in plan.shared:
        k, v = _gather_keys(kv, shared.keys, query.dtype)  # [S, Hkv, D]
        for rows, length, mask in shared.groups:
            size = (rows.shape[0], *k[:length].shape)
            out[rows] = _attend_padded(query[rows], k[:length].expand(size), v[:length].expand(size), mask, scale)
    for group in plan.prefill:
        result = _attend(query, kv, group, scale)  # [G, Qmax, Hq, D]
        out[group.out_rows] = result.reshape(-1, *query.shape[1:])[group.valid]
    return out


def _gather(cache: torch.Tensor,  # [num_blocks, block_size, *inner]: data or scales
            slots: torch.Tensor,  # [...] flat slots
            ) -> torch.Tensor:  # [..., *inner]
    """index_select, not advanced indexing: the same copy, about five times faster on CPU."""
    flat = cache.view(-1, *cache.shape[2:])
    return flat.index_select(0, slots.reshape(-1)).view(*slots.shape, *cache.shape[2:])


def _gather_keys(kv: PagedKV, keys: _Keys,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:  # k, v: [..., length, Hkv, D]
    if not keys.by_block:
        return gather_kv(kv, keys.index, dtype)
    return _read_kv(kv, lambda cache: _gather_blocks(cache, keys), dtype)


def _gather_blocks(cache: torch.Tensor,  # [num_blocks, block_size, *inner]: data or scales
                   keys: _Keys) -> torch.Tensor:  # [..., length, *inner]
    blocks = keys.index
    inner = cache.shape[2:]
    data = cache.index_select(0, blocks.reshape(-1))  # [N * n, block_size, *inner]
    if keys.unwritten is not None:
        raw = data.view(torch.uint8) if data.dtype == FP8 else data  # no fp8 index_fill_ on CPU
        raw.view(-1, *inner).index_fill_(0, keys.unwritten, 0)
    data = data.view(*blocks.shape[:-1], blocks.shape[-1] * cache.shape[1], *inner)
    return data.narrow(blocks.dim() - 1, 0, keys.length)


def _attend_padded(q: torch.Tensor,  # [G, Hq, D]
                   k: torch.Tensor,  # [G, Lpad, Hkv, D], possibly expanded (stride 0 on G)
                   v: torch.Tensor,  # [G, Lpad, Hkv, D]
                   mask: torch.Tensor,  # [G, 1, 1, Lpad] bool
                   scale: float) -> torch.Tensor:  # [G, Hq, D]
    out = F.scaled_dot_product_attention(
        q[:, :, None], k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
        scale=scale, enable_gqa=q.shape[1] != k.shape[2])  # [G, Hq, 1, D]
    return out[:, :, 0]


def _attend(query: torch.Tensor, kv: PagedKV, group: _Group,
            scale: float) -> torch.Tensor:  # [G, Qmax, Hq, D]
    q = query[group.query_index].transpose(1, 2)  # [G, Hq, Qmax, D]
    k, v = (t.transpose(1, 2) for t in gather_kv(kv, group.slots, q.dtype))  # [G, Hkv, L, D]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2)


def plan_torch(meta: AttentionMetadata, block_size: int, device: torch.device) -> TorchPlan:
    """The step's plan for a cache of `block_size` slots per block on `device`."""
    short = [b for b, n in enumerate(meta.query_lens_cpu) if n <= _SHORT_QUERY]
    long = [b for b, n in enumerate(meta.query_lens_cpu) if n > _SHORT_QUERY]
    own, shared = _short_rows(meta, short, block_size, device)
    return TorchPlan(meta, own, shared, [_group(meta, [b], block_size, device) for b in long])


def _padded(length: int) -> int:
    return -(-length // _BUCKET) * _BUCKET


def _short_rows(meta: AttentionMetadata, requests: list[int], block_size: int,
                device: torch.device) -> tuple[list[_OwnRows], list[_SharedRows]]:
    decodes: dict[int, list[tuple[int, int, torch.Tensor]]] = {}  # Lpad -> (row, keys, its blocks)
    tree_rows: dict[int, list[tuple[int, torch.Tensor]]] = {}  # Lpad -> (row, its key slots [L])
    shared = []
    for b in requests:
        slots: torch.Tensor | None = None
        prefix_rows = []
        for row, visible in _visible_keys(meta, b, device):
            if isinstance(visible, int):
                prefix_rows.append((row, visible))
                continue
            if slots is None:
                slots = _slots(meta, [b], meta.seq_lens_cpu[b], block_size, device)[0]  # [seq_len]
            tree_rows.setdefault(_padded(len(visible)), []).append((row, slots[visible]))
        if len(prefix_rows) == 1:  # a decode: batch it with other requests' decodes
            row, length = prefix_rows[0]
            decodes.setdefault(_padded(length), []).append((row, length, _blocks(meta, b, length, block_size)))
        elif prefix_rows:
            shared.append(_shared_rows(meta, b, prefix_rows, block_size, device))
    own = [_decode_rows(entries, size, block_size, device) for size, entries in decodes.items()]
    return own + [_tree_rows(entries, size, device) for size, entries in tree_rows.items()], shared


def _blocks(meta: AttentionMetadata, b: int, length: int,
            block_size: int) -> torch.Tensor:  # [ceil(Lpad / block_size)] block ids
    """Request b's blocks covering its first `length` keys padded to the bucket; the
    table's zero padding stands in for blocks past its end."""
    count = -(-_padded(length) // block_size)
    table = meta.block_tables[b].long()
    if count <= table.shape[0]:
        return table[:count]
    return torch.cat([table, table.new_zeros(count - table.shape[0])])


def _decode_rows(entries: list[tuple[int, int, torch.Tensor]], size: int, block_size: int,
                 device: torch.device) -> _OwnRows:
    rows, mask = _rows_and_mask([(row, length) for row, length, _ in entries], size, device)
    blocks = torch.stack([blocks for _, _, blocks in entries])  # [G, n]
    return _OwnRows(rows, _block_keys(blocks, size, [length for _, length, _ in entries], block_size), mask)


def _block_keys(blocks: torch.Tensor,  # [G, n] each row's block ids, or [n] for one row
                size: int, lengths: list[int],  # each row's real keys
                block_size: int) -> _Keys:
    """Keys read as whole blocks, listing every gathered position past a row's real keys."""
    span = blocks.shape[-1] * block_size  # keys gathered per row
    positions = torch.arange(span, device=blocks.device)
    unwritten = torch.cat([positions[length:] + g * span for g, length in enumerate(lengths)])
    return _Keys(blocks, size, True, unwritten)


def _tree_rows(entries: list[tuple[int, torch.Tensor]], size: int, device: torch.device) -> _OwnRows:
    slots = torch.stack([torch.cat([s, s[:1].expand(size - len(s))]) for _, s in entries])
    rows, mask = _rows_and_mask([(row, len(s)) for row, s in entries], size, device)
    return _OwnRows(rows, _Keys(slots, size, False), mask)


def _rows_and_mask(entries: list[tuple[int, int]],  # (query row, number of real keys)
                   size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """[G] row indices and the [G, 1, 1, size] bool mask of each row's real keys."""
    lengths = torch.tensor([length for _, length in entries], device=device)
    mask = torch.arange(size, device=device) < lengths[:, None]  # [G, size]
    return torch.tensor([row for row, _ in entries], device=device), mask[:, None, None]


def _shared_rows(meta: AttentionMetadata, b: int, rows: list[tuple[int, int]], block_size: int,
                 device: torch.device) -> _SharedRows:
    longest = max(length for _, length in rows)  # a tree's first path may end before its last node
    by_size: dict[int, list[tuple[int, int]]] = {}
    for row, length in rows:
        by_size.setdefault(_padded(length), []).append((row, length))
    groups = []
    for length_pad, entries in by_size.items():
        rows_t, mask = _rows_and_mask(entries, length_pad, device)
        groups.append((rows_t, length_pad, mask))
    return _SharedRows(_block_keys(_blocks(meta, b, longest, block_size), _padded(longest), [longest], block_size),
                       groups)


def _visible_keys(meta: AttentionMetadata, b: int,
                  device: torch.device) -> list[tuple[int, int | torch.Tensor]]:
    """(query row, visible keys) per query token of request b: an int L for the first L
    keys of the request, else a tensor [L] of key positions."""
    return [(row, prefix if not extra else torch.tensor(list(range(prefix)) + extra, device=device))
            for row, prefix, extra in meta.visible_keys(b)]


def _group(meta: AttentionMetadata, group: list[int], block_size: int, device: torch.device) -> _Group:
    q_max = max(meta.query_lens_cpu[b] for b in group)
    l_max = max(meta.seq_lens_cpu[b] for b in group)
    starts = [int(meta.query_start_loc[b]) for b in group]
    lens = [meta.query_lens_cpu[b] for b in group]
    pad = torch.arange(q_max, device=device)
    start_t = torch.tensor(starts, device=device)[:, None]
    len_t = torch.tensor(lens, device=device)[:, None]
    valid = pad[None, :] < len_t  # [G, Qmax]
    query_index = start_t + torch.where(valid, pad[None, :], 0)
    return _Group(query_index, _slots(meta, group, l_max, block_size, device),
                  _mask(meta, group, q_max, l_max, device), valid.reshape(-1), query_index[valid])


def _slots(meta: AttentionMetadata, group: list[int], l_max: int, block_size: int,
           device: torch.device) -> torch.Tensor:  # [G, Lmax]
    pos = torch.arange(l_max, device=device)
    tables = meta.block_tables[group].long()  # [G, max_blocks]
    block_idx = (pos // block_size).clamp(max=tables.shape[1] - 1)
    return tables[:, block_idx] * block_size + pos % block_size


def _mask(meta: AttentionMetadata, group: list[int], q_max: int, l_max: int,
          device: torch.device) -> torch.Tensor:  # [G, 1, Qmax, Lmax] bool
    return torch.stack([_request_mask(meta, b, q_max, l_max, device) for b in group]).unsqueeze(1)


def _request_mask(meta: AttentionMetadata, b: int, q_max: int, l_max: int,
                  device: torch.device) -> torch.Tensor:  # [Qmax, Lmax] bool
    q_len, seq_len = meta.query_lens_cpu[b], meta.seq_lens_cpu[b]
    prefix = seq_len - q_len
    mask = torch.zeros(q_max, l_max, dtype=torch.bool, device=device)
    mask[:, :prefix] = True
    if meta.tree_mask is None:
        among = torch.ones(q_len, q_len, dtype=torch.bool, device=device).tril()
    else:
        start = int(meta.query_start_loc[b])
        among = meta.tree_mask[start : start + q_len, :q_len]
    mask[:q_len, prefix:seq_len] = among
    mask[q_len:, 0] = True  # padded rows attend somewhere; their output is dropped
    return mask
