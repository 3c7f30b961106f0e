"""The tool-call parsers without a server: the hermes parser on whole and streamed outputs,
the registry and the serve flags, the grammar of tool_choice "required" (checked with
llguidance on the tiny tokenizer), and how tools reach the prompt."""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import llguidance
import llguidance.hf
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from specdec.cli import build_parser
from specdec.server.hermes_tool_parser import HermesToolParser, call_schema, hermes_grammar
from specdec.server.tool_parsers import ToolCallSettings, tool_call_settings, tool_parser_class
from specdec.server.tool_prompt import mentions_tools, prompt_inputs

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
ADD = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": true}}\n</tool_call>'


def streamed(text: str, sizes: list[int]) -> tuple[str, list[dict[str, Any]]]:
    """The content and the calls a client assembles from the parser's deltas when the text
    arrives in pieces of these sizes (then the last output, finished)."""
    parser, content = HermesToolParser(), ""
    calls: list[dict[str, Any]] = []
    ends = [min(len(text), sum(sizes[:i + 1])) for i in range(len(sizes))]
    for end, finished in [*((e, False) for e in ends), (len(text), True)]:
        delta = parser.stream(text[:end], finished)
        content += delta.content
        for piece in delta.tool_calls:
            if piece.id is not None:  # a call's first delta: its id and name, no arguments yet
                assert piece.index == len(calls) and piece.arguments == ""
                calls.append({"id": piece.id, "name": piece.name, "arguments": ""})
            else:
                calls[piece.index]["arguments"] += piece.arguments
    return content, calls


def whole(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    extracted = HermesToolParser().extract(text)
    return extracted.content, [{"name": c.name, "arguments": json.loads(c.arguments)} for c in extracted.tool_calls]


def test_one_call_and_no_content() -> None:
    assert whole(WEATHER) == (None, [{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}])


def test_several_calls_with_text_around_them() -> None:
    content, calls = whole(f"Let me look.\n{WEATHER}\n{ADD}\nDone.")
    assert content == "Let me look.\nDone."
    assert [c["name"] for c in calls] == ["get_weather", "add"]
    assert calls[1]["arguments"] == {"a": 1, "b": True}


def test_ids_are_openai_shaped_and_distinct() -> None:
    calls = HermesToolParser().extract(f"{WEATHER}\n{WEATHER}").tool_calls
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in calls)
    assert calls[0].id != calls[1].id
    assert calls[0].to_openai()["function"] == {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}


@pytest.mark.parametrize("block", [
    '<tool_call>\n{"name": "f", "arguments": {"a": }\n</tool_call>',  # not JSON
    '<tool_call>\n["f", {}]\n</tool_call>',  # not an object
    '<tool_call>\n{"name": "f"}\n</tool_call>',  # no arguments
    '<tool_call>\n{"name": "", "arguments": {}}\n</tool_call>',  # no name
    '<tool_call>\n{"name": "f", "arguments": "a=1"}\n</tool_call>',  # arguments not an object
])
def test_a_malformed_block_is_content(block: str) -> None:
    text = f"Before {block} after"
    assert whole(text) == (text, [])
    assert streamed(text, [3] * len(text))[0] == text


def test_an_unfinished_call_is_content() -> None:
    text = 'Sure. <tool_call>\n{"name": "get_weather", "argum'
    assert whole(text) == (text, [])
    assert streamed(text, [1] * len(text)) == (text, [])


@pytest.mark.parametrize("seed", range(6))
def test_streaming_gives_what_the_whole_output_gives(seed: int) -> None:
    text = f"Let me look.\n{WEATHER}\nand <tool not a call\n{ADD}\n{WEATHER} Done."
    rng = random.Random(seed)
    sizes = [rng.randint(1, 9) for _ in range(len(text))]
    content, calls = streamed(text, sizes)
    expected_content, expected_calls = whole(text)
    assert content == expected_content
    assert [{"name": c["name"], "arguments": json.loads(c["arguments"])} for c in calls] == expected_calls
    assert len({c["id"] for c in calls}) == 3


def test_no_markup_leaks_while_a_call_streams() -> None:
    parser = HermesToolParser()
    sent = ""
    for end in range(1, len(WEATHER)):
        delta = parser.stream("Hi " + WEATHER[:end], finished=False)
        sent += delta.content
        assert not delta.tool_calls
    assert sent == "Hi"
    last = parser.stream("Hi " + WEATHER, finished=True)
    assert last.content == "" and [d.name for d in last.tool_calls] == ["get_weather", None]


def test_a_partial_tag_is_held_until_it_is_known() -> None:
    parser = HermesToolParser()
    assert parser.stream("Use <tool", finished=False).content == "Use"
    assert parser.stream("Use <tools wisely", finished=False).content == " <tools wisely"


def test_the_registry_and_the_serve_flags() -> None:
    assert tool_parser_class("hermes") is HermesToolParser
    with pytest.raises(ValueError, match="unknown tool call parser 'nope'.*hermes"):
        tool_parser_class("nope")
    args = build_parser().parse_args(["serve", "m", "--tool-call-parser", "hermes", "--enable-auto-tool-choice"])
    assert tool_call_settings(args) == ToolCallSettings("hermes", True)
    assert tool_call_settings(build_parser().parse_args(["serve", "m"])) == ToolCallSettings(None, False)
    with pytest.raises(ValueError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        tool_call_settings(build_parser().parse_args(["serve", "m", "--enable-auto-tool-choice"]))
    with pytest.raises(ValueError, match="--tool-call-parser"):
        tool_call_settings(build_parser().parse_args(["serve", "m", "--tool-call-parser", "nope"]))


# ---- the grammar of tool_choice "required" ----------------------------------------------------

WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Berlin"]},
                                                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                  "required": ["city", "days"], "additionalProperties": False}
FUNCTIONS: dict[str, dict[str, Any] | None] = {"get_weather": WEATHER_PARAMS, "ping": None}


@pytest.fixture(scope="module")
def ll_tokenizer(tiny_model_dir: Path) -> Any:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    assert isinstance(tokenizer, PreTrainedTokenizerFast)  # the fixture's checkpoint has a fast tokenizer
    return llguidance.hf.from_tokenizer(tokenizer)


def accepts(ll_tokenizer: Any, grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(ll_tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar))
    assert not matcher.is_error(), matcher.get_error()
    ids = ll_tokenizer.tokenize_str(text)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


PING = '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'


@pytest.mark.parametrize("text, one, many", [
    (WEATHER, True, True),
    (PING, True, True),
    (f"{WEATHER}\n{PING}", False, True),
    (WEATHER.replace("Paris", "Rome"), False, False),  # not in the enum
    (WEATHER.replace('"days": 2', '"days": 9'), False, False),  # above the maximum
    (WEATHER.replace("get_weather", "add"), False, False),  # not one of the functions
    (PING.replace("{}", '{"x": 1}'), False, False),  # ping takes no arguments
    (WEATHER.replace('{"name": ', '{"name":  '), False, False),  # padded: json.dumps layout only
    ("Sure! " + WEATHER, False, False),  # nothing but calls
    (WEATHER[:-3], False, False),  # unfinished
])
def test_the_grammar_allows_exactly_valid_calls(ll_tokenizer: Any, text: str, one: bool, many: bool) -> None:
    assert accepts(ll_tokenizer, hermes_grammar(FUNCTIONS, parallel=False), text) == one
    assert accepts(ll_tokenizer, hermes_grammar(FUNCTIONS, parallel=True), text) == many


def test_definitions_move_to_the_root_where_references_point(ll_tokenizer: Any) -> None:
    params = {"type": "object", "$defs": {"City": {"type": "string", "enum": ["Oslo"]}},
              "properties": {"city": {"$ref": "#/$defs/City"}}, "required": ["city"], "additionalProperties": False}
    assert "$defs" in call_schema("f", params) and "$defs" not in call_schema("f", params)["properties"]["arguments"]
    grammar = hermes_grammar({"f": params}, parallel=False)
    assert accepts(ll_tokenizer, grammar, '<tool_call>\n{"name": "f", "arguments": {"city": "Oslo"}}\n</tool_call>')
    assert not accepts(ll_tokenizer, grammar, '<tool_call>\n{"name": "f", "arguments": {"city": "Rome"}}\n</tool_call>')


# ---- tools in the prompt -------------------------------------------------------------------------

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS}}
HISTORY: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
]


def test_without_template_support_tools_go_into_a_system_message() -> None:
    messages, extra = prompt_inputs(HISTORY, [TOOL], "{{ messages }}")
    assert extra == {}
    assert messages[0]["role"] == "system" and json.dumps(TOOL) in messages[0]["content"]
    assert "<tools>" in messages[0]["content"] and "<tool_call>" in messages[0]["content"]
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert messages[2]["content"] == call
    assert "tool_calls" not in messages[2]
    assert messages[3]["content"] == "<tool_response>\nsunny\n</tool_response>"


def test_the_tools_text_joins_an_existing_system_message() -> None:
    messages, _ = prompt_inputs([{"role": "system", "content": "Be brief."}, *HISTORY[:1]], [TOOL], "x")
    assert len(messages) == 2 and messages[0]["content"].startswith("Be brief.\n\nYou may call functions")


def test_a_template_that_knows_tools_gets_them_as_they_are() -> None:
    template = "{% for t in tools %}{{ t.function.name }}{% endfor %}"
    assert mentions_tools(template) and mentions_tools({"default": "x", "tool_use": template})
    assert prompt_inputs(HISTORY, [TOOL], template) == (HISTORY, {"tools": [TOOL]})
    assert prompt_inputs(HISTORY, None, template) == (HISTORY, {})


def test_without_tools_to_show_only_the_history_is_written_out() -> None:
    messages, extra = prompt_inputs(HISTORY, None, "{{ messages }}")
    assert extra == {} and [m["role"] for m in messages] == ["user", "assistant", "tool"]
