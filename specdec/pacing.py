"""Prefill pacing: how many prompt tokens a step may prefill while other requests decode.

A long prompt prefilled in max_num_batched_tokens chunks makes every step slow (seconds
on 2 cores), so running requests get a token only every few seconds. Like vLLM's
decode-first budgets, the scheduler cuts prefill chunks while anything decodes; the cut
is sized in time, from measured steps: with a step of D seconds of decode work and t
seconds per prefill token, a chunk of c tokens takes about D + c * t. The estimate of t
used here is the whole step's time over its prefill tokens, which overstates t by D / c;
feeding it back, the chunk settles where D + c * t equals the target, the step time asked for.
"""
from __future__ import annotations

from specdec.config import EngineConfig

FIRST_GUESS_SECONDS_PER_TOKEN = 2e-3  # until a step is measured (a 135M model on 2 cores: ~1-4 ms)
SMOOTHING = 0.3  # weight of the newest measurement; prefill cost grows with context, so track it
MIN_CHUNK = 16  # a long prompt always advances, however slow the machine


class PrefillPacer:
    """Sizes prefill chunks from the measured cost of prefill tokens."""

    @classmethod
    def from_config(cls, config: EngineConfig) -> PrefillPacer:
        return cls(config.prefill_step_target_ms / 1000, config.max_num_batched_tokens)

    def __init__(self, target_seconds: float, max_tokens: int) -> None:
        self.target_seconds = target_seconds  # 0: no pacing
        self.max_tokens = max_tokens
        self.seconds_per_token = FIRST_GUESS_SECONDS_PER_TOKEN

    def limit(self, others_decoding: bool) -> int:
        """Prefill tokens one step may run (across all its prefilling requests)."""
        if not others_decoding or self.target_seconds <= 0:
            return self.max_tokens
        return max(MIN_CHUNK, min(self.max_tokens, int(self.target_seconds / self.seconds_per_token)))

    def observe(self, prefill_tokens: int, step_seconds: float) -> None:
        """A finished step that prefilled `prefill_tokens` tokens in `step_seconds`."""
        if prefill_tokens >= MIN_CHUNK:
            per_token = step_seconds / prefill_tokens
            self.seconds_per_token += SMOOTHING * (per_token - self.seconds_per_token)
