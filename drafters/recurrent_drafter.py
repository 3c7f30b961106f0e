"""Drafts from recurrent Medusa heads (recurrent_heads.py): chains and static trees.

A chain unrolls the block along its own guesses. A tree is built one depth at a time;
each depth runs the block and the target's LM head once for every node it expands,
across the whole batch. Trees come in two kinds:

- static: a set of rank paths (`tree_choices`, best first, as for Medusa-1): the node
  (r1, ..., rd) holds the rank-rd token of the step run on its parent's path, so unlike
  Medusa-1 a node's token depends on its parent's token;
- dynamic (EAGLE-2): each depth expands the few nodes of highest cumulative draft
  log-probability, and the tree keeps the num_draft_tokens best of all candidates. The heads
  are trained toward the target's distribution, so their probabilities rank well.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from specdec.drafters.base import DraftRequest, HiddenReader
from specdec.drafters.recurrent_heads import RecurrentHeads
from specdec.drafters.tree_choices import Choice
from specdec.head_graphs import HeadForward, HeadGraphs
from specdec.sampler import SamplingTensors, logits_to_probs, sample_probs
from specdec.spec.tree import Candidate, DraftTree, ScoredDraft, expand_layer

DYNAMIC_WIDTH = 10  # nodes expanded per depth, and children considered per node (EAGLE-2's top-k)


@dataclass
class _Growth:
    """One request's dynamic tree so far. Candidate k has id k + 1; id 0 is the root."""

    root: int
    depth: int  # the request's depth limit
    width: int  # nodes expanded per depth and children kept per node
    candidates: list[Candidate] = field(default_factory=list)
    states: list[torch.Tensor] = field(default_factory=list)  # [H] each node's guessing state (root first)
    frontier: list[int] = field(default_factory=lambda: [0])  # ids to expand at the next depth

    def token(self, node: int) -> int:
        return self.root if node == 0 else self.candidates[node - 1][1]

    def score(self, node: int) -> float:
        return 0.0 if node == 0 else self.candidates[node - 1][2]


@dataclass
class _Node:
    token: int
    parent: int  # index in its request's node list; -1 for the root
    choice: Choice
    state: torch.Tensor  # [H] the state that guessed this node's token (root: the target's h)
    after: torch.Tensor | None = None  # [H] the state after reading this token, once run
    ranked: list[int] = field(default_factory=list)  # its top-k next tokens, once run


class RecurrentDrafter(HiddenReader):
    def __init__(self, heads: RecurrentHeads, embedding: torch.Tensor,
                 compute_logits: Callable[[torch.Tensor], torch.Tensor], choices: Sequence[Choice],
                 vocab: torch.Tensor | None = None, dynamic: bool = False, branching: bool = False) -> None:
        super().__init__()
        self.heads = heads
        self.embedding = embedding  # [V, H] the target's input embedding
        # The target's LM head restricted to the draft vocabulary: [N, H] -> [N, Vd] float32
        self.compute_logits = compute_logits
        self.vocab = vocab  # [Vd] int64 token id of each logit column; None: Vd = V, the identity
        self.choices = list(choices)
        self.top_k = 1 + max((max(c) for c in self.choices if c), default=0)
        self.dynamic = dynamic  # trees: EAGLE-2 dynamic ones instead of `choices`
        self.branching = branching  # trees (static or dynamic) instead of chains
        self.step_rows: HeadForward = self._step_rows  # eager, or replayed graphs (`use_graphs`)

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        drafts = [DraftTree.chain([r.token_ids[-1]]) for r in requests]
        ready = [i for i, r in enumerate(requests) if self.has_hidden(r.request_id)]
        build = self._chains if not self.branching else self._dynamic_trees if self.dynamic else self._trees
        for i, tree in zip(ready, build([requests[i] for i in ready])):
            drafts[i] = tree
        return drafts

    def use_graphs(self, max_rows: int) -> None:
        """Run the heads' steps from CUDA graphs captured per row count, up to max_rows rows
        (specdec/head_graphs.py); larger steps run eagerly."""
        examples = [self.embedding.new_zeros(1, self.embedding.shape[1]),
                    torch.zeros(1, dtype=torch.long, device=self.embedding.device)]
        self.step_rows = HeadGraphs(self._step_rows, examples, max_rows)

    def _advance(self, states: torch.Tensor, tokens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """One step for each row: [N, H] states and the N tokens they read -> the new
        states [N, H] and their logits [N, V]."""
        ids = torch.tensor(list(tokens), dtype=torch.long).to(self.embedding.device, non_blocking=True)
        states, logits = self.step_rows(states, ids)
        return states, logits

    def _step_rows(self, states: torch.Tensor,  # [N, H]
                   ids: torch.Tensor,  # [N] int64 the tokens the rows read
                   ) -> tuple[torch.Tensor, torch.Tensor]:  # [N, H] new states, [N, V] their logits
        """The heads' step on the device, row by row (what a head graph captures)."""
        states = self.heads.step(states, F.embedding(ids, self.embedding))
        return states, self.compute_logits(states)

    def _token(self, column: torch.Tensor) -> torch.Tensor:
        """Token ids of draft-vocabulary columns (any shape)."""
        return column if self.vocab is None else self.vocab[column]

    @staticmethod
    def _depth(request: DraftRequest) -> int:
        # The one block unrolls to any depth (as ReDrafter's beams do), past the
        # heads.num_steps it was trained on too; later guesses are just less often right.
        return request.max_depth

    # ---- chains ---------------------------------------------------------------------

    def _chains(self, requests: list[DraftRequest]) -> list[DraftTree]:
        if not requests:
            return []
        depths = [self._depth(r) for r in requests]
        states = torch.stack([self.target_hidden(r.request_id) for r in requests])  # [B, H]
        tokens = [r.token_ids[-1] for r in requests]
        drafted: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        for step in range(max(depths)):
            live = [i for i, d in enumerate(depths) if d > step]
            new_states, logits = self._advance(states[live], [tokens[i] for i in live])  # [L, H], [L, V]
            states[live] = new_states
            best = self._token(logits.argmax(-1)).tolist()  # [L]: one wait for the GPU per depth
            for row, i in enumerate(live):
                greedy = requests[i].sampling_params.greedy
                tokens[i] = best[row] if greedy else self._sample(requests[i], logits[row], probs[i])
                drafted[i].append(tokens[i])
        return [DraftTree.chain([r.token_ids[-1], *d], torch.stack(p) if p else None)
                for r, d, p in zip(requests, drafted, probs)]

    def _sample(self, request: DraftRequest, logits: torch.Tensor, probs: list[torch.Tensor]) -> int:
        """The next draft token of a sampled request from one [Vd] row, drawn from a
        distribution (over the whole vocabulary, zero off the draft vocabulary) that joins
        `probs` for the rejection sampler. Its own wait for the GPU: sampled requests draft
        one at a time."""
        st = SamplingTensors.from_params([request.sampling_params], [None])
        row = logits_to_probs(logits[None], st)[0]  # [Vd]
        if self.vocab is not None:
            vocab = self.embedding.shape[0]
            row = torch.zeros(vocab, dtype=row.dtype, device=row.device).index_copy_(0, self.vocab, row)  # [V]
        probs.append(row)
        return int(sample_probs(row[None], st.generators)[0])

    # ---- trees ----------------------------------------------------------------------

    def _trees(self, requests: list[DraftRequest]) -> list[DraftTree]:
        plans = [self._plan(r) for r in requests]
        nodes = [[_Node(r.token_ids[-1], -1, (), self.target_hidden(r.request_id))] for r in requests]
        for depth in range(1, 1 + max((max(map(len, p), default=0) for p in plans), default=0)):
            self._grow(nodes, plans, depth)
        return [DraftTree([n.token for n in ns], [n.parent for n in ns]) for ns in nodes]

    def _dynamic_trees(self, requests: list[DraftRequest]) -> list[DraftTree]:
        return [draft.tree for draft in self.scored_trees(requests)]

    @torch.inference_mode()
    def scored_trees(self, requests: list[DraftRequest]) -> list[ScoredDraft]:
        """EAGLE-2 dynamic trees with each node's draft path probability (requests must
        have their target hidden state)."""
        growths = [_Growth(r.token_ids[-1], self._depth(r), min(DYNAMIC_WIDTH, r.num_draft_tokens),
                           states=[self.target_hidden(r.request_id)]) for r in requests]
        for depth in range(1, 1 + max((g.depth for g in growths), default=0)):
            self._expand([g for g in growths if g.depth >= depth])
        return [ScoredDraft.from_expansion(g.root, g.candidates, r.num_draft_tokens)
                for g, r in zip(growths, requests)]

    def _expand(self, growths: list[_Growth]) -> None:
        """One depth of every growing tree: run its frontier, add each frontier node's
        `width` best next tokens as candidates, and make the `width` best of those (by
        cumulative log-prob) the next frontier."""
        rows = [(g, node) for g in growths for node in g.frontier]
        states, logits = self._advance(torch.stack([g.states[node] for g, node in rows]),
                                       [g.token(node) for g, node in rows])
        logprobs = torch.log_softmax(logits.float(), dim=-1)  # [R, Vd]
        tops = self._top_by_width(logprobs, [g.width for g in growths for _ in g.frontier])
        start = 0
        for g in growths:
            end = start + len(g.frontier)
            tokens, values = tops[g.width]
            first = len(g.candidates) + 1
            g.candidates += expand_layer(g.frontier, [g.score(n) for n in g.frontier], tokens[start:end],
                                         values[start:end])
            g.states += [state for state in states[start:end] for _ in range(g.width)]
            g.frontier = sorted(range(first, len(g.candidates) + 1), key=g.score, reverse=True)[:g.width]
            start = end

    def _top_by_width(self, logprobs: torch.Tensor,  # [R, Vd]
                      widths: list[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Per width w among the rows' widths, every row's top w token ids and log-probs
        ([R, w] each, on the host: one copy, one wait for the GPU, per distinct width)."""
        tops = {}
        for width in sorted(set(widths)):
            top = logprobs.topk(width, dim=-1)
            tops[width] = (self._token(top.indices).cpu(), top.values.cpu())
        return tops

    def _plan(self, request: DraftRequest) -> list[Choice]:
        """The request's choices, parents first: the first num_draft_tokens (in priority order)
        within its depth whose parent is kept too."""
        kept: list[Choice] = []
        for choice in self.choices:
            if len(kept) == request.num_draft_tokens:
                break
            if len(choice) <= self._depth(request) and (len(choice) == 1 or choice[:-1] in kept):
                kept.append(choice)
        return sorted(kept, key=len)  # stable: priority order within a depth

    def _grow(self, nodes: list[list[_Node]], plans: list[list[Choice]], depth: int) -> None:
        """Add every request's nodes at `depth`: run their parents, then pick by rank."""
        wanted = [[c for c in plan if len(c) == depth] for plan in plans]
        parents = [(b, i) for b, ns in enumerate(nodes) for i, n in enumerate(ns)
                   if len(n.choice) == depth - 1 and any(c[:-1] == n.choice for c in wanted[b])]
        if not parents:
            return
        states, logits = self._advance(torch.stack([nodes[b][i].state for b, i in parents]),
                                       [nodes[b][i].token for b, i in parents])
        ranked = self._token(logits.topk(self.top_k, dim=-1).indices).tolist()  # [P, top_k]
        for row, (b, i) in enumerate(parents):
            nodes[b][i].after, nodes[b][i].ranked = states[row], ranked[row]
        for b, choices in enumerate(wanted):
            index = {n.choice: i for i, n in enumerate(nodes[b])}
            for choice in choices:
                parent = nodes[b][index[choice[:-1]]]
                nodes[b].append(_Node(parent.ranked[choice[-1]], index[choice[:-1]], choice,
                                      parent.after))  # type: ignore[arg-type]
