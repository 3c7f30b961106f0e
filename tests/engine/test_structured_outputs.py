"""Structured outputs through the engine: every output follows its grammar, speculative
output equals constrained plain output, grammar-forced tokens are drafted, sampling under a
grammar keeps the constrained distribution, and bad constraints are clear errors."""
from __future__ import annotations

import json
import re
from collections import Counter
from typing import Any

import pytest

from specdec import SamplingParams
from specdec.llm import LLM
from specdec.outputs import RequestOutput
from specdec.sampling_params import StructuredOutputsParams
from specdec.structured_output import GrammarCompiler, GrammarLimits
from tests.helpers import NGRAM, assert_all_blocks_free, random_prompts, token_ids

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tags": {"type": "array", "items": {"enum": ["a", "bc"]}, "maxItems": 3}}}
CONSTRAINTS = {
    "json": StructuredOutputsParams(json=SCHEMA),
    "json_text": StructuredOutputsParams(json=json.dumps(SCHEMA)),
    "json_object": StructuredOutputsParams(json_object=True),
    "regex": StructuredOutputsParams(regex=r"(yes|no), [0-9]{2,4}!"),
    "choice": StructuredOutputsParams(choice=["red apple", "green pear", "blue"]),
    "lark": StructuredOutputsParams(grammar='start: "x=" NUM ("+" NUM)*\nNUM: /[0-9]+/'),
    "gbnf": StructuredOutputsParams(grammar='root ::= "v" [0-9] [0-9]?'),
}

UNBOUNDED = {"json_object", "lark"}  # a random model may go on until max_tokens


def check(name: str, text: str) -> None:
    """`text` is a complete sentence of the constraint `name`."""
    if name in ("json", "json_text"):
        value = json.loads(text)
        assert set(value) == {"name", "age", "tags"} and isinstance(value["age"], int)
        assert len(value["name"]) <= 12 and all(t in ("a", "bc") for t in value["tags"])
    elif name == "json_object":
        assert isinstance(json.loads(text), dict)
    elif name == "regex":
        assert re.fullmatch(r"(yes|no), [0-9]{2,4}!", text)
    elif name == "choice":
        assert text in ("red apple", "green pear", "blue")
    elif name == "lark":
        assert re.fullmatch(r"x=[0-9]+(\+[0-9]+)*", text)
    else:
        assert re.fullmatch(r"v[0-9][0-9]?", text)


@pytest.fixture(scope="module")
def plain(tiny_model_dir: Any) -> LLM:
    return LLM(str(tiny_model_dir), max_model_len=256, speculative_config=None)


@pytest.fixture(scope="module")
def ngram(tiny_model_dir: Any) -> LLM:
    return LLM(str(tiny_model_dir), max_model_len=256, speculative_config=NGRAM)


def constrained(name: str, max_tokens: int = 96, **kw: Any) -> SamplingParams:
    """Greedy under the constraint, ending at EOS (tests.helpers.greedy ignores EOS)."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=CONSTRAINTS[name], **kw)


def generate_following(llm: LLM, prompts: list[list[int]], name: str) -> list[RequestOutput]:
    """`llm`'s greedy outputs constrained by grammar `name`; each one that stopped follows it."""
    outputs = llm.generate(prompts, constrained(name))
    for out in outputs:
        completion = out.outputs[0]
        assert completion.finish_reason == "stop" or name in UNBOUNDED
        if completion.finish_reason == "stop":
            check(name, completion.text)
    return outputs


@pytest.mark.parametrize("name", list(CONSTRAINTS))
def test_greedy_output_follows_the_grammar_and_speculation_changes_nothing(plain: LLM, ngram: LLM,
                                                                            name: str) -> None:
    prompts = random_prompts(5, 3)
    expected = generate_following(plain, prompts, name)
    assert token_ids(ngram.generate(prompts, constrained(name))) == token_ids(expected)
    assert_all_blocks_free(ngram)


@pytest.mark.parametrize("name", ["json", "choice", "lark"])
def test_tree_drafters_are_lossless_under_a_grammar(plain: LLM, tiny_model_dir: Any, tiny_draft_dir: Any,
                                                    tiny_recurrent_dir: Any, name: str) -> None:
    prompts = random_prompts(6, 3)
    expected = token_ids(plain.generate(prompts, constrained(name)))
    for spec in ({"method": "draft_model", "num_speculative_tokens": 3, "num_tree_nodes": 6,
                  "model": str(tiny_draft_dir)},
                 {"method": "medusa", "num_speculative_tokens": 4, "num_tree_nodes": 6,
                  "model": str(tiny_recurrent_dir)}):
        llm = LLM(str(tiny_model_dir), max_model_len=256, speculative_config=spec)
        assert token_ids(llm.generate(prompts, constrained(name))) == expected, spec["method"]
        assert_all_blocks_free(llm)


def test_forced_tokens_are_drafted_so_fewer_steps_run(plain: LLM, ngram: LLM) -> None:
    """A schema's fixed keys are forced: speculation verifies them in one forward."""
    prompt = random_prompts(7, 1)
    steps = []
    for llm in (plain, ngram):
        before = llm.get_metrics()["num_steps"]
        out = llm.generate(prompt, constrained("json", 128))[0].outputs[0]
        steps.append(llm.get_metrics()["num_steps"] - before)
        assert out.finish_reason == "stop"
    assert steps[1] < steps[0] * 0.7, steps


def test_sampling_under_a_grammar_keeps_the_constrained_distribution(plain: LLM, ngram: LLM) -> None:
    """The choice a sampled request makes has the same distribution with and without
    speculation (forced drafts and the grammar's masks in rejection sampling). The control
    shows the test can tell distributions apart: without the grammar the outputs differ."""
    prompt = random_prompts(8, 1)[0]
    choices = StructuredOutputsParams(choice=["aa", "ab", "b", "ba"])
    params = [SamplingParams(temperature=1.5, max_tokens=8, seed=s, structured_outputs=choices) for s in range(300)]
    counts = [Counter(o.outputs[0].text for o in llm.generate([prompt] * 300, params)) for llm in (plain, ngram)]
    assert set(counts[0]) <= {"aa", "ab", "b", "ba"} and set(counts[1]) <= {"aa", "ab", "b", "ba"}
    assert _chi_square(counts[0], counts[1]) < 16.3  # 3 degrees of freedom, p = 0.001
    control = [SamplingParams(temperature=1.5, max_tokens=2, seed=s) for s in range(300)]
    free = Counter(o.outputs[0].text for o in plain.generate([prompt] * 300, control))
    assert _chi_square(counts[0], free) > 16.3


def _chi_square(a: Counter[str], b: Counter[str]) -> float:
    """Two-sample chi-square statistic over the union of outcomes."""
    na, nb = sum(a.values()), sum(b.values())
    total = 0.0
    for key in set(a) | set(b):
        x, y = a.get(key, 0), b.get(key, 0)
        expected_a, expected_b = (x + y) * na / (na + nb), (x + y) * nb / (na + nb)
        total += (x - expected_a) ** 2 / expected_a + (y - expected_b) ** 2 / expected_b
    return total


@pytest.mark.parametrize(("constraint", "message"), [
    (StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "nonsense"}}}), "JSON schema"),
    (StructuredOutputsParams(json="{not json"), "JSON schema"),
    (StructuredOutputsParams(regex="(unclosed"), "regex"),
    (StructuredOutputsParams(grammar="start: undefined_rule"), "grammar"),
])
def test_an_invalid_constraint_is_a_clear_error(plain: LLM, constraint: StructuredOutputsParams,
                                               message: str) -> None:
    with pytest.raises(ValueError, match=f"structured outputs: invalid {message}"):
        plain.generate(["hi"], SamplingParams(max_tokens=4, structured_outputs=constraint))
    assert_all_blocks_free(plain)


@pytest.mark.parametrize("fields", [{}, {"json": SCHEMA, "regex": "a"}])
def test_exactly_one_constraint_is_given(fields: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(**fields)


def test_ignore_eos_pads_a_complete_grammar_with_eos_in_both_modes(plain: LLM, ngram: LLM) -> None:
    prompts = random_prompts(9, 2)
    params = constrained("choice", 12, ignore_eos=True)
    expected = token_ids(plain.generate(prompts, params))
    eos = plain.engine.eos_token_ids
    for out in expected:
        assert len(out) == 12 and out[-1] in eos
    assert token_ids(ngram.generate(prompts, params)) == expected


def test_forced_text_is_drafted_up_to_a_string_value(plain: LLM) -> None:
    """Keys, punctuation and a string's opening quote are all forced text: following the
    forced drafts alone writes `{"name":"` (the quote is guessed from its own tokenization,
    as no token is forced while it could still merge with the value)."""
    compiler = GrammarCompiler(plain.get_tokenizer(), plain.engine.model_config.vocab_size,
                               plain.engine.eos_token_ids, GrammarLimits())
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"],
              "additionalProperties": False}
    grammar = compiler.grammar(StructuredOutputsParams(json=schema))
    output: list[int] = []
    while forced := grammar.forced_tokens():
        output += forced
        grammar.advance(output)
    assert plain.get_tokenizer().decode(output) == '{"name":"'
