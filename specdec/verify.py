"""Turns a forward's logits into committed tokens: plain sampling, chain or tree verification."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec.model_runner import ForwardOutput
from specdec.rejection import rejection_sample
from specdec.sampler import SamplingTensors, top_logprobs
from specdec.scheduler import ScheduledRequest


@dataclass
class Verified:
    tokens: list[int] = field(default_factory=list)  # accepted drafts, then one recovered/bonus token
    accepted_nodes: list[int] = field(default_factory=list)  # tree node ids of the accepted path
    hidden: torch.Tensor | None = None  # [H] hidden state of the row that produced the last token


def verify(
    batch: list[ScheduledRequest],
    output: ForwardOutput,
    draft_probs: list[torch.Tensor | None],  # per request: [num_drafts, V] or None
) -> list[Verified]:
    """Per scheduled request: what it commits (empty mid-prefill)."""
    starts = _row_starts(output.num_rows)
    results = [Verified() for _ in batch]
    active = [i for i, rows in enumerate(output.num_rows) if rows > 0]
    trees = [i for i in active if batch[i].tree is not None]
    chains = [i for i in active if batch[i].tree is None]
    if chains:
        _verify_chains(batch, output, draft_probs, chains, starts, results)
    if trees:
        _verify_trees(batch, output, trees, starts, results)
    for i in active:
        _record(batch[i], output, starts[i], results[i])
    return results


def _row_starts(num_rows: list[int]) -> list[int]:
    starts, total = [], 0
    for n in num_rows:
        starts.append(total)
        total += n
    return starts


def _sampling(batch: list[ScheduledRequest], rows: list[int]) -> SamplingTensors:
    requests = [batch[i].request for i in rows]
    return SamplingTensors.from_params([r.sampling_params for r in requests], [r.generator for r in requests])


def _gather_rows(output: ForwardOutput, rows: list[int], starts: list[int]) -> torch.Tensor:
    index = [r for i in rows for r in range(starts[i], starts[i] + output.num_rows[i])]
    if len(index) == output.logits.shape[0]:
        return output.logits
    return output.logits[torch.tensor(index)]


def _verify_chains(batch: list[ScheduledRequest], output: ForwardOutput, draft_probs: list[torch.Tensor | None],
                   rows: list[int], starts: list[int], results: list[Verified]) -> None:
    drafts = [batch[i].draft_token_ids for i in rows]
    probs = _stack_draft_probs(drafts, [draft_probs[i] for i in rows], output.logits.shape[1])
    sampled = rejection_sample(_gather_rows(output, rows, starts), drafts, probs, _sampling(batch, rows))
    for i, tokens in zip(rows, sampled):
        results[i].tokens = tokens
        results[i].accepted_nodes = list(range(1, len(tokens)))


def _verify_trees(batch: list[ScheduledRequest], output: ForwardOutput, rows: list[int], starts: list[int],
                  results: list[Verified]) -> None:
    from specdec.tree_rejection import tree_verify

    trees = [batch[i].tree for i in rows]
    verified = tree_verify(_gather_rows(output, rows, starts), trees, _sampling(batch, rows))  # type: ignore[arg-type]
    for i, result in zip(rows, verified):
        results[i].tokens = result.tokens
        results[i].accepted_nodes = result.accepted_nodes


def _stack_draft_probs(
    drafts: list[list[int]], probs: list[torch.Tensor | None], vocab: int
) -> torch.Tensor | None:  # [sum(num_drafts), V] or None when no drafter gave probabilities
    if all(p is None for p in probs):
        return None
    rows = []
    for tokens, p in zip(drafts, probs):
        if tokens:
            rows.append(p if p is not None else torch.nn.functional.one_hot(torch.tensor(tokens), vocab).float())
    return torch.cat(rows) if rows else None


def _record(item: ScheduledRequest, output: ForwardOutput, start: int, result: Verified) -> None:
    """Logprobs of the emitted tokens, and the hidden state that produced the last one.

    Emitted token j comes from the row of the j-th node on the accepted path (node 0 is
    the last committed token), for chains and trees alike.
    """
    rows = [start, *(start + node for node in result.accepted_nodes)]
    result.hidden = output.hidden[rows[-1]]
    num_top = item.request.sampling_params.logprobs
    if num_top is not None:
        logits = output.logits[torch.tensor(rows)]
        item.request.output_logprobs.extend(top_logprobs(logits, torch.tensor(result.tokens), num_top))
