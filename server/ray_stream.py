"""How the ingress ends a stream whose replica died mid-way as a replica ends a stream it
aborts (streaming.py): a last chunk with finish_reason "abort" for each choice not yet
finished, then the error event and `[DONE]`.

The ingress relays the replica's bytes as they come; a `StreamWatch` reads the SSE events
on their way (an event may be split across relayed parts) for the chunks' envelope (id,
object, created, model) and the choices that have finished. The request's body says how
many choices there are: those that have sent nothing yet are ended too.
"""
from __future__ import annotations

import json
from typing import Any

from specdec.server.asgi_relay import ForwardedRequest
from specdec.server.chat import ChatStreamer
from specdec.server.completions import CompletionStreamer
from specdec.server.streaming import Streamer, sse

STREAMERS: dict[str, type[Streamer]] = {s.object_name: s for s in (ChatStreamer, CompletionStreamer)}


class StreamWatch:
    """Follows one relayed SSE stream; `abort_events` is what ends it early."""

    def __init__(self, request: ForwardedRequest) -> None:
        self.request = request
        self.partial = b""  # an event not yet complete
        self.envelope: dict[str, Any] | None = None  # the first chunk less its choices
        self.seen: set[int] = set()
        self.finished: set[int] = set()

    def feed(self, data: bytes) -> None:
        events = (self.partial + data).split(b"\n\n")
        self.partial = events.pop()
        for event in events:
            for line in event.split(b"\n"):
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    self.read_chunk(_json(line[len(b"data: "):]))

    def read_chunk(self, chunk: Any) -> None:
        choices = chunk.get("choices") if isinstance(chunk, dict) else None
        if not isinstance(choices, list):
            return  # an error event, or not a chunk of ours
        if self.envelope is None:
            self.envelope = {key: value for key, value in chunk.items() if key != "choices"}
        for choice in choices:
            index = choice.get("index") if isinstance(choice, dict) else None
            if isinstance(index, int):
                self.seen.add(index)
                if choice.get("finish_reason") is not None:
                    self.finished.add(index)

    def abort_events(self) -> str:
        """An "abort" chunk per unfinished choice, as SSE events; none before the first
        chunk (there is no response id to give them)."""
        streamer = STREAMERS.get(str(self.envelope.get("object"))) if self.envelope is not None else None
        if self.envelope is None or streamer is None:
            return ""
        count = max(choice_count(self.request), max(self.seen, default=-1) + 1)
        return "".join(sse({**self.envelope, "choices": [streamer.abort_choice(index)]})
                       for index in range(count) if index not in self.finished)


def choice_count(request: ForwardedRequest) -> int:
    """n per prompt, as the replica read the body (it accepted it); 0 if unreadable."""
    body = _json(request.body)
    if not isinstance(body, dict):
        return 0
    n = body.get("n", 1)
    n = n if isinstance(n, int) and n > 0 else 1
    if request.path.endswith("/chat/completions"):
        return n
    prompt = body.get("prompt")
    if isinstance(prompt, list) and not all(isinstance(token, int) for token in prompt):
        return n * len(prompt)  # a batch of prompts; a list of token ids is one
    return n


def _json(data: bytes) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        return None
