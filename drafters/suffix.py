"""Suffix decoding (SuffixDecoding, NeurIPS 2025; vLLM's method "suffix"): draft the most
frequent continuations of the context's longest matched suffix, found in the request's own
prompt and output and in a cache of earlier requests' outputs.

Each step: the request's index takes the tokens committed since its last step (a few hash
writes each); the longest suffix of the context that occurred before is looked up in it
and in the cache (a bounded walk in C++, see suffix_index.py; one call reads the context
from the request's index, walks both stores and reads the continuations, so that a step
that finds nothing costs a few microseconds); the occurrences whose match is that long
are the evidence. Their continuations, each at most `suffix_spec_factor` times
the match length deep (a long match is trusted further), form a trie with counts, emitted
best-first by empirical probability with nodes under `suffix_min_prob` dropped
(suffix_tree.py). The step's num_draft_tokens and max_depth bound the tree.

A request's tokens enter the cache when the engine frees it, finished or aborted alike:
`free` cannot tell them apart, and an aborted request's output is the target's output
all the same. What is cached is what `propose` last saw: the tokens committed by the
final step are missing, and a request the drafter never saw (no speculation granted) is
not cached. With suffix_cross_request False, or suffix_cache_max_requests 0, there is no
cache: nothing of one request reaches another.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from specdec.config import SpeculativeConfig
from specdec.drafters.base import Drafter, DraftRequest
from specdec.drafters.suffix_cache import SuffixCache
from specdec.drafters.suffix_index import Lookup, SuffixIndex, native_index
from specdec.drafters.suffix_tree import build_draft
from specdec.spec.tree import DraftTree, ScoredDraft


@dataclass
class RequestContext:
    """What the drafter keeps of one running request."""

    index: SuffixIndex  # its prompt and committed output
    output_start: int  # where its output begins, as far as the first propose could tell


@dataclass(frozen=True)
class SuffixDraft:
    """A suffix draft and the length of the match it continues (0: none found), which says
    more about its worth than its nodes' frequencies do (hybrid.py calibrates by it)."""

    scored: ScoredDraft
    match_length: int


class SuffixDrafter(Drafter):
    def __init__(self, spec: SpeculativeConfig, clock: Callable[[], float] = time.monotonic) -> None:
        native_index()  # built now: without a C++ compiler the engine fails to start, not each request's draft
        self.max_match = spec.suffix_max_depth
        self.spec_factor = spec.suffix_spec_factor
        self.min_prob = spec.suffix_min_prob
        shared = spec.suffix_cross_request and spec.suffix_cache_max_requests > 0
        self.cache = (SuffixCache(spec.suffix_cache_max_requests, spec.suffix_cache_max_tokens,
                                  spec.suffix_cache_ttl_s, clock) if shared else None)
        self.contexts: dict[str, RequestContext] = {}

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        return [self.draft(request).scored.tree for request in requests]

    def draft(self, request: DraftRequest) -> SuffixDraft:
        """The request's draft tree, each node's empirical probability and the match length."""
        return self.build(request, self.lookup(request))

    def lookup(self, request: DraftRequest) -> Lookup:
        """Index the tokens committed since the request's last step and find its evidence:
        the occurrences, in its own context and the cache, of the context's longest suffix
        that occurred anywhere (own ones first, then newest first), with their continuations.
        One native call: most steps of open text find nothing."""
        token_ids = request.token_ids
        state = self.contexts.get(request.request_id)
        if state is None or len(token_ids) < state.index.end:  # new, or its history was rewritten
            # The root is the first output token when a request is first seen right after its prefill.
            state = self.contexts[request.request_id] = RequestContext(SuffixIndex(), len(token_ids) - 1)
        new = token_ids[state.index.end:]
        cache = None if self.cache is None else self.cache.live_index()
        return state.index.lookup(cache, self.max_match, request.max_depth, self.spec_factor, new)

    def build(self, request: DraftRequest, found: Lookup) -> SuffixDraft:
        """The draft tree of a lookup's continuations (bounded by the request's budget)."""
        return SuffixDraft(build_draft(request.token_ids[-1], found.continuations, request.num_draft_tokens,
                                       self.min_prob), found.match_length)

    def forget_cached(self) -> None:
        if self.cache is not None:
            self.cache.clear()

    def free(self, request_id: str) -> None:
        """Forget the request; its output (and the prompt tokens just before it) go to the cache."""
        state = self.contexts.pop(request_id, None)
        if state is None or self.cache is None:
            return
        start = max(0, state.output_start - self.max_match)
        self.cache.add(state.index.read(start, state.index.end))
