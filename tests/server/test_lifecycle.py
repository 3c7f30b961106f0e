"""Cancellation frees KV blocks at once, engine failures become 500s, /metrics moves,
and `specdec serve` drains and exits 0 on SIGTERM."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import CPU_DEVICE, RunningServer, all_blocks_free, slow_engine_steps, sse_events, wait_until

MAX_TOKENS = 100
LONG: dict[str, Any] = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": MAX_TOKENS, "ignore_eos": True,
        "temperature": 0.0, "speculative": False}
METRIC_NAMES = [
    "specdec:time_to_first_token_seconds", "specdec:inter_token_latency_seconds",
    "specdec:e2e_request_latency_seconds", "specdec:num_requests_running", "specdec:num_requests_waiting",
    "specdec:kv_cache_usage_perc", "specdec:prompt_tokens_total", "specdec:generation_tokens_total",
    "specdec:spec_decode_num_drafts", "specdec:spec_decode_num_draft_tokens",
    "specdec:spec_decode_num_accepted_tokens", "specdec:spec_decode_num_accepted_tokens_per_pos",
]


@pytest.fixture()
def slow_engine(server: RunningServer, monkeypatch: pytest.MonkeyPatch) -> RunningServer:
    """Each engine step takes >= 10 ms, so a 100-token request cannot finish by itself
    before the test has disconnected."""
    slow_engine_steps(server, monkeypatch)
    return server


def generated(server: RunningServer) -> int:
    return int(server.async_engine.stats["num_generation_tokens"])


def assert_aborted_promptly(server: RunningServer, before: int) -> None:
    assert wait_until(lambda: all_blocks_free(server), timeout=5.0), "KV blocks still in use after disconnect"
    assert wait_until(lambda: not server.engine.has_unfinished_requests(), timeout=2.0)
    assert generated(server) - before < MAX_TOKENS  # stopped early, did not run to the end


def test_stream_disconnect_frees_kv_blocks(slow_engine: RunningServer) -> None:
    server = slow_engine
    assert wait_until(lambda: all_blocks_free(server))
    before = generated(server)
    with server.client() as client, client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as response:
        assert response.status_code == 200
        first = next(line for line in response.iter_lines() if line)
        assert json.loads(first[len("data: "):])["choices"][0]["text"] is not None
        assert not all_blocks_free(server)
    # leaving the block closed the connection mid-stream
    assert_aborted_promptly(server, before)


def test_chat_stream_disconnect_frees_kv_blocks(slow_engine: RunningServer) -> None:
    server = slow_engine
    before = generated(server)
    chat = {**LONG, "messages": [{"role": "user", "content": "hi"}], "stream": True, "n": 2}
    chat.pop("prompt")
    with server.client() as client, client.stream("POST", "/v1/chat/completions", json=chat) as response:
        lines = (line for line in response.iter_lines() if line)
        for _ in range(4):  # two role chunks, then content
            next(lines)
    assert_aborted_promptly(server, before)


def test_non_streaming_disconnect_frees_kv_blocks(slow_engine: RunningServer) -> None:
    server = slow_engine
    before = generated(server)
    with server.client(timeout=httpx.Timeout(0.3)) as client, pytest.raises(httpx.ReadTimeout):
        client.post("/v1/completions", json=LONG)
    assert_aborted_promptly(server, before)


def test_engine_step_failure_is_a_500_and_serving_goes_on(server: RunningServer, client: httpx.Client,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    step = server.engine.step
    failures = {"left": 2}

    def failing_step() -> Any:
        if failures["left"]:
            failures["left"] -= 1
            raise RuntimeError("boom in the scheduler")
        return step()

    # Requests left by earlier tests (disconnects, fuzzing) would take the failures.
    assert wait_until(lambda: not server.engine.has_unfinished_requests())
    monkeypatch.setattr(server.engine, "step", failing_step)
    response = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 4})
    assert response.status_code == 500, response.text
    error = response.json()["error"]
    # The exception's text may hold any request's input: the log has it, no client does.
    assert "engine step failed" in error["message"] and error["type"] == "server_error"
    assert "boom" not in error["message"]
    with client.stream("POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 4, "stream": True}) as r:
        events = sse_events(r.iter_lines())
    assert "engine step failed" in events[-1]["error"]["message"] and "boom" not in events[-1]["error"]["message"]
    assert client.get("/health").status_code == 200
    # Sampled on random weights, EOS could come first; ignore_eos makes "length" certain.
    ok = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 4, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
    assert wait_until(lambda: all_blocks_free(server))


def scrape(client: httpx.Client) -> str:
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return response.text


def sample(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def test_metrics(server: RunningServer, client: httpx.Client) -> None:
    first = scrape(client)
    for name in METRIC_NAMES:
        assert name in first, name
    assert 'specdec:spec_decode_num_accepted_tokens_per_pos_total{position="2"}' in first
    stats = server.async_engine.stats
    before = {key: stats[key] for key in ("num_prompt_tokens", "num_generation_tokens", "num_drafts")}
    prompt = "def add(a, b):\n    return a + b\n" * 3
    response = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 12, "temperature": 0,
                                                     "ignore_eos": True})
    assert response.status_code == 200
    target = before["num_generation_tokens"] + 12
    assert wait_until(lambda: server.async_engine.stats["num_generation_tokens"] >= target)
    second = scrape(client)
    usage = response.json()["usage"]

    def grew(name: str) -> float:
        return sample(second, name) - sample(first, name)

    assert grew("specdec:prompt_tokens_total") == usage["prompt_tokens"]
    assert grew("specdec:generation_tokens_total") == usage["completion_tokens"]
    assert grew("specdec:spec_decode_num_drafts_total") > 0
    assert sample(second, "specdec:spec_decode_num_draft_tokens_total") >= \
        sample(second, "specdec:spec_decode_num_accepted_tokens_total")
    assert grew("specdec:time_to_first_token_seconds_count") > 0
    assert grew("specdec:e2e_request_latency_seconds_count") > 0
    assert sample(second, "specdec:num_requests_running") == 0
    assert sample(second, "specdec:kv_cache_usage_perc") == 0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else "server exited"
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError("`specdec serve` did not become healthy")


def test_cli_serve_drains_on_sigterm(tiny_model_dir: Path) -> None:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "specdec.cli", "serve", str(tiny_model_dir), "--port", str(port),
               "--max-model-len", "128", "--kv-cache-memory", str(64 * 8192), "--served-model-name", "cli",
               "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}', *CPU_DEVICE]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SPECDEC_DRAIN_TIMEOUT": "20"}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    try:
        _wait_healthy(url, proc)
        body = {"model": "cli", "prompt": "The quick brown fox", "max_tokens": 100, "ignore_eos": True,
                "temperature": 0, "stream": True, "speculative": False}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line)
            proc.send_signal(signal.SIGTERM)  # in-flight: this stream must still complete
            events = sse_events(iter([first, *lines]))
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
