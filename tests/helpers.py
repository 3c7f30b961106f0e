"""Shared test helpers: paged KV caches and AttentionMetadata for one request."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from specdec.kernels import AttentionMetadata, PagedKV


def make_kv_caches(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    fill: float = 0.0,
) -> list[PagedKV]:
    """One PagedKV per layer, k and v each [num_blocks, block_size, Hkv, D].

    fill=nan makes any read of a slot nobody wrote show up in the output.
    """
    caches = [
        PagedKV.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype)
        for _ in range(num_layers)
    ]
    for cache in caches:
        for t in cache.tensors():
            t.fill_(fill)
    return caches


def random_block_table(
    num_tokens: int, block_size: int, num_blocks: int, seed: int = 0
) -> list[int]:
    """Distinct, shuffled block ids covering num_tokens (non-contiguous on purpose)."""
    needed = -(-num_tokens // block_size)
    if needed > num_blocks:
        raise ValueError(f"{num_tokens} tokens need {needed} blocks, only {num_blocks} exist")
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(num_blocks, generator=gen)[:needed].tolist()


def single_request_meta(
    prefix_len: int,
    q_len: int,
    block_table: list[int],
    block_size: int,
    tree_mask: Tensor | None = None,  # [q_len, q_len] bool, or None for causal
) -> AttentionMetadata:
    """Metadata for one request whose q_len new tokens follow prefix_len cached ones.

    The new tokens take context slots prefix_len .. prefix_len + q_len - 1.
    """
    seq_len = prefix_len + q_len
    if -(-seq_len // block_size) > len(block_table):
        raise ValueError(
            f"block table of {len(block_table)} blocks is too short for {seq_len} tokens"
        )
    slots = [
        block_table[p // block_size] * block_size + p % block_size
        for p in range(prefix_len, seq_len)
    ]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor([0, q_len], dtype=torch.int32),
        seq_lens=torch.tensor([seq_len], dtype=torch.int32),
        block_tables=torch.tensor([block_table], dtype=torch.int32),
        query_lens_cpu=[q_len],
        seq_lens_cpu=[seq_len],
        tree_mask=tree_mask,
    )


def block_bytes(llm: Any) -> int:
    """Bytes of one 16-slot KV block of `llm`'s engine (every layer, K and V, its KV dtype)."""
    mc, config = llm.engine.model_config, llm.engine.config
    return 16 * mc.num_layers * PagedKV.bytes_per_slot(mc.num_kv_heads, mc.head_dim, config.kv_cache_torch_dtype)
