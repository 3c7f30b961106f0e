"""Per-request sampling settings, named as in vLLM."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

MAX_STOP_STRINGS = 16
MAX_N = 16
MAX_INT64 = 2**63
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on the output, named as vLLM's: exactly one of these is set. The engine
    compiles it with llguidance (specdec/structured_output.py) and masks every position
    the grammar forbids, in plain decoding and in verification alike."""

    json: str | dict[str, Any] | None = None  # a JSON schema (a dict, or its JSON text)
    regex: str | None = None
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # a Lark grammar in llguidance's dialect (it may embed `%json {schema}`)
    json_object: bool = False  # any JSON object

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        _check(len(given) == 1, "structured outputs need exactly one of json, regex, choice, grammar or "
                                f"json_object, got {given or 'none'}")
        _check(self.choice is None or (bool(self.choice) and all(isinstance(c, str) and c for c in self.choice)),
               "structured outputs choice must be a non-empty list of non-empty strings")
        _check(all(v is None or isinstance(v, str) for v in (self.regex, self.grammar)),
               "structured outputs regex and grammar must be strings")
        _check(self.json is None or isinstance(self.json, (str, dict)),
               "structured outputs json must be a JSON schema (an object or its JSON text)")


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
    min_p: float = 0.0  # drop tokens below min_p times the most likely token's probability
    repetition_penalty: float = 1.0  # > 1 discourages tokens of the prompt and output (divides/multiplies logits)
    presence_penalty: float = 0.0  # subtracted from the logit of every token already in the output
    frequency_penalty: float = 0.0  # subtracted once per occurrence in the output
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    allowed_token_ids: list[int] | None = None  # only these tokens may be sampled
    bad_words: list[str] | None = None  # words that may not be generated (tokenized by the engine)
    # bad_words as token-id sequences, with and without a leading space (`tokenized`)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    structured_outputs: StructuredOutputsParams | None = None  # a grammar the output must follow
    stop_strings: list[str] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        stop = self.stop
        self.stop_strings = [stop] if isinstance(stop, str) else list(stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.seed == -1:  # as in vLLM: a random seed
            self.seed = None
        if self.logit_bias is not None:
            self.logit_bias = {_token_id(k): float(v) for k, v in self.logit_bias.items()}
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
        _check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        _check(self.repetition_penalty > 0.0, f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        _check(-2.0 <= self.presence_penalty <= 2.0,
               f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        _check(-2.0 <= self.frequency_penalty <= 2.0,
               f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        _check(all(-MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS for v in (self.logit_bias or {}).values()),
               f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        _check(self.allowed_token_ids is None
               or (bool(self.allowed_token_ids) and all(_is_token_id(t) for t in self.allowed_token_ids)),
               "allowed_token_ids must be a non-empty list of non-negative integer token ids")
        _check(all(isinstance(w, str) and w for w in self.bad_words or []),
               "bad_words must be a list of non-empty strings")

    def token_ids_used(self) -> list[int]:
        """Token ids these settings name (the engine checks them against its vocabulary)."""
        return [*(self.logit_bias or {}), *(self.allowed_token_ids or []), *(self.stop_token_ids or [])]

    def tokenized(self, tokenizer: Any) -> SamplingParams:
        """A copy with bad_words as token-id sequences, each with and without a leading
        space (a word mid-sentence is usually its space-prefixed token), as vLLM does."""
        if not self.bad_words:
            return self
        sequences: list[list[int]] = []
        for word in self.bad_words:
            for text in (word, " " + word.lstrip()):
                ids = list(tokenizer.encode(text, add_special_tokens=False))
                if ids and ids not in sequences:
                    sequences.append(ids)
        return replace(self, bad_words_token_ids=sequences)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _token_id(key: Any) -> int:
    """A logit_bias key: an int, or a string of one (JSON objects have string keys)."""
    try:
        token = int(key)
    except (TypeError, ValueError):
        raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
    if token < 0 or isinstance(key, bool):
        raise ValueError(f"logit_bias keys must be non-negative token ids, got {key!r}")
    return token


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
