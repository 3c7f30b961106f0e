"""Turns a forward's logits into committed tokens: every request's draft tree is verified
(a request with no draft is a root-only tree, which is plain sampling).

Greedy requests, chains and trees alike, take one argmax over their rows and walk their
trees on the host (`DraftTree.greedy_walk`): at a few rows per request that costs tens of
microseconds, where the vectorised samplers' set-up cost 0.4-1 ms a step on the CPU.
Sampled chains take a vectorised fast path (specdec/spec/rejection.py), sampled trees the
multi-candidate tree sampler (specdec/spec/tree_rejection.py); the two agree exactly on
chains, and no other module distinguishes them.

A seeded request's draws are keyed by the position they decide: its root row decides
the token right after its known ones (position num_tokens, counting the prompt), as in
plain decoding, so with deterministic drafts it commits exactly plain decoding's tokens."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specdec.logits_processors import process_logits
from specdec.model_runner import ForwardOutput
from specdec.outputs import SampleLogprobs
from specdec.sampler import SamplingTensors, argmax, top_logprobs
from specdec.scheduler import ScheduledRequest
from specdec.spec.rejection import rejection_sample
from specdec.spec.tree import DraftTree
from specdec.spec.tree_rejection import tree_verify


@dataclass
class Verified:
    tokens: list[int] = field(default_factory=list)  # accepted drafts, then one recovered/bonus token
    accepted_nodes: list[int] = field(default_factory=list)  # tree node ids of the accepted path
    hidden: torch.Tensor | None = None  # [H] hidden state of the row that produced the last token
    # [n, F] the target's captured features (EAGLE-3) of the rows whose tokens the step
    # keeps, positions features_start.. : its known tokens (a prefill chunk too), then the
    # root and the accepted nodes; None when the executor captures none
    features: torch.Tensor | None = None
    features_start: int = 0
    logprobs: SampleLogprobs | None = None  # per token, when the request asked for logprobs
    error: str | None = None  # the request failed here (what its client is told); nothing to commit


def verify(
    batch: list[ScheduledRequest],
    trees: list[DraftTree],  # [B] the trees the forward ran, rooted at each request's last known token
    output: ForwardOutput,
) -> list[Verified]:
    """Per scheduled request: what it commits (empty mid-prefill), or why it failed."""
    starts = row_starts(output.num_rows)
    results = [Verified() for _ in batch]
    logits, faults = process_logits(output.logits, [item.request for item in batch], trees,
                                    output.num_rows)  # [R, V]
    for i, message in faults.items():
        results[i].error = message
    active = [i for i, rows in enumerate(output.num_rows) if rows > 0 and i not in faults]
    greedy = [i for i in active if batch[i].request.sampling_params.greedy]
    sampled = [i for i in active if not batch[i].request.sampling_params.greedy]
    if greedy:
        _verify_greedy(trees, logits, output.num_rows, greedy, starts, results)
    chains = [i for i in sampled if trees[i].is_chain]
    branching = [i for i in sampled if not trees[i].is_chain]
    if chains:
        _verify_chains(batch, trees, logits, output.num_rows, chains, starts, results)
    if branching:
        _verify_trees(batch, trees, logits, output.num_rows, branching, starts, results)
    for i in active:
        _record(batch[i], output, starts[i], results[i])
    if output.features is not None:
        _keep_features(batch, trees, output.features, [i for i in range(len(batch)) if i not in faults], results)
    return results


def _keep_features(batch: list[ScheduledRequest], trees: list[DraftTree], features: torch.Tensor,  # [T, F]
                   kept: list[int], results: list[Verified]) -> None:
    """Each kept request's features of the rows it keeps (see Verified.features), gathered
    with one index over the step's query rows."""
    query_starts = row_starts([item.num_query_tokens(tree) for item, tree in zip(batch, trees)])
    index: list[int] = []
    spans = []
    for i in kept:
        item, first = batch[i], query_starts[i]
        if results[i].tokens:  # the known tokens, the root, then the accepted path
            root = first + item.num_new_tokens - 1
            rows = [*range(first, root + 1), *(root + node for node in results[i].accepted_nodes)]
        else:  # mid-prefill: every known token of the chunk
            rows = list(range(first, first + item.num_new_tokens))
        spans.append((i, len(index), len(rows)))
        index += rows
    gathered = features[torch.tensor(index, dtype=torch.long, device=features.device)]  # [sum n, F]
    for i, offset, count in spans:
        results[i].features = gathered[offset : offset + count]
        results[i].features_start = batch[i].request.num_computed_tokens


def row_starts(num_rows: Sequence[int]) -> list[int]:
    """Each request's first row in rows laid out request after request."""
    starts, total = [], 0
    for n in num_rows:
        starts.append(total)
        total += n
    return starts


def _sampling(batch: list[ScheduledRequest], rows: list[int]) -> SamplingTensors:
    return SamplingTensors.from_params([batch[i].request.sampling_params for i in rows])


def _positions(batch: list[ScheduledRequest], rows: list[int]) -> list[int]:
    """The position each request's root row decides: the one after its root token."""
    return [batch[i].request.num_computed_tokens + batch[i].num_new_tokens for i in rows]


def _gather_rows(logits: torch.Tensor, num_rows: list[int], rows: list[int],
                 starts: list[int]) -> torch.Tensor:  # [R, V] -> the given requests' rows
    index = [r for i in rows for r in range(starts[i], starts[i] + num_rows[i])]
    if len(index) == logits.shape[0]:
        return logits
    return logits[torch.tensor(index)]


def _verify_greedy(trees: list[DraftTree], logits: torch.Tensor, num_rows: list[int], rows: list[int],
                   starts: list[int], results: list[Verified]) -> None:
    picks = argmax(_gather_rows(logits, num_rows, rows, starts)).tolist()  # [sum of their rows]
    offset = 0
    for i in rows:
        results[i].accepted_nodes, results[i].tokens = trees[i].greedy_walk(picks[offset:offset + num_rows[i]])
        offset += num_rows[i]


def _verify_chains(batch: list[ScheduledRequest], trees: list[DraftTree], logits: torch.Tensor, num_rows: list[int],
                   rows: list[int], starts: list[int], results: list[Verified]) -> None:
    for group in _chain_groups(batch, trees, rows):
        drafts = [trees[i].token_ids[1:] for i in group]
        probs = _stack_draft_probs(drafts, [_chain_probs(trees[i]) for i in group], logits.shape[1])
        sampled = rejection_sample(_gather_rows(logits, num_rows, group, starts), drafts, probs,
                                   _sampling(batch, group), _positions(batch, group))
        for i, tokens in zip(group, sampled):
            results[i].tokens = tokens
            results[i].accepted_nodes = list(range(1, len(tokens)))


def _chain_groups(batch: list[ScheduledRequest], trees: list[DraftTree], rows: list[int]) -> list[list[int]]:
    """Usually all chains in one call. When sampled drafts (with probabilities) share the
    step, seeded sampled requests with deterministic drafts get a call of their own:
    against a batch-wide draft_probs they would be verified by residuals, not by the
    keyed race that reproduces plain decoding."""
    if all(trees[i].draft_probs is None for i in rows):
        return [rows]
    keyed = [i for i in rows if trees[i].draft_probs is None and trees[i].num_drafts > 0
             and batch[i].request.sampling_params.seed is not None
             and not batch[i].request.sampling_params.greedy]
    taken = set(keyed)
    rest = [i for i in rows if i not in taken]
    return [group for group in (keyed, rest) if group]


def _verify_trees(batch: list[ScheduledRequest], trees: list[DraftTree], logits: torch.Tensor, num_rows: list[int],
                  rows: list[int], starts: list[int], results: list[Verified]) -> None:
    verified = tree_verify(_gather_rows(logits, num_rows, rows, starts), [trees[i] for i in rows],
                           _sampling(batch, rows), _positions(batch, rows))
    for i, result in zip(rows, verified):
        results[i].tokens = result.tokens
        results[i].accepted_nodes = result.accepted_nodes


def _chain_probs(tree: DraftTree) -> torch.Tensor | None:  # [num_drafts, V] or None
    """A chain's draft rows without the root's unused row."""
    return None if tree.draft_probs is None else tree.draft_probs[1:]


def _stack_draft_probs(
    drafts: list[list[int]], probs: list[torch.Tensor | None], vocab: int
) -> torch.Tensor | None:  # [sum(num_drafts), V] or None when no drafter gave probabilities
    if all(p is None for p in probs):
        return None
    device = next(p.device for p in probs if p is not None)
    rows = []
    for tokens, p in zip(drafts, probs):
        if tokens:
            rows.append(p if p is not None else
                        torch.nn.functional.one_hot(torch.tensor(tokens, device=device), vocab).float())
    return torch.cat(rows) if rows else None


def _record(item: ScheduledRequest, output: ForwardOutput, start: int, result: Verified) -> None:
    """Logprobs of the emitted tokens, and the hidden state that produced the last one
    (into `result`: the request itself is written only when its tokens are committed).

    Emitted token j comes from the row of the j-th node on the accepted path (node 0 is
    the last committed token), for chains and trees alike.
    """
    rows = [start, *(start + node for node in result.accepted_nodes)]
    result.hidden = output.hidden[rows[-1]]
    num_top = item.request.sampling_params.logprobs
    if num_top is not None:  # from the raw logits, before any transform (as vLLM's default)
        logits = output.logits[torch.tensor(rows)]
        detokenizer = item.request.detokenizer
        decode = detokenizer.decode_token if detokenizer is not None else None
        result.logprobs = top_logprobs(logits, torch.tensor(result.tokens), num_top, decode)
