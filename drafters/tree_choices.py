"""Medusa-style static trees: `choices`, each a path of top-k ranks per head, and the
trees built from them (the tree type itself is specdec.spec.tree.DraftTree)."""
from __future__ import annotations

import heapq
from collections.abc import Sequence

from specdec.spec.tree import DraftTree

Choice = tuple[int, ...]  # ranks of the top-k tokens along a path: (rank at depth 1, rank at depth 2, ...)

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


def tree_from_choices(
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
    return DraftTree(tokens, parents)


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
