"""Tests for specdec.spec.rejection: greedy cases, seeds, and exactness of the output distribution.

The statistical tests run many independent requests in one batch and check, with a
chi-square goodness-of-fit test, that the emitted tokens follow the target distribution.
Each one also runs a deliberately broken sampler (the residual replaced by the plain
target distribution, a classic bug; for the keyed race of seeded rows, draws keyed
without the position) and asserts that the same check rejects it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor

import specdec.spec.rejection as rejection
from specdec.sampler import SamplingTensors, sample_keyed
from specdec.sampling_params import SamplingParams
from specdec.spec.rejection import rejection_sample, residual_probs

V = 6  # vocab of the statistical tests
N_TRIALS = 40_000  # requests per statistical batch
P_OK = 1e-3  # a correct sampler must pass with p above this (seeds are fixed)
P_BROKEN = 1e-6  # the broken control must fall below this



def chi2_pvalue(counts: Tensor, probs: Tensor) -> float:
    """Pearson chi-square p-value, pooled over rows (one goodness-of-fit test per row).

    counts, probs: [G, V]. Observing a zero-probability cell gives 0.
    """
    counts = counts.double().reshape(-1, probs.shape[-1])  # [G, V]
    probs = probs.double().reshape(counts.shape)  # [G, V]
    if bool((counts[probs == 0] > 0).any()):
        return 0.0
    stat, df = torch.zeros((), dtype=torch.float64), 0
    for c, p in zip(counts, probs):
        live = p > 0
        if c.sum() == 0:
            continue
        expected = p[live] * c.sum()
        stat += ((c[live] - expected) ** 2 / expected).sum()
        df += int(live.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def greedy_st(n: int) -> SamplingTensors:
    return SamplingTensors.from_params([SamplingParams(temperature=0.0)] * n, [None] * n)


def argmax_logits(ids: list[int], vocab: int = 8) -> Tensor:
    """[len(ids), vocab] logits whose argmax is ids[row]."""
    logits = torch.randn(len(ids), vocab, generator=torch.Generator().manual_seed(len(ids)))
    logits[torch.arange(len(ids)), torch.tensor(ids)] = 10.0
    return logits


def break_residual(monkeypatch: pytest.MonkeyPatch) -> None:
    """The classic bug: resample from the target instead of the residual at a rejection."""
    monkeypatch.setattr(rejection, "residual_probs", lambda target, draft: target)


# ---------------------------------------------------------------- greedy


def test_greedy_all_accepted_gives_bonus() -> None:
    out = rejection_sample(argmax_logits([3, 1, 4, 5]), [[3, 1, 4]], None, greedy_st(1))
    assert out == [[3, 1, 4, 5]]


def test_greedy_first_rejected_gives_recovered_argmax() -> None:
    out = rejection_sample(argmax_logits([2, 1, 4, 5]), [[3, 1, 4]], None, greedy_st(1))
    assert out == [[2]]


def test_greedy_mismatch_in_the_middle() -> None:
    out = rejection_sample(argmax_logits([3, 1, 7, 5]), [[3, 1, 4]], None, greedy_st(1))
    assert out == [[3, 1, 7]]


def test_greedy_mixed_batch_with_empty_drafts() -> None:
    drafts = [[], [1, 2], [], [5], [0, 0, 0]]
    target = [[6], [1, 2, 3], [4], [2, 7], [0, 0, 1, 7]]
    logits = argmax_logits([t for row in target for t in row])
    out = rejection_sample(logits, drafts, None, greedy_st(5))
    assert out == [[6], [1, 2, 3], [4], [2], [0, 0, 1]]


def test_greedy_ignores_draft_probs() -> None:
    draft_probs = torch.softmax(torch.randn(2, 8), -1)
    out = rejection_sample(argmax_logits([1, 6, 2]), [[1, 2]], draft_probs, greedy_st(1))
    assert out == [[1, 6]]


def test_no_drafts_anywhere() -> None:
    logits = argmax_logits([4, 0, 7])
    assert rejection_sample(logits, [[], [], []], None, greedy_st(3)) == [[4], [0], [7]]
    assert rejection_sample(logits, [[], [], []], torch.empty(0, 8), greedy_st(3)) == [[4], [0], [7]]
    st = SamplingTensors.from_params([SamplingParams(top_k=1)] * 3, [None] * 3)
    assert rejection_sample(logits, [[], [], []], None, st) == [[4], [0], [7]]


def test_greedy_rows_in_a_stochastic_batch() -> None:
    torch.manual_seed(0)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.0)]
    st = SamplingTensors.from_params(params, [None] * 3)
    logits = argmax_logits([3, 1, 4, 5, 2, 2, 1, 6])
    out = rejection_sample(logits, [[3, 2], [5], [2, 0]], None, st)
    assert out[0] == [3, 1] and out[2] == [2, 1]
    assert 1 <= len(out[1]) <= 2


def test_shape_checks() -> None:
    with pytest.raises(ValueError, match="rows"):
        rejection_sample(torch.zeros(4, 8), [[1, 2]], None, greedy_st(1))
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(torch.zeros(3, 8), [[1, 2]], torch.zeros(3, 8), greedy_st(1))
    with pytest.raises(ValueError, match="sampling rows"):
        rejection_sample(torch.zeros(3, 8), [[1, 2]], None, greedy_st(2))
    seeded = SamplingTensors.from_params([SamplingParams(seed=1)])
    with pytest.raises(ValueError, match="positions"):
        rejection_sample(torch.zeros(3, 8), [[1, 2]], None, seeded)
    with pytest.raises(ValueError, match="positions"):
        rejection_sample(torch.zeros(3, 8), [[1, 2]], None, seeded, [0, 1])
    seeded_greedy = SamplingTensors.from_params([SamplingParams(seed=1, temperature=0.0)])
    assert rejection_sample(torch.zeros(3, 8), [[0, 0]], None, seeded_greedy) == [[0, 0, 0]]  # no draws, no positions


# ---------------------------------------------------------------- residual


def test_residual_probs() -> None:
    target = torch.tensor([[0.5, 0.3, 0.2], [0.2, 0.3, 0.5], [0.5, 0.3, 0.2]])
    draft = torch.tensor([[0.2, 0.6, 0.2], [0.2, 0.3, 0.5], [0.0, 0.0, 0.0]])
    out = residual_probs(target, draft)
    torch.testing.assert_close(out[0], torch.tensor([1.0, 0.0, 0.0]))  # only token 0 has surplus
    torch.testing.assert_close(out[1], target[1])  # no residual mass: falls back to the target
    torch.testing.assert_close(out[2], target[2])  # zero draft (bonus row): the target


def test_residual_one_hot_zeroes_the_draft_token() -> None:
    target = torch.tensor([[0.1, 0.6, 0.3]])
    out = residual_probs(target, torch.tensor([[0.0, 1.0, 0.0]]))
    torch.testing.assert_close(out, torch.tensor([[0.25, 0.0, 0.75]]))


# ---------------------------------------------------------------- seeds


def _seeded_run(seed: int, extra: int) -> list[int]:
    """Request 0 is seeded; `extra` unseeded requests with other drafts share the batch."""
    params = [SamplingParams(seed=seed, temperature=0.9)] + [SamplingParams()] * extra
    st = SamplingTensors.from_params(params)
    mine = torch.randn(4, 50, generator=torch.Generator().manual_seed(7))
    drafts = [[1, 2, 3]] + [[4] * (i % 4) for i in range(extra)]
    others = torch.randn(sum(len(d) + 1 for d in drafts[1:]), 50)  # global RNG
    dmine = torch.softmax(torch.randn(3, 50, generator=torch.Generator().manual_seed(8)), -1)
    dothers = torch.softmax(torch.randn(sum(len(d) for d in drafts[1:]), 50), -1)
    outs: list[int] = []
    for step in range(10):  # several steps at other positions
        positions = [12 + 4 * step] + [step] * extra
        res = rejection_sample(torch.cat([mine, others]), drafts, torch.cat([dmine, dothers]), st, positions)
        outs += res[0] + [-1]
    return outs


def test_seeded_request_reproducible_and_batch_independent() -> None:
    torch.manual_seed(0)
    alone = _seeded_run(seed=5, extra=0)
    torch.manual_seed(1)
    assert _seeded_run(seed=5, extra=6) == alone
    assert _seeded_run(seed=6, extra=0) != alone


# ---------------------------------------------------------------- statistical


@dataclass
class MarkovCase:
    """A first-order Markov target and draft over V tokens, and a batch of draft runs."""

    target0: Tensor  # [V] target distribution of the first token
    target_next: Tensor  # [V, V] target distribution of the next token given the previous
    target_logits: Tensor  # [sum(k_i + 1), V]
    drafts: list[list[int]]
    draft_probs: Tensor  # [sum(k_i), V]


def random_dist(shape: tuple[int, ...], gen: torch.Generator, scale: float = 1.5) -> Tensor:
    return torch.softmax(torch.randn(*shape, generator=gen, dtype=torch.float64) * scale, -1)


def markov_case(num_draft: Tensor, seed: int) -> MarkovCase:
    """Drafts x_1..x_k drawn from the draft chain; target rows t0, T[x_1], ..., T[x_k]."""
    gen = torch.Generator().manual_seed(seed)
    target0, target_next = random_dist((V,), gen), random_dist((V, V), gen)
    draft0, draft_next = random_dist((V,), gen), random_dist((V, V), gen)
    n, k_max = num_draft.shape[0], int(num_draft.max())
    tokens = torch.empty(n, k_max, dtype=torch.int64)  # [N, K]
    draft_rows = [draft0.expand(n, V)]  # K x [N, V]
    for j in range(k_max):
        tokens[:, j] = torch.multinomial(draft_rows[-1], 1, generator=gen).squeeze(1)
        draft_rows.append(draft_next[tokens[:, j]])
    target_all = torch.cat([target0.expand(n, 1, V), target_next[tokens]], 1)  # [N, K + 1, V]
    pos = torch.arange(k_max + 1)
    return MarkovCase(
        target0=target0, target_next=target_next,
        target_logits=target_all[pos <= num_draft[:, None]].log().float(),
        drafts=[row[:k].tolist() for row, k in zip(tokens, num_draft.tolist())],
        draft_probs=torch.stack(draft_rows[:k_max], 1)[pos[:k_max] < num_draft[:, None]].float(),
    )


def first_two_pvalues(out: list[list[int]], target0: Tensor, target_next: Tensor) -> tuple[float, float]:
    """p-values for: first token ~ target0; second token ~ target_next[first] (when emitted)."""
    first = torch.tensor([o[0] for o in out])
    p_first = chi2_pvalue(torch.bincount(first, minlength=V), target0)
    pairs = torch.tensor([o[:2] for o in out if len(o) >= 2])
    joint = torch.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V).reshape(V, V)
    return p_first, chi2_pvalue(joint, target_next)


def plain_st(n: int, **kwargs: Any) -> SamplingTensors:
    return SamplingTensors.from_params([SamplingParams(**kwargs)] * n, [None] * n)


def seeded_st(n: int) -> tuple[SamplingTensors, list[int]]:
    """n requests with distinct seeds at scattered positions: the sampling and the positions."""
    seeded = SamplingTensors.from_params([SamplingParams(seed=s) for s in range(n)])
    return seeded, [(s * 7919) % 1000 for s in range(n)]


def test_statistical_seeded_residual(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded rows with sampled drafts keep the residual method, with keyed uniforms."""
    num_draft = torch.randint(0, 4, (N_TRIALS // 2,), generator=torch.Generator().manual_seed(4))
    case = markov_case(num_draft, seed=24)
    st, positions = seeded_st(len(case.drafts))
    out = rejection_sample(case.target_logits, case.drafts, case.draft_probs, st, positions)
    assert all(1 <= len(o) <= len(d) + 1 and o[:-1] == d[:len(o) - 1] for o, d in zip(out, case.drafts))
    p_first, p_second = first_two_pvalues(out, case.target0, case.target_next)
    assert p_first > P_OK and p_second > P_OK, (p_first, p_second)
    assert sum(len(o) <= len(d) for o, d in zip(out, case.drafts)) > len(out) // 10

    break_residual(monkeypatch)
    out = rejection_sample(case.target_logits, case.drafts, case.draft_probs, st, positions)
    p_first, p_second = first_two_pvalues(out, case.target0, case.target_next)
    assert p_first < P_BROKEN and p_second < P_BROKEN, (p_first, p_second)


@pytest.mark.parametrize("k", [1, 2, 3, "mixed"])
def test_statistical_exactness(k: int | str, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(11)
    if k == "mixed":
        num_draft = torch.randint(0, 4, (N_TRIALS,), generator=torch.Generator().manual_seed(3))
    else:
        num_draft = torch.full((N_TRIALS,), int(k))
    case = markov_case(num_draft, seed=21)
    st = plain_st(N_TRIALS)
    out = rejection_sample(case.target_logits, case.drafts, case.draft_probs, st)
    # Shape of every answer: an accepted prefix of the drafts, then one more token.
    assert all(1 <= len(o) <= len(d) + 1 and o[:-1] == d[:len(o) - 1]
               for o, d in zip(out, case.drafts))
    p_first, p_second = first_two_pvalues(out, case.target0, case.target_next)
    assert p_first > P_OK and p_second > P_OK, (p_first, p_second)
    # Some drafts must be rejected, or the residual would never be exercised.
    assert sum(len(o) <= len(d) for o, d in zip(out, case.drafts)) > N_TRIALS // 10

    break_residual(monkeypatch)
    out = rejection_sample(case.target_logits, case.drafts, case.draft_probs, st)
    p_first, p_second = first_two_pvalues(out, case.target0, case.target_next)
    assert p_first < P_BROKEN, p_first
    if k != 1:  # with one draft the second token is always the bonus, which the bug spares
        assert p_second < P_BROKEN, p_second


def one_hot_case() -> tuple[MarkovCase, Tensor, list[list[int]]]:
    """The Markov case with deterministic guesses: target logits [N * 3, V] and drafts."""
    case = markov_case(torch.full((N_TRIALS,), 2), seed=22)
    # Deterministic guesses. The first is deliberately not uniform over the vocab: against
    # uniform guesses the residual bug happens to leave the first token's marginal intact.
    rows = torch.arange(N_TRIALS)
    guesses = torch.stack([(rows % V) // 2, (rows * 7 + 1) % V], 1)  # [N, 2]
    target_logits = case.target_logits.reshape(N_TRIALS, 3, V).clone()
    target_logits[:, 1:] = case.target_next[guesses].log()  # rows follow the new drafts
    return case, target_logits.reshape(-1, V).float(), guesses.tolist()


def test_statistical_one_hot_drafts(monkeypatch: pytest.MonkeyPatch) -> None:
    """draft_probs None (an n-gram drafter): drafts are arbitrary, treated as certain."""
    torch.manual_seed(12)
    case, target_logits, drafts = one_hot_case()
    st = plain_st(N_TRIALS)
    out = rejection_sample(target_logits, drafts, None, st)
    p_first, p_second = first_two_pvalues(out, case.target0, case.target_next)
    assert p_first > P_OK and p_second > P_OK, (p_first, p_second)

    break_residual(monkeypatch)
    out = rejection_sample(target_logits, drafts, None, st)
    p_first, p_second = first_two_pvalues(out, case.target0, case.target_next)
    assert p_first < P_BROKEN and p_second < P_BROKEN, (p_first, p_second)


def test_statistical_seeded_one_hot_drafts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded rows with one-hot drafts take the keyed race: across seeds, the output follows the target."""
    case, target_logits, drafts = one_hot_case()
    st, positions = seeded_st(N_TRIALS)
    out = rejection_sample(target_logits, drafts, None, st, positions)
    assert all(1 <= len(o) <= 3 and o[:-1] == d[:len(o) - 1] for o, d in zip(out, drafts))
    assert sum(len(o) == 1 for o in out) > N_TRIALS // 10 and sum(len(o) == 3 for o in out) > N_TRIALS // 40
    p_first, p_second = first_two_pvalues(out, case.target0, case.target_next)
    assert p_first > P_OK and p_second > P_OK, (p_first, p_second)

    # The bug: draws keyed without the position, so every row reuses the first row's exponentials.
    monkeypatch.setattr(rejection, "sample_keyed",
                        lambda probs, seeds, pos: sample_keyed(probs, seeds, [positions[0]] * len(pos)))
    out = rejection_sample(target_logits, drafts, None, st, positions)
    p_first, p_second = first_two_pvalues(out, case.target0, case.target_next)
    assert p_second < P_BROKEN, (p_first, p_second)


def transformed_target() -> tuple[Tensor, Tensor]:
    """Raw logits and, computed by hand, their distribution at T=0.7, top-k 5, top-p 0.9."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.6, 0.3, 0.0, -0.5, -1.0], dtype=torch.float64)
    perm = torch.tensor([5, 2, 7, 0, 3, 6, 1, 4])  # not in vocab order
    probs = torch.softmax(logits / 0.7, -1)[:5]  # top-5, sorted
    probs = probs / probs.sum()  # renormalised: cumsum 0.512, 0.763, 0.886, 0.955, 1
    probs = torch.cat([probs[:4] / probs[:4].sum(), torch.zeros(4, dtype=torch.float64)])
    out = torch.empty(8, dtype=torch.float64)
    out[perm] = probs
    shuffled = torch.empty(8, dtype=torch.float64)
    shuffled[perm] = logits
    return shuffled.float(), out


def test_statistical_temperature_top_k_top_p(monkeypatch: pytest.MonkeyPatch) -> None:
    """Target rows are context-free raw logits; emitted tokens follow the transformed target."""
    torch.manual_seed(13)
    logits, expected = transformed_target()
    n, k = N_TRIALS, 2
    gen = torch.Generator().manual_seed(23)
    # A draft spread over the whole vocab, including tokens the target masks out.
    draft = torch.softmax(torch.randn(8, generator=gen), -1)
    tokens = torch.multinomial(draft, n * k, replacement=True, generator=gen).reshape(n, k)
    st = plain_st(n, temperature=0.7, top_k=5, top_p=0.9)
    args = (logits.repeat(n * (k + 1), 1), tokens.tolist(), draft.repeat(n * k, 1), st)
    out = rejection_sample(*args)
    emitted = torch.tensor([t for o in out for t in o[:2]])  # every emitted token ~ expected
    counts = torch.bincount(emitted, minlength=8)
    assert chi2_pvalue(counts, expected) > P_OK
    assert int(counts[expected == 0].sum()) == 0

    break_residual(monkeypatch)
    out = rejection_sample(*args)
    first = torch.tensor([o[0] for o in out])
    assert chi2_pvalue(torch.bincount(first, minlength=8), expected) < P_BROKEN
