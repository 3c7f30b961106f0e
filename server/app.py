"""The OpenAI-compatible HTTP server: routes, SSE streaming, abort on disconnect, /metrics.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health,
GET /metrics, POST /tokenize, POST /detokenize. Errors are OpenAI error objects
`{"error": {"message", "type", "param", "code"}}`. When an api key is set, every route
but /health and /metrics needs `Authorization: Bearer <key>`.
"""
from __future__ import annotations

import abc
import argparse
import asyncio
import contextlib
import copy
import hmac
import json
import logging
import math
import os
import re
import signal
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, TypeVar

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from pydantic.json_schema import models_json_schema
from specdec.server.async_engine import AsyncEngine, EngineDeadError, EngineShuttingDownError, RequestStream
from specdec.server.metrics import CONTENT_TYPE, RequestTimer, ServerMetrics
from specdec.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    format_validation_error,
)
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdec.outputs import CompletionOutput, RequestOutput
from specdec.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
Body = TypeVar("Body", bound=BaseModel)
DISCONNECT_POLL_SECONDS = 0.2
DRAIN_TIMEOUT_SECONDS = int(os.environ.get("SPECDEC_DRAIN_TIMEOUT", "30"))
_SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "max_tokens", "min_tokens", "stop", "stop_token_ids",
                    "logprobs", "seed")


# ---- errors ----------------------------------------------------------------------------------


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(error: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    body = error_body(error.message, error.type, error.param, error.code)
    return JSONResponse(body, status_code=error.status, headers=headers)


def _unavailable(message: str) -> APIError:
    return APIError(503, message, "server_error", code="service_unavailable")


def _params_error(exc: ValueError) -> APIError:
    message = str(exc)
    first = message.split(" ", 1)[0]
    return APIError(400, message, param=first if first in _SAMPLING_FIELDS else None)


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


async def _on_unexpected(request: Request, exc: Exception) -> Response:
    logger.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(APIError(500, "internal server error", "server_error"))


# ---- server state ----------------------------------------------------------------------------


@dataclass
class ServerState:
    engine: AsyncEngine
    model_name: str
    api_key: str | None
    tokenizer: Any  # the server's own copy: the engine thread uses the engine's
    max_model_len: int
    vocab_size: int
    metrics: ServerMetrics
    created: int = field(default_factory=lambda: int(time.time()))
    tokens: dict[int, tuple[str, str, bytes]] = field(default_factory=dict)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist. This server serves `{self.model_name}`.",
                           param="model", code="model_not_found")

    def check_ready(self) -> None:
        if not self.engine.is_alive:
            raise _unavailable(f"the engine is not running: {self.engine.error or 'stopped'}")
        if not self.engine.is_accepting:
            raise _unavailable("the server is shutting down")

    def token_text(self, token_id: int) -> str:
        """The token decoded alone (U+FFFD for part of a character)."""
        return self._token(token_id)[0]

    def token_str(self, token_id: int) -> str:
        """The token as logprobs name it: OpenAI's `bytes:\\xNN` form for part of a character."""
        return self._token(token_id)[1]

    def token_bytes(self, token_id: int) -> list[int]:
        return list(self._token(token_id)[2])

    def _token(self, token_id: int) -> tuple[str, str, bytes]:
        entry = self.tokens.get(token_id)
        if entry is None:
            entry = self.tokens[token_id] = _describe_token(self.tokenizer, token_id)
        return entry


def _describe_token(tokenizer: Any, token_id: int) -> tuple[str, str, bytes]:
    text = str(tokenizer.decode([token_id]))
    if "\ufffd" in text:
        raw = _piece_bytes(str(tokenizer.convert_ids_to_tokens(token_id)))
        if raw is not None and not _is_utf8(raw):
            return text, "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw
    return text, text, text.encode("utf-8")


def _is_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _byte_level_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: byte-level BPE pieces back to bytes."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = {}, 0
    for byte in range(256):
        if byte in keep:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


_BYTE_DECODER = _byte_level_decoder()
_SP_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _piece_bytes(piece: str) -> bytes | None:
    match = _SP_BYTE.match(piece)  # SentencePiece byte fallback, e.g. <0xE2>
    if match:
        return bytes([int(match.group(1), 16)])
    if piece and all(c in _BYTE_DECODER for c in piece):
        return bytes(_BYTE_DECODER[c] for c in piece)
    return None


def _state(request: Request) -> ServerState:
    state: ServerState = request.app.state.server
    return state


async def _authorize(request: Request) -> None:
    key = _state(request).api_key
    if key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise APIError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`",
                       code="invalid_api_key")


async def parse_body(request: Request, model: type[Body]) -> Body:
    """Strict JSON parsing with OpenAI-style 4xx errors (no framework internals leak)."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type != "application/json":
        raise APIError(415, f"Content-Type must be application/json, got {content_type or 'none'!r}",
                       code="unsupported_media_type")
    raw = await request.body()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(400, f"the request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except ValueError as exc:
        detail = f"{exc.msg} at line {exc.lineno} column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else exc
        raise APIError(400, f"the request body is not valid JSON: {detail}") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        message, param = format_validation_error(exc)
        raise APIError(400, message, param=param) from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a valid JSON number")


# ---- running requests ------------------------------------------------------------------------


@dataclass
class _Job:
    """One API request: one engine request (RequestStream) per prompt."""

    request_id: str
    n: int
    created: int = field(default_factory=lambda: int(time.time()))
    streams: list[RequestStream] = field(default_factory=list)
    timers: list[RequestTimer] = field(default_factory=list)

    def abort(self) -> None:
        for stream in self.streams:
            stream.abort()


async def _start(state: ServerState, job: _Job, prompts: list[str | list[int]], params: SamplingParams,
                 speculative: bool, param: str) -> None:
    state.check_ready()
    index = 0
    try:
        for index, prompt in enumerate(prompts):
            request_id = job.request_id if len(prompts) == 1 else f"{job.request_id}-p{index}"
            job.timers.append(state.metrics.timer())
            job.streams.append(await state.engine.generate(request_id, prompt, params, speculative))
    except ValueError as exc:
        job.abort()
        where = f"{param}[{index}]: " if len(prompts) > 1 else ""
        raise APIError(400, f"{where}{exc}", param=param) from None
    except (EngineDeadError, EngineShuttingDownError) as exc:
        job.abort()
        raise _unavailable(str(exc)) from None
    except BaseException:
        job.abort()
        raise


async def _merge(job: _Job) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """(prompt index, merged cumulative output) as each prompt's request makes progress."""
    pending = {asyncio.ensure_future(s.__anext__()): i for i, s in enumerate(job.streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                index = pending.pop(task)
                output: RequestOutput = task.result()
                job.timers[index].observe(output)
                if not output.finished:
                    pending[asyncio.ensure_future(job.streams[index].__anext__())] = index
                yield index, output
    finally:
        for task in pending:
            task.cancel()


async def _watch_disconnect(request: Request, job: _Job) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_SECONDS)
    logger.info("client of %s disconnected: aborting", job.request_id)
    job.abort()


@contextlib.asynccontextmanager
async def _abort_on_disconnect(request: Request, job: _Job) -> AsyncIterator[None]:
    """Abort the job's engine requests (freeing their KV blocks) if the client leaves or
    the handler is cancelled; a no-op for requests that finished."""
    watcher = asyncio.create_task(_watch_disconnect(request, job))
    try:
        yield
    finally:
        watcher.cancel()
        job.abort()


def _failure(output: RequestOutput) -> APIError | None:
    reasons = {c.finish_reason for c in output.outputs}
    if output.error is not None or "error" in reasons:
        return APIError(500, f"the engine failed the request: {output.error or 'unknown error'}", "server_error",
                        code="internal_error")
    if "abort" in reasons:
        return _unavailable("the request was aborted (client gone or server shutting down)")
    return None


async def _collect(request: Request, job: _Job) -> list[RequestOutput]:
    finals: list[RequestOutput | None] = [None] * len(job.streams)
    async with _abort_on_disconnect(request, job), contextlib.aclosing(_merge(job)) as merged:
        async for index, output in merged:
            finals[index] = output
            failure = _failure(output)
            if failure is not None:
                raise failure
    return [f for f in finals if f is not None]


def _usage(outputs: list[RequestOutput]) -> dict[str, int]:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _finite(value: float) -> float:
    return value if math.isfinite(value) else -9999.0


# ---- logprobs --------------------------------------------------------------------------------


def completion_logprobs(state: ServerState, token_ids: list[int], logprobs: list[dict[int, float]],
                        offset: int) -> dict[str, Any]:
    """Legacy completions shape; top_logprobs holds the top-k plus the sampled token."""
    tokens = [state.token_str(t) for t in token_ids]
    offsets = []
    for token_id in token_ids:
        offsets.append(offset)
        offset += len(state.token_text(token_id))
    return {
        "tokens": tokens,
        "token_logprobs": [_finite(lp.get(t, -math.inf)) for t, lp in zip(token_ids, logprobs)],
        "top_logprobs": [{state.token_str(i): _finite(v) for i, v in lp.items()} for lp in logprobs],
        "text_offset": offsets,
    }


def _chat_token(state: ServerState, token_id: int, logprob: float) -> dict[str, Any]:
    return {"token": state.token_str(token_id), "logprob": _finite(logprob), "bytes": state.token_bytes(token_id)}


def chat_logprobs(state: ServerState, token_ids: list[int], logprobs: list[dict[int, float]],
                  num_top: int) -> dict[str, Any]:
    content = []
    for token_id, entry in zip(token_ids, logprobs):
        item = _chat_token(state, token_id, entry.get(token_id, -math.inf))
        top = sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:num_top]
        item["top_logprobs"] = [_chat_token(state, i, v) for i, v in top]
        content.append(item)
    return {"content": content}


# ---- streaming -------------------------------------------------------------------------------


@dataclass
class _Delta:
    index: int  # the choice index in the response
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    offset: int  # characters of this choice sent before this delta
    first: bool


@dataclass
class _Progress:
    text_len: int = 0
    num_tokens: int = 0
    finished: bool = False
    started: bool = False


class _DeltaTracker:
    """Turns cumulative outputs into per-choice deltas: finish_reason exactly once."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.progress: dict[int, _Progress] = {}

    def deltas(self, prompt_index: int, output: RequestOutput) -> list[_Delta]:
        result = []
        for completion in output.outputs:
            index = prompt_index * self.n + completion.index
            delta = self._delta(index, completion)
            if delta is not None:
                result.append(delta)
        return result

    def _delta(self, index: int, completion: CompletionOutput) -> _Delta | None:
        prog = self.progress.setdefault(index, _Progress())
        text = completion.text[prog.text_len:]
        token_ids = completion.token_ids[prog.num_tokens:]
        logprobs = None if completion.logprobs is None else completion.logprobs[prog.num_tokens:]
        finish = completion.finish_reason
        if prog.finished or not (text or finish or (token_ids and logprobs)):
            return None
        delta = _Delta(index, text, token_ids, logprobs, finish, prog.text_len, not prog.started)
        prog.text_len, prog.num_tokens = len(completion.text), len(completion.token_ids)
        prog.finished, prog.started = finish is not None, True
        return delta


class _Streamer(abc.ABC):
    """Formats one streaming response; subclasses shape completions / chat chunks."""

    object_name = ""

    def __init__(self, state: ServerState, job: _Job, include_usage: bool) -> None:
        self.state, self.job, self.include_usage = state, job, include_usage
        self.tracker = _DeltaTracker(job.n)
        self.latest: dict[int, RequestOutput] = {}

    def chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        body: dict[str, Any] = {"id": self.job.request_id, "object": self.object_name, "created": self.job.created,
                                "model": self.state.model_name, "choices": choices}
        if self.include_usage:
            body["usage"] = None
        return body

    def opening(self) -> list[dict[str, Any]]:
        return []

    def on_output(self, prompt_index: int, output: RequestOutput) -> list[dict[str, Any]]:
        self.latest[prompt_index] = output
        return [self.chunk([self.choice(output, d)]) for d in self.tracker.deltas(prompt_index, output)]

    @abc.abstractmethod
    def choice(self, output: RequestOutput, delta: _Delta) -> dict[str, Any]:
        """One chunk choice for a delta of one prompt's output."""

    def closing(self) -> list[dict[str, Any]]:
        if not self.include_usage:
            return []
        body = self.chunk([])
        body["usage"] = _usage(list(self.latest.values()))
        return [body]


class _CompletionStreamer(_Streamer):
    object_name = "text_completion"

    def __init__(self, state: ServerState, job: _Job, include_usage: bool, echo: bool) -> None:
        super().__init__(state, job, include_usage)
        self.echo = echo

    def choice(self, output: RequestOutput, delta: _Delta) -> dict[str, Any]:
        prefix = _prompt_text(self.state, output) if self.echo and delta.first else ""
        logprobs = None
        if delta.logprobs is not None:
            logprobs = completion_logprobs(self.state, delta.token_ids, delta.logprobs, delta.offset)
        return {"index": delta.index, "text": prefix + delta.text, "logprobs": logprobs,
                "finish_reason": delta.finish_reason}


class _ChatStreamer(_Streamer):
    object_name = "chat.completion.chunk"

    def __init__(self, state: ServerState, job: _Job, include_usage: bool, num_top: int) -> None:
        super().__init__(state, job, include_usage)
        self.num_top = num_top

    def opening(self) -> list[dict[str, Any]]:
        count = len(self.job.streams) * self.job.n
        return [self.chunk([{"index": i, "delta": {"role": "assistant"}, "logprobs": None, "finish_reason": None}])
                for i in range(count)]

    def choice(self, output: RequestOutput, delta: _Delta) -> dict[str, Any]:
        logprobs = None
        if delta.logprobs is not None:
            logprobs = chat_logprobs(self.state, delta.token_ids, delta.logprobs, self.num_top)
        content = {"content": delta.text} if delta.text or delta.finish_reason is None else {}
        return {"index": delta.index, "delta": content, "logprobs": logprobs, "finish_reason": delta.finish_reason}


# Characters json.dumps(ensure_ascii=False) leaves raw that str.splitlines() (and so
# httpx's aiter_lines) treats as line breaks: raw, they would cut an SSE event in two.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _sse(data: dict[str, Any] | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload.translate(_LINE_BREAKS)}\n\n"


async def _events(request: Request, job: _Job, streamer: _Streamer) -> AsyncIterator[str]:
    async with _abort_on_disconnect(request, job), contextlib.aclosing(_merge(job)) as merged:
        for chunk in streamer.opening():
            yield _sse(chunk)
        async for index, output in merged:
            failure = _failure(output)
            if failure is not None:
                yield _sse(error_body(failure.message, failure.type, failure.param, failure.code))
                break
            for chunk in streamer.on_output(index, output):
                yield _sse(chunk)
        else:
            for chunk in streamer.closing():
                yield _sse(chunk)
        yield _sse("[DONE]")


def _streaming_response(request: Request, job: _Job, streamer: _Streamer) -> StreamingResponse:
    return StreamingResponse(_events(request, job, streamer), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


# ---- completions -----------------------------------------------------------------------------


def _prompt_text(state: ServerState, output: RequestOutput) -> str:
    if output.prompt is not None:
        return output.prompt
    return str(state.tokenizer.decode(output.prompt_token_ids))


def _completion_choice(state: ServerState, output: RequestOutput, completion: CompletionOutput, index: int,
                       echo: bool) -> dict[str, Any]:
    prefix = _prompt_text(state, output) if echo else ""
    logprobs = None
    if completion.logprobs is not None:
        logprobs = completion_logprobs(state, completion.token_ids, completion.logprobs, len(prefix))
    return {"index": index, "text": prefix + completion.text, "logprobs": logprobs,
            "finish_reason": completion.finish_reason}


def completion_body(state: ServerState, job: _Job, finals: list[RequestOutput], echo: bool) -> dict[str, Any]:
    choices = [_completion_choice(state, out, c, p * job.n + c.index, echo)
               for p, out in enumerate(finals) for c in out.outputs]
    return {"id": job.request_id, "object": "text_completion", "created": job.created, "model": state.model_name,
            "choices": choices, "usage": _usage(finals)}


def _checked_params(state: ServerState, body: Any) -> SamplingParams:
    """The body's model must be ours and its sampling fields valid (else a 4xx)."""
    state.check_model(body.model)
    try:
        return body.to_sampling_params()  # type: ignore[no-any-return]
    except ValueError as exc:
        raise _params_error(exc) from None


async def create_completion(request: Request) -> Response:
    state = _state(request)
    body = await parse_body(request, CompletionRequest)
    params = _checked_params(state, body)
    job = _Job(f"cmpl-{uuid.uuid4().hex}", params.n)
    await _start(state, job, body.prompts(), params, body.speculative, "prompt")
    if body.stream:
        return _streaming_response(request, job, _CompletionStreamer(state, job, body.include_usage, body.echo))
    finals = await _collect(request, job)
    return JSONResponse(completion_body(state, job, finals, body.echo))


# ---- chat ------------------------------------------------------------------------------------


def chat_prompt(state: ServerState, conversation: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
    tokenizer = state.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, f"the model `{state.model_name}` has no chat template, so chat messages cannot be "
                            "formatted; use /v1/completions with a plain prompt instead", param="messages",
                       code="no_chat_template")
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except Exception as exc:  # noqa: BLE001 - a template that rejects these messages
        raise APIError(400, f"the chat template could not format these messages: {exc}", param="messages") from None
    return list(tokenizer.encode(text, add_special_tokens=False))


def _chat_choice(state: ServerState, completion: CompletionOutput, index: int, num_top: int) -> dict[str, Any]:
    logprobs = None
    if completion.logprobs is not None:
        logprobs = chat_logprobs(state, completion.token_ids, completion.logprobs, num_top)
    return {"index": index, "message": {"role": "assistant", "content": completion.text}, "logprobs": logprobs,
            "finish_reason": completion.finish_reason}


def chat_body(state: ServerState, job: _Job, final: RequestOutput, num_top: int) -> dict[str, Any]:
    choices = [_chat_choice(state, c, c.index, num_top) for c in final.outputs]
    return {"id": job.request_id, "object": "chat.completion", "created": job.created, "model": state.model_name,
            "choices": choices, "usage": _usage([final])}


async def create_chat_completion(request: Request) -> Response:
    state = _state(request)
    body = await parse_body(request, ChatCompletionRequest)
    params = _checked_params(state, body)
    prompt = chat_prompt(state, body.conversation(), body.add_generation_prompt)
    job = _Job(f"chatcmpl-{uuid.uuid4().hex}", params.n)
    await _start(state, job, [prompt], params, body.speculative, "messages")
    num_top = body.top_logprobs or 0
    if body.stream:
        return _streaming_response(request, job, _ChatStreamer(state, job, body.include_usage, num_top))
    finals = await _collect(request, job)
    return JSONResponse(chat_body(state, job, finals[0], num_top))


# ---- the other routes ------------------------------------------------------------------------


async def list_models(request: Request) -> Response:
    state = _state(request)
    model = {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "specdec",
             "root": state.model_name, "max_model_len": state.max_model_len}
    return JSONResponse({"object": "list", "data": [model]})


async def health(request: Request) -> Response:
    state = _state(request)
    try:
        state.check_ready()
    except APIError as exc:
        return error_response(exc)
    return JSONResponse({"status": "ok"})


async def metrics(request: Request) -> Response:
    state = _state(request)
    return Response(state.metrics.render(state.engine.stats), media_type=CONTENT_TYPE)


async def tokenize(request: Request) -> Response:
    state = _state(request)
    body = await parse_body(request, TokenizeRequest)
    state.check_model(body.model)
    if body.messages is not None:
        conversation = [m.for_template() for m in body.messages]
        tokens = chat_prompt(state, conversation, body.add_generation_prompt)
    else:
        tokens = list(state.tokenizer.encode(body.prompt or "", add_special_tokens=body.add_special_tokens))
    return JSONResponse({"count": len(tokens), "max_model_len": state.max_model_len, "tokens": tokens})


async def detokenize(request: Request) -> Response:
    state = _state(request)
    body = await parse_body(request, DetokenizeRequest)
    state.check_model(body.model)
    bad = [t for t in body.tokens if not 0 <= t < state.vocab_size]
    if bad:
        raise APIError(400, f"token ids {bad[:5]} are outside the vocabulary [0, {state.vocab_size})",
                       param="tokens")
    return JSONResponse({"prompt": state.tokenizer.decode(body.tokens)})


# ---- the app ---------------------------------------------------------------------------------


def _server_tokenizer(engine: Any) -> Any:
    """A private copy: HF fast tokenizers must not be shared across threads."""
    try:
        return copy.deepcopy(engine.tokenizer)
    except Exception:  # noqa: BLE001
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(engine.model_dir))


_SCHEMA_REF = "#/components/schemas/{model}"
_BEARER = "bearerAuth"


def _openapi_extra(body: type[BaseModel] | None, auth: bool, api_key: str | None) -> dict[str, Any]:
    """Handlers parse their bodies themselves (parse_body), so FastAPI cannot see them:
    document each body and the bearer key here, for clients and schema-driven fuzzers."""
    extra: dict[str, Any] = {}
    if body is not None:
        schema = {"$ref": _SCHEMA_REF.format(model=body.__name__)}
        extra["requestBody"] = {"required": True, "content": {"application/json": {"schema": schema}}}
    if auth and api_key is not None:
        extra["security"] = [{_BEARER: []}]
    return extra


def _router(api_key: str | None) -> APIRouter:
    router = APIRouter()
    secured = [Depends(_authorize)]
    routes: list[tuple[str, Callable[..., Any], str, bool, type[BaseModel] | None]] = [
        ("/v1/completions", create_completion, "POST", True, CompletionRequest),
        ("/v1/chat/completions", create_chat_completion, "POST", True, ChatCompletionRequest),
        ("/v1/models", list_models, "GET", True, None),
        ("/tokenize", tokenize, "POST", True, TokenizeRequest),
        ("/detokenize", detokenize, "POST", True, DetokenizeRequest),
        ("/health", health, "GET", False, None),
        ("/metrics", metrics, "GET", False, None),
    ]
    for path, endpoint, method, auth, body in routes:
        router.add_api_route(path, endpoint, methods=[method], dependencies=secured if auth else None,
                             include_in_schema=True, openapi_extra=_openapi_extra(body, auth, api_key))
    return router


def _openapi(app: FastAPI, api_key: str | None) -> Callable[[], dict[str, Any]]:
    """FastAPI's schema plus the request body models and the bearer scheme it cannot infer."""

    def build() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
            models = [CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest]
            _, defs = models_json_schema([(m, "validation") for m in models], ref_template=_SCHEMA_REF)
            components = schema.setdefault("components", {})
            components.setdefault("schemas", {}).update(defs.get("$defs", {}))
            if api_key is not None:
                components["securitySchemes"] = {_BEARER: {"type": "http", "scheme": "bearer"}}
            app.openapi_schema = schema
        return app.openapi_schema

    return build


def build_app(async_engine: AsyncEngine, served_model_name: str, api_key: str | None = None) -> FastAPI:
    engine: Any = async_engine.engine
    num_spec = int(getattr(engine, "num_speculative_tokens", 0) or 0)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await async_engine.shutdown(drain=False, timeout=DRAIN_TIMEOUT_SECONDS)

    app = FastAPI(title="specdec", summary="OpenAI-compatible speculative-decoding server", lifespan=lifespan)
    app.state.server = ServerState(
        engine=async_engine, model_name=served_model_name, api_key=api_key, tokenizer=_server_tokenizer(engine),
        max_model_len=int(engine.max_model_len), vocab_size=int(engine.model_config.vocab_size),
        metrics=ServerMetrics(num_spec),
    )
    app.include_router(_router(api_key))
    app.openapi = _openapi(app, api_key)  # type: ignore[method-assign]
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(Exception, _on_unexpected)
    return app


# ---- specdec serve ---------------------------------------------------------------------------


class _Server(uvicorn.Server):
    """uvicorn's server, but the first SIGTERM/SIGINT also stops new requests (health 503);
    in-flight ones may finish for up to DRAIN_TIMEOUT_SECONDS, the rest are aborted, and
    the process exits 0."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine) -> None:
        super().__init__(config)
        self.engine = engine

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:
            logger.info("signal %s: draining in-flight requests, then exiting", sig)
        self.engine.begin_shutdown()
        super().handle_exit(sig, frame)
        captured = getattr(self, "_captured_signals", None)
        if isinstance(captured, list) and sig in (signal.SIGTERM, signal.SIGINT):
            captured.clear()  # a drained exit is a clean one: do not re-raise the signal


def serve(args: argparse.Namespace) -> None:
    from specdec.cli import engine_kwargs
    from specdec.llm import LLM

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    llm = LLM(args.model, **engine_kwargs(args))
    async_engine = AsyncEngine(llm.engine)
    name = args.served_model_name or args.model
    api_key = args.api_key or os.environ.get("SPECDEC_API_KEY") or None
    app = build_app(async_engine, name, api_key)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info",
                            timeout_graceful_shutdown=DRAIN_TIMEOUT_SECONDS)
    logger.info("serving %s (%s) on http://%s:%s", name, llm.model_dir, args.host, args.port)
    _Server(config, async_engine).run()
