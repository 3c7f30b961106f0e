"""What every route reads: the server's engine, model name, key, tokenizer, limits and metrics.

It lives apart from app.py because the route modules need it and app.py imports them.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field, fields
from typing import Any

from fastapi import Request

from specdec.async_engine import AsyncEngine
from specdec.sampling_params import SamplingParams
from specdec.server.errors import APIError, params_error, unavailable
from specdec.server.json_body import DEFAULT_MAX_JSON_DEPTH
from specdec.server.logprobs import TokenStrings
from specdec.server.metrics import ServerMetrics
from specdec.server.protocol import (
    DEFAULT_MAX_BODY_BYTES,
    Body,
    BodyContext,
    ChatCompletionRequest,
    CompletionRequest,
    parse_body,
)
from specdec.server.tokenizing import ServerTokenizer
from specdec.server.tool_parsers import ToolCallSettings


@dataclass(frozen=True)
class ServerLimits:
    """What one request may ask of the server (`specdec serve --max-body-bytes` etc.)."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_json_depth: int = DEFAULT_MAX_JSON_DEPTH
    max_prompts: int = 64  # prompts in one completions request
    max_choices: int = 128  # n × prompts
    max_prompt_tokens: int = 65536  # all of one request's prompts together

    def __post_init__(self) -> None:
        for item in fields(self):
            value = getattr(self, item.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{item.name} must be a positive integer, got {value!r}")


def server_limits(args: Any) -> ServerLimits:
    """ServerLimits from `specdec serve` flags; a flag left unset keeps the default."""
    values = {item.name: getattr(args, item.name, None) for item in fields(ServerLimits)}
    return ServerLimits(**{name: value for name, value in values.items() if value is not None})


@dataclass(frozen=True)
class ServerOptions:
    """How the server reports and keeps streams open (`specdec serve --stats-interval` etc.)."""

    stats_interval: float = 10.0  # seconds between stats log lines; 0: none
    sse_keepalive: float = 10.0  # seconds a stream may stay silent before a `: keep-alive` comment; 0: none
    log_requests: bool = False  # a log line when each request is admitted and when it finishes

    def __post_init__(self) -> None:
        for name in ("stats_interval", "sse_keepalive"):
            value = getattr(self, name)
            if not value >= 0:  # also refuses nan
                raise ValueError(f"{name} must be 0 (off) or a positive number of seconds, got {value!r}")


def server_options(args: Any) -> ServerOptions:
    """ServerOptions from `specdec serve` flags."""
    return ServerOptions(stats_interval=args.stats_interval, sse_keepalive=args.sse_keepalive,
                         log_requests=args.enable_log_requests)


@dataclass
class ServerState:
    engine: AsyncEngine
    model_name: str
    api_key: str | None
    tokenizer: Any  # the server's own copy: the engine thread uses the engine's
    max_model_len: int
    vocab_size: int
    metrics: ServerMetrics
    limits: ServerLimits = field(default_factory=ServerLimits)
    options: ServerOptions = field(default_factory=ServerOptions)
    tool_calls: ToolCallSettings = field(default_factory=ToolCallSettings)  # --tool-call-parser etc.
    created: int = field(default_factory=lambda: int(time.time()))
    tokens: TokenStrings = field(init=False)  # per-token strings, on the event loop
    text: ServerTokenizer = field(init=False)  # everything larger, on its own thread

    def __post_init__(self) -> None:
        self.text = ServerTokenizer(self.tokenizer)
        self.tokens = TokenStrings(_private_copy(self.tokenizer))

    async def parse(self, request: Request, model: type[Body]) -> Body:
        """The request's body under this server's limits (a 4xx if it breaks one)."""
        limits = self.limits
        context = BodyContext(self.max_model_len, limits.max_prompts, limits.max_choices)
        return await parse_body(request, model, limits.max_body_bytes, limits.max_json_depth, context)

    async def encode(self, text: str, param: str, add_special_tokens: bool = True, where: str = "") -> list[int]:
        """Token ids of a text, on the tokenizer thread; a text that provably has max_model_len
        tokens or more is refused without tokenizing it (a 400 naming `param`)."""
        at_least = self.text.min_tokens(text)
        if at_least >= self.max_model_len:
            raise APIError(400, f"{where}the {param} has at least {at_least} tokens ({len(text.encode())} bytes of "
                                f"text) but max_model_len is {self.max_model_len}", param=param)
        return await self.text.encode(text, add_special_tokens)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist. This server serves `{self.model_name}`.",
                           param="model", code="model_not_found")

    def check_ready(self) -> None:
        if not self.engine.is_alive:
            raise unavailable(f"the engine is not running: {self.engine.error or 'stopped'}")
        if not self.engine.is_accepting:
            raise unavailable("the server is shutting down")

    def sampling_params(self, body: CompletionRequest | ChatCompletionRequest) -> SamplingParams:
        """The body's model must be ours and its sampling fields valid (else a 4xx)."""
        self.check_model(body.model)
        try:
            return body.to_sampling_params()
        except ValueError as exc:
            raise params_error(exc) from None


def _private_copy(tokenizer: Any) -> Any:
    """HF fast tokenizers must not be shared across threads; the tokenizer thread has the original."""
    try:
        return copy.deepcopy(tokenizer)
    except Exception:  # noqa: BLE001 - an uncopyable tokenizer is shared; only decode runs on the loop
        return tokenizer


def server_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.server
    return state
