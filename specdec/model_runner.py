"""Runs one target forward over the flattened batch and returns the logits it needs."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.config import EngineConfig
from specdec.kernels.kv_cache import PagedKV
from specdec.kernels.metadata import AttentionMetadata
from specdec.models import LlamaForCausalLM
from specdec.scheduler import ScheduledRequest
from specdec.tree import DraftTree


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
    def execute(self, batch: Sequence[ScheduledRequest], trees: Sequence[DraftTree]) -> ForwardOutput:
        """One forward over every request's known tokens and draft tree (trees[i] is
        rooted at batch[i]'s last known token; the root alone when nothing is drafted)."""
        input_ids, positions, meta, logit_rows, num_rows = self.prepare(batch, trees)
        hidden = self.model(input_ids, positions, self.kv_cache.layers, meta)  # [T, H]
        hidden = hidden[logit_rows] if len(logit_rows) < hidden.shape[0] else hidden
        return ForwardOutput(self.model.compute_logits(hidden), hidden, num_rows)

    def prepare(self, batch: Sequence[ScheduledRequest], trees: Sequence[DraftTree]) -> tuple[
        torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor, list[int]
    ]:
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        rows: list[int] = []
        num_rows: list[int] = []
        for item, tree in zip(batch, trees, strict=True):
            req = item.request
            start = req.num_computed_tokens
            known = req.all_token_ids[start : start + item.num_new_tokens - 1]  # before the root
            root = start + len(known)
            n_rows = tree.num_nodes if item.completes_prompt else 0
            query_len = item.num_query_tokens(tree)
            rows.extend(range(len(tokens) + query_len - n_rows, len(tokens) + query_len))
            num_rows.append(n_rows)
            tokens.extend(known + tree.token_ids)
            positions.extend([*range(start, root), *tree.positions(root)])
            slots.extend(self._slots(req.block_table, start, query_len))
        meta = self._metadata(batch, trees, slots)
        meta.tree_mask = _tree_mask(batch, trees, meta.max_query_len)
        as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)  # noqa: E731
        return as_long(tokens), as_long(positions), meta, as_long(rows), num_rows

    def _slots(self, block_table: list[int], start: int, count: int) -> list[int]:
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, start + count)]

    def _metadata(self, batch: Sequence[ScheduledRequest], trees: Sequence[DraftTree],
                  slots: list[int]) -> AttentionMetadata:
        query_lens = [item.num_query_tokens(tree) for item, tree in zip(batch, trees)]
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
        )


def _tree_mask(batch: Sequence[ScheduledRequest], trees: Sequence[DraftTree],
               max_query_len: int) -> torch.Tensor | None:
    """[T, max_query_len] bool: each query token sees the known tokens before it and its
    tree ancestors; None when that is causal for every request (chains), which the
    kernels take as the default."""
    if all(tree.is_chain for tree in trees):
        return None
    masks = []
    for item, tree in zip(batch, trees):
        known = item.num_new_tokens - 1
        n = item.num_query_tokens(tree)
        mask = torch.zeros(n, max_query_len, dtype=torch.bool)
        mask[:, :n] = torch.ones(n, n, dtype=torch.bool).tril()
        mask[known:n, known:n] = tree.attention_mask()
        masks.append(mask)
    return torch.cat(masks)
