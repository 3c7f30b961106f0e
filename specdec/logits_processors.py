"""Per-request logits transforms applied before sampling and verification: logit_bias,
allowed_token_ids, bad_words, min_tokens (EOS and stop ids masked), the repetition,
presence and frequency penalties (vLLM's semantics), and structured outputs' grammar masks.

Every verified row gets exactly the transform plain decoding would give that position:
row u of a request's draft tree predicts the token after node u, so its history is the
request's output so far plus the drafts on the path from the root to u (the root itself
is the last committed token, already in the output, or the prompt's last token). Greedy
argmax and rejection sampling then both read the transformed logits, so speculation stays
lossless under these settings.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from specdec.faults import fault_message
from specdec.request import Request
from specdec.sampling_params import SamplingParams
from specdec.spec.tree import DraftTree


def needs_processing(params: SamplingParams) -> bool:
    return bool(params.logit_bias or params.allowed_token_ids is not None or params.bad_words_token_ids
                or params.min_tokens or params.repetition_penalty != 1.0 or params.presence_penalty
                or params.frequency_penalty)


def process_logits(
    logits: Tensor,  # [R, V]: per request with rows, one row per tree node, in batch order
    requests: Sequence[Request],  # [B]
    trees: Sequence[DraftTree],  # [B]
    num_rows: Sequence[int],  # [B] rows per request (0 or the tree's node count)
) -> tuple[Tensor, dict[int, str]]:  # [R, V] float32, a new tensor where any row changed; faults
    """The logits every row samples from, after its request's transforms, and the requests
    whose transforms failed (batch index -> what their client is told): a grammar that
    fails fails its own request, not the batch."""
    start, out = 0, logits
    faults: dict[int, str] = {}
    for index, (request, tree, rows) in enumerate(zip(requests, trees, num_rows, strict=True)):
        if rows and (needs_processing(request.sampling_params) or request.grammar is not None):
            if out is logits:
                out = logits.float().clone()
            try:
                _process_request(out[start:start + rows], request, tree)  # [rows, V] in place
            except Exception as error:  # noqa: BLE001 - one request's fault
                faults[index] = fault_message(request.request_id, error, "masking")
        start += rows
    return out, faults


def _process_request(rows: Tensor, request: Request, tree: DraftTree) -> None:  # rows [N, V] in place
    paths = [_drafts_to(tree, node) for node in range(rows.shape[0])]
    for node, path in enumerate(paths):
        _process_row(rows[node], request, request.output_token_ids + path)  # [V] in place
    if request.grammar is not None:
        _mask_rows(rows, request.grammar.masks(paths), request)


def _drafts_to(tree: DraftTree, node: int) -> list[int]:
    """The drafts on the path to `node` (the root excluded): with the committed output,
    the tokens before the one row `node` predicts."""
    return [tree.token_ids[n] for n in tree.path_to(node)[1:]]


def _mask_rows(rows: Tensor, allowed: Tensor, request: Request) -> None:  # rows [N, V] in place, allowed [N, V]
    """Forbid what the grammar forbids. A row left with nothing (the grammar is complete
    but min_tokens or a ban forbids EOS) may take EOS, so the request ends rather than
    sampling from nothing."""
    rows.masked_fill_(~allowed.to(rows.device), float("-inf"))
    dead = torch.isneginf(rows).all(dim=1)  # [N]
    if dead.any() and request.eos_token_ids:
        eos = torch.tensor(sorted(request.eos_token_ids), dtype=torch.long)
        rows[dead.nonzero().squeeze(1).unsqueeze(1), eos] = 0.0


def _process_row(row: Tensor, request: Request, history: list[int]) -> None:  # row [V], in place
    params = request.sampling_params
    vocab = row.shape[0]
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(request.prompt_token_ids) | set(history)), dtype=torch.long)
        seen = seen[seen < vocab]
        values = row[seen]
        row[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if history and (params.presence_penalty or params.frequency_penalty):
        counts = torch.bincount(torch.tensor(history, dtype=torch.long, device=row.device),
                                minlength=vocab)[:vocab].float()  # [V]
        row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long)
        row[ids] += torch.tensor(list(params.logit_bias.values()), dtype=row.dtype, device=row.device)
    banned = _banned(request, history)
    if banned:
        row[torch.tensor(banned, dtype=torch.long)] = float("-inf")
    if params.allowed_token_ids is not None:
        keep = torch.zeros(vocab, dtype=torch.bool, device=row.device)
        keep[torch.tensor(params.allowed_token_ids, dtype=torch.long)] = True
        row.masked_fill_(~keep, float("-inf"))


def _banned(request: Request, history: list[int]) -> list[int]:
    """Tokens this position may not take: EOS and stop ids before min_tokens, and the last
    token of every bad word whose other tokens end the history."""
    params = request.sampling_params
    banned: list[int] = []
    if len(history) < params.min_tokens:
        banned += list(params.stop_token_ids or [])
        if not params.ignore_eos:
            banned += list(request.eos_token_ids)
    for word in params.bad_words_token_ids:
        prefix = word[:-1]
        if not prefix or history[-len(prefix):] == prefix:
            banned.append(word[-1])
    return banned
