"""The OpenAI-compatible HTTP server: the app factory, auth, the small routes, and `serve`.

Routes: POST /v1/completions (completions.py), POST /v1/chat/completions (chat.py),
GET /v1/models, GET /v1/models/{model_id}, GET /health, GET /version, GET /metrics,
POST /tokenize, POST /detokenize. Errors are OpenAI error objects
`{"error": {"message", "type", "param", "code"}}` (errors.py). When an api key is set, every
route but /health, /version and /metrics needs `Authorization: Bearer <key>`, the docs
(/docs, /redoc, /openapi.json) too unless `docs_without_auth`. Admission (admission.py)
refuses new requests while shutting down and caps each key's requests in flight; `_Server`
drains on SIGTERM/SIGINT. `serve` warms the engine up before the port opens.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import logging
import os
import sys
import time
from collections.abc import AsyncIterator, Callable
from types import FrameType
from typing import Any

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from specdec.async_engine import AsyncEngine
from specdec.server.admission import Admission, AdmissionMiddleware, bearer_token, key_matches, resolve_api_key
from specdec.server.chat import chat_prompt, create_chat_completion
from specdec.server.completions import create_completion
from specdec.server.connections import guarded_protocol
from specdec.server.cors import CorsPolicy, add_cors, cors_policy
from specdec.server.errors import APIError, error_response, install_error_handlers
from specdec.server.metrics import CONTENT_TYPE, ServerMetrics
from specdec.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from specdec.server.request_log import RequestRecord
from specdec.server.state import (
    ServerLimits,
    ServerOptions,
    ServerState,
    server_limits,
    server_options,
    server_state,
)
from specdec.server.stats_log import StatsLogger, startup_summary
from specdec.server.tool_parsers import ToolCallSettings, tool_call_settings
from specdec.version import specdec_version

logger = logging.getLogger(__name__)
# After the shutdown deadline has aborted what was still running: time for those error
# events to reach their clients, and uvicorn's wait for the last responses.
SHUTDOWN_FLUSH_SECONDS = 5
ENGINE_STOP_SECONDS = 10.0
_SCHEMA_REF = "#/components/schemas/{model}"
_BEARER = "bearerAuth"


# ---- auth and the small routes ---------------------------------------------------------------


async def authorize(request: Request) -> None:
    key = server_state(request).api_key
    if key is None:
        return
    # Starlette decodes headers as latin-1: encoding back gives the bytes the client sent.
    token = bearer_token(request.headers.get("authorization", "").encode("latin-1"))
    if token is None or not key_matches(token, key):
        raise APIError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`",
                       code="invalid_api_key")


async def list_models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [_model_card(server_state(request))]})


async def retrieve_model(request: Request, model_id: str) -> Response:
    """The served model's object, as in the list; 404 `model_not_found` for any other id
    (an id may hold slashes, as `org/name` does)."""
    state = server_state(request)
    state.check_model(model_id)
    return JSONResponse(_model_card(state))


def _model_card(state: ServerState) -> dict[str, Any]:
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "specdec",
            "root": state.model_name, "max_model_len": state.max_model_len}


async def version(request: Request) -> Response:
    """specdec's version. Open like /health (no key needed), as vLLM's /version is: the
    version of a public package tells nothing a key protects."""
    return JSONResponse({"version": specdec_version()})


async def health(request: Request) -> Response:
    state = server_state(request)
    try:
        state.check_ready()
    except APIError as exc:
        return error_response(exc)
    return JSONResponse({"status": "ok"})


async def metrics(request: Request) -> Response:
    state = server_state(request)
    return Response(state.metrics.render(state.engine.stats), media_type=CONTENT_TYPE)


async def tokenize(request: Request) -> Response:
    state = server_state(request)
    body = await state.parse(request, TokenizeRequest)
    state.check_model(body.model)
    if body.messages is not None:
        conversation = [m.for_template() for m in body.messages]
        tokens = await chat_prompt(state, conversation, body.add_generation_prompt)
    else:
        tokens = await state.encode(body.prompt or "", "prompt", body.add_special_tokens)
    return JSONResponse({"count": len(tokens), "max_model_len": state.max_model_len, "tokens": tokens})


async def detokenize(request: Request) -> Response:
    state = server_state(request)
    body = await state.parse(request, DetokenizeRequest)
    state.check_model(body.model)
    bad = [t for t in body.tokens if not 0 <= t < state.vocab_size]
    if bad:
        raise APIError(400, f"token ids {bad[:5]} are outside the vocabulary [0, {state.vocab_size})",
                       param="tokens")
    return JSONResponse({"prompt": await state.text.decode(body.tokens)})


async def openapi_json(request: Request) -> Response:
    return JSONResponse(request.app.openapi())


async def swagger_docs(request: Request) -> Response:
    return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{request.app.title} - docs")


async def redoc_docs(request: Request) -> Response:
    return get_redoc_html(openapi_url="/openapi.json", title=f"{request.app.title} - ReDoc")


# ---- the app ---------------------------------------------------------------------------------


def build_app(async_engine: AsyncEngine, served_model_name: str, api_key: str | None = None, *,
              docs_without_auth: bool = False, max_requests_per_key: int | None = None,
              limits: ServerLimits | None = None, options: ServerOptions | None = None,
              cors: CorsPolicy | None = None, tool_calls: ToolCallSettings | None = None) -> FastAPI:
    """The app; `max_requests_per_key` caps each key's (or address's) generation requests in
    flight (None: no cap); `cors` None: no CORS headers. `app.state.admission` is what
    `_Server` closes on a signal."""
    engine: Any = async_engine.engine
    num_spec = int(getattr(engine, "num_speculative_tokens", 0) or 0)
    options = options or ServerOptions()
    async_engine.request_log = RequestRecord if options.log_requests else None

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        stats = None
        if options.stats_interval > 0:
            stats_logger = StatsLogger(lambda: async_engine.stats, options.stats_interval, speculative=num_spec > 0)
            stats = asyncio.create_task(stats_logger.run(), name="specdec-stats-log")
        yield
        if stats is not None:
            stats.cancel()
        await async_engine.shutdown(drain=False, timeout=ENGINE_STOP_SECONDS)

    # FastAPI's own docs routes take no dependencies: _router adds them, behind the key
    app = FastAPI(title="specdec", summary="OpenAI-compatible speculative-decoding server", lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = ServerState(
        engine=async_engine, model_name=served_model_name, api_key=api_key, tokenizer=_server_tokenizer(engine),
        max_model_len=int(engine.max_model_len), vocab_size=int(engine.model_config.vocab_size),
        metrics=ServerMetrics(num_spec, served_model_name, int(engine.max_model_len)),
        limits=limits or ServerLimits(), options=options, tool_calls=tool_calls or ToolCallSettings(),
    )
    app.state.admission = Admission(api_key, max_requests_per_key, on_reject=app.state.server.metrics.reject)
    app.add_middleware(AdmissionMiddleware, admission=app.state.admission)
    if cors is not None:
        add_cors(app, cors)
    app.include_router(_router(api_key, docs_without_auth))
    app.openapi = _openapi(app, api_key)  # type: ignore[method-assign]
    install_error_handlers(app)
    return app


def _server_tokenizer(engine: Any) -> Any:
    """A private copy: HF fast tokenizers must not be shared across threads."""
    try:
        return copy.deepcopy(engine.tokenizer)
    except Exception:  # noqa: BLE001
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(engine.model_dir))


def _router(api_key: str | None, docs_without_auth: bool) -> APIRouter:
    router = APIRouter()
    secured = [Depends(authorize)]
    for path, page in (("/openapi.json", openapi_json), ("/docs", swagger_docs), ("/redoc", redoc_docs)):
        router.add_api_route(path, page, methods=["GET"], include_in_schema=False,
                             response_class=JSONResponse if path.endswith(".json") else HTMLResponse,
                             dependencies=None if docs_without_auth else secured)
    routes: list[tuple[str, Callable[..., Any], str, bool, type[BaseModel] | None]] = [
        ("/v1/completions", create_completion, "POST", True, CompletionRequest),
        ("/v1/chat/completions", create_chat_completion, "POST", True, ChatCompletionRequest),
        ("/v1/models", list_models, "GET", True, None),
        ("/v1/models/{model_id:path}", retrieve_model, "GET", True, None),
        ("/tokenize", tokenize, "POST", True, TokenizeRequest),
        ("/detokenize", detokenize, "POST", True, DetokenizeRequest),
        ("/health", health, "GET", False, None),
        ("/version", version, "GET", False, None),
        ("/metrics", metrics, "GET", False, None),
    ]
    for path, endpoint, method, auth, body in routes:
        router.add_api_route(path, endpoint, methods=[method], dependencies=secured if auth else None,
                             include_in_schema=True, openapi_extra=_openapi_extra(body, auth, api_key))
    return router


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


def _openapi(app: FastAPI, api_key: str | None) -> Callable[[], dict[str, Any]]:
    """FastAPI's schema plus the request body models and the bearer scheme it cannot infer."""

    def build() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
            models: list[type[BaseModel]] = [CompletionRequest, ChatCompletionRequest, TokenizeRequest,
                                             DetokenizeRequest]
            _, defs = models_json_schema([(m, "validation") for m in models], ref_template=_SCHEMA_REF)
            components = schema.setdefault("components", {})
            components.setdefault("schemas", {}).update(defs.get("$defs", {}))
            if api_key is not None:
                components["securitySchemes"] = {_BEARER: {"type": "http", "scheme": "bearer"}}
            app.openapi_schema = schema
        return app.openapi_schema

    return build


# ---- specdec serve ---------------------------------------------------------------------------


class _Server(uvicorn.Server):
    """uvicorn's server, draining on SIGTERM/SIGINT: the first signal closes admission (503
    for new requests, /health 503) while in-flight requests go on; at `shutdown_timeout`,
    or at a second signal, the engine aborts what is left, so each stream still ends with an
    error event and [DONE] and each non-streaming request with an error body. Only then does
    uvicorn's own shutdown start, which would cut responses still running. Exits 0."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, admission: Admission,
                 shutdown_timeout: float) -> None:
        super().__init__(config)
        self.engine, self.admission, self.shutdown_timeout = engine, admission, shutdown_timeout
        self.num_signals = 0
        self.deadline: float | None = None
        self.aborted_at: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not uvicorn's: that exits at once, and re-raises the signal after (exit code != 0).
        self.num_signals += 1
        if self.num_signals == 1:
            logger.info("signal %s: refusing new requests; those in flight have %g s to finish (a second "
                        "signal ends them now)", sig, self.shutdown_timeout)
            self.admission.close()
            self.engine.begin_shutdown()
            self.deadline = time.monotonic() + self.shutdown_timeout
        else:
            logger.info("signal %s again: ending the requests in flight now", sig)
            self.deadline = time.monotonic()

    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter):
            return True
        return self.deadline is not None and self.drained()

    def drained(self) -> bool:
        """True once no generation request is in flight, or once those the deadline aborted
        have had SHUTDOWN_FLUSH_SECONDS to send their error events."""
        if self.admission.in_flight == 0:
            return True
        now = time.monotonic()
        if self.aborted_at is None and self.deadline is not None and now >= self.deadline:
            logger.info("shutting down: ending %d requests still in flight with an error", self.admission.in_flight)
            self.aborted_at = now
            self.engine.abort_all()
        return self.aborted_at is not None and now - self.aborted_at > SHUTDOWN_FLUSH_SECONDS


def uvicorn_config(app: FastAPI, args: argparse.Namespace) -> uvicorn.Config:
    """The serve flags as uvicorn's settings (the connection limits included)."""
    return uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                          http=guarded_protocol(args.timeout_header_read),
                          h11_max_incomplete_event_size=args.max_header_bytes,
                          timeout_keep_alive=args.timeout_keep_alive, limit_concurrency=args.limit_concurrency,
                          timeout_graceful_shutdown=SHUTDOWN_FLUSH_SECONDS)


def make_server(args: argparse.Namespace, async_engine: AsyncEngine, api_key: str | None) -> _Server:
    """The app and its uvicorn server for these serve flags."""
    name = args.served_model_name or args.model
    app = build_app(async_engine, name, api_key, docs_without_auth=args.docs_without_auth,
                    max_requests_per_key=args.max_concurrent_requests_per_key, limits=server_limits(args),
                    options=server_options(args), cors=cors_policy(args), tool_calls=tool_call_settings(args))
    return _Server(uvicorn_config(app, args), async_engine, app.state.admission, args.shutdown_timeout)


def serve(args: argparse.Namespace) -> None:
    """Build and warm up the engine, then open the port: the first /health that answers
    is 200 and the first request builds nothing. A start-up error is one line on stderr
    and exit code 2 (the traceback too with --log-level debug)."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("specdec").setLevel(args.log_level.upper())
    try:
        server = _start(args)
    except Exception as exc:  # noqa: BLE001 - any start-up failure is reported as one line
        if args.log_level == "debug":
            raise
        print(f"specdec serve: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    server.run()


def _start(args: argparse.Namespace) -> _Server:
    """The server of these flags over a warmed-up engine; server flags are checked first,
    so a bad combination fails before the model loads."""
    from specdec.engine_args import engine_kwargs
    from specdec.gc_heap import freeze_startup_heap
    from specdec.llm import LLM
    from specdec.warmup import warm_up

    api_key = resolve_api_key(args.api_key, os.environ.get("SPECDEC_API_KEY"))
    for check in (server_options, cors_policy, server_limits, tool_call_settings):
        check(args)  # a ValueError names the flag
    llm = LLM(args.model, **engine_kwargs(args))
    warm_up(llm.engine)
    server = make_server(args, AsyncEngine(llm.engine), api_key)
    logger.info("%s", startup_summary(llm.engine, args.served_model_name or args.model))
    frozen = freeze_startup_heap()
    logger.debug("froze %d start-up objects out of garbage collection", frozen)
    return server
