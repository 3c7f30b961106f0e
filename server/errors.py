"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` for every failure,
including the framework's own (unknown route, wrong method, unhandled exception)."""
from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger(__name__)
# SamplingParams' messages start with the field's name: those name the request's `param`
_SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "max_tokens", "min_tokens", "stop", "stop_token_ids",
                    "logprobs", "seed")


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(error: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def unavailable(message: str) -> APIError:
    return APIError(503, message, "server_error", code="service_unavailable")


def params_error(exc: ValueError) -> APIError:
    """A 400 for SamplingParams' ValueError, naming the field when the message does."""
    message = str(exc)
    first = message.split(" ", 1)[0]
    return APIError(400, message, param=first if first in _SAMPLING_FIELDS else None)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_middleware(UnexpectedErrors)  # added last: outermost but for Starlette's own


async def _on_api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return error_response(exc)


async def _on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 404:
        message = f"Invalid URL ({request.method} {request.url.path})"
    elif exc.status_code == 405:
        message = f"Method {request.method} is not allowed on {request.url.path}"
    else:
        message = str(exc.detail)
    type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return error_response(APIError(exc.status_code, message, type_), headers=getattr(exc, "headers", None))


async def _on_validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    message = "; ".join(str(e.get("msg", "invalid value")) for e in exc.errors()) or "invalid request"
    return error_response(APIError(400, message))


class UnexpectedErrors:
    """Any other exception becomes one OpenAI-shaped 500, logged once. (An Exception handler
    would run in Starlette's ServerErrorMiddleware, which re-raises for uvicorn to log it again.)"""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception:
            logger.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            if not started:  # else the client sees its response cut short: nothing more can be sent
                await error_response(APIError(500, "internal server error", "server_error"))(scope, receive, send)
