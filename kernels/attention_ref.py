"""Plain-torch paged attention over a flattened batch: the reference every kernel matches.

It is also the CPU path, so it is vectorised: requests with short queries (decodes,
verifies) run as one padded SDPA call; each long prefill chunk runs on its own to avoid
padding waste. The gather indices and masks are built once per step (`_plan`) and
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


def paged_attention_ref(
    query: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, Hq, D]
    out = torch.empty_like(query)
    for group in _plan(meta, k_cache.shape[1], query.device):
        result = _attend(query, k_cache, v_cache, group, scale)  # [G, Qmax, Hq, D]
        out[group.out_rows] = result.reshape(-1, *query.shape[1:])[group.valid]
    return out


def _attend(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: _Group,
            scale: float) -> torch.Tensor:  # [G, Qmax, Hq, D]
    q = query[group.query_index].transpose(1, 2)  # [G, Hq, Qmax, D]
    k = k_cache.view(-1, *k_cache.shape[2:])[group.slots].transpose(1, 2).to(q.dtype)  # [G, Hkv, L, D]
    v = v_cache.view(-1, *v_cache.shape[2:])[group.slots].transpose(1, 2).to(q.dtype)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2)


def _plan(meta: AttentionMetadata, block_size: int, device: torch.device) -> list[_Group]:
    key = f"ref:{block_size}"
    if key not in meta.plan_cache:
        meta.plan_cache[key] = [_group(meta, g, block_size, device) for g in _groups(meta)]
    plan: list[_Group] = meta.plan_cache[key]
    return plan


def _groups(meta: AttentionMetadata) -> list[list[int]]:
    short = [b for b, n in enumerate(meta.query_lens_cpu) if n <= _SHORT_QUERY]
    long = [[b] for b, n in enumerate(meta.query_lens_cpu) if n > _SHORT_QUERY]
    return ([short] if short else []) + long


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
