"""Runs one target forward over the flattened batch and returns the logits it needs."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.config import EngineConfig
from specdec.kernels.kv_cache import PagedKV
from specdec.kernels.metadata import AttentionMetadata
from specdec.models import LlamaForCausalLM
from specdec.scheduler import ScheduledRequest


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [R, V] float32: rows of the requests that need logits, in batch order
    hidden: torch.Tensor  # [R, H] final hidden states of the same rows (Medusa heads read them)
    num_rows: list[int]  # [B] rows per scheduled request: 0 mid-prefill, else 1 + num drafts


class KVCache:
    """One PagedKV per layer: k, v [num_blocks, block_size, Hkv, D] in the KV cache dtype
    (plus per-slot scales for fp8, see specdec/kernels/kv_cache.py)."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.layers = [PagedKV.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
                       for _ in range(num_layers)]

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        return num_layers * block_size * PagedKV.bytes_per_slot(num_kv_heads, head_dim, dtype)


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, config: EngineConfig, kv_cache: KVCache,
                 device: torch.device) -> None:
        self.model = model
        self.config = config
        self.kv_cache = kv_cache
        self.device = device
        self.block_size = config.block_size

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledRequest]) -> ForwardOutput:
        input_ids, positions, meta, logit_rows, num_rows = self.prepare(batch)
        hidden = self.model(input_ids, positions, self.kv_cache.layers, meta)  # [T, H]
        hidden = hidden[logit_rows] if len(logit_rows) < hidden.shape[0] else hidden
        return ForwardOutput(self.model.compute_logits(hidden), hidden, num_rows)

    def prepare(self, batch: list[ScheduledRequest]) -> tuple[
        torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor, list[int]
    ]:
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        rows: list[int] = []
        num_rows: list[int] = []
        for item in batch:
            start = item.request.num_computed_tokens
            query = self._query_tokens(item)
            n_rows = item.num_query_tokens - item.num_new_tokens + 1 if item.completes_prompt else 0
            rows.extend(range(len(tokens) + len(query) - n_rows, len(tokens) + len(query)))
            num_rows.append(n_rows)
            tokens.extend(query)
            positions.extend(item.tree.positions(start) if item.tree else range(start, start + len(query)))
            slots.extend(self._slots(item.request.block_table, start, len(query)))
        meta = self._metadata(batch, slots)
        if any(item.tree is not None for item in batch):
            meta.tree_mask = _tree_mask(batch, meta.max_query_len)
        as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)  # noqa: E731
        return as_long(tokens), as_long(positions), meta, as_long(rows), num_rows

    @staticmethod
    def _query_tokens(item: ScheduledRequest) -> list[int]:
        if item.tree is not None:
            return list(item.tree.token_ids)
        req = item.request
        start = req.num_computed_tokens
        return req.all_token_ids[start : start + item.num_new_tokens] + item.draft_token_ids

    def _slots(self, block_table: list[int], start: int, count: int) -> list[int]:
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, start + count)]

    def _metadata(self, batch: list[ScheduledRequest], slots: list[int]) -> AttentionMetadata:
        query_lens = [item.num_query_tokens for item in batch]
        seq_lens = [item.request.num_computed_tokens + n for item, n in zip(batch, query_lens)]
        max_blocks = max(len(item.request.block_table) for item in batch)
        tables = [item.request.block_table + [0] * (max_blocks - len(item.request.block_table)) for item in batch]
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        int32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=self.device)  # noqa: E731
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            query_start_loc=int32(starts),
            seq_lens=int32(seq_lens),
            block_tables=int32(tables),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            backend=self.config.attention_backend,
        )


def _tree_mask(batch: list[ScheduledRequest], max_query_len: int) -> torch.Tensor:
    """[T, max_query_len] bool: trees see their ancestors, everything else is causal."""
    masks = []
    for item in batch:
        n = item.num_query_tokens
        mask = torch.zeros(n, max_query_len, dtype=torch.bool)
        mask[:, :n] = item.tree.attention_mask() if item.tree is not None else torch.ones(n, n, dtype=torch.bool).tril()
        masks.append(mask)
    return torch.cat(masks)
