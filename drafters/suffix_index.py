"""A hash-chained n-gram index over a token sequence: where the context's suffix occurred
before, and how long each of those matches is.

The suffix drafter keeps one per request (its prompt and output so far, growing) and the
cross-request cache one over a ring of earlier requests' tokens (drafters/suffix_cache.py).

Layout, as in LZ77 matchers: for each n in LEVELS, a head table maps the hash of an
n-gram to the newest position that followed it, and a link per position points back to
the previous position that followed an n-gram of the same hash. Appending a token is a
few hash and array writes; a lookup walks at most MAX_WALK links per level, newest
first, and compares tokens backwards to measure each match (which also rejects hash
collisions). Tokens, links (distances back) and a ring's heads are 32-bit arrays: a ring
position costs 4 + 4 * len(LEVELS) bytes, plus 4 * len(LEVELS) per head-table bucket (one
bucket per position of capacity, rounded up to a power of two).

Positions are global and only grow. In a ring (a `capacity`), position p lives in slot
p % capacity, and every position below `floor` is gone: evicted or overwritten. Links
only point backwards, so a walk stops at the first position below the floor.
"""
from __future__ import annotations

from array import array
from collections import defaultdict
from collections.abc import Sequence

LEVELS = (2, 4, 8)  # n-gram lengths with a chain; a lookup starts at the longest that occurs
# Chain links visited per level and lookup: this bounds a step's cost however often an
# n-gram recurs, and the newest occurrences, walked first, are the most relevant ones. 16
# drafted as well as 32 on bench_suffix.py's corpus, at half the lookup cost.
MAX_WALK = 16
SEPARATOR = -1  # between sequences in a shared store: no match or continuation crosses it
_NO_LINK = 0
_MAX_DISTANCE = (1 << 32) - 1


class SuffixIndex:
    """Tokens appended one segment after another, each n-gram indexed inside its segment."""

    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = capacity  # None: grows without bound (a request's own context)
        self.modulus = capacity or 1 << 62  # position -> slot, one expression for both kinds
        self.tokens = array("i")  # [min(end, capacity)] by slot
        self.links = [array("I") for _ in LEVELS]  # [min(end, capacity)] distance back, 0: none
        # Per level, n-gram hash -> newest following position + 1 (0: none). Levels keep their
        # own tables: a head shared by two levels would send one level's walk down the other's
        # chain. A ring's tables are fixed arrays of 32-bit heads indexed by the masked hash (a
        # dict of millions of int keys would take ~100 B a key); heads are stored modulo 2**32
        # and recovered relative to `end`, which a ring's capacity (< 2**31) makes unambiguous
        # (a position p with p + 1 = 0 mod 2**32 reads as no head: one occurrence in 2**32 lost).
        self.num_buckets = 0 if capacity is None else _bucket_count(capacity)
        self.heads: list[defaultdict[int, int]] | list[array[int]] = (
            [defaultdict[int, int](int) for _ in LEVELS] if capacity is None
            else [array("I", bytes(4 * self.num_buckets)) for _ in LEVELS])
        self.end = 0  # positions written so far
        self.floor = 0  # the oldest position still readable
        self.segment: list[int] = []  # the current segment's last max(LEVELS) tokens

    # ---- writing ----------------------------------------------------------------------

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens to the current segment, indexing the n-grams each one follows."""
        for token in tokens:
            self._append(token)

    def start_segment(self) -> None:
        """Later tokens never extend a match across this point (a separator is written)."""
        if self.end > self.floor:
            self._append(SEPARATOR)
        self.segment.clear()

    def forget_before(self, position: int) -> None:
        """Positions below `position` are evicted: lookups no longer see them, and their
        tokens are wiped, so that evicted text is not held until the ring overwrites it."""
        position = min(position, self.end)
        for p in range(self.floor, position):
            self.tokens[p % self.modulus] = SEPARATOR
        self.floor = max(self.floor, position)

    def _append(self, token: int) -> None:
        position, slot = self.end, self.end % self.modulus
        if self.capacity is not None:
            self.floor = max(self.floor, position + 1 - self.capacity)  # the slot being overwritten
        grow = slot == len(self.tokens)  # the arrays grow until a ring's capacity, then wrap
        if grow:
            self.tokens.append(token)
        else:
            self.tokens[slot] = token
        segment = self.segment
        for level, (n, links) in enumerate(zip(LEVELS, self.links)):
            link = self._relink(level, segment, position) if token != SEPARATOR and len(segment) >= n else _NO_LINK
            if grow:
                links.append(link)
            else:
                links[slot] = link
        self.end += 1
        if token == SEPARATOR:
            segment.clear()
            return
        segment.append(token)
        if len(segment) > LEVELS[-1]:
            del segment[0]

    def _relink(self, level: int, segment: list[int], position: int) -> int:
        """Make `position` the newest follower of the segment's last n-gram; the distance back
        to the previous follower (0: none, or already gone)."""
        key = self._key(LEVELS[level], segment[-LEVELS[level]:])
        previous = self._head(level, key)
        heads = self.heads[level]
        heads[key] = position + 1 if isinstance(heads, defaultdict) else (position + 1) & _MAX_DISTANCE
        distance = position - previous
        return distance if previous >= self.floor and distance <= _MAX_DISTANCE else _NO_LINK

    def _head(self, level: int, key: int) -> int:
        """The newest position that followed the n-gram of this key, or -1."""
        heads = self.heads[level]
        if isinstance(heads, defaultdict):
            return heads.get(key, 0) - 1  # get: a lookup must not insert the key
        stored = heads[key]
        return -1 if stored == 0 else self.end - ((self.end - stored) & _MAX_DISTANCE) - 1

    # ---- reading ----------------------------------------------------------------------

    def matches(self, context: Sequence[int], max_match: int) -> list[tuple[int, int]]:
        """(position, match length) of earlier occurrences of the context's suffix, newest
        first: `position` is the token that followed the occurrence, and the match length
        (capped at max_match) counts the tokens before it equal to the context's last ones.
        Only the longest level with a verified occurrence is walked: its matches are the
        longest there are, up to the walk limit."""
        for level in range(len(LEVELS) - 1, -1, -1):
            n = LEVELS[level]
            if len(context) < n or self.end == self.floor:
                continue
            found = self._walk(level, self._head(level, self._key(n, context[-n:])), context, max_match)
            if found:
                return found
        return []

    def _walk(self, level: int, position: int, context: Sequence[int], max_match: int) -> list[tuple[int, int]]:
        """Follow the chain from `position`, measuring each occurrence's match backwards.
        The lookup's hot loop, hence the local names and the inlined comparison."""
        n, links, tokens, floor, modulus = LEVELS[level], self.links[level], self.tokens, self.floor, self.modulus
        tail = context[: -min(max_match, len(context)) - 1: -1]  # the context's last tokens, last first
        found = []
        for _ in range(MAX_WALK):
            if position < floor:
                break
            limit, length = min(len(tail), position - floor), 0
            while length < limit and tokens[(position - 1 - length) % modulus] == tail[length]:
                length += 1
            if length >= n:  # shorter: a hash collision
                found.append((position, length))
            distance = links[position % modulus]
            if distance == _NO_LINK:
                break
            position -= distance
        return found

    def continuation(self, position: int, count: int) -> list[int]:
        """Up to `count` tokens from `position` on, stopping at a separator or the end."""
        if position < self.floor:
            return []
        stop = min(self.end, position + count)
        out = [self.tokens[p % self.modulus] for p in range(position, stop)]
        return out[: out.index(SEPARATOR)] if SEPARATOR in out else out

    def read(self, start: int, stop: int) -> list[int]:
        """The readable tokens in [start, stop) (separators included)."""
        start, stop = max(start, self.floor), min(stop, self.end)
        return [self.tokens[p % self.modulus] for p in range(start, stop)]

    def nbytes(self) -> int:
        """Memory held by the arrays (a request's dict of heads counted at ~100 B a key)."""
        heads = sum(h.itemsize * len(h) if isinstance(h, array) else len(h) * 100 for h in self.heads)
        return self.tokens.itemsize * len(self.tokens) + sum(a.itemsize * len(a) for a in self.links) + heads

    # ---- helpers ----------------------------------------------------------------------

    def _key(self, n: int, ngram: Sequence[int]) -> int:
        key = hash((n, *ngram))
        return key & (self.num_buckets - 1) if self.num_buckets else key


def _bucket_count(capacity: int) -> int:
    """The power of two at or above the capacity: at most one n-gram per bucket on average in
    each level's table of a full ring, so collisions cost a few extra links at most."""
    return 1 << max(10, (capacity - 1).bit_length())
