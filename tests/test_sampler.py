"""Tests for specdec.sampler: transforms, sampling, seeds, logprobs."""
from __future__ import annotations

import pytest
import torch
from torch import Tensor

import specdec.sampler as sampler
from specdec.sampler import (
    ACCEPT_STREAM,
    RACE_STREAM,
    SamplingTensors,
    argmax,
    keyed_generator,
    keyed_seed,
    keyed_uniforms,
    logits_to_probs,
    sample,
    sample_keyed,
    sample_probs,
    top_logprobs,
)
from specdec.sampling_params import SamplingParams


def make_st(params: list[SamplingParams], seeded: bool = False) -> SamplingTensors:
    gens = [torch.Generator().manual_seed(p.seed) if seeded and p.seed is not None else None
            for p in params]
    return SamplingTensors.from_params(params, gens)


def chi2_pvalue(counts: Tensor, probs: Tensor) -> float:
    """Pearson chi-square goodness of fit; 0 if a zero-probability cell was observed."""
    counts, probs = counts.double(), probs.double()
    if bool((counts[probs == 0] > 0).any()):
        return 0.0
    live = probs > 0
    expected = probs[live] * counts.sum()
    stat = ((counts[live] - expected) ** 2 / expected).sum()
    df = torch.tensor(int(live.sum()) - 1, dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, stat / 2))


# ---------------------------------------------------------------- SamplingTensors


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_argmax_is_torch_argmax(dtype: torch.dtype) -> None:
    """The CPU fast path (numpy) and the torch fallback (bf16) pick what torch.argmax
    picks: the first of tied maxima, -inf rows, 1-D, 3-D, strided and empty inputs."""
    gen = torch.Generator().manual_seed(0)
    rows = torch.randint(0, 4, (7, 50), generator=gen).to(dtype)  # many ties
    rows[3] = float("-inf")
    rows[4, 10] = float("inf")
    for values in (rows, rows[1], rows.reshape(7, 5, 10), rows[:, ::3], rows.t(), rows[:0]):
        got = argmax(values)
        assert got.dtype == torch.int64
        assert torch.equal(got, values.argmax(dim=-1))


def test_from_params_tensors() -> None:
    st = make_st([SamplingParams(temperature=0.0, top_k=-1),
                  SamplingParams(temperature=0.8, top_k=5, top_p=0.9)])
    assert st.temperature.dtype == torch.float32 and st.temperature.tolist() == pytest.approx([0.0, 0.8])
    assert st.top_k.dtype == torch.int64 and st.top_k.tolist() == [0, 5]
    assert st.top_p.dtype == torch.float32 and st.top_p.tolist() == pytest.approx([1.0, 0.9])
    assert st.greedy.tolist() == [True, False]
    assert not st.all_greedy and st.any_top_k and st.any_top_p
    assert make_st([SamplingParams(temperature=0.0)] * 2).all_greedy


def test_from_params_rejects_mismatched_generators() -> None:
    with pytest.raises(ValueError):
        SamplingTensors.from_params([SamplingParams()], [])


def test_repeat_and_select() -> None:
    g = torch.Generator().manual_seed(0)
    st = SamplingTensors.from_params(
        [SamplingParams(temperature=0.0), SamplingParams(temperature=0.5, top_k=3)], [None, g])
    rep = st.repeat([2, 3])
    assert rep.temperature.tolist() == pytest.approx([0.0, 0.0, 0.5, 0.5, 0.5])
    assert rep.top_k.tolist() == [0, 0, 3, 3, 3]
    assert rep.generators == [None, None, g, g, g]
    assert not rep.all_greedy
    sel = st.select([0])
    assert sel.all_greedy and sel.generators == [None] and not sel.any_top_k


def test_seeds_follow_the_rows() -> None:
    params = [SamplingParams(seed=4), SamplingParams(), SamplingParams(seed=6, temperature=0.0)]
    st = SamplingTensors.from_params(params)
    assert st.seeds == [4, None, 6] and st.generators == [None] * 3
    assert st.repeat([2, 1, 1]).seeds == [4, 4, None, 6]
    assert st.select([2, 0]).seeds == [6, 4]
    # Sampled, seeded and one-hot drafted: the greedy row 2 and the unseeded row 1 are not.
    assert st.keyed_rows([True] * 3) == [0] and st.keyed_rows([False, True, True]) == []


def test_min_p_leaves_other_rows_untouched() -> None:
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(5))
    alone = logits_to_probs(logits[:1], make_st([SamplingParams()]))
    mixed = logits_to_probs(logits, make_st([SamplingParams(), SamplingParams(min_p=0.3)]))
    assert torch.equal(mixed[0], alone[0])  # bit for bit: a seeded row's pick must not depend on its neighbours


# ---------------------------------------------------------------- logits_to_probs


def test_greedy_rows_are_one_hot() -> None:
    logits = torch.tensor([[0.1, 3.0, -1.0], [2.0, 0.0, 1.0]])
    st = make_st([SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)])
    probs = logits_to_probs(logits, st)
    assert probs[0].tolist() == [0.0, 1.0, 0.0]
    torch.testing.assert_close(probs[1], torch.softmax(logits[1], -1))
    assert logits_to_probs(logits, make_st([SamplingParams(temperature=0.0)] * 2)).tolist() == [
        [0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]


def test_temperature() -> None:
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(1))
    st = make_st([SamplingParams(temperature=t) for t in (0.5, 1.0, 2.0)])
    expected = torch.softmax(logits / torch.tensor([[0.5], [1.0], [2.0]]), -1)
    torch.testing.assert_close(logits_to_probs(logits, st), expected)


def test_top_k_mask() -> None:
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0, 0.0]] * 2)
    st = make_st([SamplingParams(top_k=2), SamplingParams(top_k=0)])
    probs = logits_to_probs(logits, st)
    assert (probs[0] > 0).tolist() == [False, True, True, False, False]
    torch.testing.assert_close(probs[0, 1:3], torch.softmax(torch.tensor([4.0, 3.0]), -1))
    torch.testing.assert_close(probs[1], torch.softmax(logits[1], -1))  # off: untouched


def test_top_k_larger_than_vocab_keeps_all() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    torch.testing.assert_close(logits_to_probs(logits, make_st([SamplingParams(top_k=10)])),
                               torch.softmax(logits, -1))


def test_top_p_smallest_set_reaching_mass() -> None:
    # probs 0.5, 0.3, 0.15, 0.05 (deliberately not in vocab order)
    logits = torch.tensor([0.15, 0.5, 0.05, 0.3]).log().repeat(4, 1)
    st = make_st([SamplingParams(top_p=p) for p in (0.75, 0.85, 0.01, 1.0)])
    probs = logits_to_probs(logits, st)
    torch.testing.assert_close(probs[0], torch.tensor([0.0, 0.5, 0.0, 0.3]) / 0.8)
    torch.testing.assert_close(probs[1], torch.tensor([0.15, 0.5, 0.0, 0.3]) / 0.95)
    assert probs[2].tolist() == [0.0, 1.0, 0.0, 0.0]  # the top token is always kept
    torch.testing.assert_close(probs[3], torch.tensor([0.15, 0.5, 0.05, 0.3]))


def test_top_k_then_top_p_uses_renormalised_mass() -> None:
    # top-k 3 leaves 0.5, 0.3, 0.15 -> renormalised 0.526, 0.316, 0.158; top-p 0.8 then needs
    # the first two (0.842), while on the un-renormalised mass it would need three.
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    probs = logits_to_probs(logits, make_st([SamplingParams(top_k=3, top_p=0.8)]))
    torch.testing.assert_close(probs[0], torch.tensor([0.625, 0.375, 0.0, 0.0]))


def test_top_k_paths_agree() -> None:
    """The sort-free top-k path equals the sort path when top-p is off."""
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(2))
    top_k = torch.tensor([0, 1, 5, 17, 50, 60])
    fast = sampler._mask_top_k(logits, top_k)
    slow = sampler._mask_top_k_top_p(logits, top_k, torch.ones(6))
    assert torch.equal(fast, slow)


def test_no_sort_when_top_p_off(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: object, **kwargs: object) -> Tensor:
        raise AssertionError("full sort used")
    monkeypatch.setattr(sampler, "_mask_top_k_top_p", boom)
    logits = torch.randn(2, 20)
    logits_to_probs(logits, make_st([SamplingParams(), SamplingParams(top_k=4)]))
    # A greedy row with top_p < 1 does not count either: greedy ignores top-p.
    logits_to_probs(logits, make_st([SamplingParams(temperature=0.0, top_p=0.5), SamplingParams()]))


def test_mixed_batch_rows_sum_to_one() -> None:
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(3)) * 3
    st = make_st([SamplingParams(temperature=0.0), SamplingParams(top_p=0.3),
                  SamplingParams(temperature=0.3, top_k=7), SamplingParams(temperature=1.7)])
    probs = logits_to_probs(logits, st)
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(-1), torch.ones(4))
    assert int((probs[2] > 0).sum()) == 7


# ---------------------------------------------------------------- sample


def test_all_greedy_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sampler, "logits_to_probs", None)  # must not be reached
    logits = torch.tensor([[0.0, 2.0, 1.0], [5.0, 0.0, 1.0]])
    out = sample(logits, make_st([SamplingParams(temperature=0.0)] * 2))
    assert out.dtype == torch.int64 and out.tolist() == [1, 0]


def test_mixed_batch_greedy_rows_argmax() -> None:
    logits = torch.randn(8, 40, generator=torch.Generator().manual_seed(4))
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0) for i in range(8)]
    out = sample(logits, make_st(params))
    assert out[::2].tolist() == logits[::2].argmax(-1).tolist()


def test_sampling_matches_distribution() -> None:
    torch.manual_seed(0)
    probs_row = torch.tensor([0.05, 0.4, 0.0, 0.25, 0.3])
    n = 40_000
    logits = probs_row.log().repeat(n, 1)
    out = sample(logits, make_st([SamplingParams()] * n))
    assert chi2_pvalue(torch.bincount(out, minlength=5), probs_row) > 1e-3
    # Control: the check does reject a mildly wrong distribution.
    wrong = torch.tensor([0.06, 0.39, 0.0, 0.25, 0.3])
    assert chi2_pvalue(torch.bincount(out, minlength=5), wrong) < 1e-6


def test_top_k_excluded_tokens_never_sampled() -> None:
    torch.manual_seed(0)
    logits = torch.tensor([[1.0, 1.1, 0.9, 1.05, 0.0]]).repeat(5000, 1)
    out = sample(logits, make_st([SamplingParams(top_k=2)] * 5000))
    assert set(out.tolist()) == {1, 3}


def _draw(seed: int, steps: int, batch_extra: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    params = [SamplingParams(seed=seed)] + [SamplingParams()] * batch_extra
    st = SamplingTensors.from_params(params, [gen] + [None] * batch_extra)
    mine = torch.randn(steps, 1, 100, generator=torch.Generator().manual_seed(9))
    others = torch.randn(steps, batch_extra, 100) * 3  # global RNG: differs between calls
    logits = torch.cat([mine, others], dim=1)  # [steps, 1 + batch_extra, V]
    return [int(sample(logits[s], st)[0]) for s in range(steps)]


def test_seed_reproducible_and_batch_independent() -> None:
    torch.manual_seed(1)
    alone = _draw(seed=123, steps=20, batch_extra=0)
    torch.manual_seed(2)  # the global RNG must not matter
    assert _draw(seed=123, steps=20, batch_extra=5) == alone
    assert _draw(seed=124, steps=20, batch_extra=0) != alone


# ---------------------------------------------------------------- keyed draws


def test_keyed_seed_is_deterministic_63_bit_and_distinct() -> None:
    keys = [(s, t, stream) for s in range(60) for t in range(60) for stream in (RACE_STREAM, ACCEPT_STREAM)]
    values = [keyed_seed(*k) for k in keys]
    assert values == [keyed_seed(*k) for k in keys]
    assert all(0 <= v < 2**63 for v in values)
    assert len(set(values)) == len(values)
    for seed in (-5, 2**64 - 1, 2**80 + 3):  # any Python int is a valid request seed
        assert 0 <= keyed_seed(seed, 3, RACE_STREAM) < 2**63


def test_keyed_seed_is_well_mixed() -> None:
    """Neighbouring keys differ in about half their bits (63 / 2 on average)."""
    flips = [bin(keyed_seed(s, t, 0) ^ keyed_seed(s, t + 1, 0)).count("1") for s in range(20) for t in range(50)]
    flips += [bin(keyed_seed(s, t, 0) ^ keyed_seed(s + 1, t, 0)).count("1") for s in range(20) for t in range(50)]
    flips += [bin(keyed_seed(s, t, 0) ^ keyed_seed(s, t, 1)).count("1") for s in range(20) for t in range(50)]
    mean = sum(flips) / len(flips)
    assert 30.5 < mean < 32.5 and min(flips) > 12, (mean, min(flips))


def test_sample_keyed_is_the_race_with_the_keyed_generator() -> None:
    probs = torch.softmax(torch.randn(3, 40, generator=torch.Generator().manual_seed(6)), -1)
    seeds, positions = [1, 1, 2], [10, 11, 10]
    gens: list[torch.Generator | None] = [keyed_generator(s, t, RACE_STREAM) for s, t in zip(seeds, positions)]
    torch.manual_seed(0)
    expected = sample_probs(probs, gens)
    torch.manual_seed(1)  # the global RNG must not matter
    assert torch.equal(sample_keyed(probs, seeds, positions), expected)


def test_keyed_uniforms_prefix_and_stream() -> None:
    long = keyed_uniforms(3, 7, 40)
    assert torch.equal(keyed_uniforms(3, 7, 5), long[:5])  # the j-th sibling's draw ignores the count
    assert bool(((long >= 0) & (long < 1)).all())
    race = torch.rand(40, generator=keyed_generator(3, 7, RACE_STREAM))
    assert not torch.equal(race, long)  # the two streams are distinct


def test_keyed_race_matches_distribution_across_seeds() -> None:
    """One draw per (seed, position) key, many keys: the categorical distribution; and a
    control that the same check rejects a slightly wrong one."""
    probs_row = torch.tensor([0.05, 0.4, 0.0, 0.25, 0.3])
    n = 20_000
    out = sample_keyed(probs_row.repeat(n, 1), [i // 7 for i in range(n)], [i % 7 for i in range(n)])
    counts = torch.bincount(out, minlength=5)
    assert chi2_pvalue(counts, probs_row) > 1e-3
    assert chi2_pvalue(counts, torch.tensor([0.07, 0.38, 0.0, 0.25, 0.3])) < 1e-6


# ---------------------------------------------------------------- top_logprobs


def test_top_logprobs() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 1.0]])
    ref = torch.log_softmax(logits, -1)
    out = top_logprobs(logits, torch.tensor([3, 2]), num_top=2, decode=lambda t: f"<{t}>")
    assert set(out[0]) == {3, 1, 2}  # sampled token plus the top two
    assert set(out[1]) == {2, 3}  # sampled token is itself in the top two
    assert [out[0][t].rank for t in (1, 2, 3)] == [1, 2, 4]  # the sampled 3 ranks last, outside the top two
    assert out[1][2].rank == 1 and out[1][3].rank == 2 and out[0][3].decoded_token == "<3>"
    for row, entry in enumerate(out):
        for tok, lp in entry.items():
            assert lp.logprob == pytest.approx(float(ref[row, tok]))
    none = top_logprobs(logits, torch.tensor([0, 1]), num_top=0)
    assert [(list(e), e[t].rank, e[t].decoded_token) for e, t in zip(none, (0, 1))] == [([0], 3, None), ([1], 3, None)]
