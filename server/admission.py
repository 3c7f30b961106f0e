"""Who may start a request now, decided before the route runs: nobody but /health and
/metrics once the server is shutting down (503), and at most N generation requests in
flight per API key, or per client address for a client that sends none (429), so one
client cannot take every sequence slot. It also counts the generation requests in flight,
which is what a graceful shutdown waits for.

A pure ASGI middleware, because a streaming response is only over when the app's call
returns: route dependencies are left before the stream has been sent.
"""
from __future__ import annotations

import collections
import hmac
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from specdec.server.errors import APIError, error_response, unavailable

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
OPEN_PATHS = frozenset({"/health", "/metrics"})


def check_api_key(key: str, source: str) -> None:
    """Refuse a key no client could ever present: the server strips the header's token, and
    a header cannot carry control characters."""
    if not key:
        raise ValueError(f"{source} is empty; leave it unset to serve without a key")
    if key != key.strip():
        raise ValueError(f"{source} starts or ends with whitespace, which no client can send")
    if any(ord(c) < 32 or ord(c) == 127 for c in key):
        raise ValueError(f"{source} contains control characters, which no HTTP header can carry")


def resolve_api_key(flag: str | None, env: str | None) -> str | None:
    """The server's key from --api-key and $SPECDEC_API_KEY. Both may be set only to the same
    value: two different keys are a mistake to stop at, not one to guess about."""
    for key, source in ((flag, "--api-key"), (env, "$SPECDEC_API_KEY")):
        if key is not None:
            check_api_key(key, source)
    if flag is not None and env is not None and not key_matches(flag.encode(), env):
        raise ValueError("--api-key and $SPECDEC_API_KEY are both set, to different keys; set only one "
                         "(preferably $SPECDEC_API_KEY: a flag shows in `ps` and in shell history)")
    return env if env is not None else flag


def key_matches(token: bytes, key: str) -> bool:
    """`token` as the client sent it (a header's raw bytes) against the key's UTF-8 bytes, in
    constant time: a non-ASCII key matches when the client sends its UTF-8 bytes."""
    return hmac.compare_digest(token, key.encode("utf-8"))


def bearer_token(authorization: bytes) -> bytes | None:
    scheme, _, token = authorization.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    return token.strip()


class Admission:
    """The shutdown flag and the in-flight counts (event loop only: no locks needed)."""

    def __init__(self, api_key: str | None, max_per_key: int | None,
                 on_reject: Callable[[str], None] = lambda reason: None) -> None:
        if max_per_key is not None and max_per_key < 1:
            raise ValueError(f"max_concurrent_requests_per_key must be at least 1, got {max_per_key}")
        self.api_key = api_key
        self.max_per_key = max_per_key
        self.on_reject = on_reject  # called with "per_key_limit" or "shutting_down" (the metrics' reasons)
        self.closing = False
        self.in_flight = 0
        self._per_client: collections.Counter[bytes] = collections.Counter()

    def close(self) -> None:
        """From now on only /health and /metrics are served (503 for the rest)."""
        self.closing = True

    def client_id(self, scope: Scope) -> bytes | None:
        """Whom a generation request counts against: its bearer token, else its address. None
        (not counted) when the server has a key and the token is not it: the route answers
        401, and a stranger must not use up the key holder's share."""
        authorization = dict(scope.get("headers") or []).get(b"authorization", b"")
        token = bearer_token(authorization)
        if self.api_key is not None:
            return token if token is not None and key_matches(token, self.api_key) else None
        if token:
            return b"key:" + token
        client = scope.get("client")
        return b"addr:" + str(client[0] if client else "unknown").encode()

    def enter(self, client: bytes | None) -> bool:
        """Count a generation request in; False when its client already has the most allowed."""
        if client is not None and self.max_per_key is not None:
            if self._per_client[client] >= self.max_per_key:
                return False
            self._per_client[client] += 1
        self.in_flight += 1
        return True

    def leave(self, client: bytes | None) -> None:
        self.in_flight -= 1
        if client is not None and self.max_per_key is not None:
            self._per_client[client] -= 1
            if self._per_client[client] <= 0:
                del self._per_client[client]  # the table holds clients in flight, no more


class AdmissionMiddleware:
    def __init__(self, app: ASGIApp, admission: Admission) -> None:
        self.app = app
        self.admission = admission

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if not path or path in OPEN_PATHS:
            await self.app(scope, receive, send)
        elif self.admission.closing:
            self.admission.on_reject("shutting_down")
            await error_response(unavailable("the server is shutting down and takes no new requests"))(
                scope, receive, send)
        elif path in GENERATION_PATHS:
            await self._generate(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def _generate(self, scope: Scope, receive: Receive, send: Send) -> None:
        client = self.admission.client_id(scope)
        if not self.admission.enter(client):
            self.admission.on_reject("per_key_limit")
            await error_response(_too_many(self.admission.max_per_key), headers={"Retry-After": "1"})(
                scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.admission.leave(client)


def _too_many(limit: int | None) -> APIError:
    return APIError(429, f"this API key (or client address) already has {limit} requests in flight, the most "
                         "--max-concurrent-requests-per-key allows; retry when one has finished",
                    "requests", code="rate_limit_exceeded")
