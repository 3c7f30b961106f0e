"""Operating the server (issue 21, item 5): /version, /v1/models/{id}, CORS, SSE keep-alive,
the start-up summary, the periodic stats line, per-request logs, and `specdec serve`
opening its port only after the engine is warmed up."""
from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time
from collections.abc import AsyncGenerator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from specdec.llm import LLM
from specdec.sampling_params import SamplingParams
from specdec.server.stats_log import StatsLogger, startup_summary
from specdec.server.streaming import KEEP_ALIVE, with_keep_alive
from specdec.version import specdec_version
from specdec.warmup import warm_up, warm_up_prompt
from tests.helpers import (
    CPU_DEVICE,
    NGRAM,
    RunningServer,
    ServeProcess,
    all_blocks_free,
    free_port,
    serve_in_thread,
    slow_engine_steps,
    sse_events,
    wait_until,
)

ORIGIN = "https://app.example"
KEEPALIVE_SECONDS = 0.05
STATS_SECONDS = 0.2
COMPLETION: dict[str, Any] = {"model": "tiny", "prompt": "zebra secret words", "max_tokens": 5, "ignore_eos": True,
                              "temperature": 0, "speculative": False}


@pytest.fixture(scope="module")
def ops(tiny_model_dir: Path) -> Iterator[RunningServer]:
    """A server with every operations flag on, short intervals so tests see them act."""
    running = serve_in_thread(tiny_model_dir, "--speculative-config", "none", "--sse-keepalive",
                              str(KEEPALIVE_SECONDS), "--stats-interval", str(STATS_SECONDS), "--enable-log-requests",
                              "--allowed-origins", f"{ORIGIN},https://other.example", "--allowed-methods", "GET,POST")
    yield running
    running.stop()


def messages(caplog: pytest.LogCaptureFixture, name: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == name]


# ---- small routes ----------------------------------------------------------------------------


def test_version_is_open(server: RunningServer) -> None:
    response = httpx.get(f"{server.base_url}/version")  # no key, like /health
    assert response.status_code == 200
    assert response.json() == {"version": specdec_version()}


def test_retrieve_model(server: RunningServer, client: httpx.Client) -> None:
    listed = client.get("/v1/models").json()["data"][0]
    found = client.get(f"/v1/models/{server.model}")
    assert found.status_code == 200 and found.json() == listed
    for unknown in ("other", "org/name"):
        missing = client.get(f"/v1/models/{unknown}")
        error = missing.json()["error"]
        assert missing.status_code == 404 and error["code"] == "model_not_found", missing.text
        assert f"`{unknown}`" in error["message"]
    assert httpx.get(f"{server.base_url}/v1/models/{server.model}").status_code == 401


def test_new_routes_are_in_the_schema(server: RunningServer, client: httpx.Client) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    assert "get" in paths["/version"] and "security" not in paths["/version"]["get"]
    assert paths["/v1/models/{model_id}"]["get"]["security"] == [{"bearerAuth": []}]


# ---- CORS ------------------------------------------------------------------------------------


def test_cors_preflight_with_allowed_origins(ops: RunningServer) -> None:
    headers = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
               "Access-Control-Request-Headers": "authorization,content-type"}
    preflight = httpx.options(f"{ops.base_url}/v1/completions", headers=headers)
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert "DELETE" not in preflight.headers["access-control-allow-methods"]
    stranger = httpx.options(f"{ops.base_url}/v1/completions", headers={**headers, "Origin": "https://evil.example"})
    assert stranger.status_code == 400 and "access-control-allow-origin" not in stranger.headers
    simple = httpx.get(f"{ops.base_url}/health", headers={"Origin": ORIGIN})
    assert simple.headers["access-control-allow-origin"] == ORIGIN


def test_no_cors_headers_without_allowed_origins(server: RunningServer) -> None:
    headers = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
    preflight = httpx.options(f"{server.base_url}/v1/completions", headers=headers)
    assert preflight.status_code == 405
    simple = httpx.get(f"{server.base_url}/health", headers={"Origin": ORIGIN})
    assert not [name for name in [*preflight.headers, *simple.headers] if name.startswith("access-control-")]


# ---- SSE keep-alive --------------------------------------------------------------------------


def test_keep_alive_keeps_every_event_in_order() -> None:
    async def source() -> AsyncGenerator[str, None]:
        for index, delay in enumerate([0.0, 0.12, 0.0, 0.12]):
            await asyncio.sleep(delay)  # longer than the interval: a comment must come first
            yield f"event {index}"

    async def run() -> list[str]:
        return [event async for event in with_keep_alive(source(), KEEPALIVE_SECONDS)]

    sent = asyncio.run(run())
    assert [event for event in sent if event != KEEP_ALIVE] == [f"event {i}" for i in range(4)]
    assert sent[0] == "event 0" and sent[-1] == "event 3"
    assert sent[1] == KEEP_ALIVE and sent.count(KEEP_ALIVE) >= 2


def test_keep_alive_stops_the_stream_it_wraps() -> None:
    ended = asyncio.Event()

    async def silent() -> AsyncGenerator[str, None]:
        try:
            await asyncio.sleep(3600)
            yield "never"
        finally:
            ended.set()

    async def run() -> None:
        stream = with_keep_alive(silent(), KEEPALIVE_SECONDS)
        assert await anext(stream) == KEEP_ALIVE
        await stream.aclose()  # the client went away
        await asyncio.wait_for(ended.wait(), 5)

    asyncio.run(run())


def test_keep_alive_comments_in_a_slow_stream(ops: RunningServer, monkeypatch: pytest.MonkeyPatch) -> None:
    with ops.client() as client:
        expected = client.post("/v1/completions", json=COMPLETION).json()["choices"][0]["text"]
        slow_engine_steps(ops, monkeypatch, seconds=0.15)
        with client.stream("POST", "/v1/completions", json={**COMPLETION, "stream": True}) as response:
            lines = [line for line in response.iter_lines() if line]
    comments = [line for line in lines if line.startswith(":")]
    events = sse_events(iter([line for line in lines if not line.startswith(":")]))
    assert comments and set(comments) == {KEEP_ALIVE.strip()}
    assert "".join(e["choices"][0]["text"] for e in events) == expected
    assert [e["choices"][0]["finish_reason"] for e in events][-1] == "length"


def test_client_leaving_a_silent_stream_aborts_it(ops: RunningServer, monkeypatch: pytest.MonkeyPatch) -> None:
    slow_engine_steps(ops, monkeypatch, seconds=0.3)
    body = {**COMPLETION, "max_tokens": 100, "stream": True}
    with ops.client() as client, client.stream("POST", "/v1/completions", json=body) as response:
        first = next(line for line in response.iter_lines() if line)
        assert first == KEEP_ALIVE.strip()  # the prefill step is still running
    assert wait_until(lambda: all_blocks_free(ops) and not ops.engine.has_unfinished_requests(), timeout=10)


# ---- logs ------------------------------------------------------------------------------------


def test_startup_summary(server: RunningServer) -> None:
    engine = server.engine
    line = startup_summary(engine, "tiny")
    for part in ("model tiny", str(engine.model_dir), "dtype float32", "device cpu",
                 f"attention backend {engine.model.attention_backend.name}",
                 f"linear backend {engine.model.linear_backend.name}", f"{engine.block_manager.num_blocks} blocks",
                 f"{engine.block_manager.num_blocks * engine.block_manager.block_size} tokens", "max_model_len 128",
                 "max_num_seqs 64", "speculation ngram k=3 tree nodes=0 adaptive=off"):
        assert part in line, (part, line)


def test_stats_line_numbers() -> None:
    stats: dict[str, Any] = {"num_prompt_tokens": 0, "num_generation_tokens": 0, "num_steps": 0, "num_drafts": 0,
                             "num_draft_tokens": 0, "num_accepted_tokens": 0, "num_accepted_tokens_per_pos": [0, 0],
                             "num_requests_running": 0, "num_requests_waiting": 0, "kv_cache_usage": 0.0}
    logger = StatsLogger(lambda: stats, 1.0, speculative=True)
    assert logger.line(now=logger.last_time + 2) is None  # idle
    stats.update(num_prompt_tokens=100, num_generation_tokens=30, num_steps=10, num_drafts=10, num_draft_tokens=20,
                 num_accepted_tokens=15, num_accepted_tokens_per_pos=[9, 6], num_requests_running=2,
                 num_requests_waiting=1, kv_cache_usage=0.25, prefix_cache_queries=200, prefix_cache_hits=50)
    line = logger.line(now=logger.last_time + 2)
    assert line == ("Avg prompt throughput: 50.0 tokens/s, Avg generation throughput: 15.0 tokens/s, Running: 2 reqs, "
                    "Waiting: 1 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 25.0%, "
                    "Draft acceptance rate: 75.0%, Mean accepted length: 2.50")


def test_stats_line_is_logged_while_busy_only(ops: RunningServer, caplog: pytest.LogCaptureFixture) -> None:
    name = "specdec.server.stats_log"
    caplog.set_level(logging.INFO, logger=name)
    with ops.client() as client:
        assert client.post("/v1/completions", json={**COMPLETION, "max_tokens": 30}).status_code == 200
    assert wait_until(lambda: messages(caplog, name), timeout=5)
    line = messages(caplog, name)[-1]
    for field in ("Avg prompt throughput: ", "Avg generation throughput: ", "Running: ", "Waiting: ",
                  "KV cache usage: ", "Prefix cache hit rate: "):
        assert field in line, line
    assert "Draft acceptance" not in line  # this server does not speculate
    time.sleep(2 * STATS_SECONDS)  # the interval that saw the request's end has been logged
    caplog.clear()
    time.sleep(4 * STATS_SECONDS)
    # Another test's server in this process may still log its last busy interval: those
    # servers speculate, this one does not, so its own lines never name a draft rate.
    assert [m for m in messages(caplog, name) if "Draft acceptance" not in m] == []


def test_request_log_lines(ops: RunningServer, caplog: pytest.LogCaptureFixture) -> None:
    name = "specdec.server.request_log"
    caplog.set_level(logging.INFO, logger=name)
    with ops.client() as client:
        response = client.post("/v1/completions", json={**COMPLETION, "seed": 7, "stop": ["secret stop"]})
    request_id, usage = response.json()["id"], response.json()["usage"]

    def own() -> list[str]:  # an earlier test's request may still log its end while this one runs
        return [m for m in messages(caplog, name) if f"request {request_id} " in m]

    assert wait_until(lambda: len(own()) == 2)
    admitted, finished = own()
    assert admitted.startswith(f"request {request_id} admitted: {usage['prompt_tokens']} prompt tokens, params: ")
    assert "temperature=0.0" in admitted and "seed=7" in admitted and "stop=<1 items>" in admitted
    assert admitted.endswith("speculative: off")
    assert finished.startswith(f"request {request_id} finished: reason length, {usage['prompt_tokens']} prompt "
                               f"tokens, 5 completion tokens, ttft ")
    assert " e2e " in finished
    assert not any(text in m for m in (admitted, finished) for text in ("zebra", "secret"))


def test_no_request_log_by_default(server: RunningServer, client: httpx.Client,
                                   caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="specdec.server.request_log")
    assert client.post("/v1/completions", json={**COMPLETION, "model": server.model}).status_code == 200
    assert messages(caplog, "specdec.server.request_log") == []


# ---- warm-up ---------------------------------------------------------------------------------


def test_warm_up_leaves_no_trace(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM(str(tiny_model_dir), max_model_len=128, kv_cache_memory=64 * 8192, block_size=4,
              enable_prefix_caching=True, speculative_config=NGRAM)
    engine = llm.engine
    assert engine.drafter is not None
    proposals: list[int] = []
    propose = engine.drafter.propose

    def counted(requests: Any) -> Any:
        proposals.append(len(requests))
        return propose(requests)

    monkeypatch.setattr(engine.drafter, "propose", counted)
    metrics, free = engine.get_metrics(), engine.block_manager.num_free_blocks
    assert warm_up(engine) > 0
    assert proposals, "the warm-up never ran the drafter"
    assert engine.get_metrics() == metrics
    assert engine.block_manager.num_free_blocks == free and engine.block_manager.cached == {}
    [again] = llm.generate([warm_up_prompt(engine)], SamplingParams(temperature=0, max_tokens=2))
    assert again.metrics["num_cached_tokens"] == 0  # the warm-up prompt left nothing in the prefix cache
    engine.add_request("busy", [5, 6, 7], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="idle"):
        warm_up(engine)


def test_warm_up_leaves_nothing_in_the_suffix_cache(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), max_model_len=128, speculative_config={"method": "suffix"})
    assert warm_up(llm.engine) > 0
    cache = llm.engine.drafter.cache  # type: ignore[union-attr]
    assert cache is not None and cache.num_requests == 0


def test_cli_opens_its_port_after_warm_up(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The first /health that answers is 200 (never a 503 while the engine gets ready), and
    the warm-up ran before uvicorn started."""
    port = free_port()
    command = [sys.executable, "-m", "specdec.cli", "serve", str(tiny_model_dir), "--port", str(port),
               "--served-model-name", "tiny", "--max-model-len", "128", "--kv-cache-memory", str(64 * 8192),
               "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}', *CPU_DEVICE]
    log = tmp_path / "serve.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    running = ServeProcess(proc, f"http://127.0.0.1:{port}", log)
    try:
        status = first_answer(running, "/health")
        assert status == 200, running.output()
        start = time.monotonic()
        answer = httpx.post(f"{running.url}/v1/completions", json={**COMPLETION, "max_tokens": 4}, timeout=30)
        assert answer.status_code == 200 and time.monotonic() - start < 5.0
        output = running.output()
        assert output.index("warm-up: ") < output.index("ready: model tiny") < output.index("Uvicorn running on")
    finally:
        running.kill()


def first_answer(running: ServeProcess, path: str, timeout: float = 90.0) -> int:
    """The status of the first request to `path` that gets any answer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert running.proc.poll() is None, running.output()
        try:
            return httpx.get(f"{running.url}{path}", timeout=5.0).status_code
        except httpx.TransportError:
            time.sleep(0.05)
    raise AssertionError(f"`specdec serve` never answered:\n{running.output()}")
