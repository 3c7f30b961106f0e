"""Auth and limits (issue 23, defects 7 and 8): the docs need the key unless
--docs-without-auth, a non-ASCII key matches its UTF-8 bytes, --api-key and
$SPECDEC_API_KEY are resolved as documented, each key (or address) has at most
--max-concurrent-requests-per-key generation requests in flight (429 beyond, other keys
unaffected), and uvicorn really gets the connection flags."""
from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from uvicorn.server import ServerState

from specdec.cli import build_parser
from specdec.server.admission import resolve_api_key
from specdec.server.app import uvicorn_config
from specdec.server.connections import GuardedH11Protocol, guarded_protocol
from tests.helpers import RunningServer, all_blocks_free, serve_in_thread, slow_engine_steps, start_streams, wait_until

DOCS = ["/docs", "/redoc", "/openapi.json"]
NON_ASCII_KEY = "clé-ключ-鍵"
LIMIT_FLAGS = ("--max-concurrent-requests-per-key", "1", "--limit-concurrency", "6", "--timeout-keep-alive", "1",
               "--timeout-header-read", "1", "--max-header-bytes", "2048")
STREAM: dict[str, Any] = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 100, "ignore_eos": True,
                          "temperature": 0, "stream": True, "speculative": False}
SHORT: dict[str, Any] = {"model": "tiny", "prompt": "hi", "max_tokens": 2}


def bearer(key: str) -> dict[str, Any]:
    return {"Authorization": b"Bearer " + key.encode("utf-8")}


def assert_error(response: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    if code is not None:
        assert error["code"] == code, error
    return error


# ---- auth --------------------------------------------------------------------------------


@pytest.mark.parametrize("path", DOCS)
def test_docs_need_the_key(server: RunningServer, path: str) -> None:
    assert_error(httpx.get(f"{server.base_url}{path}"), 401, "invalid_api_key")
    with server.client() as client:
        response = client.get(path)
    assert response.status_code == 200
    if path == "/openapi.json":
        assert "/v1/completions" in response.json()["paths"]


def test_health_and_metrics_need_no_key(server: RunningServer) -> None:
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert httpx.get(f"{server.base_url}/metrics").status_code == 200


@pytest.fixture(scope="module")
def open_docs(tiny_model_dir: Any) -> Iterator[RunningServer]:
    running = serve_in_thread(tiny_model_dir, "--api-key", NON_ASCII_KEY, "--docs-without-auth")
    yield running
    running.stop()


@pytest.mark.parametrize("path", DOCS)
def test_docs_without_auth(open_docs: RunningServer, path: str) -> None:
    assert httpx.get(f"{open_docs.base_url}{path}").status_code == 200
    assert_error(httpx.get(f"{open_docs.base_url}/v1/models"), 401, "invalid_api_key")


def test_non_ascii_key_matches_its_utf8_bytes(open_docs: RunningServer) -> None:
    url = open_docs.base_url
    assert httpx.get(f"{url}/v1/models", headers=bearer(NON_ASCII_KEY)).status_code == 200
    response = httpx.post(f"{url}/v1/completions", json=SHORT, headers=bearer(NON_ASCII_KEY))
    assert response.status_code == 200, response.text
    assert_error(httpx.get(f"{url}/v1/models", headers=bearer(NON_ASCII_KEY[:-1])), 401)
    latin1 = {b"Authorization": b"Bearer " + "clé".encode("latin-1")}
    assert_error(httpx.get(f"{url}/v1/models", headers=latin1), 401)


def test_resolve_api_key() -> None:
    assert resolve_api_key(None, None) is None
    assert resolve_api_key("flag-key", None) == "flag-key"
    assert resolve_api_key(None, "env-key") == "env-key"
    assert resolve_api_key("same", "same") == "same"
    with pytest.raises(ValueError, match="--api-key and \\$SPECDEC_API_KEY are both set"):
        resolve_api_key("flag-key", "env-key")
    for bad, why in [("", "empty"), (" key", "whitespace"), ("key\n", "whitespace"), ("k\x01y", "control")]:
        with pytest.raises(ValueError, match=why):
            resolve_api_key(None, bad)


# ---- per-key limit -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def limited(tiny_model_dir: Any) -> Iterator[RunningServer]:
    running = serve_in_thread(tiny_model_dir, *LIMIT_FLAGS)
    yield running
    running.stop()


@pytest.fixture()
def slow_limited(limited: RunningServer, monkeypatch: pytest.MonkeyPatch) -> RunningServer:
    """Each engine step takes >= 10 ms: a 100-token stream stays in flight for a second."""
    slow_engine_steps(limited, monkeypatch)
    return limited


def test_per_key_limit(slow_limited: RunningServer) -> None:
    url = f"{slow_limited.base_url}/v1/completions"
    [alice] = start_streams(url, STREAM, 1, headers={"Authorization": "Bearer alice"})
    assert alice.flowing.wait(30) and alice.status == 200
    error = assert_error(httpx.post(url, json=SHORT, headers={"Authorization": "Bearer alice"}), 429,
                         "rate_limit_exceeded")
    assert "--max-concurrent-requests-per-key" in error["message"]
    metrics = httpx.get(f"{slow_limited.base_url}/metrics").text
    assert 'specdec:requests_rejected_total{reason="per_key_limit"} 1.0' in metrics
    bob = httpx.post(url, json=SHORT, headers={"Authorization": "Bearer bob"}, timeout=30)
    assert bob.status_code == 200, bob.text
    anonymous = httpx.post(url, json=SHORT, timeout=30)  # counted by address, which has none in flight
    assert anonymous.status_code == 200, anonymous.text
    alice.join(30)
    assert alice.events()[-1]["choices"][0]["finish_reason"] == "length"
    again = httpx.post(url, json=SHORT, headers={"Authorization": "Bearer alice"}, timeout=30)
    assert again.status_code == 200, again.text
    assert wait_until(lambda: all_blocks_free(slow_limited))


def test_per_address_limit_without_a_key(slow_limited: RunningServer) -> None:
    url = f"{slow_limited.base_url}/v1/completions"
    [first] = start_streams(url, STREAM, 1)
    assert first.flowing.wait(30) and first.status == 200
    assert_error(httpx.post(url, json=SHORT), 429, "rate_limit_exceeded")
    assert httpx.get(f"{slow_limited.base_url}/v1/models").status_code == 200  # only generation is capped
    first.join(30)
    assert wait_until(lambda: all_blocks_free(slow_limited))


# ---- uvicorn's limits ------------------------------------------------------------------------


def test_serve_flags_reach_uvicorn() -> None:
    args = build_parser().parse_args(["serve", "tiny", *LIMIT_FLAGS])
    config = uvicorn_config(FastAPI(), args)
    assert config.timeout_keep_alive == 1
    assert config.limit_concurrency == 6
    assert config.h11_max_incomplete_event_size == 2048
    assert header_timeout(config) == 1.0
    defaults = uvicorn_config(FastAPI(), build_parser().parse_args(["serve", "tiny"]))
    assert (defaults.timeout_keep_alive, defaults.limit_concurrency, defaults.h11_max_incomplete_event_size) == \
        (5, None, 16384)
    assert header_timeout(defaults) == 10.0


def header_timeout(config: uvicorn.Config) -> float:
    """The header-read timeout of the protocol class uvicorn will run."""
    protocol = config.http
    assert isinstance(protocol, type) and issubclass(protocol, GuardedH11Protocol)
    return float(getattr(protocol, "header_timeout"))  # noqa: B009 - mypy does not narrow the union


@pytest.mark.parametrize("flags", [["--limit-concurrency", "1"], ["--max-concurrent-requests-per-key", "0"],
                                   ["--timeout-header-read", "0"], ["--timeout-keep-alive", "0"],
                                   ["--max-header-bytes", "10"], ["--shutdown-timeout", "-1"],
                                   ["--shutdown-timeout", "nan"]])
def test_bad_serve_flags_are_refused(flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "tiny", *flags])
    assert flags[0] in capsys.readouterr().err


def connect(running: RunningServer) -> socket.socket:
    parts = urlsplit(running.base_url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=10)
    return sock


def read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes the connection."""
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def json_error(raw: bytes, status: int) -> dict[str, Any]:
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/1.1 {status} ".encode()), raw[:200]
    error: dict[str, Any] = json.loads(body)["error"]
    return error


def test_slow_request_head_times_out(limited: RunningServer) -> None:
    with connect(limited) as slow, connect(limited) as silent:
        slow.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
        started = time.monotonic()
        error = json_error(read_all(slow), 408)
        assert "--timeout-header-read" in error["message"]
        assert read_all(silent) == b""  # connected, sent nothing: closed without a word
        assert time.monotonic() - started < 5


def test_keep_alive_connection_closes_when_idle(limited: RunningServer) -> None:
    with connect(limited) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        started = time.monotonic()
        assert read_all(sock).startswith(b"HTTP/1.1 200 ")
        assert time.monotonic() - started < 5


@pytest.mark.parametrize("size", [3000, 100_000, 4_000_000])
def test_request_head_over_max_header_bytes_is_431(limited: RunningServer, size: int) -> None:
    with connect(limited) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * size + b"\r\n\r\n")
        error = json_error(read_all(sock), 431)
    assert "--max-header-bytes" in error["message"]


def test_malformed_request_is_a_json_400(limited: RunningServer) -> None:
    with connect(limited) as sock:
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        assert json_error(read_all(sock), 400)["type"] == "invalid_request_error"


def test_limit_concurrency(limited: RunningServer) -> None:
    idle = [connect(limited) for _ in range(5)]
    try:
        assert wait_until(lambda: httpx.get(f"{limited.base_url}/health").status_code == 503, timeout=0.5)
    finally:
        for sock in idle:
            sock.close()
    assert wait_until(lambda: httpx.get(f"{limited.base_url}/health").status_code == 200)


class _Transport(asyncio.Transport):
    """Records what the protocol writes; closes when told."""

    def __init__(self) -> None:
        super().__init__()
        self.written, self.eof, self.closed = b"", False, False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 50000)}.get(name, default)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += bytes(data)

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof = True

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


def test_lingering_close_stops_waiting_when_the_client_closes_first() -> None:
    loop = asyncio.new_event_loop()
    try:
        config = uvicorn.Config(FastAPI(), http=guarded_protocol(10.0))
        config.load()
        protocol = GuardedH11Protocol(config, ServerState(), {}, _loop=loop)
        transport = _Transport()
        protocol.connection_made(transport)
        protocol.data_received(b"NOT HTTP AT ALL\r\n\r\n")
        assert transport.written.startswith(b"HTTP/1.1 400 ") and transport.eof and not transport.closed
        timer = protocol._linger_timer
        assert timer is not None and not timer.cancelled()  # would close it LINGER_SECONDS on
        protocol.connection_lost(None)
        assert timer.cancelled() and protocol._linger_timer is None
    finally:
        loop.close()
