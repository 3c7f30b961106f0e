"""Engine counters; speculative ones follow vLLM's spec-decode metrics."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# The counters that add up across generations, in the order reports list them (the
# per-position counts add up too, element by element; the rates derive from these).
COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_prompt_tokens",
            "num_generation_tokens", "num_steps")


@dataclass
class EngineMetrics:
    num_speculative_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_steps: int = 0

    def __post_init__(self) -> None:
        # The engine passes only k; a snapshot rebuilt from counts brings its own per-position list.
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_speculative_tokens

    @classmethod
    def from_dict(cls, stats: Mapping[str, Any]) -> EngineMetrics:
        """A snapshot from `get_metrics()`, `as_dict()` or `counters()` (extra keys are ignored)."""
        per_pos = [int(n) for n in stats["num_accepted_tokens_per_pos"]]
        return cls(len(per_pos), num_accepted_tokens_per_pos=per_pos, **{key: int(stats[key]) for key in COUNTERS})

    def observe_draft(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.num_accepted_tokens_per_pos[pos] += 1

    def __sub__(self, before: EngineMetrics) -> EngineMetrics:
        """What was counted since the `before` snapshot of the same engine."""
        per_pos = [a - b for a, b in zip(self.num_accepted_tokens_per_pos, before.num_accepted_tokens_per_pos)]
        counts = {key: getattr(self, key) - getattr(before, key) for key in COUNTERS}
        return EngineMetrics(len(per_pos), num_accepted_tokens_per_pos=per_pos, **counts)

    def __add__(self, other: EngineMetrics) -> EngineMetrics:
        """Counts of both; per-position lists of different lengths add up to the longer one."""
        a, b = self.num_accepted_tokens_per_pos, other.num_accepted_tokens_per_pos
        per_pos = [_at(a, i) + _at(b, i) for i in range(max(len(a), len(b)))]
        counts = {key: getattr(self, key) + getattr(other, key) for key in COUNTERS}
        return EngineMetrics(len(per_pos), num_accepted_tokens_per_pos=per_pos, **counts)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / max(self.num_draft_tokens, 1)

    @property
    def mean_accepted_length(self) -> float:
        """τ: tokens committed per verify step, the recovered or bonus token included."""
        return 1.0 + self.num_accepted_tokens / max(self.num_drafts, 1)

    @property
    def acceptance_per_pos(self) -> list[float]:
        """Share of drafts whose token at each position was accepted."""
        drafts = max(self.num_drafts, 1)
        return [n / drafts for n in self.num_accepted_tokens_per_pos]

    def counters(self) -> dict[str, Any]:
        """The additive counts only: what a delta or a sum of snapshots keeps."""
        return {**{key: getattr(self, key) for key in COUNTERS},
                "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos)}

    def as_dict(self) -> dict[str, object]:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generation_tokens": self.num_generation_tokens,
            "num_steps": self.num_steps,
        }


def _at(values: list[int], index: int) -> int:
    return values[index] if index < len(values) else 0
