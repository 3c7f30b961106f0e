"""The EAGLE-3 drafter (drafters/eagle3.py) on the tiny target and head: its dynamic trees
against a dense re-computation of the head (one causal sequence per path, plain SDPA),
and its KV in the paged cache rolled back with the target's.

Features are a fixed random table per position: the drafter takes whatever the target
captured, so any values test its bookkeeping."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from specdec.drafters.base import DraftRequest
from specdec.drafters.eagle3 import Eagle3Drafter
from specdec.drafters.eagle3_head import Eagle3Head, causal_attention
from specdec.llm import LLM
from specdec.sampling_params import SamplingParams
from specdec.spec.tree import DraftTree

FEATURES = torch.randn(96, 3 * 64, generator=torch.Generator().manual_seed(5))  # [position, 3H]
GREEDY = SamplingParams(temperature=0.0)


def drafter_for(model_dir: Path, head_dir: Path, topk: int, depth: int = 4, nodes: int = 16) -> Eagle3Drafter:
    llm = LLM(str(model_dir), max_model_len=128, speculative_config={
        "method": "eagle3", "model": str(head_dir), "num_speculative_tokens": depth, "num_tree_nodes": nodes,
        "eagle_topk": topk})
    drafter = llm.engine.drafter
    assert isinstance(drafter, Eagle3Drafter)
    return drafter


@pytest.fixture(scope="module")
def drafter(tiny_model_dir: Path, tiny_eagle3_dir: Path) -> Eagle3Drafter:
    return drafter_for(tiny_model_dir, tiny_eagle3_dir, topk=3)


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(3, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def draft(drafter: Eagle3Drafter, request_id: str, token_ids: list[int], nodes: int, depth: int) -> DraftTree:
    return drafter.propose([DraftRequest(request_id, token_ids, nodes, depth, GREEDY)])[0]


# ---- the dense reference ----------------------------------------------------------------------


def path_logprobs(head: Eagle3Head, token_ids: list[int], path: list[int]) -> torch.Tensor:  # -> [Vd]
    """The head's log-probs after the root and `path` (draft tokens), recomputed as one
    causal sequence: the context rows (feature of p, token p + 1, at p), then a row per
    path token reading its predecessor's output, at the next position."""
    n = len(token_ids) - 1  # context rows: positions 0 .. n - 1
    ids = token_ids[1:]
    features = head.project(FEATURES[:n])
    positions = list(range(n))
    out = head.layer(head.embed(torch.tensor(ids)), features, torch.tensor(positions), causal_attention)
    for token in path:  # a row at a time: each reads the output of the row before it
        ids, positions = ids + [token], positions + [positions[-1] + 1]
        features = torch.cat([features, out[-1:]])
        out = head.layer(head.embed(torch.tensor(ids)), features, torch.tensor(positions), causal_attention)
    return torch.log_softmax(head.logits(out[-1:]).float(), -1)[0]


def top_tokens(head: Eagle3Head, logprobs: torch.Tensor, k: int) -> list[int]:
    return head.to_target_ids(logprobs.topk(k).indices).tolist()


def path_of(tree: DraftTree, node: int) -> list[int]:
    return [tree.token_ids[n] for n in tree.path_to(node)[1:]]


# ---- trees ------------------------------------------------------------------------------------


@torch.inference_mode()
def test_every_candidate_at_width_two(tiny_model_dir: Path, tiny_eagle3_dir: Path) -> None:
    """Width 2, depth 3 and room for every candidate (2 + 2 * 2 + 2 * 2 = 10): the tree is
    the whole EAGLE-2 expansion, which the dense reference rebuilds node for node."""
    narrow = drafter_for(tiny_model_dir, tiny_eagle3_dir, topk=2)
    head = narrow.head
    ids = tokens(1, 12)
    narrow.observe_features("w2", 0, FEATURES[:11])
    tree = draft(narrow, "w2", ids, nodes=16, depth=3)
    assert tree.num_drafts == 10 and tree.max_depth == 3
    chances = tree.chances
    assert chances is not None
    for depth in (1, 2):  # EAGLE-2: the 2 likeliest nodes of a depth expand
        level = [n for n in range(tree.num_nodes) if tree.depths[n] == depth]
        assert sorted(n for n in level if tree.children(n)) == sorted(sorted(level, key=lambda n: -chances[n])[:2])
    for node in range(tree.num_nodes):
        if tree.children(node) or node == 0:
            expected = top_tokens(head, path_logprobs(head, ids, path_of(tree, node)), 2)
            assert sorted(tree.token_ids[c] for c in tree.children(node)) == sorted(expected)


@torch.inference_mode()
def test_tree_chances_are_path_probabilities_under_the_budget(drafter: Eagle3Drafter) -> None:
    head = drafter.head
    ids = tokens(2, 20)
    drafter.observe_features("budget", 0, FEATURES[:19])
    tree = draft(drafter, "budget", ids, nodes=9, depth=4)
    drafter.free("budget")
    chances = tree.chances
    assert chances is not None and tree.draft_probs is None  # top-k picks: verified one-hot
    assert tree.num_drafts == 9 and tree.max_depth <= 4 and chances[0] == 1.0
    assert all(a >= b for a, b in zip(chances[1:], chances[2:]))  # best first
    for node in range(1, tree.num_nodes):
        parent = tree.parents[node]
        logprobs = path_logprobs(head, ids, path_of(tree, parent))
        draft_id = int((head.d2t + torch.arange(len(head.d2t)) == tree.token_ids[node]).nonzero()[0])
        assert math.isclose(chances[node], chances[parent] * math.exp(float(logprobs[draft_id])), rel_tol=1e-4)
        siblings = [tree.token_ids[c] for c in tree.children(parent)]
        assert len(set(siblings)) == len(siblings) <= 3
        assert set(siblings) <= set(top_tokens(head, logprobs, 3))
    for depth in range(1, tree.max_depth + 1):  # only a depth's 3 likeliest nodes expand
        level = [n for n in range(tree.num_nodes) if tree.depths[n] == depth]
        for node in (n for n in level if tree.children(n)):
            assert sum(chances[m] > chances[node] for m in level) < 3


@torch.inference_mode()
def test_a_chain_is_the_top_one_path(tiny_model_dir: Path, tiny_eagle3_dir: Path) -> None:
    chain_drafter = drafter_for(tiny_model_dir, tiny_eagle3_dir, topk=1, nodes=0)
    head = chain_drafter.head
    ids = tokens(3, 9)
    chain_drafter.observe_features("c", 0, FEATURES[:8])
    tree = draft(chain_drafter, "c", ids, nodes=4, depth=4)
    assert tree.is_chain and tree.num_drafts == 4
    for depth in range(4):
        assert tree.token_ids[depth + 1] == top_tokens(head, path_logprobs(head, ids, tree.token_ids[1:depth + 1]),
                                                       1)[0]


@torch.inference_mode()
def test_requests_without_their_features_get_the_root_alone(drafter: Eagle3Drafter) -> None:
    ids = tokens(4, 10)
    assert draft(drafter, "none", ids, 8, 3).num_drafts == 0
    drafter.observe_features("short", 0, FEATURES[:5])  # positions 5 .. 8 not seen yet
    tree = draft(drafter, "short", ids, 8, 3)
    assert tree.num_drafts == 0 and tree.chances == [1.0]
    drafter.free("short")


# ---- the head's KV, rolled back -------------------------------------------------------------------


def same_tree(a: DraftTree, b: DraftTree) -> None:
    assert a.token_ids == b.token_ids and a.parents == b.parents
    assert a.chances is not None and b.chances is not None
    torch.testing.assert_close(torch.tensor(a.chances), torch.tensor(b.chances), rtol=1e-4, atol=1e-6)


@torch.inference_mode()
def test_drafting_after_rejections_equals_drafting_from_scratch(drafter: Eagle3Drafter) -> None:
    ids = tokens(6, 11)
    drafter.observe_features("r", 0, FEATURES[:10])
    first = draft(drafter, "r", ids, 12, 4)
    # The target accepts the first two nodes of the likeliest path, then emits its own token.
    chances = first.chances
    assert chances is not None
    path = first.path_to(max(range(first.num_nodes), key=lambda n: (first.depths[n] >= 2, chances[n])))[1:3]
    ids += [first.token_ids[n] for n in path] + [7]
    drafter.observe_features("r", 10, FEATURES[10:13])  # the root's row and the two accepted nodes'
    second = draft(drafter, "r", ids, 12, 4)
    ids += [second.token_ids[second.children(0)[0]] ^ 1]  # everything rejected: a token it did not draft
    drafter.observe_features("r", 13, FEATURES[13:14])
    after = draft(drafter, "r", ids, 12, 4)
    drafter.observe_features("fresh", 0, FEATURES[:14])
    same_tree(after, draft(drafter, "fresh", ids, 12, 4))
    for request_id in ("r", "fresh"):
        drafter.free(request_id)
    assert drafter.block_manager.num_free_blocks == drafter.block_manager.num_blocks


@torch.inference_mode()
def test_recomputed_and_skipped_positions(drafter: Eagle3Drafter) -> None:
    """A preempted request's positions come again (its rows are run again); positions a
    prefix cache hit skipped never come (the head's context starts after them)."""
    ids = tokens(8, 16)
    drafter.observe_features("p", 0, FEATURES[:10])
    draft(drafter, "p", ids[:11], 8, 3)
    drafter.observe_features("p", 0, FEATURES[:15])  # recomputed from the start, with more tokens
    drafter.observe_features("q", 0, FEATURES[:15])
    same_tree(draft(drafter, "p", ids, 8, 3), draft(drafter, "q", ids, 8, 3))
    drafter.observe_features("p", 6, FEATURES[6:15])  # recomputed from the middle
    drafter.observe_features("gap", 6, FEATURES[6:15])  # a request whose first 6 positions hit the cache
    gapped = draft(drafter, "gap", ids, 8, 3)
    assert gapped.num_drafts == 8
    same_tree(draft(drafter, "p", ids, 8, 3), draft(drafter, "q", ids, 8, 3))
    drafter.observe_features("skip", 0, FEATURES[:3])
    drafter.observe_features("skip", 6, FEATURES[6:15])  # positions 3 .. 5 never come: start over at 6
    same_tree(draft(drafter, "skip", ids, 8, 3), gapped)
    for request_id in ("p", "q", "gap", "skip"):
        drafter.free(request_id)
    assert drafter.block_manager.num_free_blocks == drafter.block_manager.num_blocks


# ---- sampling over EAGLE-3 trees ----------------------------------------------------------------------


def test_sampled_verification_of_eagle3_trees_follows_the_target(tiny_model_dir: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Temperature 1 over real EAGLE-3 trees (a head drafting among tokens 0..5, top-2,
    depth 3): many requests, each a tree over a first-order Markov target, verified in one
    batch; chi-square tests find the emitted tokens distributed as the target, and find a
    verifier that does not take a rejected guess out of the residual (the control) wrong.
    (tests/spec/test_tree_rejection.py's method, on the head's trees.)"""
    from specdec.spec import tree_rejection
    from specdec.spec.tree_rejection import tree_verify
    from tests.fixtures import make_eagle3_head
    from tests.spec.test_tree_rejection import N_TRIALS, P_BROKEN, P_OK, V, is_root_path, plain_st, pvalues, random_dist

    head_dir = make_eagle3_head(tmp_path, tiny_model_dir, draft_vocab_size=V)
    small = drafter_for(tiny_model_dir, head_dir, topk=2, depth=3, nodes=8)
    shapes = []
    with torch.inference_mode():
        for seed in range(24):
            ids = tokens(100 + seed, 8)
            small.observe_features(f"s{seed}", 0, FEATURES[seed : seed + 7])
            shapes.append(draft(small, f"s{seed}", ids, nodes=8, depth=3))
    assert all(t.num_drafts == 8 and t.max_depth == 3 and max(t.token_ids[1:]) < V for t in shapes)
    assert len({tuple(t.token_ids[1:]) + tuple(t.parents) for t in shapes}) > 4  # the trees vary
    gen = torch.Generator().manual_seed(43)
    target0, target_next = random_dist((V,), gen), random_dist((V, V), gen)
    trees = [DraftTree([0, *t.token_ids[1:]], t.parents, chances=t.chances) for t in shapes]
    trees = [trees[i % len(trees)] for i in range(N_TRIALS)]
    rows = [torch.cat([target0[None], target_next[torch.tensor(t.token_ids[1:])]]) for t in trees]  # [9, V] each
    logits = torch.cat(rows).log().float()
    torch.manual_seed(44)
    out = tree_verify(logits, trees, plain_st(len(trees)), None)
    for o, tree in zip(out, trees):  # every answer: a root-to-node path, then one more token
        assert is_root_path(tree, o.accepted_nodes) and o.tokens[:-1] == [tree.token_ids[i] for i in o.accepted_nodes]
    lengths = torch.bincount(torch.tensor([len(o.tokens) for o in out]), minlength=5)
    assert bool((lengths[1:] > 20).all()) and lengths[4] > 0, lengths  # rejections at every depth, and bonuses
    p = pvalues(out, target0, target_next)
    assert min(p) > P_OK, p

    monkeypatch.setattr(tree_rejection, "residual_probs", lambda residual, draft: residual)
    p = pvalues(tree_verify(logits, trees, plain_st(len(trees)), None), target0, target_next)
    assert min(p[0], p[1]) < P_BROKEN, p


@torch.inference_mode()
def test_a_request_holds_a_bounded_number_of_features(drafter: Eagle3Drafter,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Past MAX_PENDING_ROWS features not yet run, the oldest go and the head's context
    starts at the newest kept."""
    from specdec.drafters import eagle3

    monkeypatch.setattr(eagle3, "MAX_PENDING_ROWS", 6)
    ids = tokens(9, 11)
    drafter.observe_features("long", 0, FEATURES[:5])
    drafter.observe_features("long", 5, FEATURES[5:10])  # 10 pending: positions 4 .. 9 kept
    drafter.observe_features("newest", 4, FEATURES[4:10])
    same_tree(draft(drafter, "long", ids, 8, 3), draft(drafter, "newest", ids, 8, 3))
    for request_id in ("long", "newest"):
        drafter.free(request_id)
