"""CORS, as vLLM's `--allowed-origins` / `--allowed-methods` / `--allowed-headers` /
`--allow-credentials`: starlette's CORSMiddleware when origins are given, and no CORS
headers at all when they are not (browsers then refuse cross-origin calls)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

_ALL = ["*"]


@dataclass(frozen=True)
class CorsPolicy:
    allowed_origins: list[str]
    allowed_methods: list[str]
    allowed_headers: list[str]
    allow_credentials: bool = False

    def __post_init__(self) -> None:
        if self.allow_credentials and "*" in self.allowed_origins:
            # Browsers reject a credentialed response that allows every origin; starlette
            # would echo each caller's origin instead, letting any web page call with cookies.
            raise ValueError('--allow-credentials cannot be used with the origin "*": list the origins allowed '
                             "to send credentials in --allowed-origins")


def cors_policy(args: Any) -> CorsPolicy | None:
    """The policy of the serve flags; None without --allowed-origins. The other CORS flags
    need --allowed-origins (ValueError naming them), else they would do nothing."""
    if args.allowed_origins is None:
        alone = [flag for flag, given in (("--allowed-methods", args.allowed_methods is not None),
                                          ("--allowed-headers", args.allowed_headers is not None),
                                          ("--allow-credentials", args.allow_credentials)) if given]
        if alone:
            raise ValueError(f"{', '.join(alone)} needs --allowed-origins: without it the server sends no CORS "
                             "headers")
        return None
    return CorsPolicy(args.allowed_origins, args.allowed_methods or _ALL, args.allowed_headers or _ALL,
                      args.allow_credentials)


def add_cors(app: FastAPI, policy: CorsPolicy) -> None:
    """Outermost, so preflights are answered before auth and every response (errors too)
    carries the headers."""
    app.add_middleware(CORSMiddleware, allow_origins=policy.allowed_origins, allow_methods=policy.allowed_methods,
                       allow_headers=policy.allowed_headers, allow_credentials=policy.allow_credentials)

