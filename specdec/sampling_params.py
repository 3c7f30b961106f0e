"""Per-request sampling settings, named as in vLLM.

Every field is checked at construction, its type first, so that a bad value is refused
where it is given, by a ValueError whose message starts with the field's name (the server
answers it with a 400 naming that field: server/errors.py), and never reaches a batch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

MAX_STOP_STRINGS = 16
MAX_N = 16
MAX_INT64 = 2**63
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values
# SamplingParams' fields by type, checked before anything else reads them.
_INTS = ("n", "top_k", "min_tokens")
_OPTIONAL_INTS = ("seed", "max_tokens", "logprobs")
_NUMBERS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
_BOOLS = ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output")
_TOKEN_ID_LISTS = ("stop_token_ids", "allowed_token_ids")


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
        self._check_types()  # first: what follows assumes them
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

    def _check_types(self) -> None:
        """Each field of the right type (texts encodable), before anything reads them."""
        for name in _INTS + _OPTIONAL_INTS:
            value = getattr(self, name)
            optional = name in _OPTIONAL_INTS
            _check(_is_int(value) or (optional and value is None),
                   f"{name} must be an integer{' or None' if optional else ''}, got {_shown(value)}")
        for name in _NUMBERS:
            value = getattr(self, name)
            _check(_is_number(value), f"{name} must be a finite number, got {_shown(value)}")
        for name in _BOOLS:
            value = getattr(self, name)
            _check(isinstance(value, bool), f"{name} must be True or False, got {_shown(value)}")
        for name in _TOKEN_ID_LISTS:
            value = getattr(self, name)
            _check(value is None or (_is_list(value) and all(_is_token_id(t) for t in value)),
                   f"{name} must be a list of non-negative integer token ids, got {_shown(value)}")
        self._check_texts()
        self._check_containers()

    def _check_texts(self) -> None:
        stop, words = self.stop, self.bad_words
        _check(stop is None or _is_text(stop) or (_is_list(stop) and all(_is_text(s) for s in stop)),
               f"stop must be a non-empty string or a list of non-empty strings, got {_shown(stop)}")
        _check(words is None or (_is_list(words) and all(_is_text(w) for w in words)),
               f"bad_words must be a list of non-empty strings, got {_shown(words)}")
        for name, texts in (("stop", [stop] if isinstance(stop, str) else stop), ("bad_words", words)):
            for index, text in enumerate(texts or []):
                at = lone_surrogate(text)
                _check(at is None, f"{name} is not valid text: string {index} has a lone surrogate at position {at}")

    def _check_containers(self) -> None:
        bias, sequences = self.logit_bias, self.bad_words_token_ids
        _check(bias is None or (isinstance(bias, dict) and all(_is_number(v) for v in bias.values())),
               f"logit_bias must be a dict of token id to a finite number, got {_shown(bias)}")
        _check(_is_list(sequences) and all(_is_list(ids) and ids and all(_is_token_id(t) for t in ids)
                                           for ids in sequences),
               f"bad_words_token_ids must be a list of non-empty lists of token ids, got {_shown(sequences)}")
        _check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
               f"structured_outputs must be a StructuredOutputsParams, got {type(self.structured_outputs).__name__}")

    def validate(self) -> None:
        """The values' ranges (their types are checked first, in __post_init__)."""
        _check(1 <= self.n <= MAX_N, f"n must be in [1, {MAX_N}], got {self.n}")
        _check(self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, f"top_k must be -1, 0 or positive, got {self.top_k}")
        # The sampler packs top_k into an int64 tensor for the whole batch: a larger value
        # would fail the step of every request batched with this one.
        _check(self.top_k < MAX_INT64, f"top_k must be below 2**63, got {self.top_k}")
        # Parallel sampling's children draw with seed + 0 .. n-1: each must stay in range too.
        _check(self.seed is None or 0 <= self.seed <= MAX_INT64 - self.n,
               f"seed must be -1 (random) or in [0, 2**63 - n], got {self.seed}")
        _check(self.max_tokens is None or self.max_tokens >= 1,
               f"max_tokens must be at least 1, got {self.max_tokens}")
        _check(self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}")
        _check(len(self.stop_strings) <= MAX_STOP_STRINGS,
               f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop_strings)}")
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
        _check(self.allowed_token_ids is None or bool(self.allowed_token_ids),
               "allowed_token_ids must be a non-empty list of non-negative integer token ids")

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


def lone_surrogate(text: str) -> int | None:
    """Where `text` has a lone surrogate (a str that no UTF-8 can carry: a tokenizer
    refuses it with a TypeError naming neither), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return error.start
    return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    """An int or float and finite: nan and inf pass no range check as meant, and turn a
    batch's logits into nan."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_list(value: Any) -> bool:
    return isinstance(value, (list, tuple))


def _is_text(value: Any) -> bool:
    return isinstance(value, str) and bool(value)


def _is_token_id(value: Any) -> bool:
    return _is_int(value) and value >= 0


def _shown(value: Any) -> str:
    """A value in a message, cut short."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _token_id(key: Any) -> int:
    """A logit_bias key: an int, or a string of one (JSON objects have string keys)."""
    if not (_is_int(key) or (isinstance(key, str) and key.strip().isdecimal())):
        raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
    token = int(key)
    if token < 0:
        raise ValueError(f"logit_bias keys must be non-negative token ids, got {key!r}")
    return token


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
