"""What one forward over a flattened batch tells the attention kernels."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """Layout of a flattened batch of B requests with T query tokens in all.

    Request b owns query rows query_start_loc[b]:query_start_loc[b+1]. Its context is
    seq_lens[b] tokens long, the last q_len of which are this step's query tokens; their
    K/V are written to slot_mapping before attention runs. Query i of request b sees every
    context position before the query tokens, and, among the query tokens, either the
    causal prefix (tree_mask None) or exactly the tokens tree_mask marks (trees).
    """

    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset for each query token
    query_start_loc: torch.Tensor  # [B + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [B] int32, context length including this step's tokens
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    query_lens_cpu: list[int]  # [B]
    seq_lens_cpu: list[int]  # [B]
    # [T, max_query_len] bool: row t (a query token) may see query token j of its own
    # request; None means causal among the query tokens.
    tree_mask: torch.Tensor | None = None
    backend: str = "auto"  # the engine's attention_backend (kernels/attention.py)
    # Index tensors a kernel derives once per step and reuses in every layer.
    plan_cache: dict[str, Any] = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_cpu, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu, default=0)
