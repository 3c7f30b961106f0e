"""Choose a Medusa tree from measured head ranks (as Medusa's own tree search does).

For each training position, rank[i] is where the true token head i must guess falls in
head i's top-K list (K: not there). The target accepts a node (r1, ..., rd) exactly when
the true tokens' ranks start with that prefix, and a node's frequency is at most its
parent's, so the N most frequent rank prefixes are the best N-node tree for that data:
expected accepted drafts = the sum of their frequencies. Choices come out in priority
order, so `DraftTree.prune(n)` keeps the best n-node tree for any n.
"""
from __future__ import annotations

from collections import Counter

import torch

from specdec.drafters.tree_choices import Choice


def rank_prefix_counts(ranks: torch.Tensor,  # [N, heads] int64, K = not in the top-K
                       top_k: int) -> Counter[Choice]:
    counts: Counter[Choice] = Counter()
    for row in ranks.tolist():
        prefix: Choice = ()
        for rank in row:
            if rank >= top_k:
                break
            prefix = (*prefix, rank)
            counts[prefix] += 1
    return counts


def best_choices(ranks: torch.Tensor,  # [N, heads]
                 top_k: int, max_nodes: int) -> list[Choice]:
    """The max_nodes most frequent rank prefixes, most frequent first (parents before
    children on ties)."""
    counts = rank_prefix_counts(ranks, top_k)
    ordered = sorted(counts, key=lambda c: (-counts[c], len(c), c))
    return ordered[:max_nodes]


def expected_accepted(choices: list[Choice],
                      ranks: torch.Tensor) -> float:  # ranks [N, heads]
    """Mean number of draft tokens a tree of these choices gets accepted (greedy), on
    the positions whose true-token ranks are given: tau = 1 + this."""
    tree = set(choices)
    accepted = 0
    for row in ranks.tolist():
        prefix: Choice = ()
        for rank in row:
            prefix = (*prefix, rank)
            if prefix not in tree:
                break
            accepted += 1
    return accepted / max(len(ranks), 1)
