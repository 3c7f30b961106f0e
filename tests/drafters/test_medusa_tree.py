"""Medusa tree search from measured head ranks: the most frequent rank prefixes."""
from __future__ import annotations

import itertools
import random

import torch

from specdec.drafters.medusa_tree import best_choices, expected_accepted, rank_prefix_counts
from specdec.drafters.tree_choices import tree_from_choices

K = 3  # rank K = the true token was not in the head's top-K


def test_counts_stop_at_the_first_miss() -> None:
    ranks = torch.tensor([[0, 1, K], [0, K, 0], [2, 0, 0]])
    counts = rank_prefix_counts(ranks, K)
    assert counts == {(0,): 2, (0, 1): 1, (2,): 1, (2, 0): 1, (2, 0, 0): 1}


def test_expected_accepted_is_the_longest_matching_prefix() -> None:
    ranks = torch.tensor([[0, 0, 1], [1, 0, 0], [0, K, 0]])
    choices = [(0,), (0, 0), (1,)]
    assert expected_accepted(choices, ranks) == (2 + 1 + 1) / 3
    assert expected_accepted([], ranks) == 0.0


def test_best_choices_beat_every_other_tree_of_the_same_size() -> None:
    gen = torch.Generator().manual_seed(0)
    ranks = torch.minimum(torch.randint(0, 6, (400, 3), generator=gen), torch.tensor(K))  # skewed to misses
    ranks = torch.where(torch.rand(400, 3, generator=gen) < 0.5, torch.zeros_like(ranks), ranks)
    paths = [p for d in (1, 2, 3) for p in itertools.product(range(K), repeat=d)]
    rng = random.Random(0)
    for size in (1, 3, 6):
        best = best_choices(ranks, K, size)
        assert len(best) == size and all(c[:-1] in best or len(c) == 1 for c in best)  # ancestor-closed
        value = expected_accepted(best, ranks)
        for _ in range(300):  # random ancestor-closed trees of the same size do no better
            tree: list[tuple[int, ...]] = []
            while len(tree) < size:
                c = rng.choice(paths)
                if c not in tree and (len(c) == 1 or c[:-1] in tree):
                    tree.append(c)
            assert expected_accepted(tree, ranks) <= value + 1e-12


def test_best_choices_build_a_prunable_tree() -> None:
    ranks = torch.tensor([[0, 0, 0]] * 5 + [[1, 0, K]] * 3 + [[0, 1, K]] * 2)
    choices = best_choices(ranks, K, 10)
    assert choices[:3] == [(0,), (0, 0), (0, 0, 0)]
    topk = [[10 + r for r in range(K)], [20 + r for r in range(K)], [30 + r for r in range(K)]]
    tree = tree_from_choices(1, topk, choices).prune(2)
    assert tree.token_ids == [1, 10, 20] and tree.parents == [-1, 0, 1]
