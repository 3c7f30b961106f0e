"""What every route reads: the server's engine, model name, key, tokenizer and metrics.

It lives apart from app.py because the route modules need it and app.py imports them.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from specdec.sampling_params import SamplingParams
from specdec.server.async_engine import AsyncEngine
from specdec.server.errors import APIError, params_error, unavailable
from specdec.server.logprobs import TokenStrings
from specdec.server.metrics import ServerMetrics
from specdec.server.protocol import ChatCompletionRequest, CompletionRequest


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
    tokens: TokenStrings = field(init=False)

    def __post_init__(self) -> None:
        self.tokens = TokenStrings(self.tokenizer)

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


def server_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.server
    return state
