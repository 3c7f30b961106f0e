"""EAGLE-3 drafting (method "eagle3"): a published EAGLE-3 head (eagle3_head.py) drafts
EAGLE-2 dynamic trees from the target's own features.

The engine's executor captures the residual stream entering three target layers
(`feature_layers`: the head's low / middle / high) for every token the target keeps, and
hands them over through `observe_features`. The head keeps its own KV in a private paged
cache: its row at position p reads the feature of p and the token at p + 1, so after a
commit every position but the root's has its row. Before drafting, each request catches up
(one batched causal forward over the rows it lacks: a whole prompt after prefill, a verify
step's root and accepted nodes after that); the last row's output guesses the first draft.

Drafting then grows a tree depth by depth (EAGLE-2): the `topk` likeliest nodes of the
depth are run (each reads its token and its parent's output, at its parent's position + 1,
and attends to the committed rows and its own ancestors only, through a tree mask), each
adds its `topk` best children, and the tree keeps the num_draft_tokens nodes of highest
path probability (the product of the head's probabilities, reranked at the end), each
node's path probability as its chance. The tree's rows are dropped from the head's cache
afterwards: what the target accepts comes back as features and is run then, so rejected
tokens never stay in it.

Guesses are top-k picks, verified one-hot: lossless for greedy and sampled requests.

Limits: a position the target never runs (a prefix cache hit) has no feature: the head's
context then starts after it (drafting stays lossless, its guesses a little worse).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from specdec.block_manager import BlockManager
from specdec.drafters.base import Drafter, DrafterContext, DraftRequest
from specdec.drafters.eagle3_head import Eagle3Config, Eagle3Head, load_eagle3_head
from specdec.kernels import AttentionBackend, PagedKV
from specdec.model_runner import KVCache, StepInputs, upload
from specdec.request import Request
from specdec.sampling_params import SamplingParams
from specdec.spec.tree import Candidate, DraftTree, ScoredDraft, expand_layer

SHIPPED = Path(__file__).parent / "weights"
# Features a request may hold before the head runs them (3 x hidden floats each: 7 KB a
# token on the default model): a request that drafts nothing for longer (the policy grants
# it nothing) keeps only its newest ones, and its head context starts over from them.
MAX_PENDING_ROWS = 1024


def resolve_head_dir(name: str) -> Path:
    """An EAGLE-3 head directory, or the name of one shipped in drafters/weights."""
    path = Path(name)
    if not (path / "config.json").is_file() and (SHIPPED / name / "config.json").is_file():
        path = SHIPPED / name
    if not (path / "config.json").is_file():
        raise ValueError(f"no EAGLE-3 head at {name!r} (expected a directory with config.json and "
                         f"model.safetensors, or a head shipped in {SHIPPED})")
    return path


def is_eagle3_dir(name: str) -> bool:
    """Whether `name` (a directory or shipped name) holds an EAGLE-3 head's config."""
    try:
        Eagle3Config.from_dir(resolve_head_dir(name))
    except ValueError:
        return False
    return True


@dataclass
class _HeadContext:
    """One request's rows in the head's cache, and the features still to run."""

    shadow: Request  # block table; num_computed_tokens: rows in the head's cache
    offset: int = 0  # target position of the cache's row 0 (> 0 after positions without features)
    pending: list[Tensor] = field(default_factory=list)  # [n, F] features of the positions after the rows
    num_pending: int = 0
    last: Tensor | None = None  # [H] the head's output at its last row

    @property
    def end(self) -> int:
        """The next position whose feature is due."""
        return self.offset + self.shadow.num_computed_tokens + self.num_pending


@dataclass
class _Segment:
    """One request's rows of a head forward, after its `shadow.num_computed_tokens` cached rows."""

    shadow: Request
    token_ids: list[int]  # target ids each row reads
    positions: list[int]
    features: Tensor  # [q, H] each row's feature (projected target features, or a parent's output)
    mask: Tensor | None = None  # [q, q] bool: which rows of the segment each row sees; None: causal


@dataclass
class _Growth:
    """One request's tree so far. Candidate k has id k + 1; id 0 is the root."""

    shadow: Request  # the request's rows in the head's cache
    root: int
    width: int  # nodes expanded per depth and children tried per node
    depth: int  # the request's depth limit
    base: int  # head position of the depth-1 nodes (the root's target position)
    candidates: list[Candidate] = field(default_factory=list)
    depths: list[int] = field(default_factory=lambda: [0])  # per id
    outputs: dict[int, Tensor] = field(default_factory=dict)  # id -> [H] the head's output at its row
    frontier: list[int] = field(default_factory=list)  # ids to run at the next depth

    def score(self, node: int) -> float:
        return 0.0 if node == 0 else self.candidates[node - 1][2]

    def parent(self, node: int) -> int:
        return self.candidates[node - 1][0]

    def add(self, parents: list[int], tokens: Tensor, logprobs: Tensor) -> None:  # [P, width] each
        """Each parent's best children as candidates; the `width` best new ones become the frontier."""
        first = len(self.candidates) + 1
        self.candidates += expand_layer(parents, [self.score(p) for p in parents], tokens, logprobs)
        self.depths += [self.depths[p] + 1 for p in parents for _ in range(tokens.shape[1])]
        self.frontier = sorted(range(first, len(self.candidates) + 1), key=self.score, reverse=True)[: self.width]

    def query(self) -> list[int]:
        """The frontier and its ancestors, parents first: the rows of the next depth's forward."""
        nodes: set[int] = set()
        for node in self.frontier:
            while node != 0 and node not in nodes:
                nodes.add(node)
                node = self.parent(node)
        return sorted(nodes)


class Eagle3Drafter(Drafter):
    scores_nodes = True

    def __init__(self, head: Eagle3Head, feature_layers: tuple[int, ...], attention: AttentionBackend[Any],
                 kv: PagedKV, block_manager: BlockManager, topk: int, branching: bool) -> None:
        self.head = head
        self.feature_layers = feature_layers
        self.attention = attention
        self.kv = kv  # the head's one layer of paged K/V
        self.block_manager = block_manager
        # Children per node: a chain takes the best child of the best node; never more than
        # the draft vocabulary has tokens.
        self.topk = min(topk if branching else 1, head.config.draft_vocab_size)
        self.scale = head.config.head_dim**-0.5
        self.contexts: dict[str, _HeadContext] = {}

    @classmethod
    def from_context(cls, context: DrafterContext) -> Eagle3Drafter:
        spec = context.spec
        assert spec.model
        target = context.target
        # The table itself, not the target's Parameter (which the head would register as its own).
        table = target.embed_tokens.data if isinstance(target.embed_tokens, torch.nn.Parameter) else target.embed_tokens
        head = load_eagle3_head(resolve_head_dir(spec.model), target.config, table, device=context.device,
                                dtype=context.dtype)
        c = head.config
        tree_rows = spec.eagle_topk * spec.num_speculative_tokens
        blocks = cls.num_blocks(context.num_kv_blocks, context.block_size, context.max_num_seqs, tree_rows)
        kv = KVCache(1, blocks, context.block_size, c.num_kv_heads, c.head_dim, context.dtype, context.device)
        return cls(head, c.aux_layers(target.config.num_layers), target.attention_backend, kv.layers[0],
                   BlockManager(blocks, context.block_size, False), spec.eagle_topk, spec.num_tree_nodes > 0)

    @staticmethod
    def num_blocks(target_blocks: int, block_size: int, max_num_seqs: int, tree_rows: int) -> int:
        """Head KV blocks: a row for every token the target's cache holds, and room for
        every running request's tree rows (and a partly filled block)."""
        return target_blocks + max_num_seqs * (1 + -(-tree_rows // block_size))

    @staticmethod
    def device_bytes(name: str, block_size: int, dtype: torch.dtype, max_num_seqs: int,
                     tree_rows: int) -> tuple[int, int]:
        """(bytes per target KV block, fixed bytes) the head `name` takes once built: its
        one layer of K/V (num_blocks' blocks) and its weights at their size on disk in `dtype`."""
        path = resolve_head_dir(name)
        c = Eagle3Config.from_dir(path)
        per_block = KVCache.bytes_per_block(1, block_size, c.num_kv_heads, c.head_dim, dtype)
        weights = sum(f.stat().st_size for f in path.iterdir() if f.suffix in (".safetensors", ".bin"))
        stored = 2 if c.raw.get("torch_dtype") in ("float16", "bfloat16") else 4
        extra = Eagle3Drafter.num_blocks(0, block_size, max_num_seqs, tree_rows)
        return per_block, weights * dtype.itemsize // stored + extra * per_block

    # ---- features ---------------------------------------------------------------------

    def observe_features(self, request_id: str, start: int, features: Tensor) -> None:  # features [n, F]
        context = self.contexts.get(request_id)
        if context is None:
            context = self.contexts[request_id] = self._fresh(request_id, start)
        if start != context.end:
            self._rewind(context, start)
        if context.num_pending + features.shape[0] > MAX_PENDING_ROWS:  # start over from the newest
            kept = torch.cat([*context.pending, features])[-MAX_PENDING_ROWS:]
            self._reset(context, start + features.shape[0] - kept.shape[0])
            context.pending, context.num_pending = [kept], kept.shape[0]
            return
        context.pending.append(features)
        context.num_pending += features.shape[0]

    def _fresh(self, request_id: str, offset: int) -> _HeadContext:
        shadow = Request(request_id, [], SamplingParams(), None, 0, set())
        return _HeadContext(shadow, offset)

    def _rewind(self, context: _HeadContext, start: int) -> None:
        """Make `start` the next position due: drop what the target is running again (a
        preempted request's recompute), or start over after positions that will never come."""
        kept = start - context.offset
        if start > context.end or kept < 0:
            self._reset(context, start)
            return
        computed = context.shadow.num_computed_tokens
        if kept < computed:  # rows to run again
            context.shadow.num_computed_tokens = kept
            self.block_manager.truncate(context.shadow, kept)
            context.pending, context.num_pending, context.last = [], 0, None
            return
        features = torch.cat(context.pending)[: kept - computed] if context.pending else None
        context.pending = [features] if features is not None and features.shape[0] else []
        context.num_pending = kept - computed

    def _reset(self, context: _HeadContext, offset: int) -> None:
        """Forget the context's rows and features: its next feature is that of `offset`."""
        self.block_manager.free(context.shadow)
        context.shadow.num_computed_tokens = 0
        context.offset, context.pending, context.num_pending, context.last = offset, [], 0, None

    def free(self, request_id: str) -> None:
        context = self.contexts.pop(request_id, None)
        if context is not None:
            self.block_manager.free(context.shadow)

    # ---- drafting -----------------------------------------------------------------------

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        return [DraftTree(d.tree.token_ids, d.tree.parents, chances=d.probs) for d in self.scored_trees(requests)]

    @torch.inference_mode()
    def scored_trees(self, requests: list[DraftRequest]) -> list[ScoredDraft]:
        """Each request's dynamic tree with every node's path probability (the root alone
        for a request not `ready`, or whose rows do not fit in the head's cache)."""
        trees = [ScoredDraft.root_only(r.token_ids[-1]) for r in requests]
        ready = self._make_room(requests, [i for i, r in enumerate(requests) if self.ready(r)])
        if not ready:
            return trees
        contexts = [self.contexts[requests[i].request_id] for i in ready]
        self._catch_up([requests[i] for i in ready], contexts)
        growths = [_Growth(c.shadow, requests[i].token_ids[-1], min(self.topk, requests[i].num_draft_tokens),
                           requests[i].max_depth, len(requests[i].token_ids) - 1) for i, c in zip(ready, contexts)]
        roots = torch.stack([c.last for c in contexts if c.last is not None])  # [R, H]
        for growth, root in zip(growths, roots):
            growth.outputs[0] = root
        self._add_children(growths, [[0] for _ in growths], roots)
        for depth in range(2, 1 + max(g.depth for g in growths)):
            self._expand([g for g in growths if g.depth >= depth])
        for i, growth, context in zip(ready, growths, contexts, strict=True):
            trees[i] = ScoredDraft.from_expansion(growth.root, growth.candidates, requests[i].num_draft_tokens)
            self.block_manager.truncate(context.shadow, context.shadow.num_computed_tokens)
        return trees

    def ready(self, request: DraftRequest) -> bool:
        """Whether every position before the root has its feature (run or pending)."""
        context = self.contexts.get(request.request_id)
        return (context is not None and context.end == len(request.token_ids) - 1
                and (context.num_pending > 0 or context.last is not None))

    def _make_room(self, requests: list[DraftRequest], ready: list[int]) -> list[int]:
        """Those of `ready` whose rows and tree fit in the head's cache this step. Requests
        not in the batch (preempted or waiting in the target) lose their rows first."""
        def needed(r: DraftRequest) -> int:
            context = self.contexts[r.request_id]
            rows = context.shadow.num_computed_tokens + context.num_pending + self.topk * r.max_depth
            return self.block_manager.blocks_needed(rows) - len(context.shadow.block_table)

        if sum(needed(requests[i]) for i in ready) > self.block_manager.num_free_blocks:
            in_batch = {r.request_id for r in requests}
            for request_id in [rid for rid in self.contexts if rid not in in_batch]:
                self.free(request_id)
        fitting, free = [], self.block_manager.num_free_blocks
        for i in ready:
            n = needed(requests[i])
            if n <= free:
                fitting.append(i)
                free -= n
        return fitting

    def _catch_up(self, requests: list[DraftRequest], contexts: list[_HeadContext]) -> None:
        """Run every pending row (causally, after the cached ones); each context's `last`
        becomes its root row's output."""
        segments, behind = [], []
        for request, context in zip(requests, contexts):
            if not context.num_pending:
                continue
            start = context.offset + context.shadow.num_computed_tokens
            positions = list(range(start, start + context.num_pending))
            features = self.head.project(torch.cat(context.pending))  # [q, H]
            segments.append(_Segment(context.shadow, [request.token_ids[p + 1] for p in positions], positions,
                                     features))
            behind.append(context)
        if not segments:
            return
        out = self._forward(segments)  # [T, H]
        end = 0
        for segment, context in zip(segments, behind):
            end += len(segment.positions)
            context.shadow.num_computed_tokens += len(segment.positions)
            context.pending, context.num_pending, context.last = [], 0, out[end - 1].clone()  # not a view of out

    def _expand(self, growths: list[_Growth]) -> None:
        """One depth: run each tree's frontier (with its ancestors, under a tree mask) and
        add the frontier nodes' best children."""
        segments, queries = [], []
        for growth in growths:
            nodes = growth.query()
            index = {node: row for row, node in enumerate(nodes)}
            mask = torch.zeros(len(nodes), len(nodes), dtype=torch.bool)
            for row, node in enumerate(nodes):
                parent = growth.parent(node)
                if parent != 0:
                    mask[row] = mask[index[parent]]
                mask[row, row] = True
            features = torch.stack([growth.outputs[growth.parent(n)] for n in nodes])  # [q, H]
            segments.append(_Segment(growth.shadow, [growth.candidates[n - 1][1] for n in nodes],
                                     [growth.base + growth.depths[n] - 1 for n in nodes], features, mask))
            queries.append(nodes)
        out = self._forward(segments)  # [T, H]
        start, rows = 0, []
        for growth, nodes in zip(growths, queries):
            for row, node in enumerate(nodes):
                growth.outputs[node] = out[start + row]
            rows.append([growth.outputs[node] for node in growth.frontier])
            start += len(nodes)
        self._add_children(growths, [g.frontier for g in growths], torch.stack([h for r in rows for h in r]))

    def _add_children(self, growths: list[_Growth], parents: list[list[int]],
                      outputs: Tensor) -> None:  # outputs [P, H]: the parents' outputs, growth by growth
        """Each parent's `width` best next tokens (target ids) and their log-probs, from one
        LM-head product and one copy to the host per distinct width."""
        logprobs = torch.log_softmax(self.head.logits(outputs).float(), dim=-1)  # [P, Vd]
        tops = {}
        for width in sorted({g.width for g in growths}):
            top = logprobs.topk(width, dim=-1)
            tops[width] = (self.head.to_target_ids(top.indices).cpu(), top.values.cpu())
        start = 0
        for growth, ids in zip(growths, parents):
            tokens, values = tops[growth.width]
            growth.add(ids, tokens[start : start + len(ids)], values[start : start + len(ids)])
            start += len(ids)

    def _forward(self, segments: list[_Segment]) -> Tensor:  # -> [T, H] the head's outputs
        """One forward of the head's layer over the segments' rows, their K/V written to
        the head's cache after each request's cached rows (blocks allocated here)."""
        bs = self.block_manager.block_size
        inputs = StepInputs([], [], [], [], [], [], [], None, [])
        for segment in segments:
            shadow, q = segment.shadow, len(segment.token_ids)
            cached = shadow.num_computed_tokens
            self.block_manager.allocate(shadow, q)
            inputs.token_ids += segment.token_ids
            inputs.positions += segment.positions
            inputs.slots += [shadow.block_table[j // bs] * bs + j % bs for j in range(cached, cached + q)]
            inputs.query_lens.append(q)
            inputs.seq_lens.append(cached + q)
            inputs.block_tables.append(shadow.block_table)
            inputs.num_rows.append(0)
        if any(s.mask is not None for s in segments):
            inputs.masks = [s.mask if s.mask is not None else torch.ones(len(s.token_ids), len(s.token_ids),
                                                                            dtype=torch.bool).tril()
                            for s in segments]
        device = self.kv.k.device
        token_ids, positions, meta, _ = upload(inputs, device)
        plan = self.attention.plan(meta, self.kv)

        def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:  # [T, nH, D], [T, nKV, D] x 2 -> [T, nH, D]
            self.attention.store_kv(k, v, self.kv, plan)
            return self.attention.forward(q, self.kv, plan, self.scale)

        features = torch.cat([s.features for s in segments])
        return self.head.layer(self.head.embed(token_ids), features, positions, attend)
