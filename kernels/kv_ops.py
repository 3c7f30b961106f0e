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
    if not layers:
        return
    # One host-to-device copy each, queued behind the GPU's work rather than waiting for it.
    device = layers[0].k.device
    src, dst = (slots.to(device, non_blocking=True) for slots in (src_slots, dst_slots))
    for layer in layers:
        for cache in layer.tensors():
            flat = slot_rows(cache)
            # Gather first: a destination may be another move's source.
            flat.index_copy_(0, dst, flat[src])
