"""Schema-driven fuzzing: schemathesis reads the server's own /openapi.json and sends
valid and invalid requests to every route of a real server on 127.0.0.1; none may get a
5xx, nor a 200 stream that carries an error event (a failed engine step shows up there).

A fixed hypothesis profile keeps it deterministic and short: derandomized, no example
database, a few examples per route and generation mode. For a longer hunt set
SPECDEC_FUZZ_EXAMPLES (e.g. 500).
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from tests.helpers import API_KEY, RunningServer, all_blocks_free, wait_until

settings.register_profile(
    "specdec-fuzz", derandomize=True, database=None, deadline=None, print_blob=False,
    max_examples=int(os.environ.get("SPECDEC_FUZZ_EXAMPLES", "15")),
    phases=[Phase.explicit, Phase.generate, Phase.shrink], suppress_health_check=list(HealthCheck),
)
FUZZ = settings.get_profile("specdec-fuzz")
AUTH = {"Authorization": f"Bearer {API_KEY}"}
# Every route of server/app.py; a test below fails when the schema grows a route not here.
OPERATIONS = ["POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models", "POST /tokenize",
              "POST /detokenize", "GET /health", "GET /metrics", "GET /version", "GET /v1/models/{model_id}"]


@pytest.fixture(scope="module")
def api_schema(server: RunningServer) -> Any:
    # schemathesis' lazy pytest loader (from_fixture) breaks on pytest 9 (it sets the
    # private Node._nodeid), so cases come from its documented hypothesis strategies.
    schema = schemathesis.openapi.from_url(f"{server.base_url}/openapi.json", headers=AUTH, timeout=10)
    schema.config.update(base_url=server.base_url, headers=AUTH, request_timeout=60)
    return schema


def stream_errors(body: str) -> Iterator[dict[str, Any]]:
    """The error objects carried by `data:` events of an SSE body."""
    for line in body.splitlines():
        payload = line.removeprefix("data: ")
        if line.startswith("data: ") and payload != "[DONE]":
            event = json.loads(payload)
            if isinstance(event, dict) and "error" in event:
                yield event["error"]


def check_case(case: schemathesis.Case) -> None:
    response = case.call(headers=AUTH)
    case.validate_response(response, checks=[not_a_server_error])
    content_type = (response.headers.get("content-type") or [""])[0]  # schemathesis keeps header lists
    if content_type.startswith("text/event-stream"):
        assert list(stream_errors(response.text)) == [], case.as_curl_command()


def test_schema_documents_every_route(api_schema: Any) -> None:
    labels = {result.ok().label for result in api_schema.get_all_operations()}
    assert labels == set(OPERATIONS)
    body = api_schema["/v1/completions"]["POST"].body
    assert len(body) == 1 and body[0].media_type == "application/json"  # bodies are fuzzed, not empty


# Negative cases need something to break: only the routes with a body have any.
CASES = [(label, mode) for label in OPERATIONS for mode in GenerationMode
         if mode == GenerationMode.POSITIVE or label.startswith("POST")]


@pytest.mark.parametrize("label, mode", CASES, ids=[f"{label}-{mode.value}" for label, mode in CASES])
def test_no_server_errors(api_schema: Any, label: str, mode: GenerationMode) -> None:
    operation = api_schema.find_operation_by_label(label)
    FUZZ(given(case=operation.as_strategy(generation_mode=mode))(check_case))()


def test_server_is_clean_after_fuzzing(server: RunningServer) -> None:
    # Runs after the fuzz cases (file order): nothing leaked, still serving.
    assert wait_until(lambda: all_blocks_free(server) and not server.engine.has_unfinished_requests())
    with server.client() as client:
        assert client.get("/health").status_code == 200
