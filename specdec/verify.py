"""Turns a forward's logits into committed tokens: plain sampling or draft verification."""
from __future__ import annotations

import torch

from specdec.model_runner import ForwardOutput
from specdec.rejection import rejection_sample
from specdec.sampler import SamplingTensors, top_logprobs
from specdec.scheduler import ScheduledRequest


def verify(
    batch: list[ScheduledRequest],
    output: ForwardOutput,
    draft_probs: list[torch.Tensor | None],  # per request: [num_drafts, V] or None
) -> list[list[int]]:
    """Per scheduled request: accepted drafts + one recovered/bonus token ([] mid-prefill)."""
    active = [i for i, rows in enumerate(output.num_rows) if rows > 0]
    results: list[list[int]] = [[] for _ in batch]
    if not active:
        return results
    requests = [batch[i].request for i in active]
    st = SamplingTensors.from_params([r.sampling_params for r in requests], [r.generator for r in requests])
    drafts = [batch[i].draft_token_ids for i in active]
    probs = _stack_draft_probs(drafts, [draft_probs[i] for i in active], output.logits.shape[1])
    for i, tokens in zip(active, rejection_sample(output.logits, drafts, probs, st)):
        results[i] = tokens
    _record_logprobs(batch, active, output, results)
    return results


def _stack_draft_probs(
    drafts: list[list[int]], probs: list[torch.Tensor | None], vocab: int
) -> torch.Tensor | None:  # [sum(num_drafts), V] or None when no drafter gave probabilities
    if all(p is None for p in probs):
        return None
    rows = []
    for tokens, p in zip(drafts, probs):
        if tokens:
            rows.append(p if p is not None else torch.nn.functional.one_hot(
                torch.tensor(tokens), vocab).float())
    return torch.cat(rows) if rows else None


def _record_logprobs(batch: list[ScheduledRequest], active: list[int], output: ForwardOutput,
                     results: list[list[int]]) -> None:
    row = 0
    for i in active:
        request = batch[i].request
        num_rows = output.num_rows[i]
        num_top = request.sampling_params.logprobs
        if num_top is not None:
            tokens = torch.tensor(results[i])
            logits = output.logits[row : row + len(tokens)]
            request.output_logprobs.extend(top_logprobs(logits, tokens, num_top))
        row += num_rows
