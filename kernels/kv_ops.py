"""KV-cache slot moves, for compacting an accepted tree path into place."""
from __future__ import annotations

import torch


def move_kv(
    layers: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (k, v): [num_blocks, block_size, Hkv, D]
    src_slots: torch.Tensor,  # [M] int64 flat slots to read
    dst_slots: torch.Tensor,  # [M] int64 flat slots to write
) -> None:
    for k_cache, v_cache in layers:
        for cache in (k_cache, v_cache):
            flat = cache.view(-1, *cache.shape[2:])
            # Gather first: a destination may be another move's source.
            flat.index_copy_(0, dst_slots.to(flat.device), flat[src_slots.to(flat.device)])
