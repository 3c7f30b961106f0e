"""The HTTP/1.1 connection: uvicorn's h11 protocol with the limits it lacks.

uvicorn (0.54, h11) arms its keep-alive timer only after a response, so a client that
connects and then sends nothing, or its request head a byte at a time, holds a connection
for ever; and h11's `max_incomplete_event_size` only bounds a head that has not arrived
whole, so a huge head in one packet gets through. This protocol closes a connection whose
request head has not arrived within `header_timeout` seconds (408 when part of one came),
answers 431 to a head over the config's `h11_max_incomplete_event_size` bytes, and sends
its 4xx (and h11's 400 for a malformed request) as OpenAI-style JSON errors, closing
without a reset that could destroy them.
"""
from __future__ import annotations

import asyncio
import json
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from specdec.server.errors import error_body

logger = logging.getLogger(__name__)
_HEAD_END = b"\r\n\r\n"
DEFAULT_MAX_HEAD_BYTES = 16 * 1024  # h11's default max_incomplete_event_size, as uvicorn uses it
_REASONS = {400: "Bad Request", 408: "Request Timeout", 431: "Request Header Fields Too Large"}
LINGER_SECONDS = 2.0  # how long a rejected connection reads and drops what still arrives


class GuardedH11Protocol(H11Protocol):
    header_timeout: float = 10.0  # guarded_protocol() makes a subclass with the server's value

    _header_timer: asyncio.TimerHandle | None = None
    _linger_timer: asyncio.TimerHandle | None = None
    _lingering = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()  # the wait for the first byte counts too

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        if self._linger_timer is not None:  # the client closed first: nothing left to wait for
            self._linger_timer.cancel()
            self._linger_timer = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._lingering:  # the rest of a rejected request: dropped
            return
        if self.conn.their_state is h11.IDLE:  # (part of) a new request head
            if self._head_too_large(data):
                self._reject(431, f"the request head is over {self._max_head_bytes()} bytes (--max-header-bytes)")
                return
            self._arm_header_timer()
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._disarm_header_timer()

    def send_400_response(self, msg: str) -> None:
        """h11 could not parse the request (uvicorn's answer is plain text)."""
        self._reject(400, f"invalid HTTP request: {msg}")

    def _max_head_bytes(self) -> int:
        configured = self.config.h11_max_incomplete_event_size
        return int(configured) if configured is not None else DEFAULT_MAX_HEAD_BYTES

    def _head_too_large(self, data: bytes) -> bool:
        limit = self._max_head_bytes()
        buffered = self.conn.trailing_data[0] + data
        return len(buffered) >= limit and buffered.find(_HEAD_END, 0, limit) < 0

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout, self._on_header_timeout)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
            return
        if self.conn.trailing_data[0]:
            self._reject(408, f"the request head did not arrive within {self.header_timeout:g} s "
                              "(--timeout-header-read)")
        else:
            self.transport.close()  # idle since it connected: nothing to answer

    def _reject(self, status: int, message: str) -> None:
        """Answer with an OpenAI-style error and close. Written raw: h11 sends no response
        before it has parsed a request."""
        logger.info("%s: %s", status, message)
        body = json.dumps(error_body(message, "invalid_request_error")).encode()
        head = (f"HTTP/1.1 {status} {_REASONS[status]}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode()
        self._disarm_header_timer()
        if not self.transport.is_closing():
            self.transport.write(head + body)
            self._linger()

    def _linger(self) -> None:
        """Close after the answer as nginx's lingering close does: half-close, then drop what
        the client still sends until it closes or LINGER_SECONDS pass. Closing with its
        data unread would reset the connection, and the reset can destroy the answer
        before the client has read it (a 100 KB head rejected after its first packet)."""
        self._lingering = True
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._linger_timer = self.loop.call_later(LINGER_SECONDS, self.transport.close)


def guarded_protocol(header_timeout: float) -> type[GuardedH11Protocol]:
    """The protocol class for uvicorn's `http=`, with this server's header timeout."""
    if header_timeout <= 0:
        raise ValueError(f"the header timeout must be positive, got {header_timeout}")
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"header_timeout": header_timeout})
