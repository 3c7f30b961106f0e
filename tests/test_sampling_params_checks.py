"""SamplingParams checks every field's type and value where it is built (issue 41): a bad
one is a ValueError whose message starts with the field's name, which the server answers
with a 400 naming that field (server/errors.py), instead of an error from inside a batch
step later. No engine is needed."""
from __future__ import annotations

import math
from typing import Any

import pytest

from server.errors import _SAMPLING_FIELDS, params_error
from specdec.sampling_params import SamplingParams, StructuredOutputsParams, lone_surrogate

BAD = [
    ("seed", "x", "seed must be an integer or None, got 'x'"),
    ("seed", True, "seed must be an integer or None, got True"),
    ("seed", 1.0, "seed must be an integer or None, got 1.0"),
    ("seed", -2, "seed must be -1 (random) or in [0, 2**63 - n], got -2"),
    ("seed", 2**63, "seed must be -1 (random) or in [0, 2**63 - n]"),
    ("max_tokens", 1.5, "max_tokens must be an integer or None, got 1.5"),
    ("max_tokens", "16", "max_tokens must be an integer or None, got '16'"),
    ("n", True, "n must be an integer, got True"),
    ("n", 2.0, "n must be an integer, got 2.0"),
    ("top_k", "5", "top_k must be an integer, got '5'"),
    ("min_tokens", None, "min_tokens must be an integer, got None"),
    ("logprobs", 1.5, "logprobs must be an integer or None, got 1.5"),
    ("temperature", "0.5", "temperature must be a finite number, got '0.5'"),
    ("temperature", math.nan, "temperature must be a finite number, got nan"),
    ("temperature", math.inf, "temperature must be a finite number, got inf"),
    ("temperature", False, "temperature must be a finite number, got False"),
    ("top_p", math.nan, "top_p must be a finite number, got nan"),
    ("min_p", None, "min_p must be a finite number, got None"),
    ("repetition_penalty", math.inf, "repetition_penalty must be a finite number, got inf"),
    ("presence_penalty", "1", "presence_penalty must be a finite number, got '1'"),
    ("frequency_penalty", -math.inf, "frequency_penalty must be a finite number, got -inf"),
    ("ignore_eos", "yes", "ignore_eos must be True or False, got 'yes'"),
    ("skip_special_tokens", 1, "skip_special_tokens must be True or False, got 1"),
    ("include_stop_str_in_output", None, "include_stop_str_in_output must be True or False, got None"),
    ("stop", 5, "stop must be a non-empty string or a list of non-empty strings, got 5"),
    ("stop", ["a", 5], "stop must be a non-empty string or a list of non-empty strings, got ['a', 5]"),
    ("stop", "", "stop must be a non-empty string or a list of non-empty strings, got ''"),
    ("stop", "ab\ud800", "stop is not valid text: string 0 has a lone surrogate at position 2"),
    ("stop", ["ok", "\udfffx"], "stop is not valid text: string 1 has a lone surrogate at position 0"),
    ("stop_token_ids", 5, "stop_token_ids must be a list of non-negative integer token ids, got 5"),
    ("stop_token_ids", [1, True], "stop_token_ids must be a list of non-negative integer token ids, got [1, True]"),
    ("stop_token_ids", [-1], "stop_token_ids must be a list of non-negative integer token ids, got [-1]"),
    ("allowed_token_ids", [1.0], "allowed_token_ids must be a list of non-negative integer token ids, got [1.0]"),
    ("allowed_token_ids", [], "allowed_token_ids must be a non-empty list"),
    ("bad_words", "word", "bad_words must be a list of non-empty strings, got 'word'"),
    ("bad_words", ["a\udc00"], "bad_words is not valid text: string 0 has a lone surrogate at position 1"),
    ("bad_words_token_ids", [[]], "bad_words_token_ids must be a list of non-empty lists of token ids, got [[]]"),
    ("bad_words_token_ids", [[1, "2"]], "bad_words_token_ids must be a list of non-empty lists of token ids"),
    ("logit_bias", [1, 2], "logit_bias must be a dict of token id to a finite number, got [1, 2]"),
    ("logit_bias", {1: "x"}, "logit_bias must be a dict of token id to a finite number, got {1: 'x'}"),
    ("logit_bias", {1: math.nan}, "logit_bias must be a dict of token id to a finite number, got {1: nan}"),
    ("logit_bias", {1.5: 1.0}, "logit_bias keys must be token ids, got 1.5"),
    ("logit_bias", {True: 1.0}, "logit_bias keys must be token ids, got True"),
    ("logit_bias", {"-3": 1.0}, "logit_bias keys must be token ids, got '-3'"),
    ("structured_outputs", {"regex": "a"}, "structured_outputs must be a StructuredOutputsParams, got dict"),
]


@pytest.mark.parametrize("field, value, message", BAD, ids=[f"{f}={v!r}" for f, v, _ in BAD])
def test_a_bad_field_is_refused_at_construction_naming_it(field: str, value: Any, message: str) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value})
    assert str(info.value).startswith(message), str(info.value)
    assert params_error(info.value).param == (field if field in _SAMPLING_FIELDS else None)


def test_a_long_value_is_shown_cut_short() -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(stop_token_ids=list(range(1000)) + [-1])
    assert str(info.value).endswith("...") and len(str(info.value)) < 160


@pytest.mark.parametrize("changes", [
    {"temperature": 0, "top_p": 1, "min_p": 0, "repetition_penalty": 2, "presence_penalty": -2},  # ints for floats
    {"stop": ("a", "b"), "stop_token_ids": (1, 2), "allowed_token_ids": (3,), "bad_words": ("x",)},  # tuples
    {"seed": 0, "max_tokens": None, "logprobs": 0, "top_k": -1},
    {"seed": 2**63 - 16, "n": 16},
    {"logit_bias": {"5": 1, 7: -100.0}},  # JSON-style string keys; int values
    {"structured_outputs": StructuredOutputsParams(regex="a+")},
    {"stop": "héllo 🙂"},  # any text UTF-8 carries
])
def test_good_values_of_every_type_are_taken(changes: dict[str, Any]) -> None:
    params = SamplingParams(**changes)
    assert params.stop_token_ids == list(changes.get("stop_token_ids", []))
    assert SamplingParams(seed=-1).seed is None and SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(logit_bias={"5": 1}).logit_bias == {5: 1.0}  # type: ignore[dict-item]  # JSON-style keys


def test_every_child_of_parallel_sampling_gets_a_seed_in_range() -> None:
    with pytest.raises(ValueError, match=r"^seed must be -1 \(random\) or in \[0, 2\*\*63 - n\], got"):
        SamplingParams(seed=2**63 - 1, n=2)
    assert SamplingParams(seed=2**63 - 1).seed == 2**63 - 1


def test_a_copy_is_checked_too() -> None:
    from dataclasses import replace

    with pytest.raises(ValueError, match="^seed must be an integer"):
        replace(SamplingParams(), seed="1")  # type: ignore[arg-type]  # refused at run time


def test_lone_surrogate_finds_the_position() -> None:
    assert lone_surrogate("abc") is None and lone_surrogate("") is None
    assert lone_surrogate("abc\ud800") == 3 and lone_surrogate("\udc00") == 0
    assert lone_surrogate("🙂\ud83d") == 1  # a paired surrogate is one character; the lone one after is not
