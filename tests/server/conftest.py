"""Real servers for the HTTP tests: uvicorn on 127.0.0.1 (a free port) in a background
thread, over a tiny random checkpoint with n-gram speculation."""
from __future__ import annotations

import json
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

API_KEY = "test-key"
MODEL = "tiny"
MAX_MODEL_LEN = 128
NUM_BLOCKS = 64


@dataclass
class RunningServer:
    base_url: str
    model: str
    api_key: str | None
    async_engine: Any  # specdec.server.async_engine.AsyncEngine
    tokenizer: Any
    server: uvicorn.Server
    thread: threading.Thread

    @property
    def engine(self) -> Any:  # the LLMEngine
        return self.async_engine.engine

    def client(self, **kwargs: Any) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        kwargs.setdefault("timeout", 30.0)
        return httpx.Client(base_url=self.base_url, headers=headers, **kwargs)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def start_server(model_dir: Path, name: str, api_key: str | None, **engine_args: Any) -> RunningServer:
    from specdec.server.app import build_app
    from specdec.server.async_engine import AsyncEngine

    from specdec.llm import LLM

    block_bytes = 2 * 2 * 16 * 2 * 16 * 2  # K+V, 2 layers, 16 slots, 2 kv heads, head_dim 16, fp16 ("auto")
    llm = LLM(str(model_dir), max_model_len=MAX_MODEL_LEN, kv_cache_memory=NUM_BLOCKS * block_bytes, **engine_args)
    async_engine = AsyncEngine(llm.engine)
    app = build_app(async_engine, name, api_key)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    return RunningServer(f"http://127.0.0.1:{port}", name, api_key, async_engine, llm.engine.tokenizer, server,
                         thread)


@pytest.fixture(scope="session")
def server(tiny_model_dir: Path) -> Iterator[RunningServer]:
    running = start_server(tiny_model_dir, MODEL, API_KEY,
                           speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    yield running
    running.stop()


@pytest.fixture(scope="session")
def no_template_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """The same checkpoint with its chat template removed."""
    model_dir = tmp_path_factory.mktemp("no-template") / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    (model_dir / "chat_template.jinja").unlink(missing_ok=True)
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    running = start_server(model_dir, "plain", None)
    yield running
    running.stop()


@pytest.fixture()
def client(server: RunningServer) -> Iterator[httpx.Client]:
    with server.client() as c:
        yield c


def wait_until(condition: Any, timeout: float = 10.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return bool(condition())


def all_blocks_free(running: RunningServer) -> bool:
    bm = running.engine.block_manager
    return bool(bm.num_free_blocks == bm.num_blocks)


def sse_events(lines: Iterator[str]) -> list[Any]:
    """Parsed `data:` payloads of an SSE stream; asserts it ends with [DONE]."""
    events: list[Any] = []
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        payload = line[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    assert events and events[-1] == "[DONE]", events[-3:]
    return events[:-1]
