"""One HTTP request carried to an in-process ASGI app, its response handed back as parts.

The Ray Serve ingress (ray_ingress.py) receives the client's request and a replica
(ray_replica.py) runs it through the ordinary specdec app, so every route, auth check,
error body and SSE event is the single-process server's. What travels between them is a
`ForwardedRequest` one way and `ResponseHead` then body chunks (bytes) the other way.
Body chunks that pile up while the consumer is busy go out as one chunk: each part is
one Ray object, and a token per object would cost more than the token.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.types import ASGIApp, Message

logger = logging.getLogger(__name__)
Headers = tuple[tuple[bytes, bytes], ...]


@dataclass(frozen=True)
class ForwardedRequest:
    """An HTTP request as the ingress received it. `prefix_keys` are what the replica
    router matches cached prompt prefixes on (ray_router.py); empty for other routes."""

    method: str
    path: str
    query_string: bytes = b""
    headers: Headers = ()
    body: bytes = b""
    client: tuple[str, int] | None = None
    prefix_keys: tuple[int, ...] = field(default=(), repr=False)


@dataclass(frozen=True)
class ResponseHead:
    status: int
    headers: Headers

    def header(self, name: bytes) -> bytes | None:
        return next((value for key, value in self.headers if key.lower() == name), None)

    @property
    def is_event_stream(self) -> bool:
        return (self.header(b"content-type") or b"").startswith(b"text/event-stream")


ResponsePart = ResponseHead | bytes


class _Response:
    """What the app has sent so far; the app's `send` writes, `parts` reads."""

    def __init__(self, extra_headers: Headers) -> None:
        self.extra_headers = extra_headers
        self.head: ResponseHead | None = None
        self.body = bytearray()
        self.done = False
        self.changed = asyncio.Event()

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = tuple((bytes(k), bytes(v)) for k, v in message.get("headers", ()))
            self.head = ResponseHead(int(message["status"]), headers + self.extra_headers)
        elif message["type"] == "http.response.body":
            self.body += message.get("body", b"")
            self.done = not message.get("more_body", False)
        self.changed.set()

    def fail(self) -> None:
        """The app stopped without finishing its response: end what was sent, or send a 500."""
        if self.head is None:
            body = b'{"error": {"message": "internal server error", "type": "server_error", "param": null, ' \
                   b'"code": null}}'
            self.head = ResponseHead(500, ((b"content-type", b"application/json"), *self.extra_headers))
            self.body = bytearray(body)
        self.done = True
        self.changed.set()

    async def parts(self) -> AsyncIterator[ResponsePart]:
        head_sent = False
        while True:
            await self.changed.wait()
            self.changed.clear()
            if self.head is not None and not head_sent:
                head_sent = True
                yield self.head
            if self.body and head_sent:
                chunk = bytes(self.body)
                self.body.clear()
                yield chunk
            if self.done:
                return


def _scope(request: ForwardedRequest, state: dict[str, Any]) -> dict[str, Any]:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": request.method, "scheme": "http", "path": request.path, "raw_path": request.path.encode(),
            "root_path": "", "query_string": request.query_string, "headers": list(request.headers),
            "client": request.client, "server": None, "state": dict(state)}


async def relay(app: ASGIApp, request: ForwardedRequest, state: dict[str, Any],
                extra_headers: Headers = ()) -> AsyncIterator[ResponsePart]:
    """Run `request` through `app`; yields its ResponseHead, then its body in chunks.
    Closing the iterator early (the client went away) tells the app the client
    disconnected and cancels it, so the engine aborts the request."""
    response = _Response(extra_headers)
    disconnected = asyncio.Event()
    body_read = False

    async def receive() -> Message:
        nonlocal body_read
        if not body_read:
            body_read = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def run() -> None:
        try:
            await app(_scope(request, state), receive, response.send)
        except Exception:  # noqa: BLE001 - the app's own handlers missed it: a 500, logged
            logger.exception("%s %s failed", request.method, request.path)
        if not response.done:
            response.fail()

    task = asyncio.create_task(run(), name=f"relay {request.method} {request.path}")
    try:
        async for part in response.parts():
            yield part
    finally:
        disconnected.set()
        if not task.done():
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
