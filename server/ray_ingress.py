"""The HTTP front of the Ray Serve application: every route of `specdec serve`, served by
the engine replicas, and GET /metrics, every replica's page with a `replica` label.

Each request is handed whole to a replica chosen by the prefix-aware router
(ray_router.py, which reads the `prefix_keys` computed here) and its response streamed
back (asgi_relay.py). A replica that dies before anything of its response reached the
client is not the client's problem: the request goes to another replica (up to
MAX_ATTEMPTS in all). One that dies mid-stream ends the stream as the single-process
server ends an aborted one: an "abort" chunk per unfinished choice (ray_stream.py), an
OpenAI error event and `[DONE]`.

No `from __future__ import annotations` here: Serve rewrites the route methods' signatures
for FastAPI, which then cannot resolve annotations given as strings.
"""
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError

from specdec.server.asgi_relay import ForwardedRequest, ResponseHead, ResponsePart
from specdec.server.errors import APIError, error_body, error_response, install_error_handlers, unavailable
from specdec.server.metrics import CONTENT_TYPE
from specdec.server.ray_router import prefix_keys
from specdec.server.ray_stream import StreamWatch
from specdec.server.streaming import sse

logger = logging.getLogger(__name__)
MAX_ATTEMPTS = 3
METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
# A replica process that died, or that Ray cannot reach: another replica may serve.
REPLICA_GONE = (RayActorError, ActorUnavailableError)
Call = Callable[[ForwardedRequest], AsyncGenerator[ResponsePart, None]]

ingress_app = FastAPI(title="specdec", docs_url=None, redoc_url=None, openapi_url=None)
install_error_handlers(ingress_app)


async def read_request(request: Request, max_body_bytes: int) -> ForwardedRequest:
    """The request as a replica takes it. At most max_body_bytes + 1 body bytes are read:
    enough for the replica to refuse a larger body with its 413."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_body_bytes:
            break
    keys = prefix_keys(_json(bytes(body))) if request.url.path in GENERATION_PATHS else ()
    client = (request.client.host, request.client.port) if request.client else None
    return ForwardedRequest(request.method, request.url.path, request.scope.get("query_string", b""),
                            tuple(request.scope["headers"]), bytes(body), client, keys)


def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:  # the replica answers with the proper 400
        return None


async def respond(call: Call, request: ForwardedRequest) -> Response:
    """The response of the first replica that does not die before answering."""
    failures: list[str] = []
    for _ in range(MAX_ATTEMPTS):
        parts = call(request)
        try:
            head, first = await _start(parts)
        except REPLICA_GONE as exc:
            await parts.aclose()
            failures.append(_reason(exc))
            logger.warning("%s %s: the replica died before answering; trying another: %s", request.method,
                           request.path, failures[-1])
            continue
        except BaseException:
            await parts.aclose()
            raise
        if not head.is_event_stream:
            await parts.aclose()
            return _with_head(Response(first), head)
        return _with_head(StreamingResponse(_stream(first, parts, StreamWatch(request))), head)
    raise unavailable(f"no engine replica could serve the request ({len(failures)} died): {failures[-1]}")


async def _start(parts: AsyncGenerator[ResponsePart, None]) -> tuple[ResponseHead, bytes]:
    """The head and what may still be retried elsewhere: a whole body, or a stream's first
    chunk (nothing reaches the client before this returns)."""
    head = await anext(parts)
    if not isinstance(head, ResponseHead):
        raise RuntimeError("the replica sent a body before its response head")
    if head.is_event_stream:
        first = await anext(parts, b"")
        return head, first if isinstance(first, bytes) else b""
    return head, b"".join([part async for part in parts if isinstance(part, bytes)])


async def _stream(first: bytes, parts: AsyncGenerator[ResponsePart, None], watch: StreamWatch) -> AsyncIterator[bytes]:
    try:
        if first:
            watch.feed(first)
            yield first
        async for part in parts:
            if isinstance(part, bytes):
                watch.feed(part)
                yield part
    except REPLICA_GONE as exc:
        logger.warning("a replica died mid-stream: %s", _reason(exc))
        message = f"the engine replica serving this request stopped: {_reason(exc)}"
        error = sse(error_body(message, "server_error", code="replica_died"))
        yield (watch.abort_events() + error + sse("[DONE]")).encode()
    finally:
        await parts.aclose()


def _with_head(response: Response, head: ResponseHead) -> Response:
    response.status_code = head.status
    response.raw_headers = list(head.headers)
    return response


def _reason(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


@serve.ingress(ingress_app)
class Ingress:
    """The body of the ingress deployment (ray_app.py gives it its Serve options)."""

    def __init__(self, engine: Any, board: Any, max_body_bytes: int) -> None:
        self.engine = engine.options(stream=True)  # DeploymentHandles
        self.board = board
        self.max_body_bytes = max_body_bytes

    async def call(self, request: ForwardedRequest) -> AsyncGenerator[ResponsePart, None]:
        parts = self.engine.forward.remote(request)
        try:
            async for part in parts:
                yield part
        finally:
            parts.cancel()  # once finished, a no-op; else the replica aborts the request

    @ingress_app.get("/metrics")
    async def metrics(self) -> Response:
        return Response(await self.board.collect.remote(), media_type=CONTENT_TYPE)

    @ingress_app.api_route("/{path:path}", methods=METHODS)
    async def forward(self, request: Request) -> Response:
        try:
            return await respond(self.call, await read_request(request, self.max_body_bytes))
        except APIError as exc:
            return error_response(exc)
