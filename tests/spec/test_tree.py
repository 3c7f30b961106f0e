"""Tests for specdec.spec.tree: structure, constructors, pruning."""
from __future__ import annotations

import random

import pytest
import torch

from specdec.spec.tree import DraftTree, best_first, expand_layer

#        0 (root, token 100)
#       / \
#      1   2          tokens 11, 12
#     / \   \
#    3   4   5        tokens 13, 14, 15
#    |
#    6                token 16
TOKENS = [100, 11, 12, 13, 14, 15, 16]
PARENTS = [-1, 0, 0, 1, 1, 2, 3]


def hand_tree() -> DraftTree:
    return DraftTree(list(TOKENS), list(PARENTS))


def is_ancestor_closed(tree: DraftTree) -> bool:
    return tree.parents[0] == -1 and all(0 <= p < i for i, p in enumerate(tree.parents) if i)


def random_tree(rng: random.Random, n: int) -> DraftTree:
    return DraftTree([rng.randrange(50) for _ in range(n)], [-1] + [rng.randrange(i) for i in range(1, n)])


# ---------------------------------------------------------------- structure


def test_depths_children_leaves_paths() -> None:
    tree = hand_tree()
    assert tree.depths == [0, 1, 1, 2, 2, 2, 3]
    assert (tree.num_nodes, tree.num_drafts, tree.max_depth) == (7, 6, 3)
    assert [tree.children(i) for i in range(7)] == [[1, 2], [3, 4], [5], [6], [], [], []]
    assert tree.leaves() == [4, 5, 6]
    assert tree.paths() == [[0, 1, 4], [0, 2, 5], [0, 1, 3, 6]]
    assert tree.path_to(0) == [0]


def test_attention_mask_sees_self_and_ancestors() -> None:
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0],
        [1, 0, 1, 0, 0, 1, 0],
        [1, 1, 0, 1, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(hand_tree().attention_mask(), expected)


def test_positions_are_prefix_plus_depth() -> None:
    assert hand_tree().positions(10) == [10, 11, 11, 12, 12, 12, 13]


@pytest.mark.parametrize("tokens, parents", [
    ([1, 2], [0, 0]),  # root must have parent -1
    ([1, 2, 3], [-1, 0]),  # one parent per token
    ([1, 2, 3], [-1, 2, 0]),  # parent after child
    ([1, 2], [-1, 1]),  # self-parent
    ([], []),
])
def test_invalid_trees_rejected(tokens: list[int], parents: list[int]) -> None:
    with pytest.raises(ValueError):
        DraftTree(tokens, parents)


def test_draft_probs_rows_checked() -> None:
    with pytest.raises(ValueError, match="draft_probs"):
        DraftTree([1, 2], [-1, 0], torch.zeros(1, 8))


# ---------------------------------------------------------------- chain


def test_is_chain() -> None:
    assert DraftTree.chain([9]).is_chain and DraftTree.chain([9, 1, 2]).is_chain
    assert not hand_tree().is_chain and not DraftTree([9, 1, 2], [-1, 0, 0]).is_chain


def test_chain_is_a_causal_path() -> None:
    probs = torch.softmax(torch.randn(3, 8), -1)
    tree = DraftTree.chain([9, 1, 2, 3], probs)
    assert tree.parents == [-1, 0, 1, 2]
    assert tree.paths() == [[0, 1, 2, 3]]
    assert tree.positions(5) == [5, 6, 7, 8]
    assert torch.equal(tree.attention_mask(), torch.ones(4, 4, dtype=torch.bool).tril())
    assert tree.draft_probs is not None
    assert torch.equal(tree.draft_probs[1:], probs) and not tree.draft_probs[0].any()
    assert DraftTree.chain([9]).num_nodes == 1 and DraftTree.chain([9]).max_depth == 0
    with pytest.raises(ValueError, match="rows"):
        DraftTree.chain([9, 1], probs)


# ---------------------------------------------------------------- pruning


def test_prune_keeps_a_prefix_and_ancestors() -> None:
    rng = random.Random(0)
    for _ in range(200):
        tree = random_tree(rng, rng.randrange(1, 30))
        budget, depth = rng.randrange(0, 30), rng.choice([None, 1, 2, 3])
        pruned = tree.prune(budget, depth)
        assert is_ancestor_closed(pruned)
        assert pruned.num_drafts <= budget and (depth is None or pruned.max_depth <= depth)
        eligible = [i for i in range(tree.num_nodes) if depth is None or tree.depths[i] <= depth]
        kept = eligible[: budget + 1]
        assert pruned.token_ids == [tree.token_ids[i] for i in kept]
        # Structure survives: every kept node's path maps onto the original path.
        for new, old in enumerate(kept):
            assert [kept[i] for i in pruned.path_to(new)] == tree.path_to(old)


def test_prune_slices_draft_probs() -> None:
    probs = torch.softmax(torch.randn(7, 5), -1)
    tree = DraftTree(list(TOKENS), list(PARENTS), probs)
    pruned = tree.prune(3, max_depth=1)  # nodes 0, 1, 2
    assert pruned.draft_probs is not None and torch.equal(pruned.draft_probs, probs[:3])
    sub = tree.subtree([0, 2, 5])
    assert sub.parents == [-1, 0, 1] and sub.draft_probs is not None
    assert torch.equal(sub.draft_probs, probs[[0, 2, 5]])
    with pytest.raises(ValueError, match="parent"):
        tree.subtree([0, 3])


# ---------------------------------------------------------------- dynamic (EAGLE-2) trees


def test_from_expansion_top_scores_with_ancestors() -> None:
    # ids: 1..3 children of the root, 4..6 their children (log-probs decrease down a path).
    candidates = [(0, 10, -0.1), (0, 11, -1.0), (0, 12, -3.0),
                  (1, 20, -0.5), (1, 21, -2.0), (2, 22, -1.5)]
    tree = DraftTree.from_expansion(5, candidates, max_drafts=4)
    assert tree.token_ids == [5, 10, 20, 11, 22]  # scores -0.1, -0.5, -1.0, -1.5
    assert tree.parents == [-1, 0, 1, 0, 3]
    assert DraftTree.from_expansion(5, candidates, max_drafts=0).token_ids == [5]


def test_from_expansion_matches_plain_top_k_for_cumulative_log_probs() -> None:
    rng = random.Random(1)
    for _ in range(50):
        candidates: list[tuple[int, int, float]] = []
        scores = [0.0]
        for k in range(rng.randrange(1, 40)):
            parent = rng.randrange(k + 1)
            scores.append(scores[parent] - rng.expovariate(1.0))  # child below parent
            candidates.append((parent, rng.randrange(50), scores[-1]))
        budget = rng.randrange(0, 45)
        tree = DraftTree.from_expansion(0, candidates, budget)
        top = sorted(range(len(candidates)), key=lambda k: -candidates[k][2])[:budget]
        assert sorted(tree.token_ids[1:]) == sorted(candidates[k][1] for k in top)
        assert is_ancestor_closed(tree)


def test_from_expansion_handles_children_scoring_above_parents() -> None:
    # Candidate 2 (id 3) outscores its parent (id 1): kept only after it, never alone.
    candidates = [(0, 10, -5.0), (0, 11, -1.0), (1, 12, -0.1)]
    tree = DraftTree.from_expansion(5, candidates, max_drafts=2)
    assert tree.token_ids == [5, 11, 10] and tree.parents == [-1, 0, 0]
    tree = DraftTree.from_expansion(5, candidates, max_drafts=3)
    assert tree.token_ids == [5, 11, 10, 12] and tree.parents == [-1, 0, 0, 2]
    with pytest.raises(ValueError, match="parent"):
        DraftTree.from_expansion(5, [(1, 10, -1.0)], max_drafts=1)


def test_from_expansion_carries_draft_probs() -> None:
    candidates = [(0, 1, -2.0), (0, 2, -0.5), (2, 3, -0.7)]
    probs = torch.softmax(torch.randn(3, 6), -1)
    tree = DraftTree.from_expansion(9, candidates, 2, probs)
    assert tree.token_ids == [9, 2, 3]
    assert tree.draft_probs is not None
    assert torch.equal(tree.draft_probs, torch.cat([torch.zeros(1, 6), probs[[1, 2]]]))


def test_expand_layer_then_build() -> None:
    # Root expands to its top-2; then both children expand to their top-2.
    layer1 = expand_layer([0], [0.0], torch.tensor([[4, 5]]), torch.log(torch.tensor([[0.6, 0.3]])))
    assert [(p, t) for p, t, _ in layer1] == [(0, 4), (0, 5)]
    layer2 = expand_layer([1, 2], [s for _, _, s in layer1], torch.tensor([[6, 7], [8, 9]]),
                          torch.log(torch.tensor([[0.9, 0.05], [0.5, 0.5]])))
    assert [(p, t) for p, t, _ in layer2] == [(1, 6), (1, 7), (2, 8), (2, 9)]
    tree = DraftTree.from_expansion(3, layer1 + layer2, max_drafts=3)
    # Path probabilities: 4: .6, 4->6: .54, 5: .3, 5->8/9: .15, 4->7: .03
    assert tree.token_ids == [3, 4, 6, 5] and tree.parents == [-1, 0, 1, 0]


def test_best_first_ties_go_to_the_earlier_candidate() -> None:
    assert best_first([0, 0, 0], [-1.0, -1.0, -1.0], 2) == [0, 1]
