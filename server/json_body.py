"""A request body's bytes to a JSON object, with the checks json.loads lacks: nesting deeper
than `max_depth` is refused before json.loads recurses into it (Python's recursion limit
would be a 500), and a lone UTF-16 surrogate escape (`"\\ud800"`, not Unicode, so no
tokenizer or encoder takes it) is refused naming its field. Each failure is a 400."""
from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from specdec.server.errors import APIError

DEFAULT_MAX_JSON_DEPTH = 64


def load_json(raw: bytes, max_depth: int) -> dict[str, Any]:
    """A JSON object from UTF-8 bytes: nesting and lone surrogates are checked around json.loads,
    whose own failures there (RecursionError, a str that cannot be encoded) would be 500s."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(400, f"the request body is not valid UTF-8 (byte {exc.start})") from None
    check_depth(raw, max_depth)
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:  # only for bodies the scan did not count as JSON would (invalid ones)
        raise _too_deep(max_depth) from None
    except ValueError as exc:
        detail = f"{exc.msg} at line {exc.lineno} column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else exc
        raise APIError(400, f"the request body is not valid JSON: {detail}") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    if _SURROGATE_ESCAPE.search(text):
        check_unicode(data)
    return data


def _reject_constant(name: str) -> Any:
    """NaN and Infinity are not JSON, though Python's json module reads them."""
    raise ValueError(f"{name} is not a valid JSON number")


_STRUCTURE = b'[]{}"'
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in _STRUCTURE)
_DEPTH_STEP = np.zeros(256, dtype=np.int32)
_DEPTH_STEP[list(b"[{")] = 1
_DEPTH_STEP[list(b"]}")] = -1
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def check_depth(raw: bytes, max_depth: int) -> None:
    """Refuse nesting deeper than max_depth before json.loads recurses into it, in C and numpy
    time: escaped backslashes and quotes go first, then brackets between quotes are skipped."""
    if raw.count(b"[") + raw.count(b"{") <= max_depth:
        return
    structure = raw.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _NOT_STRUCTURE)
    codes = np.frombuffer(structure, dtype=np.uint8)
    quoted = np.cumsum(codes == ord('"'), dtype=np.int32) % 2 == 1
    depth = int(np.cumsum(np.where(quoted, 0, _DEPTH_STEP[codes]), dtype=np.int32).max(initial=0))
    if depth > max_depth:
        raise _too_deep(max_depth, depth)


def _too_deep(max_depth: int, depth: int | None = None) -> APIError:
    levels = f"{depth} levels" if depth is not None else "too"
    return APIError(400, f"the request body is nested {levels} deep; at most {max_depth} levels are allowed")


def check_unicode(data: Any) -> None:
    """A `\\ud800` escape without its pair parses to a str that is not Unicode: name its field."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, where or "a key")
                stack.append((f"{where}.{key}" if where else key, item))
        elif isinstance(value, list):
            stack.extend((f"{where}[{i}]", item) for i, item in enumerate(value))
        elif isinstance(value, str):
            _check_text(value, where)


def _check_text(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise APIError(400, f"{where}: the string holds a lone UTF-16 surrogate (U+{ord(text[exc.start]):04X}) "
                            f"at character {exc.start}, which is not valid Unicode", param=where or None) from None
