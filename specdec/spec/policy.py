"""The speculation policy: the one owner of every request's draft budget.

It decides three things each step, and nothing else decides them:
- `grant`: before drafting, how many draft tokens (tree nodes) each decoding request may
  have, 0 meaning plain decoding (the scheduler reserves their KV slots);
- `choose`: after drafting, which requests get a costlier draft source a drafter offers
  (learned heads beside suffix decoding);
- `select`: which of the drafted nodes each request verifies. Drafters that score their
  nodes (`DraftTree.chances`) are cut here by worth; the others were sized by `grant`.
`FixedSpeculation` grants every limit and verifies everything drafted;
`specdec.spec.adaptive.AdaptiveSpeculation` chooses all three for the most expected
committed tokens per second.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

from specdec.request import Request
from specdec.spec.tree import DraftTree


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


@dataclass(frozen=True)
class DraftOption:
    """A costlier draft source a drafter can add to some requests' trees this step: what
    each would gain and add, and what drafting costs, for the policy to choose."""

    gains: dict[int, float]  # request index (in the trees given) -> expected extra committed tokens
    rows: dict[int, int]  # request index -> verify rows its tree would grow by
    seconds: Callable[[int], float]  # drafting time for that many requests together


class SpeculationPolicy(ABC):
    """Grants draft tokens per request, chooses draft options, selects the nodes to verify.

    Contract: `grant(limits, base_tokens, base_commits)` returns one count per limit, in
    order, each within [0, limit.num_draft_tokens]. `base_tokens` is the number of known
    tokens the step runs without drafts and `base_commits` the number of requests that
    commit a token with none. `choose` returns request indices of the option's gains;
    `select` returns one tree per tree given, each an ancestor-closed subtree of it (the
    root at least). The observe/forget hooks let a policy learn; no hook changes a request.
    """

    @abstractmethod
    def grant(self, limits: list[DraftLimit], base_tokens: int, base_commits: int) -> list[int]: ...

    def choose(self, trees: list[DraftTree], option: DraftOption) -> list[int]:
        """The requests that get the option (trees: every decoding request's draft so far):
        by default each one it promises to help."""
        return sorted(i for i, gain in option.gains.items() if gain > 0)

    def weighs_options(self) -> bool:
        """Whether the drafter's option is to be offered (`choose`) this step: a policy may
        skip weighing it on some steps, since offering costs the drafter time too."""
        return True

    def select(self, trees: list[DraftTree]) -> list[DraftTree]:
        """The nodes each request verifies (trees: one per decoding request of the step):
        by default everything drafted."""
        return trees

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
