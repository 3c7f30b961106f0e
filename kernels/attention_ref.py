"""Plain-torch paged attention over a flattened batch: the reference every kernel matches.

It is also the CPU path. Short queries (decodes, verifies, tree nodes) are computed
row-invariantly: each query row gathers exactly the keys it may see, in position order,
and rows with the same number of keys share one unmasked SDPA call. A row's result then
does not depend on what else is in the batch or on how many drafts follow it, so a
verify step reproduces plain decoding bit for bit (given row-invariant linears, e.g. the
fp16 backend): greedy speculation stays token-identical. Each long prefill chunk runs
on its own with a causal mask. Index tensors are built once per step (`_plan`) and
reused by every layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdec.kernels.metadata import AttentionMetadata

_SHORT_QUERY = 64  # queries up to this long share one padded call


@dataclass
class _Group:
    query_index: torch.Tensor  # [G, Qmax] rows of the flattened query (padded rows repeat one)
    slots: torch.Tensor  # [G, Lmax] flat cache slots of every context position
    mask: torch.Tensor  # [G, 1, Qmax, Lmax] bool
    valid: torch.Tensor  # [G * Qmax] bool, which padded rows are real
    out_rows: torch.Tensor  # [num real rows] destination rows in the output


def store_kv_ref(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


@dataclass
class _RowGroup:
    rows: torch.Tensor  # [G] query rows, each seeing exactly L keys
    slots: torch.Tensor  # [G, L] flat cache slots of those keys, in position order


def paged_attention_ref(
    query: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, Hq, D]
    out = torch.empty_like(query)
    row_groups, prefill_groups = _plan(meta, k_cache.shape[1], query.device)
    for rows in row_groups:
        out[rows.rows] = _attend_rows(query, k_cache, v_cache, rows, scale)
    for group in prefill_groups:
        result = _attend(query, k_cache, v_cache, group, scale)  # [G, Qmax, Hq, D]
        out[group.out_rows] = result.reshape(-1, *query.shape[1:])[group.valid]
    return out


def _attend_rows(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: _RowGroup,
                 scale: float) -> torch.Tensor:  # [G, Hq, D]
    q = query[group.rows].unsqueeze(2)  # [G, Hq, 1, D]
    k = k_cache.view(-1, *k_cache.shape[2:])[group.slots].transpose(1, 2).to(q.dtype)  # [G, Hkv, L, D]
    v = v_cache.view(-1, *v_cache.shape[2:])[group.slots].transpose(1, 2).to(q.dtype)
    out = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out.squeeze(2)


def _attend(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: _Group,
            scale: float) -> torch.Tensor:  # [G, Qmax, Hq, D]
    q = query[group.query_index].transpose(1, 2)  # [G, Hq, Qmax, D]
    k = k_cache.view(-1, *k_cache.shape[2:])[group.slots].transpose(1, 2).to(q.dtype)  # [G, Hkv, L, D]
    v = v_cache.view(-1, *v_cache.shape[2:])[group.slots].transpose(1, 2).to(q.dtype)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2)


def _plan(meta: AttentionMetadata, block_size: int,
          device: torch.device) -> tuple[list[_RowGroup], list[_Group]]:
    key = f"ref:{block_size}"
    if key not in meta.plan_cache:
        short = [b for b, n in enumerate(meta.query_lens_cpu) if n <= _SHORT_QUERY]
        long = [b for b, n in enumerate(meta.query_lens_cpu) if n > _SHORT_QUERY]
        meta.plan_cache[key] = (_row_groups(meta, short, block_size, device),
                                [_group(meta, [b], block_size, device) for b in long])
    plan: tuple[list[_RowGroup], list[_Group]] = meta.plan_cache[key]
    return plan


def _row_groups(meta: AttentionMetadata, requests: list[int], block_size: int,
                device: torch.device) -> list[_RowGroup]:
    by_length: dict[int, tuple[list[int], list[torch.Tensor]]] = {}
    for b in requests:
        for row, slots in _visible_slots(meta, b, block_size, device):
            rows, keys = by_length.setdefault(len(slots), ([], []))
            rows.append(row)
            keys.append(slots)
    return [_RowGroup(torch.tensor(rows, device=device), torch.stack(keys))
            for rows, keys in by_length.values()]


def _visible_slots(meta: AttentionMetadata, b: int, block_size: int,
                   device: torch.device) -> list[tuple[int, torch.Tensor]]:
    """(query row, [L] slots it attends to) for each query token of request b."""
    q_len, seq_len = meta.query_lens_cpu[b], meta.seq_lens_cpu[b]
    prefix, start = seq_len - q_len, int(meta.query_start_loc[b])
    pos = torch.arange(seq_len, device=device)
    slots = meta.block_tables[b].long()[pos // block_size] * block_size + pos % block_size  # [seq_len]
    if meta.tree_mask is None:
        return [(start + i, slots[: prefix + i + 1]) for i in range(q_len)]
    sees = meta.tree_mask[start : start + q_len, :q_len]  # [q_len, q_len]
    return [(start + i, torch.cat([slots[:prefix], slots[prefix:][sees[i]]])) for i in range(q_len)]


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
