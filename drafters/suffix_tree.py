"""The suffix drafter's tree: the continuations of matched occurrences merged into a trie
with counts, emitted most probable first.

A node's confidence is its empirical probability: the share of continuations that pass
through it, which estimates the chance that the target accepts its whole path (drafts are
verified one-hot). Best-first by that probability maximises the expected accepted tokens
for a node budget; a child never beats its parent, so the order is topological too.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from specdec.spec.tree import DraftTree, ScoredDraft


def build_draft(root: int, continuations: Sequence[Sequence[int]], num_draft_tokens: int,
                min_prob: float) -> ScoredDraft:
    """At most num_draft_tokens nodes of probability >= min_prob, in priority order (most
    probable first; ties: shallower first, then in the order their parents were made)."""
    total = len(continuations)
    if total == 0 or num_draft_tokens < 1:
        return ScoredDraft.root_only(root)
    tokens, parents, depths, counts = _count_trie(continuations, min_prob)
    order = sorted(range(1, len(tokens)), key=lambda i: (-counts[i], depths[i], i))[:num_draft_tokens]
    new_index = {0: 0} | {old: new for new, old in enumerate(order, start=1)}
    tree = DraftTree([root] + [tokens[i] for i in order], [-1] + [new_index[parents[i]] for i in order])
    return ScoredDraft(tree, [1.0] + [counts[i] / total for i in order])


def _count_trie(continuations: Sequence[Sequence[int]],
                min_prob: float) -> tuple[list[int], list[int], list[int], list[int]]:
    """The trie of the continuations, without the nodes less than a min_prob share of them
    pass through: per node its token, parent, depth and count (node 0 is the root). Built level
    by level from the distinct continuations, so that many identical ones (a template seen
    again and again) or many rare ones (pruned at their first token) cost little."""
    distinct = Counter(tuple(c) for c in continuations)
    tokens, parents, depths, counts = [-1], [-1], [0], [len(continuations)]
    frontier: list[tuple[int, list[tuple[int, ...]]]] = [(0, list(distinct))]  # (node, continuations through it)
    depth = 0
    while frontier:
        next_frontier = []
        for node, members in frontier:
            groups: dict[int, list[tuple[int, ...]]] = {}
            for member in members:
                if len(member) > depth:
                    groups.setdefault(member[depth], []).append(member)
            for token, group in groups.items():
                count = sum(distinct[member] for member in group)
                if count / len(continuations) >= min_prob:
                    next_frontier.append((len(tokens), group))
                    tokens.append(token)
                    parents.append(node)
                    depths.append(depth + 1)
                    counts.append(count)
        frontier, depth = next_frontier, depth + 1
    return tokens, parents, depths, counts
