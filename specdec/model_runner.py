"""Runs one target forward over the flattened batch and returns the logits it needs."""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from specdec.config import EngineConfig
from specdec.kernels.kv_cache import PagedKV
from specdec.kernels.kv_ops import move_kv
from specdec.kernels.metadata import AttentionMetadata
from specdec.scheduler import ScheduledRequest
from specdec.spec.tree import DraftTree

if TYPE_CHECKING:
    from specdec.executor import Executor
    from specdec.graph_sampling import GraphTokens, RootSampling


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [R, V] float32: rows of the requests that need logits, in batch order
    hidden: torch.Tensor  # [R, H] final hidden states of the same rows (Medusa heads read them)
    num_rows: list[int]  # [B] rows per scheduled request: 0 mid-prefill, else 1 + num drafts
    # [T, n * H] EAGLE-3's target features of EVERY query row (known tokens and tree nodes,
    # in batch order), when the executor captures them (Executor.capture_features); else None
    features: torch.Tensor | None = None
    # The tokens a decode graph sampled (overlap scheduling asked for them, Feed.sampling, and
    # the step replayed a graph; specdec/graph_sampling.py); else None
    sampled: GraphTokens | None = None


@dataclass
class Feed:
    """What overlap scheduling (specdec/overlap.py) hands a step's forward on the device:
    root tokens known there only (the root of batch[requests[j]] is tokens[j], sampled by
    the step before, not read back yet), and how a decode graph is to sample the step."""

    requests: list[int]  # [F] batch indices
    tokens: torch.Tensor  # [F] int64 on the device
    sampling: RootSampling | None = None  # the step's rows sampled in its graph, if one replays it


@dataclass
class StepInputs:
    """One forward's inputs on the host, request by request: what the eager path uploads
    as is and a CUDA graph pads to its captured shape (specdec/cuda_graphs.py)."""

    token_ids: list[int]  # [T] the known tokens before each root, then the tree's nodes
    positions: list[int]  # [T]
    slots: list[int]  # [T] flat KV slot of each token
    query_lens: list[int]  # [B]
    seq_lens: list[int]  # [B] context length including this step's tokens
    block_tables: list[list[int]]  # [B] the requests' block tables, unpadded
    num_rows: list[int]  # [B] logit rows: the last num_rows[b] query tokens of request b
    # [B] each request's [q_len, q_len] bool mask over its own query tokens (known tokens
    # causal, then its tree); None when every request is causal (chains).
    masks: list[torch.Tensor] | None
    logit_rows: list[int]  # [R] flat rows whose logits are needed, in batch order
    # [F] flat rows whose token id is fed_tokens[j] on the device (token_ids holds 0 there):
    # a root sampled by the step before and not read back yet (model_runner.Feed)
    fed_rows: list[int] = field(default_factory=list)
    fed_tokens: torch.Tensor | None = None  # [F] int64 on the device
    sampling: RootSampling | None = None  # Feed.sampling: a decode graph samples these rows


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
    """Lays each step's requests out as one forward's inputs and runs them on `executor`,
    the one object that runs the forward (specdec/executor.py), over `kv_cache`."""

    def __init__(self, executor: Executor, config: EngineConfig, kv_cache: KVCache, device: torch.device) -> None:
        self.executor = executor
        self.config = config
        self.kv_cache = kv_cache
        self.device = device
        self.block_size = config.block_size

    @torch.inference_mode()
    def execute(self, batch: Sequence[ScheduledRequest], trees: Sequence[DraftTree],
                feed: Feed | None = None) -> ForwardOutput:
        """One forward over every request's known tokens and draft tree (trees[i] is
        rooted at batch[i]'s last known token; the root alone when nothing is drafted).
        `feed`: the roots that are on the device only (their trees' root ids are ignored)."""
        return self.executor.run(self.prepare(batch, trees, feed), self.kv_cache.layers, self.device)

    def prepare(self, batch: Sequence[ScheduledRequest], trees: Sequence[DraftTree],
                feed: Feed | None = None) -> StepInputs:
        inputs = StepInputs([], [], [], [], [], [], [], None, [])
        roots = []  # [B] the flat row of each request's root
        for item, tree in zip(batch, trees, strict=True):
            req = item.request
            start = req.num_computed_tokens
            known = req.all_token_ids[start : start + item.num_new_tokens - 1]  # before the root
            root = start + len(known)
            query_len = item.num_query_tokens(tree)
            roots.append(len(inputs.token_ids) + len(known))
            inputs.token_ids.extend(known + tree.token_ids)
            inputs.positions.extend([*range(start, root), *tree.positions(root)])
            inputs.slots.extend(self._slots(req.block_table, start, query_len))
            inputs.query_lens.append(query_len)
            inputs.seq_lens.append(start + query_len)
            inputs.block_tables.append(req.block_table)
            num_rows = tree.num_nodes if item.completes_prompt else 0
            inputs.logit_rows.extend(range(len(inputs.token_ids) - num_rows, len(inputs.token_ids)))
            inputs.num_rows.append(num_rows)
        if not all(tree.is_chain for tree in trees):
            inputs.masks = [_request_mask(item, tree) for item, tree in zip(batch, trees)]
        if feed is not None:
            inputs.fed_rows = [roots[i] for i in feed.requests]
            inputs.fed_tokens = feed.tokens
            inputs.sampling = feed.sampling
            for row in inputs.fed_rows:
                inputs.token_ids[row] = 0  # a valid id for the upload; the device value replaces it
        return inputs

    def keep_path(self, block_table: list[int], root: int, accepted_nodes: list[int]) -> None:
        """After a verify: move the KV of the accepted path's nodes (tree node ids, in path
        order) into the positions right after the root's (`root`: its position), where the
        next step reads them. A chain's path is there already: nothing moves."""
        moves = [(root + node, root + depth) for depth, node in enumerate(accepted_nodes, start=1) if node != depth]
        if moves:
            src = self._slots_at(block_table, [node for node, _ in moves])
            dst = self._slots_at(block_table, [kept for _, kept in moves])
            move_kv(self.kv_cache.layers, torch.tensor(src), torch.tensor(dst))

    def _slots(self, block_table: list[int], start: int, count: int) -> list[int]:
        return self._slots_at(block_table, range(start, start + count))

    def _slots_at(self, block_table: list[int], positions: Iterable[int]) -> list[int]:
        """The flat KV slot of each position (block_table: the request's blocks)."""
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in positions]


def upload(inputs: StepInputs, device: torch.device) -> tuple[
    torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor
]:  # input_ids [T] int64, positions [T] int64, the metadata, logit rows [R] int64
    """The step's tensors on `device` in two host-to-device copies that do not wait for
    the GPU (one int64 buffer, one int32 buffer, sliced there)."""
    num_tokens, batch_size = len(inputs.token_ids), len(inputs.query_lens)
    rows = inputs.logit_rows
    longs = to_device(inputs.token_ids + inputs.positions + inputs.slots + rows, torch.int64, device)
    max_blocks = max((len(t) for t in inputs.block_tables), default=0)
    tables = [x for t in inputs.block_tables for x in t + [0] * (max_blocks - len(t))]
    starts = [0]
    for n in inputs.query_lens:
        starts.append(starts[-1] + n)
    ints = to_device(starts + inputs.seq_lens + tables, torch.int32, device)
    ids, positions, slots, logit_rows = longs.split([num_tokens, num_tokens, num_tokens, len(rows)])
    query_start_loc, seq_lens, block_tables = ints.split([batch_size + 1, batch_size, len(tables)])
    meta = AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_tables=block_tables.view(batch_size, max_blocks),
        query_lens_cpu=list(inputs.query_lens),
        seq_lens_cpu=list(inputs.seq_lens),
    )
    if inputs.masks is not None:
        meta.tree_mask = stack_masks(inputs.masks, meta.max_query_len).to(device, non_blocking=True)
    feed_tokens(ids, inputs.fed_rows, inputs.fed_tokens)
    return ids, positions, meta, logit_rows


def feed_tokens(ids: torch.Tensor, rows: list[int], tokens: torch.Tensor | None) -> None:
    """Scatter device-side tokens into a step's input ids, in stream order after the ids'
    upload, without the host seeing them. ids [T] int64 on the device (written in place),
    tokens [len(rows)] int64 on the same device."""
    if tokens is not None and rows:
        ids.index_copy_(0, to_device(rows, torch.int64, ids.device), tokens.to(ids.device))


def to_device(values: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # non_blocking: the host buffer is staged at once, and the copy queues behind the GPU's
    # work instead of waiting for it (a plain torch.tensor(..., device=cuda) would).
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def stack_masks(masks: list[torch.Tensor], width: int) -> torch.Tensor:  # -> [T, width] bool
    """The requests' [q_len, q_len] masks as the kernels read them: row t over the query
    tokens of its own request, padded with False."""
    rows = [torch.cat([m, torch.zeros(len(m), width - len(m), dtype=torch.bool)], 1) for m in masks]
    return torch.cat(rows) if rows else torch.zeros(0, width, dtype=torch.bool)


def _request_mask(item: ScheduledRequest, tree: DraftTree) -> torch.Tensor:  # [q_len, q_len] bool
    """Each query token sees the known tokens before it and its tree ancestors."""
    known = item.num_new_tokens - 1
    n = item.num_query_tokens(tree)
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    mask[known:n, known:n] = tree.attention_mask()
    return mask
