"""How much host memory a server holds now, and how much once its KV cache is in use.

On the CPU the KV pool is an anonymous memory map (kernels/kv_cache.py `lazy_zeros`): its
pages become resident only when a request first writes them, and stay so. A server just
started holds little of it, and its RSS climbs by the rest over its first busy minutes (by
design: not a leak). The start-up log says both figures, so that the first one is not
taken for the server's size. The resident part of the pool is read with mincore(2).
`kv_filled_at` estimates, from outside, when a server's pool has been written once, and
`rss_once_filled` the RSS from then on (evals/load_test.py reports it).
"""
from __future__ import annotations

import ctypes
import functools
import mmap
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

GIB = 1 << 30
MIB = 1 << 20


@dataclass(frozen=True)
class MemoryReport:
    """`rss`: the process's resident bytes now; `kv_bytes`: the KV pool's bytes in host
    memory (0 when it lives on a GPU); `kv_resident`: how many of those are resident now."""

    rss: int
    kv_bytes: int
    kv_resident: int

    @property
    def expected_rss(self) -> int:
        """The RSS once every page of the KV pool has been written."""
        return self.rss + max(self.kv_bytes - self.kv_resident, 0)

    def describe(self) -> str:
        if not self.kv_bytes:
            return f"RSS {format_size(self.rss)} (the KV cache is not in host memory)"
        return (f"RSS {format_size(self.rss)} now; about {format_size(self.expected_rss)} once the "
                f"{format_size(self.kv_bytes)} KV cache is in use")


def format_size(num_bytes: int) -> str:
    """MiB below a GiB (whole), GiB from there (two decimals)."""
    if num_bytes >= GIB:
        return f"{num_bytes / GIB:.2f} GiB"
    return f"{num_bytes / MIB:.0f} MiB"


def memory_report(engine: Any) -> MemoryReport | None:
    """The engine's process now, with its target model's KV pool (a draft model's own pool,
    where there is one, is not counted); None where the RSS cannot be read (not Linux)."""
    rss = process_rss()
    if rss is None:
        return None
    host = [t for layer in engine.runner.kv_cache.layers for t in layer.tensors() if t.device.type == "cpu"]
    kv_bytes = sum(t.nbytes for t in host)
    resident = [resident_bytes(t.data_ptr(), t.nbytes) for t in host]
    # Unknown residency counts as none resident: the expected figure is then an upper bound.
    return MemoryReport(rss, kv_bytes, sum(r or 0 for r in resident))


def process_rss() -> int | None:
    """Resident bytes of this process (/proc/self/statm), or None."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * mmap.PAGESIZE
    except (OSError, IndexError, ValueError):
        return None


def resident_bytes(address: int, length: int) -> int | None:
    """Bytes of [address, address + length) in resident pages, or None where mincore(2)
    is not available or refuses the range."""
    mincore = _mincore()
    if mincore is None or length <= 0:
        return None
    page = mmap.PAGESIZE
    start = address - address % page
    num_pages = (address + length - start + page - 1) // page
    flags = (ctypes.c_ubyte * num_pages)()
    if mincore(ctypes.c_void_p(start), ctypes.c_size_t(num_pages * page), flags) != 0:
        return None
    resident = int(np.count_nonzero(np.frombuffer(memoryview(flags), dtype=np.uint8) & 1)) * page
    return min(resident, length)


@functools.cache
def _mincore() -> Any:
    if os.name != "posix":
        return None
    return getattr(ctypes.CDLL(None, use_errno=True), "mincore", None)  # libc's, already loaded


def kv_filled_at(finished: Iterable[tuple[float, int]], pool_tokens: int) -> float | None:
    """The first time at which the tokens (prompt and completion) of the requests finished
    by then reach `pool_tokens`, given (end time, tokens) per request; None if they never do.

    An estimate of when every page of the KV pool has been written, for prefix caching on
    (the default): a freed block whose contents are cached goes to the back of the free
    list, so new contents go to blocks never written until the pool has been gone through.
    Prompt tokens found in the prefix cache count as written, requests without usage (cut
    short) do not. With prefix caching off freed blocks are reused first, and the pool is
    written only as far as the most blocks in use at once."""
    total = 0
    for end, tokens in sorted(finished):
        total += tokens
        if total >= pool_tokens:
            return end
    return None


def rss_once_filled(samples: Iterable[tuple[float, float | None]], finished: Iterable[tuple[float, int]],
                    pool_tokens: int | None) -> tuple[float | None, float | None]:
    """(when the pool had been written once, per `kv_filled_at`; the largest of the RSS
    samples (time, RSS) from then on), each None where unknown."""
    filled = None if pool_tokens is None else kv_filled_at(finished, pool_tokens)
    later = [rss for time, rss in samples if filled is not None and time >= filled and rss is not None]
    return filled, max(later, default=None)
