"""Hybrid drafting: merged trees, the choice of drafters per request, what it learns from
the target's answers, and the whole engine lossless with it (greedy and seeded sampling)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from specdec import SamplingParams
from specdec.config import SpeculativeConfig
from specdec.drafters.base import DraftRequest
from specdec.drafters.hybrid import MATCH_BAND_STARTS, HybridDrafter, _Calibration, _Guess, _Offer, match_band
from specdec.drafters.suffix import SuffixDraft, SuffixDrafter
from specdec.llm import LLM
from specdec.spec.adaptive import AdaptiveSpeculation, CostModel
from specdec.spec.policy import FixedSpeculation, SpeculationPolicy
from specdec.spec.tree import DraftTree, ScoredDraft, merge_drafts
from tests.helpers import assert_all_blocks_free, greedy, random_prompts, token_ids


def scored(tokens: list[int], parents: list[int], probs: list[float]) -> ScoredDraft:
    return ScoredDraft(DraftTree(tokens, parents), probs)


def paths(tree: DraftTree) -> set[tuple[int, ...]]:
    return {tuple(tree.token_ids[n] for n in tree.path_to(i)[1:]) for i in range(1, tree.num_nodes)}


# ---- merge_drafts ---------------------------------------------------------------------------


def test_merge_unites_paths_and_keeps_the_higher_chance() -> None:
    a = scored([9, 1, 2, 3], [-1, 0, 1, 0], [1.0, 0.8, 0.6, 0.1])  # 9 -> 1 -> 2, 9 -> 3
    b = scored([9, 1, 4], [-1, 0, 1], [1.0, 0.5, 0.4])  # 9 -> 1 -> 4
    merged = merge_drafts(9, [(a, 1.0), (b, 1.0)], max_drafts=10)
    assert paths(merged.tree) == {(1,), (1, 2), (3,), (1, 4)}
    assert merged.probs[1] == 0.8  # the shared node (1,) keeps a's chance, and comes first
    assert merged.tree.token_ids[0] == 9 and merged.tree.draft_probs is None


def test_merge_weights_rank_the_drafts_best_first_within_the_budget() -> None:
    a = scored([9, 1, 2], [-1, 0, 1], [1.0, 0.9, 0.8])
    b = scored([9, 5, 6], [-1, 0, 1], [1.0, 0.9, 0.8])
    assert paths(merge_drafts(9, [(a, 0.5), (b, 1.0)], max_drafts=2).tree) == {(5,), (5, 6)}
    assert paths(merge_drafts(9, [(a, 1.0), (b, 0.5)], max_drafts=3).tree) == {(1,), (1, 2), (5,)}


def test_merge_cuts_nodes_below_the_least_chance_with_their_subtrees() -> None:
    a = scored([9, 1, 2, 3], [-1, 0, 1, 2], [1.0, 0.9, 0.05, 0.04])
    b = scored([9, 7], [-1, 0], [1.0, 0.3])
    merged = merge_drafts(9, [(a, 1.0), (b, 1.0)], max_drafts=10, min_prob=0.1)
    assert paths(merged.tree) == {(1,), (7,)}
    assert merge_drafts(9, [(a, 1.0)], max_drafts=10, min_prob=0.95).tree.num_drafts == 0


def test_merge_refuses_sampled_drafts_and_other_roots() -> None:
    sampled = ScoredDraft(DraftTree.chain([9, 1], torch.full((1, 4), 0.25)), [1.0, 0.5])
    with pytest.raises(ValueError, match="one-hot"):
        merge_drafts(9, [(sampled, 1.0)], max_drafts=4)
    with pytest.raises(ValueError, match="share the root"):
        merge_drafts(8, [(scored([9, 1], [-1, 0], [1.0, 0.5]), 1.0)], max_drafts=4)


# ---- the drafter ----------------------------------------------------------------------------


@dataclass
class FakeHeads:
    """Stands in for RecurrentDrafter.scored_trees: always guesses `guess` with chance 0.9."""

    guess: list[int]
    calls: list[list[str]] = field(default_factory=list)

    reads_hidden = True

    def has_hidden(self, request_id: str) -> bool:
        return True  # as if the target had run every request

    def ready(self, request: DraftRequest) -> bool:
        return True

    def observe_hidden(self, request_id: str, hidden: torch.Tensor) -> None:
        pass

    def free(self, request_id: str) -> None:
        pass

    def scored_trees(self, requests: list[DraftRequest]) -> list[ScoredDraft]:
        self.calls.append([r.request_id for r in requests])
        drafts = []
        for r in requests:
            chain = self.guess[: r.max_depth]
            drafts.append(ScoredDraft(DraftTree.chain([r.token_ids[-1], *chain]), [1.0] + [0.9] * len(chain)))
        return drafts


def ask(request_id: str, token_ids: list[int], budget: int = 6) -> DraftRequest:
    return DraftRequest(request_id, token_ids, budget, budget, SamplingParams())


def hybrid(heads: FakeHeads | None) -> HybridDrafter:
    spec = SpeculativeConfig(method="hybrid", num_speculative_tokens=6, num_tree_nodes=6, suffix_min_prob=0.0)
    return HybridDrafter(SuffixDrafter(spec), heads)  # type: ignore[arg-type]


def suffix_only(depth: int = 6) -> HybridDrafter:
    return HybridDrafter(SuffixDrafter(SpeculativeConfig(method="suffix", num_speculative_tokens=depth,
                                                         num_tree_nodes=depth, suffix_min_prob=0.0)), None)


def step(drafter: HybridDrafter, requests: list[DraftRequest], cost: CostModel | None = None) -> list[DraftTree]:
    """One engine step's drafting: the drafter proposes, the policy chooses where the heads
    run, then selects the nodes worth verifying (all of them without a cost model)."""
    policy: SpeculationPolicy = (AdaptiveSpeculation(cost, whole_drafts=True, scored=True) if cost is not None
                                 else FixedSpeculation())
    trees = drafter.propose(requests)
    option = drafter.option(requests, trees)
    chosen = policy.choose(trees, option) if option is not None else []
    return policy.select(drafter.extend(requests, trees, chosen) if chosen else trees)


def test_without_heads_it_drafts_what_suffix_decoding_drafts() -> None:
    context = [1, 2, 3, 4, 5, 1, 2, 3]
    drafter = hybrid(None)
    spec = SpeculativeConfig(method="suffix", num_speculative_tokens=6, num_tree_nodes=6, suffix_min_prob=0.0)
    expected = SuffixDrafter(spec).propose([ask("r", context)])[0]
    assert step(drafter, [ask("r", context)])[0].token_ids == expected.token_ids == [3, 4, 5, 1]


def test_heads_run_where_suffix_decoding_finds_nothing_and_are_merged_in() -> None:
    heads = FakeHeads([50, 51, 52])
    drafter = hybrid(heads)
    text = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    tree = step(drafter, [ask("open", [10, 11, 12]), ask("copy", [*text, *text[:8]])])
    assert heads.calls == [["open"]]  # the copying request's suffix draft is worth more than the heads'
    assert tree[0].token_ids == [12, 50, 51, 52]
    assert tree[1].token_ids[:4] == [8, 9, 1, 2]


def test_it_learns_from_the_committed_tokens() -> None:
    heads = FakeHeads([50, 51, 52])
    drafter = hybrid(heads)
    context = [10, 11, 12]
    for count in range(12):  # the target never takes the heads' guesses
        step(drafter, [ask("r", context)])
        context = context + [60 + count]
    assert drafter.heads_calibration.factor < 0.2
    assert drafter.heads_worth["r"].mean < 0.1
    calls = len(heads.calls)
    step(drafter, [ask("r", context + [1, 2, 3, 1, 2])])  # and now a weak suffix match beats them
    assert len(heads.calls) == calls
    drafter.free("r")
    assert "r" not in drafter.offers and "r" not in drafter.heads_worth


def test_accepted_suffix_guesses_raise_its_calibration() -> None:
    drafter = hybrid(None)
    context = [1, 2, 3, 4, 1, 2]
    short = drafter.suffix_calibrations[match_band(2)][0]  # first guesses after 2-token matches
    short.accepted = 0.1  # as if it had been wrong before
    before = short.factor
    for _ in range(5):
        tree = drafter.propose([ask("r", context)])[0]
        context = context + tree.token_ids[1:3]  # the target takes two guesses each step
    assert short.factor > before


def test_cut_suffix_guesses_are_judged_too_so_a_bad_start_does_not_stop_drafting() -> None:
    """A calibration that fell so low that every suffix guess is cut still learns, from
    the tokens the target commits, that the guesses were right, and drafting resumes."""
    cost = CostModel([1, 2, 4, 8], [0.010, 0.015, 0.025, 0.045])  # a verify row costs half a decode
    drafter = suffix_only()
    drafter.suffix_calibrations = [[_Calibration(accepted=0.1, predicted=4.0) for _ in band]  # as if wrong at first
                                   for band in drafter.suffix_calibrations]
    text = list(range(1, 16))
    context = text + [1, 2]
    assert step(drafter, [ask("r", context)], cost)[0].num_drafts == 0  # every guess cut
    for token in text[2:]:  # the target copies the text, one plain decode step at a time
        context = context + [token]
        step(drafter, [ask("r", context)], cost)
    # the match grew from 2 to 15 tokens as the copy went on, eight steps of them 8 or longer
    assert drafter.suffix_calibrations[match_band(8)][0].factor > 0.5
    assert step(drafter, [ask("r", text + text[:12])], cost)[0].num_drafts > 0


def test_each_match_band_keeps_its_own_calibration() -> None:
    """Wrong guesses after short matches (open text) do not cut the guesses that continue
    a long match (text being copied), and the other way round."""
    assert [match_band(n) for n in (2, 3, 4, 7, 8, 15, 16, 30)] == [0, 1, 2, 2, 3, 3, 4, 4]
    assert len(MATCH_BAND_STARTS) == 4
    cost = CostModel([1, 2, 4, 8], [0.010, 0.015, 0.025, 0.045])
    drafter = suffix_only()
    drafter.suffix_calibrations[match_band(2)][0] = _Calibration(accepted=0.1, predicted=4.0)  # short ones failed
    text = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]
    assert step(drafter, [ask("short", [*text, 20, 3, 4])], cost)[0].num_drafts == 0  # a 2-token match: cut
    long = step(drafter, [ask("long", [*text, 20, 1, 2, 3, 4, 5, 6, 7, 8])], cost)[0]  # an 8-token match
    assert long.token_ids[1:3] == [9, 10]


def test_a_guess_is_judged_once_decided_and_only_where_its_parent_was_taken() -> None:
    drafter = hybrid(None)
    band = match_band(8)
    guesses = [_Guess((3,), 0.9), _Guess((3, 9), 0.5), _Guess((3, 4, 5), 1.0), _Guess((7, 8, 9), 0.5)]
    drafter.offers["r"] = [_Offer(2, [guesses, []], band)]
    before = [_Calibration(c.accepted, c.predicted) for c in drafter.suffix_calibrations[band]]
    drafter.propose([ask("r", [1, 2, 3, 3, 4])])  # two tokens known after the root: 3, 4
    first, second, deeper = drafter.suffix_calibrations[band]
    # (3,) right; (3, 9) wrong after its parent was taken; (7, 8, 9) decided, but its parent
    # was not taken, so it says nothing of how a copy goes on; (3, 4, 5) waits for its token
    assert (first.accepted, first.predicted) == pytest.approx((0.98 * before[0].accepted + 1,
                                                               0.98 * before[0].predicted + 0.9))
    assert (second.accepted, second.predicted) == pytest.approx((0.98 * before[1].accepted,
                                                                 0.98 * before[1].predicted + 0.5))
    assert (deeper.accepted, deeper.predicted) == (before[2].accepted, before[2].predicted)
    drafter.propose([ask("r", [1, 2, 3, 3, 4, 5])])  # and now it is right
    assert (deeper.accepted, deeper.predicted) == pytest.approx((0.98 * before[2].accepted + 1,
                                                                 0.98 * before[2].predicted + 1.0))


def test_a_suffix_guess_chance_is_its_parents_times_its_calibrated_frequency() -> None:
    """A copy that holds on keeps most of its chance deep down (the cells' factors are per
    depth given the parent), and a branch's share of its parent's count scales its chance."""
    drafter = hybrid(None)
    cells = drafter.suffix_calibrations[match_band(8)]
    for cell, factor in zip(cells, (0.8, 0.9, 0.95), strict=True):
        cell.accepted, cell.predicted = factor, 1.0
    tree = DraftTree([0, 1, 2, 3, 4, 5], [-1, 0, 1, 2, 3, 2])  # 1 2 3 4 and a branch 1 2 5
    found = SuffixDraft(ScoredDraft(tree, [1.0, 1.0, 1.0, 0.5, 0.5, 0.5]), match_length=8)
    chances = drafter._calibrated(found).probs
    assert chances == pytest.approx([1.0, 0.8, 0.8 * 0.9, 0.72 * 0.5 * 0.95, 0.72 * 0.5 * 0.95 * 0.95,
                                     0.72 * 0.5 * 0.95])


def test_a_long_copy_whose_guesses_are_all_likely_is_verified_whole() -> None:
    """The bar a node must clear is the best rate a cut reaches, not the rate of every
    node: a long copy's sixteen near-certain guesses are all worth a verify row."""
    cost = CostModel([1, 2, 4, 8, 16], [0.010, 0.014, 0.022, 0.038, 0.070])  # a row: 4 ms
    drafter = suffix_only(16)
    for cell in drafter.suffix_calibrations[match_band(24)]:
        cell.accepted = cell.predicted = 1.0
    text = list(range(1, 41))
    assert step(drafter, [ask("r", text + text[:24], budget=16)], cost)[0].token_ids[1:] == text[24:40]


def test_the_cost_model_keeps_heads_off_when_their_time_outweighs_their_worth() -> None:
    cost = CostModel([1, 8], [0.01, 0.012])
    heads = FakeHeads([50, 51])
    drafter = hybrid(heads)
    drafter.heads_seconds.add(1, 0.05)  # the heads took five forwards' time
    drafter.heads_seconds.add(2, 0.06)
    step(drafter, [ask("r", [10, 11, 12])], cost)
    assert heads.calls == []


def test_the_heads_first_run_is_not_timed() -> None:
    """The first run sets up kernels and buffers: timed, its cost priced the heads out of
    every later step, so they were never timed again (one run a session, mt_bench)."""
    heads = FakeHeads([50, 51])
    drafter = hybrid(heads)
    step(drafter, [ask("r", [10, 11, 12])])
    assert heads.calls == [["r"]] and drafter.heads_seconds.w == 0
    step(drafter, [ask("r", [10, 11, 12, 50])])
    assert len(heads.calls) == 2 and drafter.heads_seconds.w > 0


def test_the_heads_guesses_are_verified_where_they_pay_and_suffix_decoding_found_nothing() -> None:
    cost = CostModel([1, 2, 4, 8], [0.010, 0.0105, 0.0115, 0.0135])  # a row: a twentieth of a decode
    heads = FakeHeads([50, 51])  # chance 0.9 each, calibrated at 1
    drafter = hybrid(heads)
    tree = step(drafter, [ask("r", [10, 11, 12])], cost)[0]
    assert heads.calls == [["r"]]
    assert tree.token_ids == [12, 50, 51]

# ---- the engine -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain(tiny_model_dir: Path) -> LLM:
    return LLM(str(tiny_model_dir), max_model_len=256, speculative_config=None)


@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_hybrid_is_lossless(plain: LLM, tiny_model_dir: Path, tiny_recurrent_dir: Path, adaptive: bool) -> None:
    config = {"method": "hybrid", "num_speculative_tokens": 4, "num_tree_nodes": 8, "model": str(tiny_recurrent_dir),
              "adaptive": adaptive}
    spec = LLM(str(tiny_model_dir), max_model_len=256, speculative_config=config)
    for seed in range(4):
        prompts = random_prompts(seed, 4)
        assert token_ids(spec.generate(prompts, greedy())) == token_ids(plain.generate(prompts, greedy()))
    assert spec.get_metrics()["num_drafts"] > 0
    assert_all_blocks_free(spec)


def test_hybrid_with_chunked_prefill_and_preemption(plain: LLM, tiny_model_dir: Path, tiny_recurrent_dir: Path) -> None:
    from tests.helpers import block_bytes

    prompts = random_prompts(100, 6)
    expected = token_ids(plain.generate(prompts, greedy()))
    config = {"method": "hybrid", "num_speculative_tokens": 4, "num_tree_nodes": 6, "model": str(tiny_recurrent_dir)}
    spec = LLM(str(tiny_model_dir), max_model_len=128, max_num_batched_tokens=24,
               kv_cache_memory=9 * block_bytes(plain), speculative_config=config)
    assert token_ids(spec.generate(prompts, greedy())) == expected
    assert spec.get_metrics()["num_preemptions"] > 0 and spec.get_metrics()["num_drafts"] > 0
    assert_all_blocks_free(spec)
    assert spec.engine.drafter.offers == {} and spec.engine.drafter.suffix.contexts == {}  # type: ignore[union-attr]


def test_hybrid_refuses_heads_that_are_not_recurrent(tiny_model_dir: Path, tiny_medusa_dir: Path) -> None:
    with pytest.raises(ValueError, match="recurrent Medusa heads"):
        LLM(str(tiny_model_dir), speculative_config={"method": "hybrid", "model": str(tiny_medusa_dir)})


# ---- sampling through a tree that mixes drafters ------------------------------------------------


def mixed_trees(n: int) -> list[DraftTree]:
    """Per request a suffix-style chain and a heads-style branching tree merged into one:
    shared first tokens for some requests, distinct for others, 2 to 3 levels deep."""
    trees = []
    for r in range(n):
        v = V_MIXED
        chain = scored([0, r % v, (r + 1) % v, (r // 3) % v], [-1, 0, 1, 2], [1.0, 0.7, 0.5, 0.3])
        a, b = (r // 2) % v, (r // 2 + 1 + r % 3) % v
        heads = scored([0, a, b, (a + 2) % v, (b + 4) % v], [-1, 0, 0, 1, 2], [1.0, 0.6, 0.3, 0.4, 0.2])
        trees.append(merge_drafts(0, [(chain, 1.0), (heads, 0.8)], max_drafts=6).tree)
    return trees


V_MIXED = 6


def test_sampling_through_mixed_trees_follows_the_target(monkeypatch: pytest.MonkeyPatch) -> None:
    """The emitted tokens of trees merged from two drafters follow a Markov target (chi-square,
    as tests/spec/test_tree_rejection.py does for one drafter), and a verifier that forgets the
    residual update is caught by the same check."""
    from specdec.sampler import SamplingTensors
    from specdec.spec import tree_rejection
    from specdec.spec.tree_rejection import tree_verify
    from tests.spec.test_tree_rejection import P_BROKEN, P_OK, pvalues, random_dist

    n = 20_000
    torch.manual_seed(33)
    gen = torch.Generator().manual_seed(43)
    target0, target_next = random_dist((V_MIXED,), gen), random_dist((V_MIXED, V_MIXED), gen)
    trees = mixed_trees(n)
    assert len({tuple(t.parents) for t in trees}) >= 3  # the merge made trees of several shapes
    rows = [target0 if i == 0 else target_next[t.token_ids[i]] for t in trees for i in range(t.num_nodes)]
    logits = torch.stack(rows).log().float()  # [G, V]
    st = SamplingTensors.from_params([SamplingParams(temperature=1.0)] * n, [None] * n)
    out = tree_verify(logits, trees, st)
    assert sum(len(o.tokens) >= 3 for o in out) > n // 20  # accepted paths of two guesses and more
    p = pvalues(out, target0, target_next)
    assert min(p) > P_OK, p
    monkeypatch.setattr(tree_rejection, "residual_probs", lambda residual, draft: residual)
    p = pvalues(tree_verify(logits, trees, st), target0, target_next)
    assert p[0] < P_BROKEN and p[1] < P_BROKEN, p
