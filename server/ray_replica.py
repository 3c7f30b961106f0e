"""One engine replica of the Ray Serve application: its own engine, KV cache and share of
CPU threads, with the ordinary specdec app (server/app.py) in front of it.

The ingress hands each HTTP request over as a `ForwardedRequest`; `forward` runs it
through the app in-process (asgi_relay.py) and streams the response back, so a replica
answers exactly as `specdec serve` would. Serve calls `check_health` (the engine loop
must be alive and accepting), and `__del__` when it stops the replica: in-flight requests
have had Serve's graceful-shutdown time by then; the app's lifespan stops the engine.
The replica publishes its /metrics page to the metrics board (ray_metrics.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from ray import serve

from specdec.async_engine import AsyncEngine
from specdec.server.app import build_app
from specdec.server.asgi_relay import ForwardedRequest, ResponsePart, relay
from specdec.server.cors import CorsPolicy
from specdec.server.state import ServerLimits, ServerOptions
from specdec.server.stats_log import startup_summary
from specdec.server.tool_parsers import ToolCallSettings

logger = logging.getLogger(__name__)
REPLICA_HEADER = b"x-specdec-replica"  # on every response: which replica answered


@dataclass(frozen=True)
class ReplicaSettings:
    """What each replica builds: the engine (`model` and LLM keyword arguments) and the app
    in front of it, as `specdec serve` would; `num_threads` torch threads for its engine;
    its metrics page is published every `metrics_interval` seconds."""

    model: str
    served_model_name: str
    engine_kwargs: Mapping[str, Any] = field(default_factory=dict)
    num_threads: int = 1
    api_key: str | None = None
    docs_without_auth: bool = False
    limits: ServerLimits = ServerLimits()
    options: ServerOptions = ServerOptions()
    cors: CorsPolicy | None = None
    tool_calls: ToolCallSettings = ToolCallSettings()
    log_level: str = "info"
    metrics_interval: float = 2.0


def start_engine(settings: ReplicaSettings) -> Any:
    """The replica's LLMEngine, loaded and warmed up (blocking: run it off the event loop)."""
    from specdec.gc_heap import freeze_startup_heap
    from specdec.llm import LLM
    from specdec.warmup import warm_up

    llm = LLM(settings.model, **settings.engine_kwargs)
    warm_up(llm.engine)
    freeze_startup_heap()  # the replica's process lives as long as its engine
    return llm.engine


class EngineReplica:
    """The body of the engine deployment (ray_app.py gives it its Serve options)."""

    async def __init__(self, settings: ReplicaSettings, board: Any) -> None:  # type: ignore[misc]
        logging.getLogger("specdec").setLevel(settings.log_level.upper())
        torch.set_num_threads(settings.num_threads)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.board = board  # the MetricsBoard's DeploymentHandle
        engine = await asyncio.to_thread(start_engine, settings)
        self.app = build_app(AsyncEngine(engine), settings.served_model_name, settings.api_key,
                             docs_without_auth=settings.docs_without_auth, limits=settings.limits,
                             options=settings.options, cors=settings.cors, tool_calls=settings.tool_calls)
        self.lifespan = contextlib.AsyncExitStack()
        await self.lifespan.enter_async_context(self.app.router.lifespan_context(self.app))
        self.headers = ((REPLICA_HEADER, self.replica_id.encode()),)
        self.publisher = asyncio.create_task(self.publish_metrics(settings.metrics_interval))
        self.stopped = False
        logger.info("replica %s: %s", self.replica_id, startup_summary(engine, settings.served_model_name))

    async def forward(self, request: ForwardedRequest) -> AsyncIterator[ResponsePart]:
        """The app's response to `request`: a ResponseHead, then body chunks."""
        async for part in relay(self.app, request, {}, self.headers):
            yield part

    def check_health(self) -> None:
        """Raises (Serve then replaces this replica) once the engine loop has died."""
        state = self.app.state.server
        if not state.engine.is_alive:
            raise RuntimeError(f"replica {self.replica_id}: the engine is not running: {state.engine.error}")

    def metrics_page(self) -> str:
        state = self.app.state.server
        return state.metrics.render(state.engine.stats).decode()

    async def publish_metrics(self, interval: float) -> None:
        while True:
            try:
                await self.board.publish.remote(self.replica_id, self.metrics_page())
            except Exception as exc:  # noqa: BLE001 - the board restarts; the next round gets through
                logger.warning("replica %s: publishing metrics failed: %s", self.replica_id, exc)
            await asyncio.sleep(interval)

    async def __del__(self) -> None:
        """Serve's graceful stop: withdraw the metrics page, stop the app and its engine."""
        if self.stopped:
            return
        self.stopped = True
        self.publisher.cancel()
        with contextlib.suppress(Exception):
            await self.board.withdraw.remote(self.replica_id)
        await self.lifespan.aclose()

