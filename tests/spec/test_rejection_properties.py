"""Property tests for the chain and tree rejection samplers (hypothesis).

Random small batches (vocab 2..8, up to 4 requests, up to 4 drafts or 8 tree nodes),
mixing greedy, temperature, top-k and top-p rows, seeded and unseeded, with and without
draft distributions. Whatever the input, the output must be well formed; on greedy rows
it must be exactly the longest matching prefix (or tree path) plus the target argmax;
on seeded sampled rows with one-hot drafts it must be exactly what plain decoding with
the same seed emits at those positions; tokens outside the target's support are never
emitted; a draft equal to the target is always accepted. The exact output distribution is tested statistically elsewhere
(tests/spec/test_rejection.py, tests/spec/test_tree_rejection.py).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import Tensor

from specdec.sampler import SamplingTensors, logits_to_probs
from specdec.sampling_params import SamplingParams
from specdec.spec.rejection import rejection_sample
from specdec.spec.tree import DraftTree
from specdec.spec.tree_rejection import TreeResult, tree_verify

settings.register_profile("specdec-samplers", derandomize=True, database=None, deadline=None, max_examples=100,
                          suppress_health_check=[HealthCheck.too_slow])
SAMPLERS = settings.get_profile("specdec-samplers")

GREEDY = SamplingParams(temperature=0.0)
TOP_1 = SamplingParams(temperature=1.0, top_k=1)  # the stochastic path with a one-token target
MODES = [GREEDY, SamplingParams(temperature=1.0), SamplingParams(temperature=0.5),
         SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=0.8, top_p=0.7), TOP_1]


@dataclass
class Batch:
    vocab: int
    logits: Tensor  # [T, V] target rows, request by request
    params: list[SamplingParams]
    seeds: list[int | None]
    positions: list[int]  # [N] the position each request's first row decides (seeded rows' keys)

    def sampling(self) -> SamplingTensors:
        return SamplingTensors.from_params([replace(p, seed=s) for p, s in zip(self.params, self.seeds)])

    def probs(self, rows: Sequence[int], params: SamplingParams) -> Tensor:
        """[len(rows), V] the target distributions of the given rows under params."""
        st_ = SamplingTensors.from_params([params] * len(rows), [None] * len(rows))
        return logits_to_probs(self.logits[list(rows)], st_)


def argmax(logits: Tensor, row: int) -> int:
    return int(logits[row].argmax())


def keyed(batch: Batch, request: int) -> bool:
    """Sampled with a seed: the verifiers must reproduce plain decoding there."""
    return batch.seeds[request] is not None and not batch.params[request].greedy


def plain_token(batch: Batch, request: int, row: int, position: int) -> int:
    """What plain decoding (a root-only verify) of the request emits from `row` at `position`."""
    st_ = SamplingTensors.from_params([replace(batch.params[request], seed=batch.seeds[request])])
    return rejection_sample(batch.logits[row : row + 1], [[]], None, st_, [position])[0][0]


@st.composite
def batch_setup(draw: st.DrawFn, num_rows: list[int]) -> Batch:
    """Target logits for requests with the given row counts, and each one's sampling."""
    vocab = draw(st.integers(2, 8))
    scale = draw(st.sampled_from([0.3, 2.0, 8.0]))  # flat to peaked targets
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    logits = torch.randn(sum(num_rows), vocab, generator=gen) * scale
    n = len(num_rows)
    params = draw(st.lists(st.sampled_from(MODES), min_size=n, max_size=n))
    seeds = draw(st.lists(st.none() | st.integers(0, 2**32), min_size=n, max_size=n))
    positions = draw(st.lists(st.integers(0, 4096), min_size=n, max_size=n))
    return Batch(vocab, logits, params, seeds, positions)


# ---- chain ----------------------------------------------------------------------------------


@dataclass
class Chains:
    batch: Batch
    drafts: list[list[int]]
    draft_probs: Tensor | None  # [D, V]

    @property
    def starts(self) -> list[int]:
        """First target row of each request."""
        out, row = [], 0
        for d in self.drafts:
            out.append(row)
            row += len(d) + 1
        return out


@st.composite
def chains(draw: st.DrawFn) -> Chains:
    lengths = draw(st.lists(st.integers(0, 4), min_size=1, max_size=4))
    batch = draw(batch_setup([k + 1 for k in lengths]))
    drafts, row = [], 0
    for k in lengths:
        # Each draft token agrees with the target argmax or is any token: long accepted
        # prefixes and early rejections both come up.
        agree = draw(st.lists(st.booleans(), min_size=k, max_size=k))
        other = draw(st.lists(st.integers(0, batch.vocab - 1), min_size=k, max_size=k))
        drafts.append([argmax(batch.logits, row + j) if a else o for j, (a, o) in enumerate(zip(agree, other))])
        row += k + 1
    draft_probs = None
    if draw(st.booleans()):
        gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
        draft_probs = torch.softmax(torch.randn(sum(lengths), batch.vocab, generator=gen) * 2, dim=-1)
    return Chains(batch, drafts, draft_probs)


def greedy_chain(logits: Tensor, start: int, drafts: list[int]) -> list[int]:
    """Reference: accept while the draft equals the target argmax, then emit the argmax."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == argmax(logits, start + accepted):
        accepted += 1
    return drafts[:accepted] + [argmax(logits, start + accepted)]


def run_chains(case: Chains) -> list[list[int]]:
    return rejection_sample(case.batch.logits, case.drafts, case.draft_probs, case.batch.sampling(),
                            case.batch.positions)


@SAMPLERS
@given(case=chains())
def test_chain_output_is_well_formed(case: Chains) -> None:
    out = run_chains(case)
    assert len(out) == len(case.drafts)
    for tokens, drafts in zip(out, case.drafts):
        accepted = len(tokens) - 1
        assert 0 <= accepted <= len(drafts)
        assert tokens[:accepted] == drafts[:accepted]  # only a prefix of the drafts is kept
        assert all(0 <= t < case.batch.vocab for t in tokens)


@SAMPLERS
@given(case=chains())
def test_chain_greedy_rows_accept_exactly_the_matching_prefix(case: Chains) -> None:
    out = run_chains(case)
    for tokens, drafts, start, params in zip(out, case.drafts, case.starts, case.batch.params):
        # top_k=1 goes through the stochastic path, but its target is the argmax alone.
        if params in (GREEDY, TOP_1):
            assert tokens == greedy_chain(case.batch.logits, start, drafts)


@SAMPLERS
@given(case=chains())
def test_chain_seeded_one_hot_rows_emit_plain_decoding(case: Chains) -> None:
    out = rejection_sample(case.batch.logits, case.drafts, None, case.batch.sampling(), case.batch.positions)
    for i, (tokens, drafts, start) in enumerate(zip(out, case.drafts, case.starts)):
        if not keyed(case.batch, i):
            continue
        expected: list[int] = []
        while True:  # plain decoding's token at each position, while the drafts agree
            j = len(expected)
            expected.append(plain_token(case.batch, i, start + j, case.batch.positions[i] + j))
            if j == len(drafts) or drafts[j] != expected[-1]:
                break
        assert tokens == expected


@SAMPLERS
@given(case=chains())
def test_chain_never_emits_a_token_the_target_excludes(case: Chains) -> None:
    out = run_chains(case)
    for tokens, start, params in zip(out, case.starts, case.batch.params):
        if params.top_p < 1.0:
            continue  # the top-p cut sits on float sums: recomputing it here may differ by an ulp
        support = case.batch.probs(range(start, start + len(tokens)), params) > 0  # [len, V]
        assert all(bool(support[j, t]) for j, t in enumerate(tokens))


@SAMPLERS
@given(case=chains(), temperature=st.sampled_from([0.5, 1.0]))
def test_chain_draft_equal_to_target_is_always_accepted(case: Chains, temperature: float) -> None:
    params = SamplingParams(temperature=temperature)
    batch = replace(case.batch, params=[params] * len(case.drafts))
    draft_rows = [s + j for s, d in zip(case.starts, case.drafts) for j in range(len(d))]
    out = rejection_sample(batch.logits, case.drafts, batch.probs(draft_rows, params), batch.sampling(),
                           batch.positions)
    assert [tokens[:-1] for tokens in out] == case.drafts


# ---- tree -----------------------------------------------------------------------------------


@dataclass
class Trees:
    batch: Batch
    trees: list[DraftTree]

    @property
    def starts(self) -> list[int]:
        out, row = [], 0
        for tree in self.trees:
            out.append(row)
            row += tree.num_nodes
        return out


@st.composite
def tree_shapes(draw: st.DrawFn) -> list[int]:
    """Parents of a random tree in topological order (root first)."""
    size = draw(st.integers(1, 8))
    return [-1] + [draw(st.integers(0, i - 1)) for i in range(1, size)]


@st.composite
def trees(draw: st.DrawFn) -> Trees:
    shapes = draw(st.lists(tree_shapes(), min_size=1, max_size=4))
    batch = draw(batch_setup([len(p) for p in shapes]))
    with_probs = draw(st.booleans())
    out, row = [], 0
    for parents in shapes:
        tokens = []
        for node, parent in enumerate(parents):
            # A child agrees with the argmax of its parent's row, or is any token (siblings
            # may repeat a token: greedy must then take the first of them).
            agree = node > 0 and draw(st.booleans())
            tokens.append(argmax(batch.logits, row + parent) if agree else draw(st.integers(0, batch.vocab - 1)))
        probs = None
        if with_probs:
            gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
            probs = torch.softmax(torch.randn(len(parents), batch.vocab, generator=gen) * 2, dim=-1)
        out.append(DraftTree(tokens, parents, probs))
        row += len(parents)
    return Trees(batch, out)


def greedy_walk(logits: Tensor, start: int, tree: DraftTree) -> tuple[list[int], int]:
    """Reference: move to the first child carrying the argmax; emit the argmax where none does."""
    path: list[int] = []
    node = 0
    while True:
        target = argmax(logits, start + node)
        child = next((c for c in tree.children(node) if tree.token_ids[c] == target), None)
        if child is None:
            return path, target
        path.append(child)
        node = child


def run_trees(case: Trees) -> list[TreeResult]:
    return tree_verify(case.batch.logits, case.trees, case.batch.sampling(), case.batch.positions)


@SAMPLERS
@given(case=trees())
def test_tree_output_is_well_formed(case: Trees) -> None:
    out = run_trees(case)
    assert len(out) == len(case.trees)
    for result, tree in zip(out, case.trees):
        path = result.accepted_nodes
        assert 0 <= len(path) <= tree.max_depth
        assert path == tree.path_to(path[-1])[1:] if path else True  # a path down from the root
        assert result.tokens[:-1] == [tree.token_ids[i] for i in path]
        assert len(result.tokens) == len(path) + 1
        assert all(0 <= t < case.batch.vocab for t in result.tokens)


@SAMPLERS
@given(case=trees())
def test_tree_greedy_rows_follow_the_argmax_path(case: Trees) -> None:
    out = run_trees(case)
    for result, tree, start, params in zip(out, case.trees, case.starts, case.batch.params):
        if params in (GREEDY, TOP_1):
            path, final = greedy_walk(case.batch.logits, start, tree)
            assert (result.accepted_nodes, result.tokens) == (path, [tree.token_ids[i] for i in path] + [final])


@SAMPLERS
@given(case=trees())
def test_tree_seeded_one_hot_rows_emit_plain_decoding(case: Trees) -> None:
    one_hot = [DraftTree(t.token_ids, t.parents) for t in case.trees]
    out = tree_verify(case.batch.logits, one_hot, case.batch.sampling(), case.batch.positions)
    for i, (result, tree, start) in enumerate(zip(out, one_hot, case.starts)):
        if not keyed(case.batch, i):
            continue
        path: list[int] = []
        node = 0
        while True:  # plain decoding's token at each depth; follow the first child carrying it
            token = plain_token(case.batch, i, start + node, case.batch.positions[i] + len(path))
            child = next((c for c in tree.children(node) if tree.token_ids[c] == token), None)
            if child is None:
                break
            path.append(child)
            node = child
        assert (result.accepted_nodes, result.tokens) == (path, [tree.token_ids[c] for c in path] + [token])


@SAMPLERS
@given(case=trees())
def test_tree_never_emits_a_token_the_target_excludes(case: Trees) -> None:
    out = run_trees(case)
    for result, tree, start, params in zip(out, case.trees, case.starts, case.batch.params):
        if params.top_p < 1.0:
            continue  # see the chain test
        rows = [start + i for i in [0, *result.accepted_nodes]]  # the row each token is drawn from
        support = case.batch.probs(range(start, start + tree.num_nodes), params) > 0  # [N, V]
        assert all(bool(support[row - start, t]) for row, t in zip(rows, result.tokens))


@SAMPLERS
@given(case=trees(), temperature=st.sampled_from([0.5, 1.0]))
def test_tree_draft_equal_to_target_accepts_the_first_children(case: Trees, temperature: float) -> None:
    # Each node drawn from exactly its parent's target distribution: the first child is
    # always accepted, so the walk goes down first children to a leaf.
    params = SamplingParams(temperature=temperature)
    batch = replace(case.batch, params=[params] * len(case.trees))
    same = []
    for tree, start in zip(case.trees, case.starts):
        target = batch.probs(range(start, start + tree.num_nodes), params)  # [N, V]
        rows = torch.tensor([max(p, 0) for p in tree.parents])  # the root row is unused
        same.append(DraftTree(tree.token_ids, tree.parents, target[rows]))
    out = tree_verify(batch.logits, same, batch.sampling(), batch.positions)
    for result, tree in zip(out, same):
        path: list[int] = []
        node = 0
        while tree.children(node):
            node = tree.children(node)[0]
            path.append(node)
        assert result.accepted_nodes == path
