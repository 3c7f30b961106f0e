"""Prompt-lookup drafting: continue the longest recent n-gram match in the context."""
from __future__ import annotations

from specdec.drafters.base import Drafter, DraftRequest
from specdec.spec.tree import DraftTree


class NgramIndex:
    """For each n, the latest position following every n-gram seen so far.

    Built incrementally as the context grows, so a lookup costs O(max_n) however long
    the context is.
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self.reset()

    def reset(self) -> None:
        self.tables: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(self.min_n, self.max_n + 1)}
        self.num_indexed = 0  # continuation positions indexed so far

    def extend(self, tokens: list[int]) -> None:
        """Index every n-gram followed by at least one token (never the suffix itself)."""
        if len(tokens) < self.num_indexed:
            self.reset()  # history rewritten: rebuild
        for start in range(max(self.num_indexed, 1), len(tokens)):
            for n, table in self.tables.items():
                if start >= n:
                    table[tuple(tokens[start - n : start])] = start
        self.num_indexed = max(self.num_indexed, len(tokens))

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the longest earlier occurrence of the suffix."""
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            start = self.tables[n].get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start : start + k]
        return []


class NgramDrafter(Drafter):
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self.indexes: dict[str, NgramIndex] = {}

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        return [self._propose_one(r) for r in requests]

    def _propose_one(self, request: DraftRequest) -> DraftTree:
        index = self.indexes.get(request.request_id)
        if index is None:
            index = self.indexes[request.request_id] = NgramIndex(self.min_n, self.max_n)
        index.extend(request.token_ids)
        return DraftTree.chain([request.token_ids[-1], *index.lookup(request.token_ids, request.max_depth)])

    def free(self, request_id: str) -> None:
        self.indexes.pop(request_id, None)
