"""Draft trees: the one representation of a request's candidate continuations.

Node 0 is the ROOT: the last committed token, whose KV is not computed yet, so the
target scores it together with the drafts. Every other node is a draft token whose
parent is the node before it on its path. Nodes are in topological order (parent index
< node index) and, by convention, in PRIORITY order too: the constructors below put the
most promising nodes first, so any prefix of the node list is itself a good, ancestor-
closed tree, which is what `prune` keeps.

A chain of k drafts is the tree root -> d1 -> ... -> dk. Static trees come from
Medusa-style `choices` (a path of top-k ranks per head); dynamic trees (EAGLE-2) from
scored candidate expansions.
"""
from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

Choice = tuple[int, ...]  # ranks of the top-k tokens along a path: (rank at depth 1, rank at depth 2, ...)
Candidate = tuple[int, int, float]  # (parent candidate id, token, cumulative draft log-prob); id 0 = root

# Medusa's mc_sim_7b_63 (FasterDecoding/Medusa, medusa/model/medusa_choices.py): built
# greedily by expected acceptance for Vicuna-7B's heads, so every prefix is prefix-closed.
MEDUSA_MC_SIM_7B_63: list[Choice] = [
    (0,), (0, 0), (1,), (0, 1), (2,), (0, 0, 0), (1, 0), (0, 2), (3,), (0, 3), (4,), (0, 4),
    (2, 0), (0, 5), (0, 0, 1), (5,), (0, 6), (6,), (0, 7), (0, 1, 0), (1, 1), (7,), (0, 8),
    (0, 0, 2), (3, 0), (0, 9), (8,), (9,), (1, 0, 0), (0, 2, 0), (1, 2), (0, 0, 3), (4, 0),
    (2, 1), (0, 0, 4), (0, 0, 5), (0, 0, 0, 0), (0, 1, 1), (0, 0, 6), (0, 3, 0), (5, 0),
    (1, 3), (0, 0, 7), (0, 0, 8), (0, 0, 9), (6, 0), (0, 4, 0), (1, 4), (7, 0), (0, 1, 2),
    (2, 0, 0), (3, 1), (2, 2), (8, 0), (0, 5, 0), (1, 5), (1, 0, 1), (0, 2, 1), (9, 0),
    (0, 6, 0), (0, 0, 0, 1), (1, 6), (0, 7, 0),
]

# Estimated P(the rank-r token of head d is right | the path above it was accepted) for
# the shipped 4-head SmolLM2-135M Medusa heads (weights/smollm2-135m-medusa/accuracy.json).
# Rank 0: conditional top-1 from the measured chain acceptance (0.38, then .174/.38,
# .085/.174, .05/.085). Ranks 1-4: the measured top5 - top1 mass of each head (not
# conditional, so on the low side), split geometrically (ratio 0.6): only top-1 and
# top-5 were measured.
SMOLLM2_MEDUSA_RANK_ACCURACY: list[list[float]] = [
    [0.380, 0.109, 0.066, 0.039, 0.024],
    [0.458, 0.091, 0.055, 0.033, 0.020],
    [0.489, 0.080, 0.048, 0.029, 0.017],
    [0.588, 0.077, 0.046, 0.028, 0.017],
]

# The fallback static tree, for heads whose medusa_config.json has no measured
# `tree_choices` (train_medusa.py stores the best tree on its data, see medusa_tree.py):
# 24 drafts (25 nodes) chosen by `greedy_choices` from the estimates above.
# Equal to greedy_choices(SMOLLM2_MEDUSA_RANK_ACCURACY, 24) (a test checks it).
DEFAULT_CHOICES: list[Choice] = [
    (0,), (0, 0), (1,), (0, 0, 0), (2,), (0, 0, 0, 0), (1, 0), (3,), (0, 1), (2, 0), (1, 0, 0),
    (4,), (0, 2), (3, 0), (0, 1, 0), (2, 0, 0), (1, 0, 0, 0), (0, 0, 1), (0, 3), (4, 0),
    (0, 2, 0), (0, 1, 0, 0), (1, 1), (3, 0, 0),
]


@dataclass(eq=False)
class DraftTree:
    """A request's draft tree; see the module docstring for the conventions."""

    token_ids: list[int]  # [N] node tokens; token_ids[0] is the root (last committed token)
    parents: list[int]  # [N] parent node index; parents[0] == -1, else 0 <= parents[i] < i
    # [N, V] row i = the distribution node i's token was SAMPLED from (siblings drawn
    # i.i.d. share one row's values); row 0 (root) is unused. None: every node is a
    # deterministic guess given the context (top-k picks, n-gram), verified as one-hot.
    # Top-k picks must use None: they are not draws from the draft distribution, and
    # verifying them against it would bias the output.
    draft_probs: Tensor | None = None
    depths: list[int] = field(init=False)  # [N] root = 0
    _children: list[list[int]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if n == 0 or len(self.parents) != n or self.parents[0] != -1:
            raise ValueError(f"need parents[0] == -1 and one parent per token, got {self.parents} "
                             f"for {n} tokens")
        if self.draft_probs is not None and (self.draft_probs.dim() != 2 or self.draft_probs.shape[0] != n):
            raise ValueError(f"draft_probs shape {tuple(self.draft_probs.shape)}, expected ({n}, V)")
        depths: list[int] = [0] * n
        children: list[list[int]] = [[] for _ in range(n)]
        for i, p in enumerate(self.parents[1:], start=1):
            if not 0 <= p < i:
                raise ValueError(f"parents must satisfy 0 <= parents[i] < i (topological order): {self.parents}")
            depths[i] = depths[p] + 1
            children[p].append(i)
        self.depths, self._children = depths, children

    # ---- views -------------------------------------------------------------------

    @property
    def num_nodes(self) -> int:
        """Query tokens a verify step runs: the root plus every draft node."""
        return len(self.token_ids)

    @property
    def num_drafts(self) -> int:
        return len(self.token_ids) - 1

    @property
    def max_depth(self) -> int:
        """The most drafts one step can accept (the longest root-to-leaf path)."""
        return max(self.depths)

    def children(self, i: int) -> list[int]:
        return list(self._children[i])

    def leaves(self) -> list[int]:
        return [i for i, kids in enumerate(self._children) if not kids]

    def path_to(self, i: int) -> list[int]:
        """Node indices from the root to node i, both included."""
        path = [i]
        while self.parents[path[-1]] >= 0:
            path.append(self.parents[path[-1]])
        return path[::-1]

    def paths(self) -> list[list[int]]:
        """Every root-to-leaf path of node indices, leaves in node order."""
        return [self.path_to(leaf) for leaf in self.leaves()]

    def positions(self, prefix_len: int) -> list[int]:
        """RoPE position of each node: the root sits at prefix_len, a node at root + depth."""
        return [prefix_len + d for d in self.depths]

    def attention_mask(self) -> Tensor:
        """[N, N] bool: node i attends to itself and its ancestors (the prefix is implied)."""
        n = self.num_nodes
        mask = torch.zeros(n, n, dtype=torch.bool)  # [N, N]
        for i in range(n):
            # Topological order: the parent's row (its ancestors) is already final.
            if i > 0:
                mask[i] = mask[self.parents[i]]
            mask[i, i] = True
        return mask

    # ---- constructors -------------------------------------------------------------

    @classmethod
    def chain(cls, token_ids: Sequence[int], draft_probs: Tensor | None = None) -> DraftTree:
        """token_ids = [root, d1, ..., dk]; draft_probs [k, V] for the drafts (a Draft.probs)."""
        n = len(token_ids)
        return cls(list(token_ids), list(range(-1, n - 1)), _with_root_row(draft_probs, n))

    @classmethod
    def from_choices(
        cls,
        root: int,
        tokens_per_head_topk: Sequence[Sequence[int]],  # [heads][k]: head h's tokens by rank, for depth h + 1
        choices: Sequence[Sequence[int]] = DEFAULT_CHOICES,
    ) -> DraftTree:
        """A Medusa static tree: choice (r1, ..., rd) is the node whose token is head d-1's
        rank-rd token, under the node of (r1, ..., r(d-1)).

        Medusa heads all read the root's hidden state, so a node's token depends only on
        its depth and rank, not on its parent's token. Choices needing a head or rank that
        tokens_per_head_topk lacks are dropped with their descendants. Node order follows
        the order of `choices` (their priority) as far as topological order allows.
        """
        ordered = _topological(
            [tuple(c) for c in choices])
        index: dict[Choice, int] = {(): 0}
        tokens, parents = [root], [-1]
        for choice in ordered:
            head, rank = len(choice) - 1, choice[-1]
            parent = index.get(choice[:-1])
            if parent is None or head >= len(tokens_per_head_topk) or rank >= len(tokens_per_head_topk[head]):
                continue
            index[choice] = len(tokens)
            tokens.append(int(tokens_per_head_topk[head][rank]))
            parents.append(parent)
        return cls(tokens, parents)

    @classmethod
    def from_expansion(
        cls,
        root: int,
        candidates: Sequence[Candidate],  # candidate k has id k + 1; its parent id is < k + 1
        max_drafts: int,
        # [len(candidates), V] only if candidates were sampled i.i.d. from these rows; None
        # for top-k picks (EAGLE-2's default), which are verified exactly as one-hot guesses.
        draft_probs: Tensor | None = None,
    ) -> DraftTree:
        """An EAGLE-2 dynamic tree: the max_drafts candidates of highest cumulative draft
        log-prob whose ancestors are all kept, in best-first order.

        With true cumulative log-probs a child never beats its parent, so this is the plain
        top-max_drafts. A child scoring above its parent (a heuristic score) cannot be kept
        without it: best-first expansion picks the child right after its parent.
        """
        parents = [c[0] for c in candidates]
        if any(not 0 <= p <= k for k, p in enumerate(parents)):
            raise ValueError("every candidate's parent id must be 0 (root) or an earlier candidate's id")
        kept = best_first(parents, [c[2] for c in candidates], max_drafts)  # candidate indices
        new_id = {0: 0} | {k + 1: i + 1 for i, k in enumerate(kept)}
        probs = None if draft_probs is None else draft_probs[torch.tensor(kept, dtype=torch.long)]
        return cls([root] + [candidates[k][1] for k in kept],
                   [-1] + [new_id[parents[k]] for k in kept],
                   _with_root_row(probs, len(kept) + 1))

    # ---- pruning ------------------------------------------------------------------

    def prune(self, max_drafts: int, max_depth: int | None = None) -> DraftTree:
        """The first max_drafts draft nodes (in priority order) no deeper than max_depth.

        Ancestor-closed: a kept node's ancestors are shallower and come earlier.
        """
        keep = [i for i in range(self.num_nodes) if max_depth is None or self.depths[i] <= max_depth]
        return self.subtree(keep[: max_drafts + 1])

    def subtree(self, keep: Sequence[int]) -> DraftTree:
        """The tree of the given nodes, which must include the root and every kept node's parent."""
        keep = sorted(keep)
        new_index = {old: new for new, old in enumerate(keep)}
        if not keep or keep[0] != 0 or any(self.parents[i] not in new_index for i in keep[1:]):
            raise ValueError("a subtree needs the root and the parent of every kept node")
        if len(keep) == self.num_nodes:
            return self
        probs = None if self.draft_probs is None else self.draft_probs[torch.tensor(keep, dtype=torch.long)]
        return DraftTree([self.token_ids[i] for i in keep],
                         [-1] + [new_index[self.parents[i]] for i in keep[1:]], probs)


def expand_layer(
    frontier: Sequence[int],  # P candidate ids being expanded (0 = root)
    frontier_scores: Sequence[float],  # [P] their cumulative draft log-probs (root: 0)
    top_tokens: Tensor,  # [P, k] int64 each node's top-k next tokens from the draft
    top_logprobs: Tensor,  # [P, k] float their draft log-probs
) -> list[Candidate]:
    """One EAGLE-2 expansion step: the (parent, token, cumulative log-prob) candidates of
    the next layer, to append to the candidate list for `DraftTree.from_expansion`."""
    scores = torch.tensor(frontier_scores, dtype=torch.float64).unsqueeze(1) + top_logprobs.double()  # [P, k]
    return [(parent, tok, score)
            for parent, toks, row in zip(frontier, top_tokens.tolist(), scores.tolist())
            for tok, score in zip(toks, row)]


def best_first(parents: Sequence[int], scores: Sequence[float], budget: int) -> list[int]:
    """Up to `budget` candidate indices by best-first expansion from the root.

    parents[k] is candidate k's parent id (0 = root, j + 1 = candidate j). The result is
    ancestor-closed and in selection order (topological). Ties go to the earlier candidate.
    """
    children: list[list[int]] = [[] for _ in range(len(parents) + 1)]  # by parent id
    for k, p in enumerate(parents):
        children[p].append(k)
    heap = [(-scores[k], k) for k in children[0]]
    heapq.heapify(heap)
    kept: list[int] = []
    while heap and len(kept) < budget:
        _, k = heapq.heappop(heap)
        kept.append(k)
        for child in children[k + 1]:
            heapq.heappush(heap, (-scores[child], child))
    return kept


def greedy_choices(rank_accuracy: Sequence[Sequence[float]], num_drafts: int) -> list[Choice]:
    """The num_drafts Medusa choices of highest expected acceptance, best first.

    rank_accuracy[d][r]: P(head d's rank-r token is right | its parent was accepted). A
    path's acceptance probability is the product along it and the expected number of
    accepted drafts is the sum over the tree's nodes; since a child is never more likely
    than its parent, best-first expansion maximises it for the budget (Medusa, sec. 3.1.2).
    """
    heap: list[tuple[float, Choice]] = []  # (-acceptance probability, choice); ties: smaller ranks first

    def push_children(choice: Choice, prob: float) -> None:
        if len(choice) < len(rank_accuracy):
            for rank, acc in enumerate(rank_accuracy[len(choice)]):
                heapq.heappush(heap, (-prob * acc, choice + (rank,)))

    push_children((), 1.0)
    chosen: list[Choice] = []
    while heap and len(chosen) < num_drafts:
        neg_prob, choice = heapq.heappop(heap)
        chosen.append(choice)
        push_children(choice, -neg_prob)
    return chosen


def _topological(choices: list[Choice]) -> list[Choice]:
    """Choices reordered so every prefix precedes its extensions, otherwise keeping the
    given (priority) order: sort by (latest position along the path, depth)."""
    position = {c: i for i, c in enumerate(choices)}
    if len(position) != len(choices):
        raise ValueError("duplicate choices")
    missing = [c for c in choices if len(c) > 1 and c[:-1] not in position]
    if missing or any(len(c) == 0 for c in choices):
        raise ValueError(f"choices must be non-empty and prefix-closed; missing parents of {missing[:3]}")
    latest = {c: max(position[c[:d]] for d in range(1, len(c) + 1)) for c in choices}
    return sorted(choices, key=lambda c: (latest[c], len(c)))


def _with_root_row(draft_probs: Tensor | None, num_nodes: int) -> Tensor | None:
    """[num_nodes - 1, V] draft rows -> [num_nodes, V] with a zero row for the root."""
    if draft_probs is None:
        return None
    if draft_probs.shape[0] != num_nodes - 1:
        raise ValueError(f"draft_probs has {draft_probs.shape[0]} rows for {num_nodes - 1} drafts")
    return torch.cat([draft_probs.new_zeros(1, draft_probs.shape[1]), draft_probs])
