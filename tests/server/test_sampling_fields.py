"""Sampling transforms over HTTP with the official openai client: each field works (and
speculation does not change greedy output under it), or is refused naming it."""
from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.helpers import RunningServer, all_blocks_free

PROMPT = "def add(a, b):\n    return a + b\n" * 3  # n-gram lookup finds drafts here
GREEDY: dict[str, Any] = {"temperature": 0.0, "max_tokens": 16}


def oai(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=server.api_key, max_retries=0)


def tokens(server: RunningServer, speculative: bool = True, **extra: Any) -> list[int]:
    """Completion token ids of PROMPT (the tokenizer round-trips the tiny model's text)."""
    body = {**GREEDY, "speculative": speculative}
    extra_body = {k: extra.pop(k) for k in list(extra) if k in ("repetition_penalty", "min_p", "allowed_token_ids",
                                                                  "bad_words", "min_tokens", "ignore_eos")}
    reply = oai(server).completions.create(model=server.model, prompt=PROMPT, logprobs=0,
                                           extra_body={**body, **extra_body}, **extra)
    assert reply.choices[0].logprobs is not None
    return [server.tokenizer.convert_tokens_to_ids(t) for t in reply.choices[0].logprobs.tokens or []]


@pytest.mark.parametrize("field", [
    {"frequency_penalty": 1.0}, {"presence_penalty": 1.5}, {"repetition_penalty": 1.5},
    {"allowed_token_ids": list(range(3, 100))},
], ids=lambda f: next(iter(f)))
def test_a_transform_changes_output_and_speculation_keeps_it(server: RunningServer, field: dict[str, Any]) -> None:
    plain = tokens(server, speculative=False, **dict(field))
    assert tokens(server, speculative=True, **dict(field)) == plain
    assert plain != tokens(server, speculative=False)
    assert all_blocks_free(server)


def test_a_logit_bias_ban_removes_the_token(server: RunningServer) -> None:
    first = tokens(server)[0]
    banned = tokens(server, logit_bias={str(first): -100})
    assert first not in banned


def test_min_tokens_holds_back_eos(server: RunningServer) -> None:
    eos = server.tokenizer.eos_token_id
    reply = oai(server).completions.create(model=server.model, prompt=PROMPT, temperature=0.0, max_tokens=20,
                                           logit_bias={str(eos): 100}, extra_body={"min_tokens": 4})
    assert reply.usage is not None and reply.usage.completion_tokens == 5
    assert reply.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("body, field", [
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"presence_penalty": 3}, "presence_penalty"),
    ({"min_p": 2}, "min_p"), ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 500}}, "logit_bias"), ({"logit_bias": {"999999": 1}}, "vocabulary"),
    ({"allowed_token_ids": []}, "allowed_token_ids"), ({"seed": -2}, "seed"),
])
def test_bad_values_are_refused_by_name(server: RunningServer, body: dict[str, Any], field: str) -> None:
    with server.client() as client:
        response = client.post("/v1/completions", json={"model": server.model, "prompt": "hi", **body})
    assert response.status_code == 400, response.text
    assert field in response.json()["error"]["message"]
    assert all_blocks_free(server)


def test_seed_minus_one_samples(server: RunningServer) -> None:
    reply = oai(server).completions.create(model=server.model, prompt="hi", max_tokens=4, seed=-1)
    assert reply.choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize("path, body, field", [
    ("/v1/completions", {"prompt": "hi", "temprature": 0}, "temprature"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "functions": [{"name": "f"}]}, "functions"),  # OpenAI's deprecated form of tools
    ("/v1/completions", {"prompt": "hi", "guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
])
def test_an_unknown_field_is_a_400_naming_it(server: RunningServer, path: str, body: dict[str, Any],
                                              field: str) -> None:
    with server.client() as client:
        response = client.post(path, json={"model": server.model, "max_tokens": 2, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and "unknown field" in error["message"]


def test_the_user_field_is_accepted(server: RunningServer) -> None:
    reply = oai(server).completions.create(model=server.model, prompt="hi", max_tokens=2, user="someone")
    assert reply.choices[0].finish_reason in ("length", "stop")
