"""Over HTTP, one request's constraint never harms another's: a recursive schema that fails
mid-generation beside four healthy streams (speculative and plain) ends with its own error
event while the streams finish as they would without it; every invalid or oversized
constraint is a 400 naming its own field and bound; and no error a client reads carries
another request's input, a grammar dump or a backtrace."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from tests.engine.test_fault_isolation import RECURSIVE
from tests.helpers import RunningServer, all_blocks_free, sse_events, wait_until

LEAKS = ("SECRET", "<grammar>", "<state>", "Traceback", "panicked", "RUST_BACKTRACE")


def stream_completion(server: RunningServer, body: dict[str, Any]) -> list[Any]:
    with server.client() as client, client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, response.read()
        return sse_events(response.iter_lines())


def text_of(events: list[Any]) -> str:
    return "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict) and e.get("choices"))


@pytest.mark.parametrize("speculative", [True, False])
def test_a_failing_grammar_beside_healthy_streams(server: RunningServer, speculative: bool) -> None:
    healthy = [{"model": server.model, "prompt": f"story {i}:", "max_tokens": 40, "temperature": 0,
                "ignore_eos": True, "stream": True, "speculative": speculative} for i in range(4)]
    with ThreadPoolExecutor(4) as pool:
        alone = [text_of(events) for events in pool.map(lambda b: stream_completion(server, b), healthy)]
    bad = {"model": server.model, "prompt": "json:", "max_tokens": 40, "stream": True, "speculative": speculative,
           "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": RECURSIVE}}}
    with ThreadPoolExecutor(5) as pool:
        runs = list(pool.map(lambda b: stream_completion(server, b), [*healthy, bad]))
    assert [text_of(events) for events in runs[:4]] == alone
    assert not any("error" in event for events in runs[:4] for event in events)
    error = runs[4][-1]["error"]
    assert "structured outputs: the grammar failed" in error["message"]
    assert not any(leak in json.dumps(runs[4]) for leak in LEAKS)
    assert wait_until(lambda: all_blocks_free(server))


@pytest.mark.parametrize(("fields", "needle"), [
    ({"guided_grammar": "::=::= ((("}, "invalid grammar"),
    ({"guided_grammar": 'root ::= [a-'}, "invalid grammar"),
    ({"guided_regex": "a{99999999999}"}, "invalid regex"),
    ({"guided_json": {"type": "object", "properties": {"SECRET_x": {"type": "nonsense"}}}}, "invalid JSON schema"),
    ({"guided_choice": [f"c{i}" for i in range(10_001)]}, "max_guided_choices=10000"),
    ({"guided_regex": "a" * (512 * 1024 + 1)}, "max_grammar_bytes=524288"),
])
def test_every_bad_constraint_is_a_400_without_a_dump(server: RunningServer, fields: dict[str, Any],
                                                      needle: str) -> None:
    with server.client() as client:
        response = client.post("/v1/completions", json={"model": server.model, "prompt": "hi", "max_tokens": 4,
                                                        **fields})
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert needle in message and not any(leak in message for leak in ("<grammar>", "<state>", "Traceback"))
    assert len(message) < 1000
    assert all_blocks_free(server)


def test_a_grammar_over_the_compile_time_bound_is_a_400(server: RunningServer,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    grammars = server.engine.grammars
    monkeypatch.setattr(grammars, "limits", type(grammars.limits)(compile_s=1e-6))
    choices = [f"a distinct choice {i}" for i in range(3000)]  # a few milliseconds of compiling
    with server.client() as client:
        response = client.post("/v1/completions", json={"model": server.model, "prompt": "hi", "max_tokens": 4,
                                                        "guided_choice": choices})
    assert response.status_code == 400, response.text
    assert "max_grammar_compile_s=1e-06" in response.json()["error"]["message"]


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": "abc\ud800def"}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi \udfff"}]}, "messages"),
])
def test_a_lone_surrogate_is_a_400_naming_the_field(server: RunningServer, path: str, body: dict[str, Any],
                                                    param: str) -> None:
    raw = json.dumps({"model": server.model, "max_tokens": 4, **body})  # ASCII-escaped: "\ud800" travels as is
    with server.client() as client:
        response = client.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "surrogate" in error["message"] and error["param"].startswith(param)
