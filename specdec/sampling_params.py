"""Per-request sampling settings, named as in vLLM."""
from __future__ import annotations

from dataclasses import dataclass, field

MAX_STOP_STRINGS = 16
MAX_N = 16
MAX_INT64 = 2**63


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per output token
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stop_strings: list[str] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        stop = self.stop
        self.stop_strings = [stop] if isinstance(stop, str) else list(stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        _check(1 <= self.n <= MAX_N, f"n must be in [1, {MAX_N}], got {self.n}")
        _check(self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, f"top_k must be -1, 0 or positive, got {self.top_k}")
        # The sampler packs top_k into an int64 tensor for the whole batch: a larger value
        # would fail the step of every request batched with this one.
        _check(self.top_k < MAX_INT64, f"top_k must be below 2**63, got {self.top_k}")
        _check(self.max_tokens is None or self.max_tokens >= 1,
               f"max_tokens must be at least 1, got {self.max_tokens}")
        _check(self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}")
        _check(all(isinstance(s, str) and s for s in self.stop_strings),
               "stop must be a non-empty string or a list of non-empty strings")
        _check(len(self.stop_strings) <= MAX_STOP_STRINGS,
               f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop_strings)}")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids or []),
               "stop_token_ids must be non-negative integers")
        _check(self.logprobs is None or 0 <= self.logprobs <= 20,
               f"logprobs must be in [0, 20], got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
