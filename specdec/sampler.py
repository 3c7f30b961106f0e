"""Batched token sampling: temperature, top-k, top-p, min-p, seeded draws.

Every function works on a batch of rows, one row per request (or per position of a
request during verification, see `SamplingTensors.repeat`).

A seeded request's draws in the verifier are keyed, not streamed: the noise that decides
the token at position t comes from a fresh generator seeded with a hash of (seed, t,
stream), so it does not depend on how many draws earlier steps made (how many drafts
they had, or which were accepted). See `keyed_generator`.
"""
from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from specdec.outputs import Logprob
from specdec.sampling_params import SamplingParams


@dataclass
class SamplingTensors:
    """The sampling settings of a batch as tensors, built once per step."""

    temperature: Tensor  # [N] float32; 0 on greedy rows
    top_k: Tensor  # [N] int64; 0 = off
    top_p: Tensor  # [N] float32; 1 = off
    min_p: Tensor  # [N] float32; 0 = off
    greedy: Tensor  # [N] bool
    # [N] a sequential generator per row, or None (global RNG): for drafters sampling their
    # own guesses with `sample_probs`. The verifiers ignore it and key draws by `seeds`.
    generators: list[torch.Generator | None]
    seeds: list[int | None]  # [N] the request's seed (SamplingParams.seed), or None
    all_greedy: bool
    # Computed once here so the hot path never has to ask the tensors (a device sync on GPU):
    # the tensors are made on the host, and `to` carries these flags over to the device.
    any_top_k: bool = field(init=False)
    any_top_p: bool = field(init=False)
    any_min_p: bool = field(init=False)
    any_greedy: bool = field(init=False)
    largest_top_k: int = field(init=False)  # the largest k of any row; top-k off counts as unbounded

    def __post_init__(self) -> None:
        stochastic = ~self.greedy
        self.any_top_k = bool(((self.top_k > 0) & stochastic).any())
        self.any_top_p = bool(((self.top_p < 1.0) & stochastic).any())
        self.any_min_p = bool(((self.min_p > 0.0) & stochastic).any())
        self.any_greedy = bool(self.greedy.any())
        unbounded = torch.iinfo(torch.int64).max
        self.largest_top_k = int(torch.where(self.top_k > 0, self.top_k, unbounded).max()) if len(self.top_k) else 0

    def to(self, device: torch.device) -> SamplingTensors:
        """The same settings with the tensors on `device` (copies that do not wait for the
        GPU), the host-side flags kept as they are."""
        if self.temperature.device == device:
            return self
        moved = copy.copy(self)
        for name in ("temperature", "top_k", "top_p", "min_p", "greedy"):
            setattr(moved, name, getattr(self, name).to(device, non_blocking=True))
        return moved

    @classmethod
    def from_params(
        cls,
        params: list[SamplingParams],
        generators: list[torch.Generator | None] | None = None,
        device: torch.device | str = "cpu",
    ) -> SamplingTensors:
        if generators is None:
            generators = [None] * len(params)
        if len(generators) != len(params):
            raise ValueError(f"{len(params)} params but {len(generators)} generators")
        greedy = [p.greedy for p in params]
        return cls(
            temperature=torch.tensor(
                [0.0 if g else p.temperature for p, g in zip(params, greedy)],
                dtype=torch.float32, device=device),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            generators=list(generators),
            seeds=[p.seed for p in params],
            all_greedy=all(greedy),
        )

    def __len__(self) -> int:
        return len(self.generators)

    def repeat(self, counts: list[int]) -> SamplingTensors:
        """Row i repeated counts[i] times: one row per verified position."""
        reps = torch.tensor(counts, dtype=torch.int64, device=self.temperature.device)
        gens = [g for g, c in zip(self.generators, counts) for _ in range(c)]
        seeds = [s for s, c in zip(self.seeds, counts) for _ in range(c)]
        return self._rows(lambda t: t.repeat_interleave(reps, dim=0), gens, seeds)

    def select(self, rows: list[int]) -> SamplingTensors:
        """The sub-batch made of the given rows, in that order."""
        idx = torch.tensor(rows, dtype=torch.int64, device=self.temperature.device)
        return self._rows(lambda t: t[idx], [self.generators[r] for r in rows], [self.seeds[r] for r in rows])

    def keyed_rows(self, one_hot: list[bool]) -> list[int]:
        """Sampled rows with a seed whose drafts are deterministic guesses (one_hot [N]): the
        verifiers give them exactly plain decoding's tokens."""
        greedy = self.greedy.tolist()
        return [i for i, (g, s, o) in enumerate(zip(greedy, self.seeds, one_hot)) if not g and s is not None and o]

    def _rows(
        self, take: Callable[[Tensor], Tensor], gens: list[torch.Generator | None], seeds: list[int | None]
    ) -> SamplingTensors:
        greedy = take(self.greedy)
        return SamplingTensors(
            temperature=take(self.temperature), top_k=take(self.top_k),
            top_p=take(self.top_p), min_p=take(self.min_p), greedy=greedy, generators=gens,
            seeds=seeds, all_greedy=bool(greedy.all()),
        )


def logits_to_probs(logits: Tensor, st: SamplingTensors) -> Tensor:
    """[N, V] logits -> [N, V] float32 probabilities after temperature, top-k, top-p, min-p.

    Greedy rows come out one-hot at their argmax, so a verifier can treat them like any
    other distribution.
    """
    logits = logits.float()  # [N, V]
    if st.all_greedy:
        return _one_hot_argmax(logits)
    st = st.to(logits.device)
    # Greedy rows get temperature 1 here (no division by 0) and are overwritten below.
    temp = torch.where(st.greedy, torch.ones_like(st.temperature), st.temperature)  # [N]
    logits = logits / temp.unsqueeze(1)  # [N, V]
    if st.any_top_p:
        logits = _mask_top_k_top_p(logits, st.top_k, st.top_p)
    elif st.any_top_k:
        logits = _mask_top_k(logits, st.top_k, st.largest_top_k)
    probs = torch.softmax(logits, dim=-1)  # [N, V]
    if st.any_min_p:
        probs = _mask_min_p(probs, st.min_p)
    if st.any_greedy:
        probs = torch.where(st.greedy.unsqueeze(1), _one_hot_argmax(logits), probs)
    return probs


def argmax(values: Tensor) -> Tensor:  # [..., V] -> [...] int64
    """The index of each row's first largest value, as torch.argmax(dim=-1). On the CPU
    numpy's vectorised argmax reads the row: torch 2.13's CPU argmax takes about 1 ns an
    element (0.13 ms for one 49k-token row of logits, 0.4 ms for a six-row verify: 1-4% of
    the default model's step on two cores), numpy's 0.2 ns."""
    if values.device.type == "cpu" and values.dtype in _NUMPY_DTYPES:
        return torch.from_numpy(np.asarray(values.detach().numpy().argmax(axis=-1), dtype=np.int64))
    return values.argmax(dim=-1)


_NUMPY_DTYPES = (torch.float32, torch.float64, torch.float16)


def _one_hot_argmax(logits: Tensor) -> Tensor:
    probs = torch.zeros_like(logits, dtype=torch.float32)  # [N, V]
    return probs.scatter_(1, argmax(logits).unsqueeze(1), 1.0)


def _mask_min_p(probs: Tensor, min_p: Tensor) -> Tensor:  # [N, V], [N] -> [N, V]
    """Zero the tokens below min_p times the row's top probability, then renormalise.
    Rows with min_p off are returned untouched (a renormalisation would move their last
    bits, and a seeded row's token must not depend on its neighbours' settings)."""
    floor = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)  # [N, 1]
    kept = probs.masked_fill(probs < floor, 0.0)  # [N, V]
    return torch.where(min_p.unsqueeze(1) > 0, kept / kept.sum(dim=-1, keepdim=True), probs)


def _mask_top_k(logits: Tensor, top_k: Tensor, largest_top_k: int | None = None) -> Tensor:
    """Top-k without a full sort: threshold at the k-th largest logit (ties are kept).
    largest_top_k: top_k's largest (off: unbounded) if the host knows it; else top_k is
    asked, a wait for the GPU."""
    vocab = logits.shape[1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)  # [N]; off = keep all
    width = int(k.max()) if largest_top_k is None else min(largest_top_k, vocab)
    top_vals = logits.topk(width, dim=-1).values  # [N, max_k], descending
    kth = top_vals.gather(1, (k - 1).unsqueeze(1))  # [N, 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def _mask_top_k_top_p(logits: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Top-k then top-p in one descending sort of the vocab."""
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [N, V] each
    rank = torch.arange(vocab, device=logits.device).unsqueeze(0)  # [1, V]
    k = torch.where(top_k > 0, top_k, vocab).unsqueeze(1)  # [N, 1]
    sorted_logits = sorted_logits.masked_fill(rank >= k, float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=-1)  # [N, V], top-k renormalised
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [N, V], exclusive cumsum
    # Smallest prefix with mass >= top_p: keep a token while the mass before it is short.
    # Rank 0 is always kept; top_p == 1 keeps everything despite cumsum rounding.
    drop = (mass_before >= top_p.unsqueeze(1)) & (rank > 0) & (top_p.unsqueeze(1) < 1.0)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def sample(logits: Tensor, st: SamplingTensors) -> Tensor:
    """[N, V] logits -> [N] int64 sampled tokens (argmax on greedy rows)."""
    if st.all_greedy:
        return argmax(logits)
    probs = logits_to_probs(logits, st)  # [N, V], greedy rows one-hot
    return sample_probs(probs, st.generators)


def sample_probs(probs: Tensor, generators: list[torch.Generator | None]) -> Tensor:
    """[N, V] probabilities -> [N] int64 by the exponential race argmax(probs / Exp(1)).

    Equivalent to a categorical draw, but one vectorised call for all unseeded rows;
    each row with a generator draws its own V exponentials from it, so its result
    depends only on that generator, never on the rest of the batch.
    """
    race = torch.empty_like(probs, dtype=torch.float32)  # [N, V]
    if any(gen is None for gen in generators):
        race.exponential_()  # unseeded rows; seeded rows are overwritten below
    for row, gen in enumerate(generators):
        if gen is not None:
            race[row] = _exponential(probs.shape[1], gen).to(probs.device, non_blocking=True)
    # Exp(1) can be exactly 0; clamping avoids 0/0 and inf (a bias of ~1e-38).
    race.clamp_(min=torch.finfo(torch.float32).tiny)
    return argmax(probs / race)


def _exponential(n: int, gen: torch.Generator) -> Tensor:
    return torch.empty(n, device=gen.device).exponential_(generator=gen)  # [n]


# The streams of a seeded request's keyed draws at one position.
RACE_STREAM = 0  # V exponentials: the token the target picks there (`sample_keyed`)
ACCEPT_STREAM = 1  # uniforms: accepting or rejecting sampled drafts for it (`keyed_uniforms`)

_MASK64 = (1 << 64) - 1
_MASK63 = (1 << 63) - 1


def keyed_seed(seed: int, position: int, stream: int) -> int:
    """A 63-bit generator seed for (request seed, token position, stream).

    splitmix64's mixing step folds in each part in turn: keys that differ in one bit
    (seed and seed + 1, consecutive positions, the two streams) give unrelated seeds, so
    their draws are independent for every practical purpose.
    """
    mixed = _mix64(seed & _MASK64)
    mixed = _mix64(mixed ^ (position & _MASK64))
    return _mix64(mixed ^ stream) & _MASK63


def _mix64(x: int) -> int:
    """splitmix64: add the golden-ratio increment, then its xorshift-multiply finaliser."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def keyed_generator(seed: int, position: int, stream: int) -> torch.Generator:
    """A fresh CPU generator for one (seed, position, stream) key (a few microseconds)."""
    return torch.Generator().manual_seed(keyed_seed(seed, position, stream))


def sample_keyed(probs: Tensor, seeds: list[int], positions: list[int]) -> Tensor:
    """[M, V] probabilities -> [M] int64: row i's token by the exponential race with the
    V exponentials keyed by (seeds[i], positions[i]); what plain decoding picks there."""
    return sample_probs(probs, [keyed_generator(s, t, RACE_STREAM) for s, t in zip(seeds, positions)])


def keyed_race_noise(seed: int, position: int, vocab: int) -> Tensor:  # [vocab] float32 on the host
    """The V exponentials `sample_keyed` races with at (seed, position), drawn alone (the
    CUDA graphs' sampler fills its static noise with them, specdec/graph_sampling.py)."""
    return _exponential(vocab, keyed_generator(seed, position, RACE_STREAM))


def keyed_uniforms(seed: int, position: int, count: int) -> Tensor:
    """[count] uniforms in [0, 1) keyed by (seed, position), on the CPU. A prefix of a longer
    draw with the same key: the j-th value does not depend on count."""
    return torch.rand(count, generator=keyed_generator(seed, position, ACCEPT_STREAM))  # [count]


def top_logprobs(logits: Tensor, token_ids: Tensor, num_top: int,
                 decode: Callable[[int], str] | None = None) -> list[dict[int, Logprob]]:
    """Per row {sampled token: Logprob} plus the num_top most likely tokens, each with its
    1-based rank and, given `decode`, its text.

    Logprobs come from the raw logits (before temperature / top-k / top-p), as in vLLM.
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    token_ids = token_ids.to(logprobs.device).long()  # [N]
    sampled = logprobs.gather(1, token_ids.unsqueeze(1))  # [N, 1]
    ranks = (logprobs > sampled).sum(dim=1) + 1  # [N] the sampled tokens' ranks
    top_vals, top_ids = logprobs.topk(num_top, dim=-1)  # [N, num_top] each
    out: list[dict[int, Logprob]] = []
    for tok, lp, rank, ids, vals in zip(token_ids.tolist(), sampled.squeeze(1).tolist(), ranks.tolist(),
                                        top_ids.tolist(), top_vals.tolist()):
        entry = {tok: Logprob(lp, rank, decode(tok) if decode else None)}
        for top_rank, (top_id, value) in enumerate(zip(ids, vals), start=1):
            entry.setdefault(top_id, Logprob(value, top_rank, decode(top_id) if decode else None))
        out.append(entry)
    return out
