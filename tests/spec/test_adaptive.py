"""Adaptive speculation: the cost model, the per-step choice of draft lengths, and that
the engine stays lossless while the choice changes from step to step."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from specdec.llm import LLM
from specdec.spec.adaptive import (
    LOOKUP_EVERY,
    LOOKUP_PATIENCE,
    OPTION_EVERY,
    PROBE_EVERY,
    AdaptiveSpeculation,
    CostModel,
)
from specdec.spec.policy import DraftLimit, DraftOption, FixedSpeculation, SpeculationPolicy, StepReport
from specdec.spec.tree import DraftTree
from tests.helpers import assert_all_blocks_free, greedy, random_prompts, token_ids


class FixedCost(CostModel):
    """A cost model that ignores measurements, so the choices do not depend on timing."""

    def observe_forward(self, num_tokens: int, seconds: float) -> None:
        pass

    def observe_draft(self, depth: int, seconds: float) -> None:
        pass


def flat_cost() -> CostModel:
    """A forward costs the same for any number of tokens: every draft pays."""
    return CostModel([1, 64], [0.01, 0.01])


def linear_cost() -> CostModel:
    """Each query token costs as much as the first: no draft below certainty pays."""
    return CostModel([1, 64], [0.01, 0.64])


def limit(request_id: str, depth: int, nodes: int = 0) -> DraftLimit:
    request: Any = SimpleNamespace(request_id=request_id)
    return DraftLimit(request, nodes or depth, depth)


def grant(planner: SpeculationPolicy, limits: list[DraftLimit], base_tokens: int | None = None) -> list[int]:
    """The planner's grants for a step of decoding requests (one known token each)."""
    count = len(limits)
    return planner.grant(limits, count if base_tokens is None else base_tokens, count)


def test_cost_model_fits_measured_steps() -> None:
    cost = CostModel([1, 8, 64], [0.010, 0.017, 0.080])
    assert cost.forward_time(1) < cost.forward_time(8) < cost.forward_time(64)  # the prior's line
    for step in range(200):  # a batch of 16: each extra query token costs 3 ms over 50 ms
        tokens = 16 + step % 25
        cost.observe_forward(tokens, 0.002 + 0.003 * tokens)
    cost.observe_forward(2048, 5.0)  # a long prefill step does not bend the line
    assert cost.forward_time(16) == pytest.approx(0.050, rel=0.02)
    assert cost.forward_time(40) == pytest.approx(0.122, rel=0.02)
    for _ in range(100):
        cost.observe_draft(4, 0.008)
    assert cost.draft_time(2) == pytest.approx(0.004, rel=1e-3)


def test_cost_line_is_fitted_in_relative_error() -> None:
    """A start-up calibration whose large forwards cost more per token than small ones
    (as measured on 2 CPU cores) prices a verify row by the small ones: equal weights put
    the intercept at 1.6 ms and a row at 3.5 ms, near a whole 9 ms decode."""
    cost = CostModel([1, 2, 4, 8, 16, 32, 64], [0.0091, 0.011, 0.0157, 0.0277, 0.0485, 0.115, 0.224])
    intercept, slope = cost.line()
    assert intercept > 0.004 and slope < 0.0035
    assert cost.forward_time(2) == pytest.approx(0.011, rel=0.15)


def test_flat_cost_keeps_every_draft() -> None:
    planner = AdaptiveSpeculation(flat_cost(), whole_drafts=False)
    assert planner.grant([limit("a", 5), limit("b", 3)], 3, 3) == [5, 3]


def test_linear_cost_turns_speculation_off_then_probes() -> None:
    planner = AdaptiveSpeculation(linear_cost(), whole_drafts=False)
    for step in range(1, PROBE_EVERY + 1):
        expected = 1 if step == PROBE_EVERY else 0  # a one-token probe keeps its rates current
        assert grant(planner, [limit("a", 4)]) == [expected]


def test_better_requests_get_drafts_first() -> None:
    planner = AdaptiveSpeculation(CostModel([1, 2, 64], [0.01, 0.0115, 0.2]), whole_drafts=False)
    for _ in range(10):
        planner.observe_verify("good", 4, 4, 4)
        planner.observe_verify("bad", 4, 0, 4)
    bad, good = grant(planner, [limit("bad", 4), limit("good", 4)])
    assert bad == 0 and good >= 1


def test_acceptance_runs_make_later_tokens_worth_more() -> None:
    """All-or-nothing verifies (an n-gram match either holds or not): half the first
    tokens are accepted, but once one is, the rest follow, so deep drafts still pay."""
    planner = AdaptiveSpeculation(CostModel([1, 8, 64], [0.010, 0.012, 0.1]), whole_drafts=False)
    for _ in range(10):
        planner.observe_verify("runs", 5, 5, 5)
        planner.observe_verify("runs", 5, 0, 5)
    counts = planner.stats.get("runs")
    assert counts.first == pytest.approx(0.5, abs=0.1) and counts.later > 0.9
    assert counts.gain(5) > 0.4
    assert grant(planner, [limit("runs", 5)]) == [5]


def test_whole_drafts_are_all_or_nothing() -> None:
    planner = AdaptiveSpeculation(CostModel([1, 64], [0.01, 0.012]), whole_drafts=True)
    assert grant(planner, [limit("t", 4, nodes=16)]) == [16]
    slow = AdaptiveSpeculation(linear_cost(), whole_drafts=True)
    assert grant(slow, [limit("t", 4, nodes=16)]) == [0]


def test_prefill_rows_count_in_the_cost() -> None:
    """A long prefill chunk in the same forward makes a few more draft rows nearly free."""
    cost = CostModel([1, 64, 512], [0.01, 0.02, 0.6])
    planner = AdaptiveSpeculation(cost, whole_drafts=False)
    grant(planner, [limit("a", 4)])
    assert planner.grant([limit("a", 4)], 61, 1)[0] >= 1  # 60 prefill tokens join the step


@pytest.mark.parametrize("method", ["ngram", "draft_model", "draft_tree"])
def test_adaptive_engine_is_lossless(tiny_model_dir: Any, tiny_draft_dir: Any, method: str) -> None:
    configs: dict[str, dict[str, Any]] = {
        "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
        "draft_model": {"method": "draft_model", "num_speculative_tokens": 3, "model": str(tiny_draft_dir)},
        "draft_tree": {"method": "draft_model", "num_speculative_tokens": 3, "num_tree_nodes": 6,
                       "model": str(tiny_draft_dir)},
    }
    plain = LLM(str(tiny_model_dir), max_model_len=256, speculative_config=None)
    spec = LLM(str(tiny_model_dir), max_model_len=256, speculative_config={**configs[method], "adaptive": True})
    planner = spec.engine.policy
    assert isinstance(planner, AdaptiveSpeculation)
    planner.cost = FixedCost([1, 64], [0.01, 0.02])  # likely drafts pay, unlikely ones not
    for seed in range(4):
        prompts = random_prompts(seed, 4)
        assert token_ids(spec.generate(prompts, greedy())) == token_ids(plain.generate(prompts, greedy()))
    metrics = spec.get_metrics()
    assert metrics["num_drafts"] > 0
    assert sum(metrics["num_accepted_tokens_per_pos"]) == metrics["num_accepted_tokens"]
    assert not planner.stats.requests  # finished requests are forgotten
    assert_all_blocks_free(spec)


def test_calibration_measures_a_rising_curve(tiny_model_dir: Any) -> None:
    spec = LLM(str(tiny_model_dir), max_model_len=256,
               speculative_config={"method": "ngram", "num_speculative_tokens": 4, "adaptive": True})
    policy = spec.engine.policy
    assert isinstance(policy, AdaptiveSpeculation)
    cost = policy.cost
    assert len(cost.seconds) == len(cost.sizes) and all(s > 0 for s in cost.seconds)
    assert cost.seconds[-1] > cost.seconds[0]


def test_probes_are_rarer_in_bigger_batches() -> None:
    planner = AdaptiveSpeculation(linear_cost(), whole_drafts=False)
    probes = 0
    for _ in range(4 * PROBE_EVERY):
        probes += sum(grant(planner, [limit(f"r{i}", 4) for i in range(4)]))
    assert probes == 4  # each of the 4 requests once in 4 * PROBE_EVERY steps


def test_scored_drafts_get_every_limit_where_a_sure_guess_pays_and_the_cost_is_learnt() -> None:
    cheap_rows = CostModel([1, 2, 4, 8, 16], [0.010, 0.014, 0.022, 0.038, 0.070])  # a row: 4 ms of a 10 ms step
    policy = AdaptiveSpeculation(cheap_rows, whole_drafts=True, scored=True)
    assert grant(policy, [limit("a", 4, 8), limit("b", 2)]) == [8, 2]
    # sixteen requests: a row of even a certain guess costs more than the token it adds
    assert grant(policy, [limit(f"r{i}", 4) for i in range(16)]) == [0] * 16
    before = policy.cost.forward_time(1)
    for _ in range(20):
        policy.observe_step(StepReport(num_query_tokens=1, decode_only=True, max_draft_depth=0,
                                       draft_seconds=0.0, forward_seconds=0.05))
    assert policy.cost.forward_time(1) > 2 * before  # the measured steps move the line


def scored(chances: list[float]) -> DraftTree:
    """A chain whose nodes carry these chances (after the root's 1)."""
    return DraftTree(list(range(len(chances) + 1)), list(range(-1, len(chances))), chances=[1.0, *chances])


def test_select_verifies_the_batchs_likeliest_nodes_worth_their_rows() -> None:
    cheap_rows = CostModel([1, 2, 4, 8, 16], [0.010, 0.014, 0.022, 0.038, 0.070])  # a row: 4 ms
    policy = AdaptiveSpeculation(cheap_rows, whole_drafts=True, scored=True)
    likely, unlikely = scored([0.99, 0.99, 0.98]), scored([0.2, 0.1])
    forced = DraftTree.chain([7, 8, 9])  # unscored (a grammar's forced tokens): verified whole
    kept = policy.select([likely, unlikely, forced])
    assert [t.num_drafts for t in kept] == [3, 0, 2]
    assert kept[0].chances == likely.chances
    everything = FixedSpeculation().select([likely, unlikely])
    assert everything == [likely, unlikely]


def test_select_keeps_a_long_likely_copy_whole() -> None:
    """The bar a node must clear is the best rate a cut reaches, not the rate of every
    node: a long copy's sixteen near-certain guesses are all worth a verify row."""
    cost = CostModel([1, 2, 4, 8, 16], [0.010, 0.014, 0.022, 0.038, 0.070])
    policy = AdaptiveSpeculation(cost, whole_drafts=True, scored=True)
    assert policy.select([scored([0.99] * 16)])[0].num_drafts == 16
    assert policy.select([scored([0.1])])[0].num_drafts == 0


def test_choose_runs_an_option_only_where_its_gain_beats_its_time_and_rows() -> None:
    cost = CostModel([1, 2, 4, 8], [0.010, 0.0105, 0.0115, 0.0135])  # a row: a twentieth of a decode
    policy = AdaptiveSpeculation(cost, whole_drafts=True, scored=True)
    trees = [scored([]), scored([0.9, 0.9])]
    cheap = DraftOption({0: 1.5, 1: -0.5}, {0: 2, 1: 0}, lambda count: 0.0005 * count)
    assert policy.choose(trees, cheap) == [0]  # request 1 would lose by it
    slow = DraftOption({0: 1.5}, {0: 2}, lambda count: 0.05 * count)  # five forwards' time
    assert policy.choose(trees, slow) == []
    assert FixedSpeculation().choose(trees, slow) == [0]  # without a cost model: wherever it gains


def test_a_declined_option_is_weighed_again_only_every_few_steps() -> None:
    """Offering and weighing the heads cost a lookup's time: once declined, the policy skips
    weighing them for OPTION_EVERY - 1 drafting steps; while one is taken, every step."""
    cost = CostModel([1, 2, 4, 8], [0.010, 0.0105, 0.0115, 0.0135])
    policy = AdaptiveSpeculation(cost, whole_drafts=True, scored=True)
    trees = [scored([])]
    slow = DraftOption({0: 1.5}, {0: 2}, lambda count: 0.05 * count)
    cheap = DraftOption({0: 1.5}, {0: 2}, lambda count: 0.0005 * count)
    assert policy.weighs_options() and policy.choose(trees, slow) == []
    for _ in range(2):
        assert [policy.weighs_options() for _ in range(OPTION_EVERY)] == [False] * (OPTION_EVERY - 1) + [True]
        assert policy.choose(trees, slow) == []
    assert policy.choose(trees, cheap) == [0]
    assert all(policy.weighs_options() for _ in range(OPTION_EVERY))
    assert FixedSpeculation().weighs_options()


def test_adaptive_hybrid_drafting_is_cut_by_the_policy(tiny_model_dir: Any) -> None:
    spec = LLM(str(tiny_model_dir), max_model_len=256,
               speculative_config={"method": "hybrid", "num_speculative_tokens": 4, "adaptive": True})
    policy = spec.engine.policy
    assert isinstance(policy, AdaptiveSpeculation) and policy.scored


def test_scored_lookups_thin_out_where_nothing_is_verified_and_resume_at_once() -> None:
    cheap_rows = CostModel([1, 2, 4, 8, 16], [0.010, 0.014, 0.022, 0.038, 0.070])
    policy = AdaptiveSpeculation(cheap_rows, whole_drafts=True, scored=True)
    looked = [grant(policy, [limit("r", 4)])[0] > 0 for _ in range(10)]
    assert looked == [True] * LOOKUP_PATIENCE + [i % LOOKUP_EVERY == 0 for i in range(LOOKUP_PATIENCE + 1, 11)]
    policy.observe_verify("r", 2, 1, 2)  # a draft was verified: every step again
    assert all(grant(policy, [limit("r", 4)])[0] > 0 for _ in range(LOOKUP_PATIENCE))
