"""How many draft tokens each request may have this step: the speculation policy the
scheduler asks while it plans.

The scheduler gives the policy each decoding request's limit (what the token budget,
the request's room and the speculative config allow); the policy answers with the
number of draft tokens (tree nodes) it grants, 0 meaning plain decoding. `FixedSpeculation`
grants the limit; `specdec.spec.adaptive.AdaptiveSpeculation` grants what maximises expected
committed tokens per second.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from specdec.request import Request


@dataclass(frozen=True)
class DraftLimit:
    """The most a request may draft this step."""

    request: Request
    num_draft_tokens: int  # draft nodes (KV slots beyond the root) the step has room for
    max_depth: int  # the longest draft path that can still be committed (<= num_draft_tokens)


@dataclass(frozen=True)
class StepReport:
    """What a finished step measured, for policies that learn costs."""

    num_query_tokens: int  # target rows of the forward
    decode_only: bool  # every request ran one known token (no prefill chunk)
    max_draft_depth: int  # the deepest draft the drafter was asked for
    draft_seconds: float
    forward_seconds: float


class SpeculationPolicy(ABC):
    """Grants draft tokens per request.

    Contract: `grant(limits, base_tokens, base_commits)` returns one count per limit, in
    order, each within [0, limit.num_draft_tokens]. `base_tokens` is the number of known
    tokens the step runs without drafts and `base_commits` the number of requests that
    commit a token with none. The observe/forget hooks let a policy learn; no hook
    changes a request.
    """

    @abstractmethod
    def grant(self, limits: list[DraftLimit], base_tokens: int, base_commits: int) -> list[int]: ...

    def observe_step(self, report: StepReport) -> None:
        """A finished step's size and timings."""

    def observe_verify(self, request_id: str, num_drafted: int, num_accepted: int, num_nodes: int) -> None:
        """One request's verify: drafts offered along its deepest path, drafts accepted,
        and draft nodes verified (the tree's size)."""

    def forget(self, request_id: str) -> None:
        """The request finished; drop what is kept about it."""


class FixedSpeculation(SpeculationPolicy):
    """Every decoding request drafts as much as its limit allows."""

    def grant(self, limits: list[DraftLimit], base_tokens: int, base_commits: int) -> list[int]:
        return [limit.num_draft_tokens for limit in limits]
