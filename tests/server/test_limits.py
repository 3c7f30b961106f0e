"""Issue 23, part B: bounded work per request, abandoned work stops, every client error a clean
4xx. Each test names the defect it covers (2: one request stalls everyone, 3: work goes on for
clients that left, 5: unhandled 500s)."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import threading
import time
from typing import Any

import httpx
import pytest

from tests.helpers import (
    API_KEY,
    MAX_MODEL_LEN,
    RunningServer,
    all_blocks_free,
    app_state,
    logged_errors,
    wait_until,
)

CHAT = [{"role": "user", "content": "hi"}]
JSON_HEADERS = {"Content-Type": "application/json"}


def assert_error(response: httpx.Response, status: int, *needles: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    for needle in needles:
        assert needle in error["message"], error["message"]
    return error


def raw_exchange(server: RunningServer, head: bytes, parts: list[bytes], timeout: float = 5.0) -> bytes:
    """Send a request head and body parts on a raw socket, never finishing a body the parts do
    not finish; then the answer, up to the server closing or `timeout` passing."""
    port = int(server.base_url.rsplit(":", 1)[1])
    answer = b""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(head)
        for part in parts:
            sock.sendall(part)
        try:
            while not answer.endswith(b"}") and (chunk := sock.recv(65536)):
                answer += chunk
        except (TimeoutError, ConnectionResetError):
            pass
    return answer


def head(length: int | None) -> bytes:
    framing = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    return (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\n{framing}\r\n\r\n").encode()


def idle(server: RunningServer) -> bool:
    return all_blocks_free(server) and not server.engine.has_unfinished_requests()


# ---- defect 2: bounded work per request -------------------------------------------------------


def test_declared_body_over_the_limit_is_refused_unread(server: RunningServer) -> None:
    started = time.monotonic()
    answer = raw_exchange(server, head(100_000_000), [b'{"prompt": "' + b"a" * 65536])
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert time.monotonic() - started < 3
    error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
    assert error["code"] == "request_too_large"
    assert str(app_state(server).limits.max_body_bytes) in error["message"]


def test_chunked_body_is_cut_off_at_the_limit(server: RunningServer) -> None:
    chunk = b"a" * (1 << 20)
    parts = [b"%x\r\n%s\r\n" % (len(chunk), chunk)] * 9  # 9 MiB, over the default 8; no final 0-chunk
    answer = raw_exchange(server, head(None), parts)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]


def test_too_many_prompts_or_choices(server: RunningServer, client: httpx.Client) -> None:
    many = client.post("/v1/completions", json={"prompt": [[5, 6]] * 65, "max_tokens": 1})
    fanned = client.post("/v1/completions", json={"prompt": [[5, 6]] * 9, "n": 16, "max_tokens": 1})
    error = assert_error(many, 400, "65", "64 per request")  # the defaults
    assert error["param"] == "prompt"
    assert_error(fanned, 400, "144", "128 per request")
    assert app_state(server).limits.max_prompts == 64


def test_prompt_tokens_of_all_prompts_are_capped(server: RunningServer, client: httpx.Client,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    state = app_state(server)
    monkeypatch.setattr(state, "limits", dataclasses.replace(state.limits, max_prompt_tokens=100))
    response = client.post("/v1/completions", json={"prompt": [[5] * 60, [6] * 60], "max_tokens": 1})
    assert_error(response, 400, "120", "100")


def test_huge_prompt_is_refused_untokenized_while_others_run(server: RunningServer, client: httpx.Client) -> None:
    times: dict[str, float] = {}

    def small() -> None:
        with server.client() as other:
            started = time.monotonic()
            ok = other.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
            assert ok.status_code == 200, ok.text
            times["small"] = time.monotonic() - started

    started = time.monotonic()
    thread = threading.Thread(target=small)
    thread.start()
    text = "hello world " * 600_000  # 7.2 MB, under the body limit
    response = client.post("/v1/completions", json={"prompt": text, "max_tokens": 4})
    times["huge"] = time.monotonic() - started
    thread.join()
    assert_error(response, 400, str(MAX_MODEL_LEN), "at least")
    assert times["huge"] < 2.0 and times["small"] < 2.0, times  # tokenizing it takes seconds
    started = time.monotonic()
    response = client.post("/v1/completions", json={"prompt": [5] * 1_000_000, "max_tokens": 4})
    assert_error(response, 400, "1000000", str(MAX_MODEL_LEN))
    assert time.monotonic() - started < 1.5


def max_health_latency(server: RunningServer, busy: threading.Thread) -> float:
    worst = 0.0
    with server.client() as probe:
        while busy.is_alive():
            started = time.monotonic()
            assert probe.get("/health").status_code == 200
            worst = max(worst, time.monotonic() - started)
            time.sleep(0.01)
    return worst


def tokenize_while_probing_health(server: RunningServer, text: str) -> tuple[httpx.Response, float]:
    """/tokenize of `text` on another thread; its response and /health's worst latency meanwhile."""
    results: dict[str, httpx.Response] = {}

    def tokenize() -> None:
        with server.client() as big:
            results["tokenize"] = big.post("/tokenize", json={"prompt": text})

    busy = threading.Thread(target=tokenize)
    busy.start()
    worst = max_health_latency(server, busy)
    return results["tokenize"], worst


def test_tokenize_of_a_large_text_does_not_block_health(server: RunningServer) -> None:
    response, worst = tokenize_while_probing_health(server, "hello world " * 300_000)
    assert worst < 0.5
    assert_error(response, 400, str(MAX_MODEL_LEN))


def test_tokenizing_runs_off_the_event_loop(server: RunningServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """With no length bound the text is tokenized in full, on the tokenizer thread."""
    monkeypatch.setattr(app_state(server).text, "max_token_bytes", None)
    response, worst = tokenize_while_probing_health(server, "hello world " * 100_000)
    assert worst < 0.5
    assert response.status_code == 200 and response.json()["count"] > 100_000


@pytest.mark.parametrize("path, body, field", [
    ("/v1/completions", {"prompt": [5] * 100, "max_tokens": 50}, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 500}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 500}, "max_tokens"),
])
def test_max_tokens_over_the_room_left(client: httpx.Client, path: str, body: dict[str, Any], field: str) -> None:
    error = assert_error(client.post(path, json=body), 400, field, str(body.get(field)), str(MAX_MODEL_LEN))
    assert error["param"] == field
    if path == "/v1/completions":
        assert "at most 28 tokens" in error["message"]


def test_default_max_tokens_is_clamped_not_refused(client: httpx.Client) -> None:
    response = client.post("/v1/completions", json={"prompt": [5] * 120})  # the default 16 > 8 left
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] <= 8


@pytest.mark.parametrize("path, body, field", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1.5}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2.0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "4"}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "n": True}, "n"),
    ("/v1/completions", {"prompt": "hi", "logprobs": True}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "seed": 1.5}, "seed"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [True]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, "stream"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": True, "logprobs": True}, "top_logprobs"),
    ("/detokenize", {"tokens": [1, True]}, "tokens"),
])
def test_booleans_and_floats_are_not_integers(client: httpx.Client, path: str, body: dict[str, Any],
                                              field: str) -> None:
    error = assert_error(client.post(path, json=body), 400, field)
    assert error["param"] is not None and error["param"].startswith(field)


# ---- defect 3: work stops when the client leaves ----------------------------------------------


def test_disconnect_aborts_every_prompt_of_a_request(server: RunningServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Slow steps: added a few prompts per step, 60 prompts kept the engine stepping long
    after the client left; added together, they are all aborted within a step or two."""
    engine_step = server.engine.step
    steps: list[float] = []

    def slow_step() -> Any:
        steps.append(time.monotonic())
        time.sleep(0.2)
        return engine_step()

    monkeypatch.setattr(server.engine, "step", slow_step)
    body = {"prompt": [[5 + i, 6, 7] for i in range(60)], "max_tokens": 100, "ignore_eos": True}
    with server.client(timeout=0.3) as client, pytest.raises(httpx.ReadTimeout):
        client.post("/v1/completions", json=body)
    left = time.monotonic()
    assert wait_until(lambda: idle(server), timeout=30)
    assert len([t for t in steps if t > left]) <= 5, len(steps)


def test_disconnect_while_tokenizing_adds_nothing(server: RunningServer, monkeypatch: pytest.MonkeyPatch) -> None:
    text = app_state(server).text
    calls: list[str] = []
    encode = text.encode

    async def slow_encode(prompt: str, add_special_tokens: bool = True) -> list[int]:
        calls.append(prompt)
        await asyncio.sleep(0.1)
        return await encode(prompt, add_special_tokens)

    added: list[str] = []
    add_request = server.engine.add_request

    def counted_add(request_id: str, *args: Any, **kwargs: Any) -> Any:
        added.append(request_id)
        return add_request(request_id, *args, **kwargs)

    monkeypatch.setattr(text, "encode", slow_encode)
    monkeypatch.setattr(server.engine, "add_request", counted_add)
    with server.client(timeout=0.3) as client, pytest.raises(httpx.ReadTimeout):
        client.post("/v1/completions", json={"prompt": [f"prompt {i}" for i in range(30)], "max_tokens": 50})
    time.sleep(1.0)
    assert len(calls) < 15 and added == []
    assert wait_until(lambda: idle(server))


# ---- defect 5: no unhandled 500s for client errors --------------------------------------------


@pytest.mark.parametrize("path, raw, param", [
    ("/v1/completions", b'{"prompt": "\\ud800", "max_tokens": 2}', "prompt"),
    ("/v1/completions", b'{"prompt": ["ok", "a\\udfffb"], "max_tokens": 2}', "prompt[1]"),
    ("/v1/completions", b'{"prompt": "hi", "stop": ["\\ud83d"]}', "stop[0]"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content"),
    ("/tokenize", b'{"prompt": "\\udc00\\ud800"}', "prompt"),
])
def test_lone_surrogates_are_client_errors(client: httpx.Client, path: str, raw: bytes, param: str) -> None:
    with logged_errors() as errors:
        error = assert_error(client.post(path, content=raw, headers=JSON_HEADERS), 400, "surrogate")
    assert error["param"] == param
    assert errors == []


def test_surrogate_pairs_and_escaped_backslashes_are_fine(client: httpx.Client) -> None:
    raw = b'{"prompt": "\\ud83d\\ude00 \\\\ud800", "max_tokens": 2}'
    assert client.post("/v1/completions", content=raw, headers=JSON_HEADERS).status_code == 200


@pytest.mark.parametrize("depth", [65, 100_000])
def test_deep_nesting_is_a_client_error(client: httpx.Client, depth: int) -> None:
    inner = b"[" * (depth - 1) + b"]" * (depth - 1)
    with logged_errors() as errors:
        response = client.post("/v1/completions", content=b'{"prompt": "hi", "x": ' + inner + b"}",
                               headers=JSON_HEADERS)
    assert_error(response, 400, "nested", "64")
    assert errors == []


def test_nesting_at_the_limit_is_fine(client: httpx.Client) -> None:
    inner = b"[" * 63 + b"]" * 63  # the body object is level 1
    body = b'{"prompt": "hi", "max_tokens": 1, "x": ' + inner + b', "stop": "[[[[' + b"[" * 100 + b'"}'
    response = client.post("/v1/completions", content=body, headers=JSON_HEADERS)
    # Past the depth check (brackets inside a string do not count): refused only as an unknown field.
    assert response.status_code == 400 and response.json()["error"]["param"] == "x"
    assert "unknown field" in response.json()["error"]["message"]


def test_an_unexpected_error_is_one_500_logged_once(server: RunningServer, client: httpx.Client,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(model: str | None) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(app_state(server), "check_model", broken)
    with logged_errors() as errors:
        error = assert_error(client.post("/v1/completions", json={"prompt": "hi"}), 500)
    assert error["type"] == "server_error" and "boom" not in error["message"]
    assert [r.name for r in errors] == ["specdec.server.errors"]
    assert client.get("/health").status_code == 200  # the connection and the server carry on


def test_serve_flags_reach_the_app(server: RunningServer) -> None:
    from specdec.cli import build_parser
    from specdec.server.app import build_app
    from specdec.server.state import ServerLimits, server_limits

    args = build_parser().parse_args(["serve", "m", "--max-body-bytes", "1000", "--max-prompts", "3"])
    limits = server_limits(args)
    assert limits == ServerLimits(max_body_bytes=1000, max_prompts=3)
    app = build_app(server.async_engine, "other", None, limits=limits)
    assert app.state.server.limits is limits
    with pytest.raises(ValueError, match="max_prompts"):
        ServerLimits(max_prompts=0)
