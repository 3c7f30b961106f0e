"""The one interface every drafter implements."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specdec.sampling_params import SamplingParams

if TYPE_CHECKING:
    from specdec.drafters.tree import DraftTree


@dataclass
class DraftRequest:
    """What a drafter sees of one request when asked for a draft."""

    request_id: str
    token_ids: list[int]  # prompt + committed output tokens, the last one not yet in the target KV
    num_tokens: int  # chain length, or a tree's depth, the scheduler has room for (>= 1)
    sampling_params: SamplingParams
    max_nodes: int = 0  # > 0: a tree of at most this many draft nodes may be proposed
    # [H] the target's final hidden state at the last committed token's predecessor
    # (what produced that token's logits), for drafters that read it (Medusa).
    hidden: torch.Tensor | None = None


@dataclass
class Draft:
    token_ids: list[int]  # at most DraftRequest.num_tokens; may be empty (no guess)
    # [len(token_ids), vocab] draft distribution after the request's sampling transforms,
    # or None: the draft is then treated as one-hot by the rejection sampler.
    probs: torch.Tensor | None = None
    # A tree instead of a chain (token_ids then unused): node 0 is the last committed token.
    tree: DraftTree | None = None


class Drafter(ABC):
    """Proposes draft tokens for a batch of requests.

    Contract: `propose` returns one Draft per request, in order, each no longer than the
    request's num_tokens. A drafter may keep per-request state (a KV cache); it must
    reconcile that state itself from `token_ids` (tokens it drafted that the target
    rejected no longer appear there) and release it in `free`.
    """

    @abstractmethod
    def propose(self, requests: list[DraftRequest]) -> list[Draft]: ...

    def free(self, request_id: str) -> None:
        """Forget a finished or aborted request."""
