"""glibc malloc tuning: applied on glibc Linux, a no-op elsewhere, never an error."""
from __future__ import annotations

import ctypes
import sys

import pytest

from specdec import allocator


def test_keep_freed_memory_applies_on_glibc() -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("glibc only")
    try:
        ctypes.CDLL("libc.so.6").gnu_get_libc_version  # noqa: B018
    except (OSError, AttributeError):
        pytest.skip("not glibc")
    assert allocator.keep_freed_memory() is True


def test_keep_freed_memory_is_a_no_op_off_linux(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "platform", "darwin")
    assert allocator.keep_freed_memory() is False
