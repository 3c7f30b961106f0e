"""The OpenAI-compatible HTTP server: the app factory, auth, the small routes, and `serve`.

Routes: POST /v1/completions (completions.py), POST /v1/chat/completions (chat.py),
GET /v1/models, GET /health, GET /metrics, POST /tokenize, POST /detokenize. Errors are
OpenAI error objects `{"error": {"message", "type", "param", "code"}}` (errors.py). When an
api key is set, every route but /health and /metrics needs `Authorization: Bearer <key>`.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import hmac
import logging
import os
import signal
from collections.abc import AsyncIterator, Callable
from types import FrameType
from typing import Any

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from specdec.server.async_engine import AsyncEngine
from specdec.server.chat import chat_prompt, create_chat_completion
from specdec.server.completions import create_completion
from specdec.server.errors import APIError, error_response, install_error_handlers
from specdec.server.metrics import CONTENT_TYPE, ServerMetrics
from specdec.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    parse_body,
)
from specdec.server.state import ServerState, server_state

logger = logging.getLogger(__name__)
DRAIN_TIMEOUT_SECONDS = int(os.environ.get("SPECDEC_DRAIN_TIMEOUT", "30"))
_SCHEMA_REF = "#/components/schemas/{model}"
_BEARER = "bearerAuth"


# ---- auth and the small routes ---------------------------------------------------------------


async def authorize(request: Request) -> None:
    key = server_state(request).api_key
    if key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise APIError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`",
                       code="invalid_api_key")


async def list_models(request: Request) -> Response:
    state = server_state(request)
    model = {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "specdec",
             "root": state.model_name, "max_model_len": state.max_model_len}
    return JSONResponse({"object": "list", "data": [model]})


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
    body = await parse_body(request, TokenizeRequest)
    state.check_model(body.model)
    if body.messages is not None:
        conversation = [m.for_template() for m in body.messages]
        tokens = chat_prompt(state, conversation, body.add_generation_prompt)
    else:
        tokens = list(state.tokenizer.encode(body.prompt or "", add_special_tokens=body.add_special_tokens))
    return JSONResponse({"count": len(tokens), "max_model_len": state.max_model_len, "tokens": tokens})


async def detokenize(request: Request) -> Response:
    state = server_state(request)
    body = await parse_body(request, DetokenizeRequest)
    state.check_model(body.model)
    bad = [t for t in body.tokens if not 0 <= t < state.vocab_size]
    if bad:
        raise APIError(400, f"token ids {bad[:5]} are outside the vocabulary [0, {state.vocab_size})",
                       param="tokens")
    return JSONResponse({"prompt": state.tokenizer.decode(body.tokens)})


# ---- the app ---------------------------------------------------------------------------------


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
    install_error_handlers(app)
    return app


def _server_tokenizer(engine: Any) -> Any:
    """A private copy: HF fast tokenizers must not be shared across threads."""
    try:
        return copy.deepcopy(engine.tokenizer)
    except Exception:  # noqa: BLE001
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(engine.model_dir))


def _router(api_key: str | None) -> APIRouter:
    router = APIRouter()
    secured = [Depends(authorize)]
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
    from specdec.engine_args import engine_kwargs
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
