"""Recurrent Medusa heads: the block, its drafter's chains and trees, save/load."""
from __future__ import annotations

import json
from pathlib import Path
from typing import cast

import pytest
import torch

from specdec import SamplingParams
from specdec.drafters import recurrent_drafter as rcd
from specdec.drafters import recurrent_heads
from specdec.drafters.base import DraftRequest
from specdec.drafters.recurrent_drafter import RecurrentDrafter
from specdec.drafters.recurrent_heads import RecurrentHeads
from specdec.spec.tree import DraftTree

HIDDEN, VOCAB = 16, 40


def drafter(choices: list[tuple[int, ...]], num_steps: int = 3, seed: int = 0,
            vocab: torch.Tensor | None = None) -> RecurrentDrafter:
    gen = torch.Generator().manual_seed(seed)
    heads = RecurrentHeads(HIDDEN, 32, num_steps)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    lm_head = torch.randn(VOCAB, HIDDEN, generator=gen)
    embedding = torch.randn(VOCAB, HIDDEN, generator=gen)
    rows = lm_head if vocab is None else lm_head[vocab]
    return RecurrentDrafter(heads.eval(), embedding, lambda h: h.float() @ rows.T, choices, vocab)


def request(seed: int, depth: int = 3, max_nodes: int = 0, params: SamplingParams | None = None) -> DraftRequest:
    return DraftRequest(str(seed), [1, 2, 3 + seed], max_nodes or depth, depth,
                        params or SamplingParams(temperature=0.0))


def hidden_of(request: DraftRequest) -> torch.Tensor:  # [H]
    """The target hidden state the engine would have given the request (`observe`)."""
    return torch.randn(HIDDEN, generator=torch.Generator().manual_seed(100 + int(request.request_id)))


def observed(d: RecurrentDrafter, requests: list[DraftRequest]) -> list[DraftRequest]:
    for r in requests:
        d.observe_hidden(r.request_id, hidden_of(r))
    return requests


def trees(d: RecurrentDrafter, requests: list[DraftRequest]) -> list[DraftTree]:
    """The drafter's trees (it drafts trees when built for a branching config)."""
    d.branching = True
    return d.propose(observed(d, requests))


def chains(d: RecurrentDrafter, requests: list[DraftRequest]) -> list[DraftTree]:
    d.branching = False
    return d.propose(observed(d, requests))


def ranked(d: RecurrentDrafter, hidden: torch.Tensor, path: list[int]) -> list[int]:
    """Draft-vocabulary tokens by rank after reading `path` (root first), step by step."""
    state = hidden[None]
    for token in path:
        state = d.heads.step(state, d.embedding[[token]])
    order = d.compute_logits(state)[0].argsort(descending=True)
    return (order if d.vocab is None else d.vocab[order]).tolist()


def logprob(d: RecurrentDrafter, hidden: torch.Tensor, path: list[int], token: int) -> float:
    """The drafter's log-prob of `token` after reading `path`, over the draft vocabulary."""
    state = hidden[None]
    for t in path:
        state = d.heads.step(state, d.embedding[[t]])
    logprobs = torch.log_softmax(d.compute_logits(state)[0].detach().float(), dim=-1)
    column = token if d.vocab is None else int((d.vocab == token).nonzero())
    return float(logprobs[column])


@pytest.mark.parametrize("vocab", [None, torch.tensor([0, 3, 4, 7, 9, 12, 20, 21, 30, 39])])
def test_tree_nodes_are_the_ranked_guesses_after_their_own_path(vocab: torch.Tensor | None) -> None:
    choices = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (2,)]
    d = drafter(choices, vocab=vocab)
    req = request(0, max_nodes=len(choices))
    tree = trees(d, [req])[0]
    assert tree is not None
    token: dict[tuple[int, ...], int] = {(): req.token_ids[-1]}
    for c in sorted(choices, key=len):  # the drafter's node order: by depth, then priority
        token[c] = ranked(d, hidden_of(req), [token[c[:i]] for i in range(len(c))])[c[-1]]
    order = [()] + sorted(choices, key=len)
    assert tree.token_ids == [token[c] for c in order]
    assert tree.parents == [-1] + [order.index(c[:-1]) for c in order[1:]]


def test_greedy_chain_is_the_rank_zero_path_and_batching_changes_nothing() -> None:
    d = drafter([(0,), (0, 0), (0, 0, 0)])
    alone = [chains(d, [request(s)])[0].token_ids[1:] for s in range(3)]
    batched = [draft.token_ids[1:] for draft in chains(d, [request(0), request(1, depth=2), request(2)])]
    assert batched == [alone[0], alone[1][:2], alone[2]]
    tree = trees(d, [request(0, max_nodes=3)])[0]
    assert tree is not None and tree.token_ids[1:] == alone[0]


@pytest.mark.parametrize("vocab", [None, torch.arange(0, VOCAB, 3)])
def test_sampled_chain_draws_from_the_distribution_it_reports(vocab: torch.Tensor | None) -> None:
    d = drafter([(0,)], num_steps=1, vocab=vocab)
    params = SamplingParams(temperature=1.0)
    counts = torch.zeros(VOCAB)
    trials = 4000
    for _ in range(trials):
        draft = chains(d, [request(0, depth=1, params=params)])[0]
        assert draft.draft_probs is not None and draft.draft_probs.shape == (2, VOCAB)  # root row, then the draft
        counts[draft.token_ids[1]] += 1
    assert draft.draft_probs is not None
    probs = draft.draft_probs[1]
    # Chi-square over the tokens with expected count >= 5 (a wrong or stale distribution
    # is off by far more).
    expected = probs * trials
    keep = expected >= 5
    chi2 = (((counts - expected) ** 2 / expected)[keep]).sum().item()
    assert chi2 < 3 * int(keep.sum()) + 30
    assert torch.allclose(probs.sum(), torch.tensor(1.0), atol=1e-5)
    if vocab is not None:  # nothing off the draft vocabulary, and every token of it possible
        off = torch.ones(VOCAB, dtype=torch.bool).index_fill_(0, vocab, False)
        assert probs[off].sum() == 0 and counts[off].sum() == 0 and bool((probs[vocab] > 0).all())


def test_chains_unroll_past_the_trained_depth() -> None:
    d = drafter([(0,)], num_steps=2)
    req = request(0, depth=5)
    chain = chains(d, [req])[0].token_ids[1:]
    assert len(chain) == 5
    assert chain == [ranked(d, hidden_of(req), [req.token_ids[-1]] + chain[:i])[0] for i in range(5)]


def test_dynamic_tree_keeps_the_best_cumulative_guesses() -> None:
    d = drafter([(0,)], vocab=torch.tensor([0, 3, 4, 7, 9, 12, 20, 21, 30, 39]))
    d.dynamic = True
    req = request(0, depth=3, max_nodes=5)
    tree = trees(d, [req])[0]
    assert tree is not None and tree.num_drafts == 5 and tree.max_depth <= 3
    # Every node is one of its path's top-`width` next tokens, scored by cumulative
    # log-prob; a node never outscores its parent, and the best depth-1 guess left out
    # (every depth-1 candidate is generated) outscores no kept node.
    score = {0: 0.0}
    for node in range(1, tree.num_nodes):
        path = [tree.token_ids[i] for i in tree.path_to(tree.parents[node])]
        order = ranked(d, hidden_of(req), path)
        assert order.index(tree.token_ids[node]) < min(5, rcd.DYNAMIC_WIDTH)
        score[node] = score[tree.parents[node]] + logprob(d, hidden_of(req), path, tree.token_ids[node])
        assert score[node] <= score[tree.parents[node]]
    depth1 = [n for n in range(1, tree.num_nodes) if tree.parents[n] == 0]
    best = ranked(d, hidden_of(req), [req.token_ids[-1]])
    assert [tree.token_ids[n] for n in depth1] == best[:len(depth1)]
    left_out = logprob(d, hidden_of(req), [req.token_ids[-1]], best[len(depth1)])
    assert len(depth1) < 5 and all(score[n] >= left_out for n in range(1, tree.num_nodes))
    alone = [trees(d, [request(s, depth=3, max_nodes=5)])[0] for s in range(2)]
    batched = trees(d, [request(0, depth=3, max_nodes=5), request(1, depth=3, max_nodes=5)])
    assert [t.token_ids for t in batched] == [t.token_ids for t in alone]


def reference_dynamic_tree(d: RecurrentDrafter, req: DraftRequest) -> tuple[list[int], list[int]]:
    """EAGLE-2 by hand: per depth, each frontier node's `width` best next tokens; the
    `width` best new ones (cumulative log-prob) form the next frontier; the tree keeps
    the max_nodes best candidates, best-first from the root."""
    from specdec.spec.tree import best_first

    width = min(rcd.DYNAMIC_WIDTH, req.num_draft_tokens)
    paths: list[list[int]] = [[req.token_ids[-1]]]  # by node id; id 0 the root
    scores, parents, frontier = [0.0], [], [0]
    for _ in range(req.max_depth):
        new = []
        for node in frontier:
            for token in ranked(d, hidden_of(req), paths[node])[:width]:
                parents.append(node)
                paths.append(paths[node] + [token])
                scores.append(scores[node] + logprob(d, hidden_of(req), paths[node], token))
                new.append(len(paths) - 1)
        frontier = sorted(new, key=lambda n: -scores[n])[:width]
    kept = best_first(parents, scores[1:], req.num_draft_tokens)
    index = {0: 0} | {k + 1: i + 1 for i, k in enumerate(kept)}
    return [paths[0][-1]] + [paths[k + 1][-1] for k in kept], [-1] + [index[parents[k]] for k in kept]


@pytest.mark.parametrize("seed, max_nodes", [(0, 3), (1, 6), (2, 10)])
def test_dynamic_tree_equals_a_reference_expansion(seed: int, max_nodes: int) -> None:
    d = drafter([(0,)], seed=seed)
    d.dynamic = True
    req = request(seed, depth=4, max_nodes=max_nodes)
    tree = trees(d, [req])[0]
    assert tree is not None and (tree.token_ids, tree.parents) == reference_dynamic_tree(d, req)
    assert tree.max_depth >= 3  # deep nodes are kept, so the frontier choice matters


def test_depth_and_node_budget_are_respected() -> None:
    choices = [(0,), (0, 0), (1,), (0, 0, 0), (0, 1)]
    d = drafter(choices)
    tree = trees(d, [request(0, depth=2, max_nodes=4)])[0]
    assert tree is not None and tree.max_depth <= 2 and tree.num_drafts == 4
    blind = DraftRequest("x", [1, 2], 3, 3, SamplingParams(temperature=0.0))
    assert d.propose([blind])[0].token_ids == [2]  # no hidden state yet: the root alone


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    model = drafter([(0,)]).heads
    recurrent_heads.save(model, tmp_path, {"tree_choices": [[0]]}, torch.tensor([2, 5, 7]))
    loaded, vocab = recurrent_heads.load(tmp_path)
    assert vocab is not None and vocab.tolist() == [2, 5, 7]
    config = json.loads((tmp_path / recurrent_heads.CONFIG).read_text())
    assert config["head_type"] == "recurrent" and config["tree_choices"] == [[0]]
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor.to(torch.float16).float())


def test_load_rejects_medusa_one_heads(tmp_path: Path) -> None:
    (tmp_path / recurrent_heads.CONFIG).write_text(json.dumps({"num_heads": 3, "hidden_size": 16}))
    with pytest.raises(ValueError, match="head_type"):
        recurrent_heads.load(tmp_path)


def test_draft_vocabulary_is_the_most_generated_tokens() -> None:
    from specdec.drafters.train_medusa import FlatData
    from specdec.drafters.train_recurrent_heads import draft_vocab

    class Data:  # the one field draft_vocab reads
        token = torch.tensor([5, 5, 5, 2, 2, 9, 1, 1, 1, 1])

    assert draft_vocab(cast(FlatData, Data()), 3, 12).tolist() == [1, 2, 5]


def test_training_learns_a_deterministic_continuation() -> None:
    """On a toy stream where each token fixes the next, a few hundred steps make step 0
    (which reads x_{t+1}) guess x_{t+2} almost always."""
    import argparse

    from specdec.drafters.train_medusa import FlatData
    from specdec.drafters.train_recurrent_heads import step_ranks, train

    gen = torch.Generator().manual_seed(0)
    embed = torch.randn(VOCAB, HIDDEN, generator=gen)
    records = []
    for r in range(8):
        tokens = [(3 * r + 7 * i) % VOCAB for i in range(30)]  # x_{i+1} = x_i + 7 (mod V)
        top_idx = torch.tensor([[tokens[i + 1], (tokens[i + 1] + 1) % VOCAB] for i in range(29)], dtype=torch.int32)
        records.append({"prompt_len": 1, "tokens": torch.tensor(tokens, dtype=torch.int32),
                        "hidden": torch.randn(29, HIDDEN, generator=gen).half(),
                        "top_val": torch.tensor([[8.0, 0.0]] * 29).half(), "top_idx": top_idx})
    data = FlatData(records, 2)
    model = RecurrentHeads(HIDDEN, 32, 2)
    args = argparse.Namespace(lr=3e-2, warmup=5, steps=300, batch_positions=64, loss_topk=2, negatives=8,
                              feature_weight=0.0)
    with torch.random.fork_rng():  # train samples positions from the global RNG
        torch.manual_seed(0)
        train(model, data, embed, args)
    ranks = step_ranks(model.eval(), data, embed, top_k=4)  # [N, 2]
    valid = data.future[0] >= 0
    assert ranks.shape == (len(data), 2)
    assert (ranks[valid, 0] == 0).float().mean() > 0.9


def test_choices_without_their_parent_are_dropped() -> None:
    d = drafter([(0,), (1, 0), (0, 0), (1,), (0, 0, 0)])  # (1, 0) comes before its parent
    tree = trees(d, [request(0, max_nodes=5)])[0]
    assert tree is not None and tree.num_drafts == 4 and tree.depths == [0, 1, 1, 2, 3]
