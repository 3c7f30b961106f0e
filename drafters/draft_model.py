"""A small draft LM with its own paged KV cache, proposing k tokens autoregressively.

Each request has a shadow `Request` in the drafter: its token list (committed tokens,
then the drafts it proposed) and its own block table. Before proposing, the shadow is
reconciled with the committed tokens: drafts the target rejected are rolled back by
truncating `num_computed_tokens` and the block table, exactly as the target does.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from specdec.block_manager import BlockManager
from specdec.config import DTYPES
from specdec.drafters.base import Drafter, DrafterContext, DraftRequest
from specdec.model_registry import resolve_model
from specdec.model_runner import KVCache, ModelRunner
from specdec.models import LlamaForCausalLM, load_model
from specdec.models.config import ModelConfig
from specdec.request import Request
from specdec.sampler import SamplingTensors, argmax, logits_to_probs, sample_probs
from specdec.scheduler import ScheduledRequest
from specdec.spec.tree import Candidate, DraftTree, expand_layer


class DraftModelDrafter(Drafter):
    def __init__(self, model: LlamaForCausalLM, runner: ModelRunner, block_manager: BlockManager,
                 branching: bool) -> None:
        self.model = model
        self.runner = runner
        self.block_manager = block_manager
        self.branching = branching  # EAGLE-2 style dynamic trees instead of chains
        self.shadows: dict[str, Request] = {}
        self.num_committed: dict[str, int] = {}

    @classmethod
    def from_context(cls, context: DrafterContext) -> DraftModelDrafter:
        assert context.spec.model
        draft_dir = resolve_draft_dir(context.spec.model)
        model = load_model(draft_dir, dtype=context.dtype, device=context.device,
                           fallback_weights=context.target.hf_embedding_weights(),
                           max_positions=context.max_model_len + 32, linear_backend=context.linear_backend,
                           attention_backend=context.target.attention_backend)
        check_compatible(context, model, draft_dir)
        # As many blocks as the target, plus lookahead room for every running request.
        runner, block_manager = context.allocate_kv(model, context.num_kv_blocks + context.max_num_seqs)
        return cls(model, runner, block_manager, branching=context.spec.num_tree_nodes > 0)

    @staticmethod
    def device_bytes(name: str, block_size: int, dtype: torch.dtype, max_num_seqs: int) -> tuple[int, int]:
        """(bytes per target KV block, fixed bytes) the draft model `name` will take once
        built: its KV blocks in the activation dtype (one per target block, plus
        max_num_seqs, as from_context allocates them), and its weights at their size on
        disk converted to that dtype."""
        path = resolve_draft_dir(name)
        mc = ModelConfig.from_dir(path)
        per_block = KVCache.bytes_per_block(mc.num_layers, block_size, mc.num_kv_heads, mc.head_dim, dtype)
        stored = DTYPES.get(mc.checkpoint_dtype or "float32", torch.float32).itemsize
        weights = sum(f.stat().st_size for f in path.glob("*.safetensors")) * dtype.itemsize // stored
        return per_block, weights + max_num_seqs * per_block

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        shadows = [self._sync(r) for r in requests]
        if self.branching:
            return self._propose_trees(requests, shadows)
        st = SamplingTensors.from_params([r.sampling_params for r in requests],
                                         [s.generator for s in shadows])
        tokens: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        active = self._make_room(requests, shadows)
        for _ in range(max(r.max_depth for r in requests)):
            active = [i for i in active if len(tokens[i]) < requests[i].max_depth]
            if not active:
                break
            self._draft_step([shadows[i] for i in active], st.select(active),
                             [tokens[i] for i in active], [probs[i] for i in active])
        return [DraftTree.chain([r.token_ids[-1], *t], torch.stack(p) if p else None)
                for r, t, p in zip(requests, tokens, probs)]

    def _draft_step(self, shadows: list[Request], st: SamplingTensors, tokens: list[list[int]],
                    probs: list[list[torch.Tensor]]) -> None:
        """One batched draft forward: catch up on new tokens, sample the next draft token."""
        logits = self._catch_up(shadows)  # [B, V]
        if st.all_greedy:  # greedy verification never reads draft probabilities
            sampled, step_probs = argmax(logits), None
        else:
            step_probs = logits_to_probs(logits, st)  # [B, V]
            sampled = sample_probs(step_probs, st.generators)
        for i, (shadow, token) in enumerate(zip(shadows, sampled.tolist())):  # one wait for the GPU per step
            shadow.all_token_ids.append(token)
            tokens[i].append(token)
            if step_probs is not None:
                probs[i].append(step_probs[i])

    def _propose_trees(self, requests: list[DraftRequest], shadows: list[Request]) -> list[DraftTree]:
        """EAGLE-2 style dynamic trees: expand the best few nodes of each level, keep the
        num_draft_tokens candidates of highest cumulative draft log-probability.

        Each level re-runs the expanded nodes so far as one tree query (root included),
        so a node attends to the committed prefix and its own ancestors only. The tree's
        KV is dropped afterwards: the next catch-up recomputes what the target accepted.
        """
        active = self._make_room(requests, shadows, extra=lambda r: 1 + _WIDTH * r.max_depth)
        expansions = {i: _Expansion(shadows[i].all_token_ids[-1]) for i in active}
        top = _top_branches(self._catch_up([shadows[i] for i in active]))  # [A, _BRANCH] each
        for row, i in enumerate(active):
            expansions[i].grow([0], top[0][row : row + 1], top[1][row : row + 1])
        for depth in range(2, 1 + max((requests[i].max_depth for i in active), default=0)):
            growing = [i for i in active if requests[i].max_depth >= depth]
            if not growing:
                break
            self._expand_level([shadows[i] for i in growing], [expansions[i] for i in growing])
        drafts = [DraftTree.chain([r.token_ids[-1]]) for r in requests]
        for i in active:
            drafts[i] = expansions[i].tree(requests[i].num_draft_tokens)
            shadows[i].num_computed_tokens = shadows[i].num_tokens
            self.block_manager.truncate(shadows[i], shadows[i].num_tokens)
        return drafts

    def _catch_up(self, shadows: list[Request]) -> torch.Tensor:  # -> [B, V] logits after the last token
        batch = [ScheduledRequest(s, s.num_tokens - s.num_computed_tokens) for s in shadows]
        for item in batch:
            self.block_manager.allocate(item.request, item.num_new_tokens)
        logits = self.runner.execute(batch, [DraftTree.chain([item.root_token]) for item in batch]).logits
        for item in batch:
            item.request.num_computed_tokens += item.num_new_tokens
        return logits

    def _expand_level(self, shadows: list[Request], expansions: list[_Expansion]) -> None:
        batch, trees = [], []
        for shadow, expansion in zip(shadows, expansions):
            shadow.num_computed_tokens = shadow.num_tokens - 1  # the root joins the tree query
            trees.append(expansion.query_tree())
            batch.append(ScheduledRequest(shadow, 1, trees[-1].num_drafts, trees[-1].max_depth))
            self.block_manager.allocate(shadow, trees[-1].num_nodes)
        output = self.runner.execute(batch, trees)
        rows, start = [], 0
        for tree, expansion in zip(trees, expansions):
            rows.append([start + r for r in expansion.frontier_rows()])
            start += tree.num_nodes
        top = _top_branches(output.logits[[r for request_rows in rows for r in request_rows]])  # [F, _BRANCH] each
        start = 0
        for expansion, request_rows in zip(expansions, rows):
            end = start + len(request_rows)
            expansion.grow(expansion.frontier, top[0][start:end], top[1][start:end])
            start = end

    def _make_room(self, requests: list[DraftRequest], shadows: list[Request],
                   extra: Callable[[DraftRequest], int] = lambda r: r.max_depth) -> list[int]:
        """Indices of requests whose drafts fit in the draft KV pool this step.

        Shadows of requests not in this batch (preempted or waiting in the target) are
        evicted first; they are rebuilt from their tokens when they come back.
        """
        needed = [self.block_manager.blocks_needed(s.num_tokens + extra(r)) - len(s.block_table)
                  for r, s in zip(requests, shadows)]
        if sum(needed) > self.block_manager.num_free_blocks:
            in_batch = {r.request_id for r in requests}
            for request_id in [rid for rid in self.shadows if rid not in in_batch]:
                self.free(request_id)
        active, free = [], self.block_manager.num_free_blocks
        for i, n in enumerate(needed):
            if n <= free:
                active.append(i)
                free -= n
        return active

    def _sync(self, request: DraftRequest) -> Request:
        """Bring the shadow in line with the committed tokens; roll back rejected drafts."""
        shadow = self.shadows.get(request.request_id)
        if shadow is None:
            shadow = Request(request.request_id, [], request.sampling_params, None, 0, set())
            self.shadows[request.request_id] = shadow
        committed = self.num_committed.get(request.request_id, 0)
        keep = committed + _common_prefix(shadow.all_token_ids[committed:], request.token_ids[committed:])
        shadow.num_computed_tokens = min(shadow.num_computed_tokens, keep)
        shadow.all_token_ids = list(request.token_ids)
        self.block_manager.truncate(shadow, shadow.num_computed_tokens)
        self.num_committed[request.request_id] = len(request.token_ids)
        return shadow

    def free(self, request_id: str) -> None:
        shadow = self.shadows.pop(request_id, None)
        self.num_committed.pop(request_id, None)
        if shadow is not None:
            self.block_manager.free(shadow)


_WIDTH = 4  # nodes expanded per level (EAGLE-2's top-k)
_BRANCH = 4  # children considered per expanded node


class _Expansion:
    """One request's growing candidate set: (parent id, token, cumulative log-prob)."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.candidates: list[Candidate] = []
        self.expanded: list[int] = []  # candidate ids run through the draft so far (0 = root)
        self.frontier: list[int] = []

    def grow(self, parents: list[int], tokens: torch.Tensor,  # [P, _BRANCH] each parent's best next tokens
             logprobs: torch.Tensor) -> None:  # [P, _BRANCH] their draft log-probs
        scores = [0.0 if p == 0 else self.candidates[p - 1][2] for p in parents]
        first_new = len(self.candidates) + 1
        self.candidates += expand_layer(parents, scores, tokens, logprobs)
        self.expanded += [p for p in parents if p not in self.expanded]
        new = range(first_new, len(self.candidates) + 1)
        self.frontier = sorted(new, key=lambda c: -self.candidates[c - 1][2])[:_WIDTH]

    def query_tree(self) -> DraftTree:
        """The root, every expanded node and the frontier, as one tree (frontier last)."""
        ids = sorted(set(self.expanded) | set(self.frontier))
        self._order = {c: n for n, c in enumerate(ids)}
        tokens = [self.root if c == 0 else self.candidates[c - 1][1] for c in ids]
        parents = [-1 if c == 0 else self._order[self.candidates[c - 1][0]] for c in ids]
        return DraftTree(tokens, parents)

    def frontier_rows(self) -> list[int]:
        return [self._order[c] for c in self.frontier]

    def tree(self, max_drafts: int) -> DraftTree:
        return DraftTree.from_expansion(self.root, self.candidates, max_drafts)


def _top_branches(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [P, V] -> [P, _BRANCH] x 2
    """Each row's _BRANCH best tokens and their draft log-probs, on the host (one copy)."""
    top = torch.log_softmax(logits.float(), dim=-1).topk(_BRANCH, dim=-1)
    return top.indices.cpu(), top.values.cpu()


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def resolve_draft_dir(name: str) -> Path:
    """A draft dir, a known model name, or one of the drafts shipped in drafters/weights."""
    shipped = Path(__file__).parent / "weights" / name
    if (shipped / "config.json").is_file():
        return shipped
    return resolve_model(name)


def check_compatible(context: DrafterContext, draft: LlamaForCausalLM, draft_dir: Path) -> None:
    target_vocab = context.target.config.vocab_size
    if draft.config.vocab_size != target_vocab:
        raise ValueError(f"draft model {draft_dir} has vocab size {draft.config.vocab_size}, "
                         f"the target has {target_vocab}: they must share one tokenizer")
    if (draft_dir / "tokenizer.json").is_file():
        from transformers import AutoTokenizer

        if AutoTokenizer.from_pretrained(str(draft_dir)).get_vocab() != context.tokenizer.get_vocab():
            raise ValueError(f"draft model {draft_dir} uses a different tokenizer than the target")
