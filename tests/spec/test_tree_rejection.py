"""Tests for specdec.spec.tree_rejection: greedy walks, chain equivalence, exactness.

The statistical tests verify many independent requests in one batch, each with a
two-level tree over a first-order Markov target, and check with chi-square tests that
the emitted tokens follow the target. Each also runs a deliberately broken verifier
(the residual update after a rejected child skips the subtraction; for the keyed race of
seeded rows: draws keyed without the position, or a walk biased towards the argmax) and
asserts that the same check rejects it.
"""
from __future__ import annotations

import pytest
import torch
from torch import Tensor

from specdec.sampler import SamplingTensors, sample_keyed
from specdec.sampling_params import SamplingParams
from specdec.spec import tree_rejection
from specdec.spec.rejection import rejection_sample
from specdec.spec.tree import DraftTree
from specdec.spec.tree_rejection import TreeResult, tree_verify

V = 6  # vocab of the statistical tests
N_TRIALS = 20_000  # requests per statistical batch (the broken control fails by > 40 orders)
P_OK = 1e-3  # a correct verifier must pass with p above this (seeds are fixed)
P_BROKEN = 1e-6  # the broken control must fall below this



def greedy_st(n: int) -> SamplingTensors:
    return SamplingTensors.from_params([SamplingParams(temperature=0.0)] * n, [None] * n)


def plain_st(n: int, **kwargs: float) -> SamplingTensors:
    return SamplingTensors.from_params([SamplingParams(**kwargs)] * n, [None] * n)  # type: ignore[arg-type]


def is_root_path(tree: DraftTree, nodes: list[int]) -> bool:
    """nodes = the path from the root (excluded) down to some node."""
    return not nodes or nodes == tree.path_to(nodes[-1])[1:]


def argmax_logits(ids: list[int], vocab: int = 8) -> Tensor:
    """[len(ids), vocab] logits whose argmax is ids[row]."""
    logits = torch.randn(len(ids), vocab, generator=torch.Generator().manual_seed(len(ids)))
    logits[torch.arange(len(ids)), torch.tensor(ids)] = 10.0
    return logits


# ---------------------------------------------------------------- greedy

#        0 (root)
#       / \
#   1:5    2:7
#    |     /  \
#   3:2  4:3  5:4
#         |
#        6:1
HAND = DraftTree([100, 5, 7, 2, 3, 4, 1], [-1, 0, 0, 1, 2, 2, 4])


def test_greedy_accepts_along_the_second_child() -> None:
    #                        row: 0  1  2  3  4  5  6
    out = tree_verify(argmax_logits([7, 0, 4, 0, 0, 6, 0]), [HAND], greedy_st(1))
    assert out == [TreeResult(accepted_nodes=[2, 5], tokens=[7, 4, 6])]  # 6: bonus at leaf 5


def test_greedy_rejects_at_the_root() -> None:
    out = tree_verify(argmax_logits([0, 5, 4, 0, 1, 6, 0]), [HAND], greedy_st(1))
    assert out == [TreeResult(accepted_nodes=[], tokens=[0])]


def test_greedy_full_path_then_bonus() -> None:
    out = tree_verify(argmax_logits([7, 0, 3, 0, 1, 0, 2]), [HAND], greedy_st(1))
    assert out == [TreeResult(accepted_nodes=[2, 4, 6], tokens=[7, 3, 1, 2])]


def test_greedy_recovers_in_the_middle() -> None:
    out = tree_verify(argmax_logits([5, 6, 3, 0, 1, 0, 2]), [HAND], greedy_st(1))
    assert out == [TreeResult(accepted_nodes=[1], tokens=[5, 6])]


def test_greedy_duplicate_siblings_take_the_first() -> None:
    tree = DraftTree([0, 5, 5, 3, 4], [-1, 0, 0, 1, 2])
    out = tree_verify(argmax_logits([5, 3, 4, 2, 2]), [tree], greedy_st(1))
    assert out[0].accepted_nodes == [1, 3] and out[0].tokens == [5, 3, 2]


def test_greedy_batch_of_trees_and_lone_roots() -> None:
    trees = [HAND, DraftTree([9], [-1]), HAND, DraftTree.chain([9, 1, 2])]
    ids = [7, 0, 4, 0, 0, 6, 0] + [3] + [0, 5, 4, 0, 1, 6, 0] + [1, 2, 6]
    out = tree_verify(argmax_logits(ids), trees, greedy_st(4))
    assert [o.tokens for o in out] == [[7, 4, 6], [3], [0], [1, 2, 6]]
    assert [o.accepted_nodes for o in out] == [[2, 5], [], [], [1, 2]]


def test_greedy_ignores_draft_probs() -> None:
    tree = DraftTree(HAND.token_ids, HAND.parents, torch.softmax(torch.randn(7, 8), -1))
    out = tree_verify(argmax_logits([7, 0, 4, 0, 0, 6, 0]), [tree], greedy_st(1))
    assert out[0].tokens == [7, 4, 6]


def test_top_k_1_sampling_is_greedy() -> None:
    logits = argmax_logits([7, 0, 3, 0, 1, 0, 2] * 2)
    out = tree_verify(logits, [HAND, HAND], plain_st(2, temperature=0.8, top_k=1))
    assert [o.tokens for o in out] == [[7, 3, 1, 2]] * 2


def test_greedy_rows_in_a_stochastic_batch() -> None:
    torch.manual_seed(0)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0), SamplingParams(temperature=0.0)]
    st = SamplingTensors.from_params(params, [None] * 3)
    logits = argmax_logits([7, 0, 4, 0, 0, 6, 0] * 2 + [7, 0, 3, 0, 1, 0, 2])
    out = tree_verify(logits, [HAND] * 3, st)
    assert out[0].tokens == [7, 4, 6] and out[2].tokens == [7, 3, 1, 2]
    assert is_root_path(HAND, out[1].accepted_nodes) and len(out[1].tokens) == len(out[1].accepted_nodes) + 1


def test_shape_checks() -> None:
    with pytest.raises(ValueError, match="rows"):
        tree_verify(torch.zeros(6, 8), [HAND], greedy_st(1))
    with pytest.raises(ValueError, match="sampling rows"):
        tree_verify(torch.zeros(7, 8), [HAND], greedy_st(2))
    with pytest.raises(ValueError, match="vocab"):
        tree_verify(torch.zeros(3, 8), [DraftTree.chain([1, 2, 3], torch.zeros(2, 5))], greedy_st(1))
    assert tree_verify(torch.zeros(0, 8), [], greedy_st(0)) == []
    with pytest.raises(ValueError, match="positions"):
        tree_verify(torch.zeros(7, 8), [HAND], SamplingTensors.from_params([SamplingParams(seed=1)]))


# ---------------------------------------------------------------- chains


def random_chains(n: int, vocab: int, seed: int) -> tuple[list[list[int]], Tensor, Tensor]:
    """Drafts (0..4 tokens each), target logits [sum(k + 1), V], draft probs [sum(k), V]."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 5, (n,), generator=gen).tolist()
    drafts = [torch.randint(0, vocab, (k,), generator=gen).tolist() for k in lengths]
    logits = torch.randn(sum(lengths) + n, vocab, generator=gen) * 2
    probs = torch.softmax(torch.randn(sum(lengths), vocab, generator=gen) * 2, -1)
    return drafts, logits, probs


def chain_trees(drafts: list[list[int]], probs: Tensor | None) -> list[DraftTree]:
    trees, row = [], 0
    for d in drafts:
        trees.append(DraftTree.chain([99] + d, None if probs is None else probs[row : row + len(d)]))
        row += len(d)
    return trees


def test_greedy_chain_equals_chain_sampler() -> None:
    drafts, logits, _ = random_chains(300, vocab=3, seed=1)  # a tiny vocab: many matches
    out = tree_verify(logits, chain_trees(drafts, None), greedy_st(300))
    expected = rejection_sample(logits, drafts, None, greedy_st(300))
    assert [o.tokens for o in out] == expected
    assert [o.accepted_nodes for o in out] == [list(range(1, len(e))) for e in expected]
    assert {len(e) for e in expected} == {1, 2, 3, 4, 5}


@pytest.mark.parametrize("with_probs", [True, False])
def test_seeded_chain_equals_chain_sampler(with_probs: bool) -> None:
    """Same seeds and positions, same keyed draws: identical outputs, position after position."""
    n = 200
    drafts, logits, probs = random_chains(n, vocab=5, seed=2)
    draft_probs = probs if with_probs else None
    st = SamplingTensors.from_params([SamplingParams(temperature=0.9, seed=s) for s in range(n)])
    trees = chain_trees(drafts, draft_probs)
    bonus = rejected = 0
    for step in range(5):  # several steps at other positions
        positions = [3 * s + 7 * step for s in range(n)]
        out = tree_verify(logits, trees, st, positions)
        expected = rejection_sample(logits, drafts, draft_probs, st, positions)
        assert [o.tokens for o in out] == expected
        bonus += sum(len(e) == len(d) + 1 for e, d in zip(expected, drafts) if d)
        rejected += sum(len(e) <= len(d) for e, d in zip(expected, drafts))
    assert bonus > 20 and rejected > 100  # both endings were compared


def _seeded_tree_run(seed: int, extra: int) -> list[int]:
    """Request 0 is seeded; `extra` unseeded requests with other trees share the batch."""
    st = SamplingTensors.from_params([SamplingParams(seed=seed)] + [SamplingParams()] * extra)
    mine = torch.randn(7, 8, generator=torch.Generator().manual_seed(7))
    probs = torch.softmax(torch.randn(7, 8, generator=torch.Generator().manual_seed(8)), -1)
    trees = [DraftTree(HAND.token_ids, HAND.parents, probs)] + [HAND, DraftTree.chain([1, 2])] * (extra // 2)
    others = torch.randn(sum(t.num_nodes for t in trees[1:]), 8)  # global RNG
    outs: list[int] = []
    for step in range(10):
        positions = [5 + 4 * step] + [step] * extra
        outs += tree_verify(torch.cat([mine, others]), trees, st, positions)[0].tokens + [-1]
    return outs


def test_seeded_request_reproducible_and_batch_independent() -> None:
    torch.manual_seed(0)
    alone = _seeded_tree_run(seed=5, extra=0)
    torch.manual_seed(1)
    assert _seeded_tree_run(seed=5, extra=6) == alone
    assert _seeded_tree_run(seed=6, extra=0) != alone


# ---------------------------------------------------------------- statistical

# Every request has the same shape: 3 children at the root, 2 under each of them.
PARENTS = [-1, 0, 0, 0, 1, 1, 2, 2, 3, 3]
DEPTH1, DEPTH2 = [1, 2, 3], [4, 5, 6, 7, 8, 9]


def chi2_pvalue(counts: Tensor, probs: Tensor) -> float:
    """Pearson chi-square p-value pooled over rows; counts, probs [G, V]. Observing a
    zero-probability cell gives 0."""
    counts = counts.double().reshape(-1, probs.shape[-1])
    probs = probs.double().reshape(counts.shape)
    if bool((counts[probs == 0] > 0).any()):
        return 0.0
    stat, df = torch.zeros((), dtype=torch.float64), 0
    for c, p in zip(counts, probs):
        if c.sum() == 0:
            continue
        live = p > 0
        expected = p[live] * c.sum()
        stat += ((c[live] - expected) ** 2 / expected).sum()
        df += int(live.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def random_dist(shape: tuple[int, ...], gen: torch.Generator) -> Tensor:
    return torch.softmax(torch.randn(*shape, generator=gen, dtype=torch.float64) * 1.5, -1)


def markov_trees(tokens: Tensor, target0: Tensor, target_next: Tensor,
                 draft_probs: Tensor | None) -> tuple[Tensor, list[DraftTree]]:
    """tokens [N, 10] per node (column 0: the root) -> target logits [N * 10, V], trees.

    The target is a Markov chain: after the root it is target0, after a node carrying
    token x it is target_next[x].
    """
    n = tokens.shape[0]
    rows = torch.cat([target0.expand(n, 1, V), target_next[tokens[:, 1:]]], 1)  # [N, 10, V]
    trees = [DraftTree(t, PARENTS, None if draft_probs is None else draft_probs[i])
             for i, t in enumerate(tokens.tolist())]
    return rows.reshape(-1, V).log().float(), trees


def pvalues(out: list[TreeResult], target0: Tensor, target_next: Tensor) -> list[float]:
    """first token ~ target0; token j+1 ~ target_next[token j] for j = 0, 1 when emitted."""
    first = torch.tensor([o.tokens[0] for o in out])
    result = [chi2_pvalue(torch.bincount(first, minlength=V), target0)]
    for j in (0, 1):
        pairs = torch.tensor([o.tokens[j : j + 2] for o in out if len(o.tokens) >= j + 2])
        joint = torch.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V).reshape(V, V)
        result.append(chi2_pvalue(joint, target_next))
    return result


def seeded_st(n: int) -> tuple[SamplingTensors, list[int]]:
    """n requests with distinct seeds at scattered positions: the sampling and the positions."""
    st = SamplingTensors.from_params([SamplingParams(seed=s) for s in range(n)])
    return st, [(s * 7919) % 1000 for s in range(n)]


def check_well_formed(out: list[TreeResult], trees: list[DraftTree]) -> None:
    for o, tree in zip(out, trees):  # every answer: a root-to-node path, then one more token
        assert is_root_path(tree, o.accepted_nodes)
        assert o.tokens[:-1] == [tree.token_ids[i] for i in o.accepted_nodes]
    lengths = torch.bincount(torch.tensor([len(o.tokens) for o in out]), minlength=4)
    assert bool((lengths[1:] > len(trees) // 20).all()), lengths  # rejections at every depth, and bonuses


def check_exact_then_broken(logits: Tensor, trees: list[DraftTree], target0: Tensor, target_next: Tensor,
                            monkeypatch: pytest.MonkeyPatch, seeded: bool = False) -> None:
    st, positions = seeded_st(len(trees)) if seeded else (plain_st(len(trees)), None)
    out = tree_verify(logits, trees, st, positions)
    check_well_formed(out, trees)
    p = pvalues(out, target0, target_next)
    assert min(p) > P_OK, p

    # The bug: a rejected child's draft is not subtracted from the residual.
    monkeypatch.setattr(tree_rejection, "residual_probs", lambda residual, draft: residual)
    p = pvalues(tree_verify(logits, trees, st, positions), target0, target_next)
    assert p[0] < P_BROKEN and p[1] < P_BROKEN, p


def one_hot_markov_case() -> tuple[Tensor, list[DraftTree], Tensor, Tensor]:
    """Deterministic (top-k style) guesses: distinct siblings, varying over requests."""
    gen = torch.Generator().manual_seed(41)
    target0, target_next = random_dist((V,), gen), random_dist((V, V), gen)
    r = torch.arange(N_TRIALS)
    a = (r % V) // 2  # 0..2: deliberately not uniform over the vocab
    depth1 = torch.stack([a, a + 1 + r % 2, a + 3], 1) % V  # [N, 3] distinct
    depth2 = torch.stack([depth1 + 1, depth1 + 3], 2).reshape(N_TRIALS, 6) % V  # [N, 6], distinct per parent
    tokens = torch.cat([torch.full((N_TRIALS, 1), 99 % V), depth1, depth2], 1)  # [N, 10]
    logits, trees = markov_trees(tokens, target0, target_next, None)
    return logits, trees, target0, target_next


def test_statistical_distinct_one_hot_children(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(31)
    logits, trees, target0, target_next = one_hot_markov_case()
    check_exact_then_broken(logits, trees, target0, target_next, monkeypatch)


def test_statistical_seeded_one_hot_children(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded rows take the keyed race: across seeds, the output follows the target."""
    logits, trees, target0, target_next = one_hot_markov_case()
    st, positions = seeded_st(N_TRIALS)
    out = tree_verify(logits, trees, st, positions)
    check_well_formed(out, trees)
    p = pvalues(out, target0, target_next)
    assert min(p) > P_OK, p

    # Bug 1: draws keyed without the position, so every depth reuses the root's exponentials.
    monkeypatch.setattr(tree_rejection, "sample_keyed",
                        lambda probs, seeds, pos: sample_keyed(probs, seeds, [positions[0]] * len(pos)))
    p = pvalues(tree_verify(logits, trees, st, positions), target0, target_next)
    assert p[1] < P_BROKEN, p
    monkeypatch.undo()

    # Bug 2: the walk also moves to a child carrying the target's argmax when the pick is elsewhere.
    carrying = tree_rejection._child_carrying

    def biased(flat: tree_rejection.FlatTrees, node: Tensor, token: Tensor) -> Tensor:
        picked = carrying(flat, node, token)  # [L]
        return torch.where(picked >= 0, picked, carrying(flat, node, logits[node].argmax(-1)))

    monkeypatch.setattr(tree_rejection, "_child_carrying", biased)
    p = pvalues(tree_verify(logits, trees, st, positions), target0, target_next)
    assert p[0] < P_BROKEN, p


def sampled_markov_case() -> tuple[Tensor, list[DraftTree], Tensor, Tensor]:
    """Children drawn i.i.d. (with replacement) from a Markov draft, with its probabilities."""
    gen = torch.Generator().manual_seed(42)
    target0, target_next = random_dist((V,), gen), random_dist((V, V), gen)
    draft0, draft_next = random_dist((V,), gen), random_dist((V, V), gen)
    depth1 = torch.multinomial(draft0.expand(N_TRIALS, V), 3, replacement=True, generator=gen)  # [N, 3]
    parent_dist = draft_next[depth1].reshape(-1, V)  # [N * 3, V]
    depth2 = torch.multinomial(parent_dist, 2, replacement=True, generator=gen).reshape(N_TRIALS, 6)
    tokens = torch.cat([torch.zeros(N_TRIALS, 1, dtype=torch.int64), depth1, depth2], 1)  # [N, 10]
    probs = torch.cat([torch.zeros(N_TRIALS, 1, V, dtype=torch.float64), draft0.expand(N_TRIALS, 3, V),
                       draft_next[depth1].repeat_interleave(2, dim=1)], 1).float()  # [N, 10, V]
    logits, trees = markov_trees(tokens, target0, target_next, probs)
    return logits, trees, target0, target_next


@pytest.mark.parametrize("seeded", [False, True])
def test_statistical_sampled_children(monkeypatch: pytest.MonkeyPatch, seeded: bool) -> None:
    """Unseeded rows draw from the global RNG; seeded ones keep the residual method with keyed uniforms."""
    torch.manual_seed(32)
    logits, trees, target0, target_next = sampled_markov_case()
    check_exact_then_broken(logits, trees, target0, target_next, monkeypatch, seeded)
