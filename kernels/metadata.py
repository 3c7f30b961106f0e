"""What one forward over a flattened batch tells the attention kernels."""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

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

    # [T] int64: block_id * block_size + offset for each query token; -1 for a padding
    # token of a CUDA-graph step, which owns no cache entry (see attention_base.py)
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor  # [B + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [B] int32, context length including this step's tokens
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    query_lens_cpu: list[int]  # [B]
    seq_lens_cpu: list[int]  # [B]
    # [T, max_query_len] bool: row t (a query token) may see query token j of its own
    # request; None means causal among the query tokens.
    tree_mask: torch.Tensor | None = None

    @property
    def num_requests(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_cpu, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu, default=0)

    @functools.cached_property
    def query_starts_cpu(self) -> list[int]:  # [B] query_start_loc[:-1], summed on the host
        return list(itertools.accumulate(self.query_lens_cpu, initial=0))[:-1]

    def visible_keys(self, b: int) -> list[tuple[int, int, list[int]]]:
        """(query row, prefix, extra positions) per query token of request b: the row sees
        the request's first `prefix` positions, then the extra ones (a tree node off its
        tree's first path: its ancestors among the query tokens, after the cached context)."""
        q_len, seq_len = self.query_lens_cpu[b], self.seq_lens_cpu[b]
        context, start = seq_len - q_len, self.query_starts_cpu[b]
        if self.tree_mask is None:
            return [(start + i, context + i + 1, []) for i in range(q_len)]
        sees = self.tree_mask[start : start + q_len, :q_len].tolist()  # [q_len][q_len] bool
        keys: list[tuple[int, int, list[int]]] = []
        for i, row in enumerate(sees):
            count = sum(row)
            if all(row[:count]):  # a run from the first query token: a plain prefix
                keys.append((start + i, context + count, []))
            else:
                keys.append((start + i, context, [context + j for j, seen in enumerate(row) if seen]))
        return keys
