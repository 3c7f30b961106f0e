"""Graceful shutdown (issue 23, defect 6): on SIGTERM `specdec serve` refuses new requests
(503, /health 503), lets the streams in flight finish, ends any still running at the
deadline or on a second signal with an "abort" chunk per unfinished choice (issue 41), an
error event and [DONE], logs no traceback and exits 0."""
from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import (
    RunningServer,
    ServeProcess,
    StreamReader,
    all_blocks_free,
    serve_in_thread,
    slow_engine_steps,
    start_serve_process,
    start_streams,
    wait_until,
)

NUM_STREAMS = 16
FLAGS = ("--max-model-len", "512", "--kv-cache-memory", str(1024 * 4096))
BODY: dict[str, Any] = {"model": "tiny", "prompt": "The quick brown fox", "ignore_eos": True, "temperature": 0,
                        "stream": True, "speculative": False}


def outcome(reader: StreamReader) -> str:
    """How one stream ended: its finish_reason, or "error" for an error event. Either way
    it ended with [DONE] (StreamReader.events asserts that)."""
    events = reader.events()
    assert events, "the stream ended without a single event"
    if "error" in events[-1]:
        error = events[-1]["error"]
        assert error["message"] and error["type"], error
        return "error"
    reasons = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"] is not None]
    assert len(reasons) == 1, reasons
    return str(reasons[0])


def aborted_choices(reader: StreamReader) -> list[dict[str, Any]]:
    """The choices of the "abort" chunks, one choice each, that come right before the
    stream's error event; asserts no earlier chunk was aborted."""
    events = reader.events()
    assert "error" in events[-1], events[-3:]
    aborted = [e for e in events if e.get("choices") and e["choices"][0]["finish_reason"] == "abort"]
    assert events[len(events) - 1 - len(aborted):-1] == aborted, events[-4:]
    assert all(len(e["choices"]) == 1 and e["id"] == events[0]["id"] for e in aborted), aborted
    return [e["choices"][0] for e in aborted]


def flowing_streams(server: ServeProcess, max_tokens: int) -> list[StreamReader]:
    readers = start_streams(f"{server.url}/v1/completions", {**BODY, "max_tokens": max_tokens}, NUM_STREAMS)
    assert all(r.flowing.wait(30) for r in readers)
    assert all(r.status == 200 for r in readers), [r.status for r in readers]
    return readers


def health_status(url: str) -> int | None:
    try:
        return httpx.get(f"{url}/health", timeout=2.0).status_code
    except httpx.TransportError:
        return None


def join(readers: list[StreamReader], timeout: float = 60.0) -> None:
    for reader in readers:
        reader.join(timeout)
        assert not reader.is_alive(), "a stream was still open"


def assert_clean_exit(server: ServeProcess, within: float) -> None:
    assert server.proc.wait(timeout=within) == 0, server.output()
    output = server.output()
    assert "Traceback" not in output, output
    assert "Cancel" not in output, output  # uvicorn had to cancel a task: a stream was cut


def test_sigterm_drains_every_stream_in_flight(tiny_model_dir: Path, tmp_path: Path) -> None:
    server = start_serve_process(tiny_model_dir, tmp_path / "serve.log", *FLAGS)
    try:
        readers = flowing_streams(server, max_tokens=300)
        server.proc.send_signal(signal.SIGTERM)
        assert wait_until(lambda: health_status(server.url) == 503, timeout=5.0), health_status(server.url)
        late = httpx.post(f"{server.url}/v1/completions", json={**BODY, "stream": False, "max_tokens": 4},
                          timeout=10.0)
        assert late.status_code == 503 and late.json()["error"]["code"] == "service_unavailable", late.text
        assert any(r.is_alive() for r in readers), "the streams were over before the 503s were checked"
        join(readers)
        assert [outcome(r) for r in readers] == ["length"] * NUM_STREAMS
        assert_clean_exit(server, within=30)
    finally:
        server.kill()


def test_second_signal_ends_every_stream_with_an_error_event(tiny_model_dir: Path, tmp_path: Path) -> None:
    server = start_serve_process(tiny_model_dir, tmp_path / "serve.log", *FLAGS)
    try:
        readers = flowing_streams(server, max_tokens=480)
        server.proc.send_signal(signal.SIGTERM)
        assert wait_until(lambda: health_status(server.url) == 503, timeout=5.0)
        started = time.monotonic()
        server.proc.send_signal(signal.SIGINT)  # Ctrl-C counts as a signal like any other
        join(readers)
        outcomes = [outcome(r) for r in readers]
        assert "error" in outcomes and set(outcomes) <= {"error", "length"}, outcomes
        for reader, ended in zip(readers, outcomes, strict=True):
            if ended == "error":
                assert aborted_choices(reader) == [{"index": 0, "text": "", "logprobs": None,
                                                    "finish_reason": "abort"}]
        assert_clean_exit(server, within=15)
        assert time.monotonic() - started < 15
    finally:
        server.kill()


@pytest.fixture()
def draining(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[RunningServer]:
    """A server from the serve flags with a 0.5 s shutdown timeout, whose engine steps take
    >= 10 ms, so 100-token requests are still running at the deadline."""
    running = serve_in_thread(tiny_model_dir, "--shutdown-timeout", "0.5")
    slow_engine_steps(running, monkeypatch)
    yield running
    running.stop()


def test_deadline_ends_what_is_still_running_with_errors(draining: RunningServer) -> None:
    url = f"{draining.base_url}/v1/completions"
    readers = start_streams(url, {**BODY, "max_tokens": 100}, 4)
    blocking: list[httpx.Response] = []
    waiter = threading.Thread(target=lambda: blocking.append(
        httpx.post(url, json={**BODY, "stream": False, "max_tokens": 100}, timeout=30)))
    waiter.start()
    assert all(r.flowing.wait(30) for r in readers)
    assert wait_until(lambda: draining.async_engine.stats["num_requests_running"] == 5)
    started = time.monotonic()
    draining.server.handle_exit(signal.SIGTERM, None)  # as the signal would, in this thread
    join(readers)
    waiter.join(30)
    assert [outcome(r) for r in readers] == ["error"] * 4
    assert "shutting down" in readers[0].events()[-1]["error"]["message"]
    for reader in readers:
        assert aborted_choices(reader) == [{"index": 0, "text": "", "logprobs": None, "finish_reason": "abort"}]
    error = blocking[0].json()["error"]
    assert blocking[0].status_code == 503 and error["code"] == "service_unavailable", blocking[0].text
    draining.thread.join(15)
    assert not draining.thread.is_alive() and time.monotonic() - started < 10
    assert all_blocks_free(draining)


def test_deadline_ends_each_unfinished_chat_choice_with_abort(draining: RunningServer) -> None:
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100, "ignore_eos": True,
            "temperature": 0, "stream": True, "speculative": False, "n": 2, "stream_options": {"include_usage": True}}
    (reader,) = start_streams(f"{draining.base_url}/v1/chat/completions", chat, 1)
    assert reader.flowing.wait(30)
    assert wait_until(lambda: draining.async_engine.stats["num_requests_running"] >= 1)
    draining.server.handle_exit(signal.SIGTERM, None)
    join([reader])
    assert aborted_choices(reader) == [{"index": i, "delta": {}, "logprobs": None, "finish_reason": "abort"}
                                       for i in (0, 1)]
    assert reader.events()[-2]["usage"] is None  # the chunks' envelope, as include_usage has it
    draining.thread.join(15)
    assert not draining.thread.is_alive() and all_blocks_free(draining)
