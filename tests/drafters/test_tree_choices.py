"""Tests for drafters/tree_choices.py: Medusa-style static trees from rank paths."""
from __future__ import annotations

import pytest

from specdec.drafters.tree_choices import (
    DEFAULT_CHOICES,
    MEDUSA_MC_SIM_7B_63,
    SMOLLM2_MEDUSA_RANK_ACCURACY,
    greedy_choices,
    tree_from_choices,
)
from specdec.spec.tree import DraftTree


def is_ancestor_closed(tree: DraftTree) -> bool:
    return all(p < i for i, p in enumerate(tree.parents[1:], start=1))


TOPK = [[10, 11, 12], [20, 21, 22], [30, 31, 32]]  # head h's tokens by rank


def test_from_choices_tokens_and_parents() -> None:
    tree = tree_from_choices(7, TOPK, [(0,), (1,), (0, 0), (0, 2), (1, 0), (0, 0, 1)])
    assert tree.token_ids == [7, 10, 11, 20, 22, 20, 31]
    assert tree.parents == [-1, 0, 0, 1, 1, 2, 3]


def test_from_choices_keeps_priority_order_but_fixes_topology() -> None:
    # (0, 1) is listed before its parent (0,): a child is worth no more than its parent,
    # so it moves down to right after it; the rest keep their order.
    tree = tree_from_choices(7, TOPK, [[1], [0, 1], [2], [0]])
    assert tree.token_ids == [7, 11, 12, 10, 21]
    assert tree.parents == [-1, 0, 0, 0, 3]


def test_from_choices_drops_what_the_heads_cannot_fill() -> None:
    tree = tree_from_choices(7, TOPK[:2], [(0,), (5,), (5, 0), (0, 0), (0, 0, 0)])
    assert tree.token_ids == [7, 10, 20]  # rank 5 and head 3 do not exist


def test_from_choices_rejects_bad_choices() -> None:
    with pytest.raises(ValueError, match="prefix-closed"):
        tree_from_choices(7, TOPK, [(0,), (1, 0)])
    with pytest.raises(ValueError, match="duplicate"):
        tree_from_choices(7, TOPK, [(0,), (0,)])


@pytest.mark.parametrize("choices", [DEFAULT_CHOICES, MEDUSA_MC_SIM_7B_63])
def test_choice_lists_are_prefix_closed_in_order(choices: list[tuple[int, ...]]) -> None:
    """Every truncation of the list is a valid tree: each prefix comes before its extension."""
    assert len(set(choices)) == len(choices)
    for i, choice in enumerate(choices):
        assert len(choice) == 1 or choice[:-1] in choices[:i], choice


def test_default_tree_well_formed() -> None:
    assert 16 <= len(DEFAULT_CHOICES) + 1 <= 26
    assert max(len(c) for c in DEFAULT_CHOICES) == 4  # uses all 4 Medusa heads
    topk = [[100 * h + r for r in range(10)] for h in range(4)]
    tree = tree_from_choices(1, topk, DEFAULT_CHOICES)
    assert tree.num_nodes == len(DEFAULT_CHOICES) + 1 and tree.max_depth == 4
    assert is_ancestor_closed(tree)
    # Node order = choice order, and a node's token is its head's token at its rank.
    for node, choice in enumerate(DEFAULT_CHOICES, start=1):
        assert tree.token_ids[node] == topk[len(choice) - 1][choice[-1]]
        assert tree.depths[node] == len(choice)
    # The default is the greedy optimum for the estimated head accuracies.
    assert greedy_choices(SMOLLM2_MEDUSA_RANK_ACCURACY, len(DEFAULT_CHOICES)) == DEFAULT_CHOICES


def test_greedy_choices_maximises_expected_acceptance() -> None:
    acc = [[0.5, 0.2], [0.6, 0.1]]
    assert greedy_choices(acc, 3) == [(0,), (0, 0), (1,)]  # 0.5, 0.3, 0.2
    assert greedy_choices(acc, 10) == [(0,), (0, 0), (1,), (1, 0), (0, 1), (1, 1)]  # all 6 paths




def test_prune_default_tree_equals_truncated_choices() -> None:
    topk = [[100 * h + r for r in range(10)] for h in range(4)]
    full = tree_from_choices(1, topk)
    for k in (0, 4, 15, 24, 40):
        small = tree_from_choices(1, topk, DEFAULT_CHOICES[:k])
        pruned = full.prune(k)
        assert (pruned.token_ids, pruned.parents) == (small.token_ids, small.parents)
    assert full.prune(24) is full  # nothing to drop: the same tree
