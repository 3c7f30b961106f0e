"""Structured outputs over HTTP with the official openai client, speculation on and off:
response_format (json_object, json_schema, `beta.chat.completions.parse`), vLLM's guided_*
fields and structured_outputs object, streaming, and the 400s."""
from __future__ import annotations

import json
import re
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from pydantic import BaseModel, Field

from tests.helpers import RunningServer, all_blocks_free

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Give me a person as JSON."}]


class Person(BaseModel):
    name: str = Field(max_length=10)
    age: int = Field(ge=0, le=120)
    admin: bool


# JSON Schema allows other keys unless told not to (OpenAI's strict mode requires this)
SCHEMA = {**Person.model_json_schema(), "additionalProperties": False}


def oai(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=server.api_key, max_retries=0)


def chat(server: RunningServer, speculative: bool, **fields: Any) -> Any:
    return oai(server).chat.completions.create(model=server.model, messages=MESSAGES,
                                               temperature=0.0, max_tokens=80,
                                               extra_body={"speculative": speculative, **fields})


@pytest.mark.parametrize("speculative", [True, False])
def test_parse_with_a_pydantic_model_returns_a_valid_object(server: RunningServer, speculative: bool) -> None:
    reply = oai(server).beta.chat.completions.parse(model=server.model, messages=MESSAGES,
                                                    response_format=Person, temperature=0.0, max_tokens=80,
                                                    extra_body={"speculative": speculative})
    person = reply.choices[0].message.parsed
    assert isinstance(person, Person)
    assert reply.choices[0].finish_reason == "stop"
    assert all_blocks_free(server)


def test_json_schema_output_validates_and_speculation_changes_nothing(server: RunningServer) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    texts = [chat(server, spec, response_format=response_format).choices[0].message.content for spec in (True, False)]
    assert texts[0] == texts[1]
    Person.model_validate_json(texts[0])


def test_json_object_is_a_json_object(server: RunningServer) -> None:
    # The random tiny model may not close an unconstrained object within max_tokens; a
    # finished reply must parse, a cut one must be a prefix of the grammar's language.
    reply = chat(server, True, response_format={"type": "json_object"}).choices[0]
    if reply.finish_reason == "stop":
        assert isinstance(json.loads(reply.message.content), dict)
    else:
        assert reply.message.content.startswith("{")


@pytest.mark.parametrize(("fields", "check"), [
    ({"guided_choice": ["yes", "no", "maybe later"]}, lambda t: t in ("yes", "no", "maybe later")),
    ({"guided_regex": r"[A-Z][a-z]{2,5} [0-9]{3}"}, lambda t: re.fullmatch(r"[A-Z][a-z]{2,5} [0-9]{3}", t)),
    ({"guided_json": SCHEMA}, lambda t: Person.model_validate_json(t)),
    ({"guided_grammar": 'start: "ok" | "not " ("ok" | "sure")'}, lambda t: t in ("ok", "not ok", "not sure")),
    ({"structured_outputs": {"choice": ["left", "right"]}}, lambda t: t in ("left", "right")),
], ids=["guided_choice", "guided_regex", "guided_json", "guided_grammar", "structured_outputs"])
def test_vllm_guided_fields(server: RunningServer, fields: dict[str, Any], check: Any) -> None:
    texts = [chat(server, spec, **fields).choices[0].message.content for spec in (True, False)]
    assert texts[0] == texts[1]
    assert check(texts[0])


def test_completions_take_the_constraints_too(server: RunningServer) -> None:
    reply = oai(server).completions.create(model=server.model, prompt="Answer:", max_tokens=16, temperature=0.0,
                                           extra_body={"guided_choice": ["alpha", "beta"]})
    assert reply.choices[0].text in ("alpha", "beta")


def test_a_streamed_constrained_reply_joins_to_valid_json(server: RunningServer) -> None:
    stream = oai(server).chat.completions.create(
        model=server.model, messages=MESSAGES, temperature=0.0, max_tokens=80, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    Person.model_validate_json(text)


@pytest.mark.parametrize(("fields", "needle"), [
    ({"guided_json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}, "JSON schema"),
    ({"guided_regex": "(unclosed"}, "regex"),
    ({"guided_grammar": "start: nowhere"}, "grammar"),
    ({"guided_choice": ["a"], "guided_regex": "b"}, "at most one of"),
    ({"response_format": {"type": "json_schema"}}, "json_schema is required"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"structured_outputs": {}}, "exactly one of"),
])
def test_bad_constraints_are_400s(server: RunningServer, fields: dict[str, Any], needle: str) -> None:
    with server.client() as client:
        response = client.post("/v1/chat/completions", json={"model": server.model, "messages": MESSAGES,
                                                             "max_tokens": 4, **fields})
    assert response.status_code == 400, response.text
    assert needle in response.json()["error"]["message"]
    assert all_blocks_free(server)
