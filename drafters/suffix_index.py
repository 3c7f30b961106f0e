"""A hash-chained n-gram index over a token sequence: where the context's suffix occurred
before, and how long each of those matches is. A handle over the C++ index
(kernels/csrc/suffix_index.cpp, which documents the layout): a lookup runs for every request
on every step, and in Python its appends, walks and comparisons cost tens of microseconds.

The suffix drafter keeps one per request (its prompt and output so far, growing) and the
cross-request cache one over a ring of earlier requests' tokens (drafters/suffix_cache.py).
A request's own index holds exactly its tokens, so a step's lookup (`lookup`) reads the
context from there, in both the own index and the cache, in one call that also reads the
matches' continuations: no Python list crosses into C++ on a step but the new tokens.

Positions are global and only grow. In a ring (a `capacity`), position p lives in slot
p % capacity, and every position below `floor` is gone: evicted or overwritten. A ring
costs 4 + 4 * len(LEVELS) bytes a position of capacity plus 4 * len(LEVELS) a head-table
bucket (one per position of capacity, rounded up to a power of two); a request's own
index grows with its tokens.
"""
from __future__ import annotations

import ctypes
import functools
import weakref
from array import array
from collections.abc import Sequence
from typing import Any, NamedTuple

from specdec.kernels import cpu_build

LEVELS = (2, 4, 8)  # n-gram lengths with a chain; a lookup starts at the longest that occurs
# Chain links visited per level and lookup: this bounds a step's cost however often an
# n-gram recurs, and the newest occurrences, walked first, are the most relevant ones. 16
# drafted as well as 32 on bench_suffix.py's corpus, at half the lookup cost.
MAX_WALK = 16
SEPARATOR = -1  # between sequences in a shared store: no match or continuation crosses it
MAX_FOUND = 2 * MAX_WALK  # a lookup's occurrences at most: the own index's walk, then the cache's
_LIBRARY = "suffix_index"
_ITEMS = 2 + 3 * MAX_FOUND  # a lookup's result row (see specdec_suffix_lookup)
_ERRORS = {-1: "bad argument", -2: "out of memory", -3: "output buffer too small"}


class _Header(ctypes.Structure):
    """The C++ index's first fields, read in place: `end` and `floor` cost no call."""

    _fields_ = [("end", ctypes.c_int64), ("floor", ctypes.c_int64), ("capacity", ctypes.c_int64),
                ("num_buckets", ctypes.c_int64)]


class Lookup(NamedTuple):
    """A step's evidence: the longest match length (0: none), and per occurrence (own ones
    first, then the cache's, newest first in each) its store (0: own, 1: cache), its
    position and its continuation (empty unless a depth was asked for)."""

    match_length: int
    stores: list[int]
    positions: list[int]
    continuations: list[list[int]]


_NOTHING = Lookup(0, [], [], [])  # shared by every lookup that finds nothing: never mutated


class _Native:
    """The C functions, typed once."""

    def __init__(self) -> None:
        void, i64, f64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double

        def function(symbol: str, argtypes: list[Any], restype: Any = i64) -> Any:
            return cpu_build.function(_LIBRARY, f"specdec_suffix_{symbol}", argtypes, restype)

        self.create = function("create", [i64, i64], void)
        self.free = function("free", [void], None)
        self.extend = function("extend", [void, void, i64])
        self.push = function("push", [void, i64])
        self.start_segment = function("start_segment", [void])
        self.forget_before = function("forget_before", [void, i64])
        self.matches = function("matches", [void, void, i64, i64, void, void, i64])
        self.step = function("step", [void, void, void, i64, i64, i64, f64, void, i64, void, i64])
        self.continuation = function("continuation", [void, i64, i64, void, i64])
        self.read = function("read", [void, i64, i64, void, i64])
        self.slots = function("slots", [void, void, i64])
        self.nbytes = function("nbytes", [void])
        layout = array("q", bytes(8 * 8))
        count = function("layout", [void, i64])(layout.buffer_info()[0], len(layout))
        expected = [*LEVELS, MAX_WALK, SEPARATOR, MAX_FOUND, ctypes.sizeof(_Header)]
        if layout[:count].tolist() != expected:
            raise cpu_build.KernelBuildError(f"{_LIBRARY}.cpp's constants {layout[:count].tolist()} are not "
                                             f"suffix_index.py's {expected}")


@functools.cache
def _native() -> _Native:
    return _Native()


def native_index() -> None:
    """Build and load the C++ index now (raises KernelBuildError, naming the compiler, if it cannot)."""
    _native()


def _checked(status: int, what: str) -> int:
    if status < 0:
        if status == -2:
            raise MemoryError(f"suffix index {what}: out of memory")
        raise ValueError(f"suffix index {what}: {_ERRORS.get(status, f'error {status}')}")
    return status


def _address(buffer: array[Any]) -> int:
    return buffer.buffer_info()[0]


class SuffixIndex:
    """Tokens appended one segment after another, each n-gram indexed inside its segment."""

    def __init__(self, capacity: int | None = None, start: int = 0) -> None:
        """capacity None: grows without bound (a request's own context); else a ring of that
        many positions. start: a ring's first position (as if that many had passed through)."""
        if capacity is not None and not 1 <= capacity <= 1 << 31:
            raise ValueError(f"a suffix index ring needs a capacity in [1, 2**31], got {capacity}")
        if start < 0 or (start and capacity is None):
            raise ValueError(f"a suffix index starts at 0, or at a position >= 0 for a ring; got {start}")
        self._c = _native()
        handle = self._c.create(capacity or 0, start)
        if not handle:
            raise MemoryError(f"cannot allocate a suffix index of capacity {capacity}")
        self._handle: int = handle
        self._header = _Header.from_address(handle)
        weakref.finalize(self, self._c.free, handle)
        self.capacity = capacity
        self._items = array("q", bytes(8 * _ITEMS))  # lookup's result row and continuations, reused
        self._tokens = array("i")
        self._new = array("i", [0])  # a step's one new token, passed in place
        self._items_address, self._tokens_address, self._new_address = map(_address, (self._items, self._tokens,
                                                                                   self._new))

    @property
    def end(self) -> int:
        """Positions written so far."""
        return self._header.end

    @property
    def floor(self) -> int:
        """The oldest position still readable."""
        return self._header.floor

    @property
    def num_buckets(self) -> int:
        """Buckets in each level's head table."""
        return self._header.num_buckets

    # ---- writing ----------------------------------------------------------------------

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens to the current segment, indexing the n-grams each one follows."""
        if len(tokens) == 1:  # a decode step's one committed token: no buffer to build
            _checked(self._c.push(self._handle, tokens[0]), "extend")
        elif tokens:
            buffer = array("i", tokens)
            _checked(self._c.extend(self._handle, _address(buffer), len(buffer)), "extend")

    def start_segment(self) -> None:
        """Later tokens never extend a match across this point (a separator is written)."""
        _checked(self._c.start_segment(self._handle), "start_segment")

    def forget_before(self, position: int) -> None:
        """Positions below `position` are evicted: lookups no longer see them, and their
        tokens are wiped, so that evicted text is not held until the ring overwrites it."""
        _checked(self._c.forget_before(self._handle, position), "forget_before")

    # ---- reading ----------------------------------------------------------------------

    def matches(self, context: Sequence[int], max_match: int) -> list[tuple[int, int]]:
        """(position, match length) of earlier occurrences of the context's suffix, newest
        first: `position` is the token that followed the occurrence, and the match length
        (capped at max_match) counts the tokens before it equal to the context's last ones.
        Only the longest level with a verified occurrence is walked: its matches are the
        longest there are, up to the walk limit."""
        tail = array("i", context[len(context) - min(len(context), max(max_match, 0)):])
        positions, lengths = array("q", bytes(8 * MAX_WALK)), array("i", bytes(4 * MAX_WALK))
        count = _checked(self._c.matches(self._handle, _address(tail), len(tail), max_match, _address(positions),
                                         _address(lengths), MAX_WALK), "matches")
        return list(zip(positions[:count].tolist(), lengths[:count].tolist()))

    def lookup(self, cache: SuffixIndex | None, max_match: int, max_depth: int, spec_factor: float,
               new_tokens: Sequence[int] = ()) -> Lookup:
        """A drafting step's evidence, after appending `new_tokens` (one native call: a step
        that finds nothing costs little more than the call), the context being this index's
        tokens: the occurrences of its longest matched suffix here and in `cache` whose match
        is that long, each with its continuation min(max_depth, max(1, int(spec_factor *
        match))) tokens deep at most (none if max_depth is 0), stopping at a separator."""
        if len(self._tokens) < MAX_FOUND * max_depth:
            self._tokens = array("i", bytes(4 * MAX_FOUND * max_depth))
            self._tokens_address = _address(self._tokens)
        new_address: int | None
        if len(new_tokens) == 1:  # a decode step's one committed token: the reused buffer
            self._new[0] = new_tokens[0]
            new, new_address = self._new, self._new_address
        else:
            new = array("i", new_tokens)
            new_address = _address(new) if new else None
        items, tokens = self._items, self._tokens
        # Addresses kept, no helper calls: on a step that finds nothing this wrapper is most of the cost.
        count = self._c.step(self._handle, None if cache is None else cache._handle, new_address, len(new), max_match,
                             max_depth, spec_factor, self._items_address, len(items), self._tokens_address,
                             len(tokens))
        if count < 0:
            _checked(count, "lookup")
        if count == 0:
            return _NOTHING
        depth = items[1]
        lengths = items[2 + 2 * MAX_FOUND: 2 + 2 * MAX_FOUND + count]
        return Lookup(items[0], items[2: 2 + count].tolist(), items[2 + MAX_FOUND: 2 + MAX_FOUND + count].tolist(),
                      [tokens[i * depth: i * depth + n].tolist() for i, n in enumerate(lengths)])

    def continuation(self, position: int, count: int) -> list[int]:
        """Up to `count` tokens from `position` on, stopping at a separator or the end."""
        if count <= 0:
            return []
        out = array("i", bytes(4 * count))
        written = _checked(self._c.continuation(self._handle, position, count, _address(out), count), "continuation")
        return out[:written].tolist()

    def read(self, start: int, stop: int) -> list[int]:
        """The readable tokens in [start, stop) (separators included)."""
        count = min(stop, self.end) - max(start, self.floor)
        if count <= 0:
            return []
        out = array("i", bytes(4 * count))
        written = _checked(self._c.read(self._handle, start, stop, _address(out), count), "read")
        return out[:written].tolist()

    def slots(self) -> list[int]:
        """Every slot's token as stored, by slot: evicted ones are wiped (SEPARATOR) or
        overwritten, which is what bounds how long a ring holds any text."""
        size = _checked(self._c.slots(self._handle, None, 0), "slots")
        out = array("i", bytes(4 * size))
        return out[:_checked(self._c.slots(self._handle, _address(out) if size else None, size), "slots")].tolist()

    def nbytes(self) -> int:
        """Memory held by the C++ arrays (allocated, not only used)."""
        return _checked(self._c.nbytes(self._handle), "nbytes")
