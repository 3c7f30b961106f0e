"""Request outputs shaped like vLLM's RequestOutput / CompletionOutput / Logprob."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's log-probability, as vLLM's `Logprob`.

    rank is 1-based among the model's tokens (1: the most likely; ties share the better rank).
    """

    logprob: float
    rank: int
    decoded_token: str | None = None


# one dict per output token: {token_id: Logprob}, the sampled token first, then the top-k
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    logprobs: SampleLogprobs | None = None  # None unless the request asked for logprobs
    cumulative_logprob: float | None = None  # sum of the sampled tokens' logprobs (with logprobs only)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None
