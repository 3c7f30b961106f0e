"""Drafts from recurrent Medusa heads (recurrent_heads.py): chains and static trees.

A chain unrolls the block along its own guesses. A tree is a set of rank paths
(`tree_choices`, best first, as for Medusa-1): the node (r1, ..., rd) holds the rank-rd
token of the step run on its parent's path, so unlike Medusa-1 a node's token depends
on its parent's token. The tree is built one depth at a time; each depth runs the block
and the target's LM head once for every node with children, across the whole batch.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from specdec.drafters.base import Draft, Drafter, DraftRequest
from specdec.drafters.recurrent_heads import RecurrentHeads
from specdec.drafters.tree import Choice, DraftTree

from specdec.sampler import SamplingTensors, logits_to_probs, sample_probs


@dataclass
class _Node:
    token: int
    parent: int  # index in its request's node list; -1 for the root
    choice: Choice
    state: torch.Tensor  # [H] the state that guessed this node's token (root: the target's h)
    after: torch.Tensor | None = None  # [H] the state after reading this token, once run
    ranked: list[int] = field(default_factory=list)  # its top-k next tokens, once run


class RecurrentDrafter(Drafter):
    def __init__(self, heads: RecurrentHeads, embedding: torch.Tensor,
                 compute_logits: Callable[[torch.Tensor], torch.Tensor], choices: Sequence[Choice],
                 vocab: torch.Tensor | None = None) -> None:
        self.heads = heads
        self.embedding = embedding  # [V, H] the target's input embedding
        # The target's LM head restricted to the draft vocabulary: [N, H] -> [N, Vd] float32
        self.compute_logits = compute_logits
        self.vocab = vocab  # [Vd] int64 token id of each logit column; None: Vd = V, the identity
        self.choices = list(choices)
        self.top_k = 1 + max((max(c) for c in self.choices if c), default=0)

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        drafts = [Draft([]) for _ in requests]
        ready = [i for i, r in enumerate(requests) if r.hidden is not None]
        trees = [i for i in ready if requests[i].max_nodes]
        chains = [i for i in ready if not requests[i].max_nodes]
        for i, tree in zip(trees, self._trees([requests[i] for i in trees])):
            drafts[i] = Draft([], tree=tree)
        for i, draft in zip(chains, self._chains([requests[i] for i in chains])):
            drafts[i] = draft
        return drafts

    def _advance(self, states: torch.Tensor, tokens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """One step for each row: [N, H] states and the N tokens they read -> the new
        states [N, H] and their logits [N, V]."""
        ids = torch.tensor(list(tokens), dtype=torch.long)
        states = self.heads.step(states, F.embedding(ids, self.embedding))
        return states, self.compute_logits(states)

    def _token(self, column: torch.Tensor) -> torch.Tensor:
        """Token ids of draft-vocabulary columns (any shape)."""
        return column if self.vocab is None else self.vocab[column]

    def _depth(self, request: DraftRequest) -> int:
        return min(request.num_tokens, self.heads.num_steps)

    # ---- chains ---------------------------------------------------------------------

    def _chains(self, requests: list[DraftRequest]) -> list[Draft]:
        if not requests:
            return []
        depths = [self._depth(r) for r in requests]
        states = torch.stack([r.hidden for r in requests])  # type: ignore[misc]  # [B, H]
        tokens = [r.token_ids[-1] for r in requests]
        drafted: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        for step in range(max(depths)):
            live = [i for i, d in enumerate(depths) if d > step]
            new_states, logits = self._advance(states[live], [tokens[i] for i in live])  # [L, H], [L, V]
            states[live] = new_states
            for row, i in enumerate(live):
                tokens[i] = self._pick(requests[i], logits[row], probs[i])
                drafted[i].append(tokens[i])
        return [Draft(d, torch.stack(p) if p else None) for d, p in zip(drafted, probs)]

    def _pick(self, request: DraftRequest, logits: torch.Tensor, probs: list[torch.Tensor]) -> int:
        """The next draft token from one [Vd] row: argmax when greedy, else a sample whose
        distribution (over the whole vocabulary, zero off the draft vocabulary) joins
        `probs` for the rejection sampler."""
        params = request.sampling_params
        if params.greedy:
            return int(self._token(logits.argmax()))
        st = SamplingTensors.from_params([params], [None])
        row = logits_to_probs(logits[None], st)[0]  # [Vd]
        if self.vocab is not None:
            row = torch.zeros(self.embedding.shape[0], dtype=row.dtype).index_copy_(0, self.vocab, row)  # [V]
        probs.append(row)
        return int(sample_probs(row[None], st.generators)[0])

    # ---- trees ----------------------------------------------------------------------

    def _trees(self, requests: list[DraftRequest]) -> list[DraftTree]:
        plans = [self._plan(r) for r in requests]
        nodes = [[_Node(r.token_ids[-1], -1, (), r.hidden)] for r in requests]  # type: ignore[arg-type]
        for depth in range(1, 1 + max((max(map(len, p), default=0) for p in plans), default=0)):
            self._grow(nodes, plans, depth)
        return [DraftTree([n.token for n in ns], [n.parent for n in ns]) for ns in nodes]

    def _plan(self, request: DraftRequest) -> list[Choice]:
        """The request's choices, parents first: the first max_nodes (in priority order)
        within its depth whose parent is kept too."""
        kept: list[Choice] = []
        for choice in self.choices:
            if len(kept) == request.max_nodes:
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
