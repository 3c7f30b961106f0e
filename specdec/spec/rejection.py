"""Speculative-decoding verification: the rejection sampler (vLLM-v1 style).

For each request the target model scored one row per draft position plus one bonus
row. Draft token x at a position is accepted with probability
min(1, target_probs[x] / draft_probs[x]); at the first rejection a recovered token is
sampled from norm(max(0, target_probs - draft_probs)); if every draft is accepted a
bonus token is sampled from the target at the bonus row. The emitted tokens are then
distributed exactly as if sampled from the target alone.

Seeded requests are reproducible: their draws are keyed by the position they decide
(see `specdec.sampler.keyed_generator`); row j of request i decides position
positions[i] + j. With deterministic drafts (draft_probs None) a seeded row takes the
exponential race at each position, y_j = argmax(target_probs_j / E_j) with E_j keyed by
(seed, positions[i] + j), accepts drafts while they equal y_j and emits the first y_j that
differs (or the bonus): each emitted token follows the target, and they are exactly the
tokens plain decoding with the same seed picks. With draft_probs, the acceptance uniform
of draft j and the race of the final token are keyed by their positions. Unseeded rows
use the global RNG in batch-shaped calls.

Shapes: N requests, K = max draft length in the batch, V vocab,
T = sum(num_draft_i + 1) target rows, D = sum(num_draft_i) draft rows.
Metrics (accepted / drafted) are counted by the caller from the returned lengths.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from specdec.sampler import (
    RACE_STREAM,
    SamplingTensors,
    argmax,
    keyed_generator,
    keyed_uniforms,
    logits_to_probs,
    sample_keyed,
    sample_probs,
)

# Below this mass the residual is float32 rounding noise, and a rejection there happens
# with probability equal to that mass anyway, so falling back to the target is harmless.
RESIDUAL_EPS = 1e-6


@dataclass
class DraftLayout:
    """Where each request's draft positions live in the flat target / draft rows."""

    num_draft: Tensor  # [N] int64
    tokens: Tensor  # [N, K] int64 draft token ids, 0 past num_draft
    valid: Tensor  # [N, K] bool, position j < num_draft
    target_rows: Tensor  # [N, K + 1] int64 flat target row; positions past num_draft -> bonus row
    draft_rows: Tensor  # [N, K] int64 flat draft row; past num_draft: garbage but in range

    @classmethod
    def build(cls, draft_token_ids: list[list[int]], device: torch.device) -> DraftLayout:
        # Laid out on the host, where the lists are, then copied over without waiting for the GPU.
        counts = [len(d) for d in draft_token_ids]
        k_max = max(counts, default=0)
        num_draft = torch.tensor(counts, dtype=torch.int64)  # [N]
        pos = torch.arange(k_max + 1).unsqueeze(0)  # [1, K + 1]
        valid = pos[:, :k_max] < num_draft.unsqueeze(1)  # [N, K]
        tokens = torch.zeros(len(counts), k_max, dtype=torch.int64)  # [N, K]
        # Row-major boolean indexing lays the flat list out request by request.
        tokens[valid] = torch.tensor([t for d in draft_token_ids for t in d], dtype=torch.int64)  # [D]
        draft_start = torch.cumsum(num_draft, 0) - num_draft  # [N], exclusive cumsum
        target_start = draft_start + torch.arange(len(counts))  # [N]: +1 bonus row each
        nd = num_draft.unsqueeze(1)  # [N, 1]
        layout = (
            num_draft, tokens, valid, target_start.unsqueeze(1) + torch.minimum(pos, nd),
            # Clamped so padding never indexes past the last draft row (values are masked).
            (draft_start.unsqueeze(1) + pos[:, :k_max]).clamp(max=max(sum(counts) - 1, 0)),
        )
        return cls(*(t.to(device, non_blocking=True) for t in layout))


def rejection_sample(
    target_logits: Tensor,  # [T, V]: per request, one row per draft position then the bonus row
    draft_token_ids: list[list[int]],  # [N] lists of num_draft_i tokens; may be empty
    draft_probs: Tensor | None,  # [D, V] draft distribution after sampling transforms; None = one-hot
    st: SamplingTensors,  # one row per request
    positions: list[int] | None = None,  # [N] position each first row decides; needed by seeded rows
) -> list[list[int]]:  # per request: accepted drafts, then one recovered or bonus token
    _check_shapes(target_logits, draft_token_ids, draft_probs, st, positions)
    layout = DraftLayout.build(draft_token_ids, target_logits.device)
    greedy = st.greedy.tolist()
    num_accepted = torch.empty(len(greedy), dtype=torch.int64, device=target_logits.device)  # [N]
    final_token = torch.empty_like(num_accepted)  # [N]
    if any(greedy):
        # One vectorised pass over every row beats gathering the greedy ones first;
        # sampled rows are overwritten below.
        num_accepted[:], final_token[:] = _greedy(target_logits, layout)
    keyed = st.keyed_rows([draft_probs is None] * len(greedy))
    if keyed:
        assert positions is not None  # _check_shapes
        rows = device_index(keyed, target_logits.device)  # [K]
        num_accepted[rows], final_token[rows] = _keyed(
            target_logits, layout, st, keyed, [positions[i] for i in keyed], [len(draft_token_ids[i]) for i in keyed])
    stochastic = sorted(set(i for i, g in enumerate(greedy) if not g) - set(keyed))
    if stochastic:
        rows = device_index(stochastic, target_logits.device)  # [S]
        num_accepted[rows], final_token[rows] = _stochastic(
            target_logits, draft_probs, layout, st, stochastic, [len(draft_token_ids[i]) for i in stochastic],
            None if positions is None else [positions[i] for i in stochastic])
    # The step's one wait for the GPU: both results come back in one copy.
    accepted_counts, final_tokens = torch.stack([num_accepted, final_token]).tolist()
    return [drafts[:n] + [tok] for drafts, n, tok in zip(draft_token_ids, accepted_counts, final_tokens)]


def device_index(values: list[int], device: torch.device) -> Tensor:  # [len(values)] int64
    """Host indices as an int64 tensor on `device`, copied without waiting for it."""
    return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)


def _greedy(target_logits: Tensor, layout: DraftLayout) -> tuple[Tensor, Tensor]:
    """Accept while draft == target argmax; then emit the target argmax there."""
    target_argmax = argmax(target_logits)[layout.target_rows]  # [N, K + 1]
    k_max = layout.tokens.shape[1]
    match = (layout.tokens == target_argmax[:, :k_max]) & layout.valid  # [N, K]
    num_accepted = _leading_true(match)  # [N]
    # Position num_accepted is the first mismatch (recovered) or, past the drafts, the bonus row.
    final = target_argmax.gather(1, num_accepted.unsqueeze(1)).squeeze(1)  # [N]
    return num_accepted, final


def _keyed(
    target_logits: Tensor,  # [T, V]
    layout: DraftLayout,
    st: SamplingTensors,  # [N] rows
    requests: list[int],  # K seeded request indices with one-hot drafts
    positions: list[int],  # [K] position each one's first row decides
    counts: list[int],  # [K] their numbers of drafts
) -> tuple[Tensor, Tensor]:  # num_accepted [K], final token [K]
    sub = st.select(requests)
    seeds = [s for s in sub.seeds if s is not None]
    idx = device_index(requests, target_logits.device)  # [K]
    target_rows = layout.target_rows[idx]  # [K, Kmax + 1]
    tokens = layout.tokens[idx]  # [K, Kmax]
    valid = layout.valid[idx]  # [K, Kmax]
    target_probs = _target_probs(target_logits, target_rows, counts, sub)  # [T, V], K requests' rows filled
    num_accepted = torch.zeros(len(requests), dtype=torch.int64, device=target_logits.device)  # [K]
    final = torch.empty_like(num_accepted)  # [K]
    matching = list(range(len(requests)))  # host-side: rows whose drafts so far equal the picks
    j = 0
    # Position by position, so that a row draws the V exponentials of a position only once
    # it gets there: one race per emitted token, as in plain decoding.
    while matching:
        at = device_index(matching, target_logits.device)  # [L]
        choice = sample_keyed(target_probs[target_rows[at, j]], [seeds[k] for k in matching],
                              [positions[k] + j for k in matching])  # [L]
        final[at] = choice
        if j == tokens.shape[1]:
            break  # every row left took its bonus
        match = valid[at, j] & (tokens[at, j] == choice)  # [L]
        num_accepted[at] += match.to(torch.int64)
        matching = [k for k, m in zip(matching, match.tolist()) if m]
        j += 1
    return num_accepted, final


def _stochastic(
    target_logits: Tensor,  # [T, V]
    draft_probs: Tensor | None,  # [D, V] or None
    layout: DraftLayout,
    st: SamplingTensors,  # [N] rows
    requests: list[int],  # S stochastic request indices
    counts: list[int],  # [S] their numbers of drafts
    positions: list[int] | None,  # [S] position each first row decides; None if no row is seeded
) -> tuple[Tensor, Tensor]:  # num_accepted [S], final token [S]
    sub = st.select(requests)
    idx = device_index(requests, target_logits.device)  # [S]
    target_rows = layout.target_rows[idx]  # [S, K + 1]
    tokens = layout.tokens[idx]  # [S, K]
    num_draft = layout.num_draft[idx]  # [S]
    target_probs = _target_probs(target_logits, target_rows, counts, sub)  # [T, V], S rows filled
    k_max = tokens.shape[1]

    target_at_draft = target_probs[target_rows[:, :k_max], tokens]  # [S, K]
    if draft_probs is None:
        draft_at_draft = torch.ones_like(target_at_draft)  # [S, K], one-hot drafts
    else:
        draft_at_draft = draft_probs[layout.draft_rows[idx], tokens].float()  # [S, K]
    uniform = _uniforms(sub.seeds, positions, counts, k_max, target_logits.device)  # [S, K]
    # u < target/draft, written without a division; a zero draft prob means a bogus draft: reject.
    accept = layout.valid[idx] & (draft_at_draft > 0) & (uniform * draft_at_draft < target_at_draft)
    num_accepted = _leading_true(accept)  # [S]

    stop_row = target_rows.gather(1, num_accepted.unsqueeze(1)).squeeze(1)  # [S]
    rejected = num_accepted < num_draft  # [S]
    draft_at_stop = _draft_at_stop(draft_probs, layout, idx, tokens, num_accepted, rejected,
                                   target_probs.shape[1])  # [S, V], zero rows at the bonus
    final_probs = residual_probs(target_probs[stop_row], draft_at_stop)  # [S, V]
    return num_accepted, sample_probs(final_probs, _final_generators(sub.seeds, positions, num_accepted))


def _final_generators(
    seeds: list[int | None],  # [S]
    positions: list[int] | None,  # [S]
    num_accepted: Tensor,  # [S]
) -> list[torch.Generator | None]:  # [S] the race generator of the position each final token takes
    if all(s is None for s in seeds):
        return [None] * len(seeds)
    assert positions is not None  # _check_shapes
    # Seeded rows only: which position the final token takes is known after acceptance.
    return [None if seed is None else keyed_generator(seed, pos + n, RACE_STREAM)
            for seed, pos, n in zip(seeds, positions, num_accepted.tolist())]


def _target_probs(
    target_logits: Tensor,  # [T, V]
    target_rows: Tensor,  # [S, K + 1]
    counts: list[int],  # [S] their numbers of drafts
    sub: SamplingTensors,  # [S]
) -> Tensor:  # [T, V]; only the S requests' rows are written
    width = target_rows.shape[1]
    # Request by request, indexed from the host's counts: a boolean mask would make the GPU
    # report its size first.
    index = torch.tensor([s * width + j for s, n in enumerate(counts) for j in range(n + 1)], dtype=torch.int64)
    rows = target_rows.flatten()[index.to(target_rows.device, non_blocking=True)]  # [sum(counts) + S]
    out = torch.empty(target_logits.shape, dtype=torch.float32, device=target_logits.device)
    out[rows] = logits_to_probs(target_logits[rows], sub.repeat([n + 1 for n in counts]))
    return out


def _draft_at_stop(
    draft_probs: Tensor | None,  # [D, V] or None
    layout: DraftLayout,
    idx: Tensor,  # [S]
    tokens: Tensor,  # [S, K]
    num_accepted: Tensor,  # [S]
    rejected: Tensor,  # [S] bool
    vocab: int,
) -> Tensor:  # [S, V]: the draft distribution at the first rejection, zeros if none
    out = torch.zeros(idx.shape[0], vocab, dtype=torch.float32, device=idx.device)
    if tokens.shape[1] == 0:
        return out  # no drafts anywhere, so only bonus tokens
    pos = num_accepted.clamp(max=tokens.shape[1] - 1).unsqueeze(1)  # [S, 1]
    if draft_probs is None:
        out.scatter_(1, tokens.gather(1, pos), 1.0)  # one-hot at the rejected draft token
    else:
        out = draft_probs[layout.draft_rows[idx].gather(1, pos).squeeze(1)].float()
    return out * rejected.unsqueeze(1)


def residual_probs(target_probs: Tensor, draft_probs: Tensor) -> Tensor:
    """norm(max(0, target_probs - draft_probs)) per row, [M, V] -> [M, V].

    Rows whose residual has (almost) no mass fall back to target_probs. A zero draft row
    (bonus position) gives target_probs back.
    """
    residual = (target_probs - draft_probs).clamp(min=0.0)  # [M, V]
    mass = residual.sum(dim=-1, keepdim=True)  # [M, 1]
    ok = mass > RESIDUAL_EPS  # [M, 1]
    return torch.where(ok, residual / torch.where(ok, mass, 1.0), target_probs)


def _uniforms(
    seeds: list[int | None], positions: list[int] | None, num_draft: list[int], k_max: int,
    device: torch.device,
) -> Tensor:  # [S, K] uniform [0, 1)
    uniform = torch.rand(len(seeds), k_max, device=device)  # unseeded rows, in one call
    for row, (seed, k) in enumerate(zip(seeds, num_draft)):
        if seed is not None and k > 0:
            assert positions is not None  # _check_shapes
            # Draft j decides position positions[row] + j: the first draw of that key.
            keyed = torch.cat([keyed_uniforms(seed, positions[row] + j, 1) for j in range(k)])  # [k]
            uniform[row, :k] = keyed.to(device, non_blocking=True)
    return uniform


def _leading_true(mask: Tensor) -> Tensor:
    """[M, K] bool -> [M] int64 count of leading True values (index of the first False)."""
    return mask.to(torch.int64).cumprod(dim=1).sum(dim=1)


def _check_shapes(
    target_logits: Tensor, draft_token_ids: list[list[int]], draft_probs: Tensor | None,
    st: SamplingTensors, positions: list[int] | None,
) -> None:
    num_draft = sum(len(d) for d in draft_token_ids)
    if target_logits.shape[0] != num_draft + len(draft_token_ids):
        raise ValueError(f"target_logits has {target_logits.shape[0]} rows, expected "
                         f"{num_draft + len(draft_token_ids)} (drafts + one bonus row each)")
    if draft_probs is not None and tuple(draft_probs.shape) != (num_draft, target_logits.shape[1]):
        raise ValueError(f"draft_probs shape {tuple(draft_probs.shape)}, expected "
                         f"({num_draft}, {target_logits.shape[1]})")
    if len(st) != len(draft_token_ids):
        raise ValueError(f"{len(st)} sampling rows for {len(draft_token_ids)} requests")
    check_positions(positions, st)


def check_positions(positions: list[int] | None, st: SamplingTensors) -> None:
    """Seeded sampled rows key their draws by position, so they need one."""
    if positions is None:
        if st.keyed_rows([True] * len(st)):
            raise ValueError("seeded requests need positions (the position each request's first row decides)")
    elif len(positions) != len(st):
        raise ValueError(f"{len(positions)} positions for {len(st)} requests")
