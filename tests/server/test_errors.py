"""Every error is an OpenAI error object with the right status, and leaks no internals."""
from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.helpers import MAX_MODEL_LEN, RunningServer

CHAT = [{"role": "user", "content": "hi"}]


def assert_error(response: httpx.Response, status: int, *needles: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body: dict[str, Any] = response.json()
    assert set(body) == {"error"}
    error: dict[str, Any] = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    for leak in ("pydantic", "Traceback", "errors.pydantic.dev", "File \""):
        assert leak not in error["message"]
    for needle in needles:
        assert needle in error["message"], error["message"]
    return error


def post(client: httpx.Client, path: str, **body: Any) -> httpx.Response:
    return client.post(path, json={"model": "tiny", "max_tokens": 4, **body})


@pytest.mark.parametrize("field, value, needle", [
    ("max_tokens", 0, "max_tokens"),
    ("max_tokens", -3, "max_tokens"),
    ("temperature", -1, "temperature"),
    ("top_p", 0, "top_p"),
    ("top_p", 1.5, "top_p"),
    ("n", 17, "n"),
    ("stop", [f"s{i}" for i in range(17)], "stop"),
    ("logprobs", 21, "logprobs"),
    ("top_k", -2, "top_k"),
    ("top_k", 2**64, "top_k"),  # would overflow the sampler's int64 tensor and fail the whole batch
    ("stream_options", {"include_usage": True}, "stream"),
])
def test_invalid_fields(client: httpx.Client, field: str, value: Any, needle: str) -> None:
    error = assert_error(post(client, "/v1/completions", prompt="hi", **{field: value}), 400, needle)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("prompt, needle", [
    ("", "empty"),
    ([], "prompt"),
    ([[]], "empty"),
    ([1, 2, 999_999], "vocabulary"),
    ([1, -5], "vocabulary"),
    ([1, "a"], "prompt"),
    (None, "prompt"),
])
def test_bad_prompts(client: httpx.Client, prompt: Any, needle: str) -> None:
    assert_error(post(client, "/v1/completions", prompt=prompt), 400, needle)


def test_prompt_longer_than_max_model_len(client: httpx.Client) -> None:
    error = assert_error(post(client, "/v1/completions", prompt=[5] * 200), 400, "200", str(MAX_MODEL_LEN))
    assert error["param"] == "prompt"
    long_chat = [{"role": "user", "content": "fox " * 300}]
    assert_error(post(client, "/v1/chat/completions", messages=long_chat), 400, str(MAX_MODEL_LEN))
    assert_error(post(client, "/v1/completions", prompt=[5] * 200, stream=True), 400, "200")


@pytest.mark.parametrize("messages, needle", [
    ([{"role": "wizard", "content": "hi"}], "messages[0].role"),
    ([{"role": "developer", "content": "hi"}], "role"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "text"),
    ([{"content": "hi"}], "role"),
    ([], "messages"),
    ("hello", "messages"),
])
def test_bad_messages(client: httpx.Client, messages: Any, needle: str) -> None:
    assert_error(post(client, "/v1/chat/completions", messages=messages), 400, needle)


def test_chat_field_checks(client: httpx.Client) -> None:
    assert_error(post(client, "/v1/chat/completions", messages=CHAT, top_logprobs=3), 400, "logprobs")
    assert_error(post(client, "/v1/chat/completions", messages=CHAT, max_completion_tokens=0), 400,
                 "max_completion_tokens")
    assert_error(post(client, "/v1/chat/completions", messages=CHAT, logprobs=5), 400, "logprobs")


def test_unknown_model_and_route(client: httpx.Client) -> None:
    error = assert_error(post(client, "/v1/completions", prompt="hi", model="gpt-4"), 404, "gpt-4")
    assert error["code"] == "model_not_found"
    assert_error(post(client, "/v1/chat/completions", messages=CHAT, model="other"), 404, "other")
    assert_error(client.post("/tokenize", json={"model": "nope", "prompt": "x"}), 404, "nope")
    assert_error(client.get("/v1/nothing"), 404, "/v1/nothing")
    assert_error(client.post("/v2/completions", json={}), 404)
    assert_error(client.get("/v1/completions"), 405)
    assert_error(client.delete("/v1/models"), 405)


def test_api_key(server: RunningServer) -> None:
    with httpx.Client(base_url=server.base_url) as anonymous:
        error = assert_error(anonymous.post("/v1/completions", json={"prompt": "hi"}), 401)
        assert error["code"] == "invalid_api_key"
        assert_error(anonymous.get("/v1/models"), 401)
        wrong = {"Authorization": "Bearer nope"}
        assert_error(anonymous.post("/v1/completions", json={"prompt": "hi"}, headers=wrong), 401)
        assert_error(anonymous.post("/tokenize", json={"prompt": "hi"}, headers=wrong), 401)
        assert anonymous.get("/health").status_code == 200  # probes need no key
        assert anonymous.get("/metrics").status_code == 200


def test_malformed_bodies(client: httpx.Client) -> None:
    json_header = {"Content-Type": "application/json"}
    assert_error(client.post("/v1/completions", content=b'{"prompt": "hi",', headers=json_header), 400, "JSON")
    assert_error(client.post("/v1/completions", content=b"[1, 2]", headers=json_header), 400, "object")
    assert_error(client.post("/v1/completions", content=b'{"prompt": NaN}', headers=json_header), 400)
    invalid_utf8 = b'{"model": "tiny", "prompt": "\xff\xfe bad"}'
    assert_error(client.post("/v1/completions", content=invalid_utf8, headers=json_header), 400, "UTF-8")
    status = client.post("/v1/completions", content=b'{"prompt": "hi"}', headers={"Content-Type": "text/plain"})
    assert_error(status, 415, "application/json")
    assert_error(client.post("/v1/completions", data={"prompt": "hi"}), 415)
    assert_error(client.post("/v1/chat/completions", content=b""), 415)
    assert_error(client.post("/v1/chat/completions", content=b"", headers=json_header), 400, "JSON")


def test_detokenize_outside_vocab(client: httpx.Client) -> None:
    assert_error(client.post("/detokenize", json={"tokens": [1, 100_000]}), 400, "vocabulary")
    assert_error(client.post("/tokenize", json={}), 400, "prompt")


def test_no_chat_template(no_template_server: RunningServer) -> None:
    with no_template_server.client() as plain:
        request = {"model": "plain", "messages": CHAT, "max_tokens": 4}
        error = assert_error(plain.post("/v1/chat/completions", json=request), 400, "chat template")
        assert error["param"] == "messages"
        ok = plain.post("/v1/completions", json={"model": "plain", "prompt": "hi", "max_tokens": 4})
        assert ok.status_code == 200, ok.text
