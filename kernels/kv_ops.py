"""KV-cache slot moves, for compacting an accepted tree path into place."""
from __future__ import annotations

import torch

from specdec.kernels.kv_cache import PagedKV, slot_rows


def move_kv(
    layers: list[PagedKV],
    src_slots: torch.Tensor,  # [M] int64 flat slots to read
    dst_slots: torch.Tensor,  # [M] int64 flat slots to write
) -> None:
    """Copy K, V and (fp8) their scales from src to dst slots in every layer."""
    for layer in layers:
        for cache in layer.tensors():
            flat = slot_rows(cache)
            # Gather first: a destination may be another move's source.
            flat.index_copy_(0, dst_slots.to(flat.device), flat[src_slots.to(flat.device)])
