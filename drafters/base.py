"""The one interface every drafter implements, and the narrow context drafters are built from."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from specdec.config import SpeculativeConfig
from specdec.sampling_params import SamplingParams
from specdec.spec.policy import DraftOption
from specdec.spec.tree import DraftTree

if TYPE_CHECKING:
    from specdec.block_manager import BlockManager
    from specdec.model_runner import ModelRunner
    from specdec.models import LlamaForCausalLM


@dataclass(frozen=True)
class DraftRequest:
    """What a drafter sees of one request when asked for a draft."""

    request_id: str
    token_ids: list[int]  # prompt + committed output tokens, the last one (the root) not yet in the target KV
    num_draft_tokens: int  # draft nodes the step has room for (>= 1)
    max_depth: int  # the longest path that can still be committed (1 <= max_depth <= num_draft_tokens)
    sampling_params: SamplingParams


class Drafter(ABC):
    """Proposes draft trees for a batch of requests.

    Contract: `propose` returns one DraftTree per request, in order, rooted at the
    request's last token, with at most num_draft_tokens nodes beyond the root and no
    path deeper than max_depth (a chain is a tree with one child per node; the root
    alone means no guess). A drafter may keep per-request state (a KV cache); it must
    reconcile that state itself from `token_ids` (tokens it drafted that the target
    rejected no longer appear there) and release it in `free`. A drafter that reads the
    target's hidden states sets `reads_hidden` and gets them through `observe_hidden`; one
    that reads the inputs of some target layers (EAGLE-3) names them in `feature_layers`
    and gets them through `observe_features`.
    """

    reads_hidden = False  # True: the engine calls `observe_hidden` after each commit
    scores_nodes = False  # True: every tree's nodes carry chances (`DraftTree.chances`)
    # Target layers whose input hidden states (the residual stream entering them) the
    # drafter reads, in the order it reads them: the engine has its executor capture them
    # once, when the drafter is built, and calls `observe_features` after every step.
    feature_layers: tuple[int, ...] = ()

    @abstractmethod
    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]: ...

    def option(self, requests: list[DraftRequest], trees: list[DraftTree]) -> DraftOption | None:
        """A costlier source this drafter could add to some of these requests' trees (trees:
        what `propose` returned), for the policy to choose; None: it has none."""
        return None

    def extend(self, requests: list[DraftRequest], trees: list[DraftTree], chosen: list[int]) -> list[DraftTree]:
        """The trees with the option run for the chosen requests (indices into both lists)."""
        return trees

    def ready(self, request: DraftRequest) -> bool:
        """Whether the drafter holds what it drafts `request` from (a learned drafter: the
        target's hidden state or features up to the root); without it, it drafts nothing."""
        return True

    def observe_hidden(self, request_id: str, hidden: torch.Tensor) -> None:  # hidden [H]
        """The target's final hidden state at the row that produced the request's newest
        committed token (what its logits came from); called after each commit when
        `reads_hidden`, kept by the drafter until the request's next step or `free`."""

    def observe_features(self, request_id: str, start: int, features: torch.Tensor) -> None:  # features [n, F]
        """The captured features (`feature_layers` side by side, F = their count x the
        target's hidden size) of the request's tokens at positions start .. start + n - 1,
        once the target ran them and kept them: a prefill chunk's tokens, or a verify step's
        known tokens, root and accepted nodes (never a rejected node's). A position comes
        again when the target computes it again (after a preemption); positions a prefix
        cache hit skipped never come."""

    def free(self, request_id: str) -> None:
        """Forget a finished or aborted request."""

    def forget_cached(self) -> None:
        """Drop what the drafter keeps across requests (a cache of earlier outputs), so that
        nothing of the requests served so far can be drafted into later ones."""


class HiddenReader(Drafter):
    """A drafter that drafts from the target's hidden states (Medusa and recurrent heads):
    it keeps each request's newest one from `observe_hidden` until the request is freed."""

    reads_hidden = True

    def __init__(self) -> None:
        self._hidden: dict[str, torch.Tensor] = {}  # request id -> [H]

    def observe_hidden(self, request_id: str, hidden: torch.Tensor) -> None:
        self._hidden[request_id] = hidden

    def has_hidden(self, request_id: str) -> bool:
        return request_id in self._hidden

    def ready(self, request: DraftRequest) -> bool:
        return self.has_hidden(request.request_id)

    def target_hidden(self, request_id: str) -> torch.Tensor:  # [H]
        """The request's hidden state (ask only when `has_hidden`)."""
        hidden = self._hidden.get(request_id)
        if hidden is None:
            raise ValueError(f"request {request_id!r} has no target hidden state yet")
        return hidden

    def free(self, request_id: str) -> None:
        self._hidden.pop(request_id, None)


@dataclass(frozen=True)
class DrafterContext:
    """Everything a drafter may use of the engine it serves, and nothing more."""

    spec: SpeculativeConfig
    tokenizer: Any  # the target's (transformers) tokenizer: draft models must share its vocabulary
    target: LlamaForCausalLM  # embeddings, LM head and linear backend, read only
    device: torch.device
    dtype: torch.dtype  # the target's activation dtype, which a draft model runs in too
    linear_backend: str  # the target's linear backend name, for a draft model's projections
    max_model_len: int
    # A KV allocator for a draft model: (model, num_blocks) -> a runner over a fresh
    # paged cache of that many blocks of the engine's block size, and its block manager.
    allocate_kv: Callable[[LlamaForCausalLM, int], tuple[ModelRunner, BlockManager]]
    num_kv_blocks: int  # the target's KV blocks
    max_num_seqs: int
    # Drafters may replay their heads from CUDA graphs (on CUDA, unless enforce_eager).
    cuda_graphs: bool = False
    block_size: int = 16  # tokens per target KV block
