"""The suffix drafter's cross-request cache: earlier requests' outputs, indexed, bounded.

One per engine (one drafter instance per engine). Each finished request adds one entry:
its output, preceded by the last prompt tokens before it, so that a new request's prompt
end (the chat template's assistant header, the tail of a repeated instruction) matches and
the draft can start with the output's first tokens.

Bounds: at most `max_requests` entries and `max_tokens` tokens (the ring's capacity: the
memory is proportional to it, 16 B a token plus 12 B of heads per token of capacity,
see suffix_index.py and bench_suffix.py), and no entry older than `ttl_s` seconds. Eviction
is oldest first (FIFO, as vLLM's suffix cache): a hit does not renew an entry, because the
TTL promises how long any tenant's text is held at most. Evicting costs the entry's length:
the index's floor moves past the oldest entry, whose positions are never read again, and its
tokens are wiped.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from specdec.drafters.suffix_index import SuffixIndex


@dataclass(frozen=True)
class CacheEntry:
    start: int  # its first position in the ring
    added: float  # clock time it was added


class SuffixCache:
    def __init__(self, max_requests: int, max_tokens: int, ttl_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_requests < 1 or max_tokens < 2 or ttl_s <= 0:
            raise ValueError(f"a suffix cache needs max_requests >= 1, max_tokens >= 2 and ttl_s > 0, got "
                             f"{max_requests}, {max_tokens}, {ttl_s}")
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.ttl_s = ttl_s
        self.clock = clock
        self.entries: deque[CacheEntry] = deque()
        self.index: SuffixIndex | None = None  # built on the first add: an unused cache costs nothing

    @property
    def num_requests(self) -> int:
        self.expire()
        return len(self.entries)

    @property
    def num_tokens(self) -> int:
        """Ring positions held (tokens and the separators between entries)."""
        return 0 if self.index is None else self.index.end - self.index.floor

    def add(self, tokens: Sequence[int]) -> None:
        """Cache one request's tokens (its last max_tokens - 1 if longer: one slot separates entries)."""
        tokens = tokens[len(tokens) - (self.max_tokens - 1):] if len(tokens) >= self.max_tokens else tokens
        if not tokens:
            return
        if self.index is None:
            self.index = SuffixIndex(capacity=self.max_tokens)
        self.expire()
        while self.entries and (len(self.entries) >= self.max_requests
                                or self.num_tokens + 1 + len(tokens) > self.max_tokens):
            self._evict_oldest()
        self.index.start_segment()
        self.entries.append(CacheEntry(self.index.end, self.clock()))
        self.index.extend(tokens)

    def clear(self) -> None:
        """Evict every entry."""
        while self.entries:
            self._evict_oldest()

    def expire(self) -> None:
        """Evict the entries older than the TTL."""
        deadline = self.clock() - self.ttl_s
        while self.entries and self.entries[0].added < deadline:
            self._evict_oldest()

    def live_index(self) -> SuffixIndex | None:
        """The ring to look up in, once the entries older than the TTL are evicted (None: empty)."""
        self.expire()
        return self.index if self.entries else None

    def matches(self, context: Sequence[int], max_match: int) -> list[tuple[int, int]]:
        """(position, match length) of cached occurrences of the context's suffix (see SuffixIndex)."""
        index = self.live_index()
        return [] if index is None else index.matches(context, max_match)

    def continuation(self, position: int, count: int) -> list[int]:
        return [] if self.index is None else self.index.continuation(position, count)

    def _evict_oldest(self) -> None:
        assert self.index is not None
        self.entries.popleft()
        # The next entry's start (its separator before it goes too), or everything.
        self.index.forget_before(self.entries[0].start if self.entries else self.index.end)
