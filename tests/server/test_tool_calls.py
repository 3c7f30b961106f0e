"""Tool calls over HTTP with the official openai client: tool_choice "required" and a named
function (a grammar makes the random tiny model's calls valid), streamed and not, speculation
on and off; "auto" through the hermes parser; a history with calls and tool results; the 400s.

The tiny checkpoint's chat template knows no tools, so the tools are written into a system
message (server/tool_prompt.py): hundreds of tokens with its small vocabulary, so this
server's copy of the checkpoint takes longer contexts."""
from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from specdec.outputs import CompletionOutput, RequestOutput
from specdec.server.chat import ChatStreamer, ToolPlan, chat_body
from specdec.server.hermes_tool_parser import HermesToolParser
from specdec.server.jobs import Job
from tests.helpers import RunningServer, all_blocks_free, serve_in_thread

MAX_MODEL_LEN = 2048
KV_BYTES = 512 * 2 * 2 * 16 * 2 * 16 * 2  # 512 blocks of 16 slots (as tests/helpers.py sizes a block)
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


class Weather(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: Literal["Paris", "Berlin"]
    days: int = Field(ge=1, le=7)


class Add(BaseModel):
    model_config = ConfigDict(extra="forbid")
    a: int = Field(ge=0, le=99)
    b: bool


ARGUMENTS: dict[str, type[BaseModel]] = {"get_weather": Weather, "add": Add}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": name, "description": f"{name} tool",
                                      "parameters": {**model.model_json_schema(), "additionalProperties": False}}}
    for name, model in ARGUMENTS.items()]
ADD_ONLY = {"type": "function", "function": {"name": "add"}}


@pytest.fixture(scope="module")
def tool_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """n-gram speculation (a request turns it off with `speculative: false`), the hermes
    parser and auto tool choice."""
    model_dir = tmp_path_factory.mktemp("long-context") / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "max_position_embeddings": MAX_MODEL_LEN}))
    running = serve_in_thread(model_dir, "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory", str(KV_BYTES),
                              "--tool-call-parser", "hermes", "--enable-auto-tool-choice", "--speculative-config",
                              json.dumps({"method": "ngram", "num_speculative_tokens": 3}))
    yield running
    running.stop()


def oai(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=server.api_key or "none", max_retries=0)


def ask(server: RunningServer, speculative: bool = True, **fields: Any) -> Any:
    """A greedy chat request with the tools; fields override the defaults."""
    request: dict[str, Any] = {"model": server.model, "messages": MESSAGES, "tools": TOOLS, "temperature": 0.0,
                               "max_tokens": 200, "tool_choice": "required", "parallel_tool_calls": False,
                               "extra_body": {"speculative": speculative}, **fields}
    return oai(server).chat.completions.create(**request)


def assert_valid(calls: list[Any], names: set[str]) -> None:
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert call.function.name in names
        ARGUMENTS[call.function.name].model_validate_json(call.function.arguments)


def collect_stream(server: RunningServer, **fields: Any) -> tuple[str | None, list[dict[str, str]], str | None]:
    """Content, calls and finish reason assembled from a stream the way OpenAI streams calls:
    a call's first delta has its id, type, name and arguments "", later ones fragments."""
    content, finish = None, None
    calls: list[dict[str, str]] = []
    for chunk in ask(server, stream=True, **fields):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        assert finish is None, "nothing may follow the finish reason"
        finish = choice.finish_reason
        if choice.delta.content:
            content = (content or "") + choice.delta.content
        for piece in choice.delta.tool_calls or []:
            if piece.id is not None:
                assert piece.index == len(calls) and piece.type == "function" and piece.function.arguments == ""
                calls.append({"id": piece.id, "name": piece.function.name, "arguments": ""})
            else:
                assert piece.function.name is None
                calls[piece.index]["arguments"] += piece.function.arguments
    return content, calls, finish


@pytest.mark.parametrize("speculative", [True, False])
def test_required_returns_one_valid_call(tool_server: RunningServer, speculative: bool) -> None:
    choice = ask(tool_server, speculative).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None and len(choice.message.tool_calls) == 1
    assert_valid(choice.message.tool_calls, set(ARGUMENTS))
    assert all_blocks_free(tool_server)


def test_speculation_and_streaming_give_the_same_call(tool_server: RunningServer) -> None:
    calls = [ask(tool_server, speculative).choices[0].message.tool_calls[0] for speculative in (True, False)]
    expected = [(calls[0].function.name, calls[0].function.arguments)]
    assert [(c.function.name, c.function.arguments) for c in calls] == expected * 2
    for speculative in (True, False):
        content, streamed, finish = collect_stream(tool_server, extra_body={"speculative": speculative})
        assert (content, finish) == (None, "tool_calls")
        assert [(c["name"], c["arguments"]) for c in streamed] == expected
        assert streamed[0]["id"].startswith("call_")


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_function_is_the_one_called(tool_server: RunningServer, stream: bool) -> None:
    if stream:
        content, calls, finish = collect_stream(tool_server, tool_choice=ADD_ONLY)
        assert (content, finish, [c["name"] for c in calls]) == (None, "tool_calls", ["add"])
        Add.model_validate_json(calls[0]["arguments"])
    else:
        choice = ask(tool_server, tool_choice=ADD_ONLY).choices[0]
        assert choice.finish_reason == "tool_calls"
        assert [c.function.name for c in choice.message.tool_calls] == ["add"]
        assert_valid(choice.message.tool_calls, {"add"})


def test_parallel_calls_are_each_valid(tool_server: RunningServer) -> None:
    """One or more calls; the random model may go on calling until max_tokens, and then the
    call it was writing is content, not a broken call."""
    choice = ask(tool_server, parallel_tool_calls=True, max_tokens=300).choices[0]
    assert choice.message.tool_calls and choice.finish_reason in ("tool_calls", "length")
    assert_valid(choice.message.tool_calls, set(ARGUMENTS))
    if choice.finish_reason == "tool_calls":
        assert choice.message.content is None
    else:
        assert choice.message.content is None or choice.message.content.startswith("<tool_call>")


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_cut_by_max_tokens_is_content(tool_server: RunningServer, stream: bool) -> None:
    if stream:
        content, calls, finish = collect_stream(tool_server, max_tokens=8)
    else:
        choice = ask(tool_server, max_tokens=8).choices[0]
        content, calls, finish = choice.message.content, choice.message.tool_calls or [], choice.finish_reason
    assert finish == "length" and calls == []
    assert content is not None and "<tool_call>\n{".startswith(content[:12]) and content.startswith("<tool")
    assert all_blocks_free(tool_server)


def test_several_choices_each_get_their_calls(tool_server: RunningServer) -> None:
    reply = ask(tool_server, n=2, temperature=1.0, seed=7)
    assert len(reply.choices) == 2
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        assert_valid(choice.message.tool_calls, set(ARGUMENTS))


def test_auto_sends_text_as_content_streamed_or_not(tool_server: RunningServer) -> None:
    """The random model writes no call, so its whole text is content, the same either way."""
    choice = ask(tool_server, tool_choice="auto", max_tokens=16).choices[0]
    content, calls, finish = collect_stream(tool_server, tool_choice="auto", max_tokens=16)
    assert choice.message.tool_calls is None and calls == []
    assert (content, finish) == (choice.message.content, choice.finish_reason)
    assert "<tool_call>" not in (content or "")


AUTO_TEXT = ('Checking. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": true}}\n</tool_call>\n'
             '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": false}}\n</tool_call>')


def engine_output(text: str, finished: bool) -> RequestOutput:
    """A cumulative output of one choice, a token per character."""
    completion = CompletionOutput(0, text, [3] * len(text), "stop" if finished else None)
    return RequestOutput("r", None, [1], [completion], finished)


@pytest.mark.parametrize("parallel", [True, False])
def test_auto_calls_in_the_text_become_tool_calls(parallel: bool) -> None:
    """The random model never writes a call, so the route's handling of one is fed outputs
    directly: cumulative outputs 7 characters apart, the last finished."""
    plan = ToolPlan(shown=[], parser=HermesToolParser, parallel=parallel)
    state: Any = SimpleNamespace(model_name="tiny", tokens=None)
    outputs = [engine_output(AUTO_TEXT[:end], False) for end in range(7, len(AUTO_TEXT), 7)]
    outputs.append(engine_output(AUTO_TEXT, True))
    streamer = ChatStreamer(state, Job("chatcmpl-1", 1), False, 0, plan)
    deltas = [c["choices"][0] for output in outputs for c in streamer.on_output(0, output)]
    content = "".join(d["delta"].get("content", "") for d in deltas)
    calls = [call for d in deltas for call in d["delta"].get("tool_calls", [])]
    message = chat_body(state, Job("chatcmpl-2", 1), outputs[-1], 0, plan)["choices"][0]["message"]
    expected = [{"a": 1, "b": True}, {"a": 2, "b": False}][:2 if parallel else 1]
    assert content == message["content"] == "Checking."
    assert [json.loads(c["function"]["arguments"]) for c in calls if "id" not in c] == expected
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == expected
    assert [d["finish_reason"] for d in deltas] == [None] * (len(deltas) - 1) + ["tool_calls"]


def test_none_leaves_the_tools_out_of_the_prompt(tool_server: RunningServer) -> None:
    with_tools = ask(tool_server, tool_choice="required", max_tokens=1).usage.prompt_tokens
    without = ask(tool_server, tool_choice="none", max_tokens=1)
    assert without.usage.prompt_tokens < with_tools - 100
    assert without.choices[0].message.tool_calls is None


HISTORY: list[dict[str, Any]] = [
    *MESSAGES,
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_abc", "type": "function", "function": {"name": "get_weather",
                                                           "arguments": '{"city": "Paris", "days": 2}'}}]},
    {"role": "tool", "tool_call_id": "call_abc", "content": "sunny, 24 C"},
]


def test_a_history_with_calls_and_results_is_accepted(tool_server: RunningServer) -> None:
    choice = ask(tool_server, messages=HISTORY, tool_choice=ADD_ONLY).choices[0]
    assert choice.finish_reason == "tool_calls"
    with tool_server.client() as client:
        response = client.post("/tokenize", json={"messages": HISTORY})
        assert response.status_code == 200, response.text
        prompt = client.post("/detokenize", json={"tokens": response.json()["tokens"]}).json()["prompt"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>' in prompt
    assert "<tool_response>\nsunny, 24 C\n</tool_response>" in prompt


def post(server: RunningServer, body: dict[str, Any]) -> dict[str, Any]:
    """The error of a request that must be a 400; the server leaks nothing."""
    with server.client() as client:
        response = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    assert all_blocks_free(server)
    error: dict[str, Any] = response.json()["error"]
    return error


NAMED_MISSING = {"type": "function", "function": {"name": "nope"}}
BAD_SCHEMA = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": "x"}}}
ARRAY_SCHEMA = {"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}
BAD_NAME = {"type": "function", "function": {"name": "two words"}}
ODD_FORMAT = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "string", "format": "made-up"}}}}}


@pytest.mark.parametrize("body, param, words", [
    ({"tools": TOOLS, "tool_choice": NAMED_MISSING}, "tool_choice", "'nope'"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", '"required"'),
    ({"tools": [BAD_SCHEMA]}, "tools[0].function.parameters", "required"),
    ({"tools": [ARRAY_SCHEMA]}, "tools[0].function.parameters", "object"),
    ({"tools": [BAD_NAME]}, "tools[0].function.name", "pattern"),
    ({"tools": [ODD_FORMAT], "tool_choice": "required"}, "tools", "made-up"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools", "unique"),
    ({"tools": []}, "tools", "at least 1"),
    ({"tools": [{**TOOLS[0], "function": {**TOOLS[0]["function"], "strict": True}}], "tool_choice": "auto"},
     "tools", "strict"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0]", "tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": HISTORY[1]["tool_calls"]}]}, "messages[0]",
     "assistant"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                         "function": {"name": "f", "arguments": "{x"}}]}]},
     "messages[0].tool_calls[0].function.arguments", "JSON object"),
])
def test_bad_tool_fields_are_400s_naming_the_field(tool_server: RunningServer, body: dict[str, Any], param: str,
                                                   words: str) -> None:
    error = post(tool_server, body)
    assert error["param"] == param and words in error["message"], error


def test_a_schema_the_grammar_cannot_enforce_may_still_be_shown(tool_server: RunningServer) -> None:
    """An unknown format only annotates (JSON Schema): fine for "auto", which constrains nothing."""
    choice = ask(tool_server, tools=[ODD_FORMAT], tool_choice="auto", max_tokens=2).choices[0]
    assert choice.finish_reason == "length"


def test_structured_outputs_and_a_tool_grammar_are_refused_together(tool_server: RunningServer) -> None:
    error = post(tool_server, {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}})
    assert error["param"] == "tool_choice"
    assert "response_format" in error["message"] and "tool_choice" in error["message"]


def test_auto_needs_the_server_flags(server: RunningServer) -> None:
    """The shared server was started without --enable-auto-tool-choice: tools alone mean "auto"."""
    for body in ({"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "auto"}):
        error = post(server, body)
        assert error["param"] == "tool_choice" and "--enable-auto-tool-choice" in error["message"]


@pytest.mark.slow
def test_the_default_model_calls_the_tool_it_is_asked_about() -> None:
    """SmolLM2's template knows no tools: the Hermes system message must be enough for the
    real model to fill the arguments in sensibly, speculating or not."""
    from specdec.model_registry import DEFAULT_MODEL

    running = serve_in_thread(Path(DEFAULT_MODEL), "--max-model-len", "2048", "--kv-cache-memory", str(128 << 20),
                              "--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 4}))
    weather = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                                "parameters": {"type": "object", "properties": {
                                                    "city": {"type": "string", "maxLength": 40},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                                                    "required": ["city", "unit"], "additionalProperties": False}}}
    messages = [{"role": "user", "content": "What's the weather like in Paris today, in celsius?"}]
    try:
        for speculative in (True, False):
            choice = ask(running, speculative, messages=messages, tools=[weather], max_tokens=120).choices[0]
            assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
            call = choice.message.tool_calls[0]
            assert call.function.name == "get_weather"
            assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}
        assert all_blocks_free(running)
    finally:
        running.stop()
