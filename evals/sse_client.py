"""One streaming request to the OpenAI-compatible server, read as server-sent events.

Shared by the serving benchmark (bench_serving.py) and the load test (load_test.py), so
both read the stream, and classify its failures, the same way.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

DATA = "data: "
DONE = "data: [DONE]"


@dataclass
class Stream:
    """How one streaming request ended."""

    status: int = 0  # HTTP status, 0 when no response came
    done: bool = False  # the stream ended with [DONE]
    stopped: bool = False  # on_event asked to stop, and the connection was closed mid-stream
    error: str | None = None  # why the request failed; None when it did not
    server_error: bool = False  # a 5xx, or an error event of type "server_error" inside a 200 stream

    @property
    def ok(self) -> bool:
        return self.error is None


def choice_text(choice: dict[str, Any]) -> str:
    """The text one choice of a chunk carries: `text` for completions, `delta.content` for chat."""
    return str(choice.get("text") or (choice.get("delta") or {}).get("content") or "")


def event_text(event: dict[str, Any]) -> str:
    """The text of every choice of one chunk."""
    return "".join(choice_text(choice) for choice in event.get("choices") or [])


async def stream(client: httpx.AsyncClient, route: str, body: dict[str, Any],
                 on_event: Callable[[dict[str, Any]], bool]) -> Stream:
    """POST `body` to `route` and hand each JSON event to `on_event` until [DONE], an error,
    or `on_event` returns False (then the connection is closed, as a client that gives up would)."""
    result = Stream()
    try:
        async with client.stream("POST", route, json=body) as response:
            result.status = response.status_code
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                result.server_error = response.status_code >= 500
                return result
            async for line in response.aiter_lines():
                if line == DONE:
                    result.done = True
                    break
                if not line.startswith(DATA):
                    continue
                event = json.loads(line[len(DATA):])
                if "error" in event:
                    # The server ends the stream after an error event; nothing after it counts.
                    result.error = f"stream error event: {event['error'].get('message')}"
                    result.server_error = event["error"].get("type") == "server_error"
                    return result
                if not on_event(event):
                    result.stopped = True
                    return result  # leaving the block closes the connection mid-stream
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    if not result.done:
        result.error = "the stream ended without [DONE]"
    return result
