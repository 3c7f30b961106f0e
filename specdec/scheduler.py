"""Continuous batching under one token budget (vLLM v1 style).

Every scheduled request simply gets some number of new tokens: a prefill chunk, one
decode token, or one token plus lookahead slots for draft tokens to verify. Running
requests go first (oldest first); when KV blocks run out the newest running request is
preempted and later recomputed from scratch.

No request starves: waiting requests are admitted strictly from the front (admission
stops at the first that does not fit), and victims, taken newest first, go back to the
front, so the queue stays in arrival order and every running request arrived before
every waiting one. The oldest unfinished request is therefore always running, scheduled
first and never the victim (tests/engine/test_kv_exhaustion.py checks this).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specdec.block_manager import BlockManager
from specdec.config import EngineConfig, SpeculativeConfig
from specdec.request import Request, RequestStatus

if TYPE_CHECKING:
    from specdec.drafters.tree import DraftTree


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # known tokens to run (prefill chunk or the last sampled token)
    num_lookahead: int = 0  # slots reserved for draft tokens (or tree nodes)
    max_depth: int = 0  # draft tokens that can still be committed this step
    draft_token_ids: list[int] = field(default_factory=list)
    tree: DraftTree | None = None  # a draft tree; its root is the one new token

    @property
    def num_query_tokens(self) -> int:
        if self.tree is not None:
            return self.tree.num_nodes
        return self.num_new_tokens + len(self.draft_token_ids)

    @property
    def completes_prompt(self) -> bool:
        """After this step every known token is computed: logits are needed."""
        req = self.request
        return req.num_computed_tokens + self.num_new_tokens == req.num_tokens


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.spec: SpeculativeConfig | None = config.speculative_config
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledRequest]:
        budget = self.config.max_num_batched_tokens
        scheduled, budget, preempted = self._schedule_running(budget)
        if not preempted:
            scheduled += self._schedule_waiting(budget)
        return scheduled

    def _schedule_running(self, budget: int) -> tuple[list[ScheduledRequest], int, bool]:
        scheduled: list[ScheduledRequest] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            item = self._plan(request, budget)
            if not self._reserve(item):
                preempted = True
                continue  # the list shrank from the end; retry the same request
            scheduled.append(item)
            budget -= item.num_new_tokens + item.num_lookahead
            i += 1
        return scheduled, budget, preempted

    def _reserve(self, item: ScheduledRequest) -> bool:
        """Allocate blocks for the item, preempting the newest requests as needed."""
        tokens = item.num_new_tokens + item.num_lookahead
        while not self.block_manager.can_allocate(item.request, tokens):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is item.request:
                return False
        self.block_manager.allocate(item.request, tokens)
        return True

    def _plan(self, request: Request, budget: int) -> ScheduledRequest:
        num_new = min(request.num_tokens - request.num_computed_tokens, budget)
        if self.spec is None or not (request.is_decoding and request.use_speculation):
            return ScheduledRequest(request, num_new)
        depth = max(0, min(self.spec.num_speculative_tokens, budget - 1, self._room(request)))
        slots = min(self.spec.num_tree_nodes, budget - 1) if self.spec.num_tree_nodes else depth
        return ScheduledRequest(request, num_new, slots if depth else 0, min(depth, slots))

    def _room(self, request: Request) -> int:
        """Draft tokens that can still be committed: the step commits accepted + 1."""
        by_length = self.config.max_model_len - request.num_tokens - 1
        by_max_tokens = request.max_tokens - request.num_output_tokens - 1
        return min(by_length, by_max_tokens)

    def _schedule_waiting(self, budget: int) -> list[ScheduledRequest]:
        scheduled: list[ScheduledRequest] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            self.block_manager.match_prefix(request)
            item = ScheduledRequest(request, min(request.num_tokens - request.num_computed_tokens, budget))
            if not self.block_manager.can_allocate(request, item.num_new_tokens):
                self._unmatch(request)
                break
            self.block_manager.allocate(request, item.num_new_tokens)
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(item)
            budget -= item.num_new_tokens
        return scheduled

    def _unmatch(self, request: Request) -> None:
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.num_cached_tokens = 0

    def preempt(self, request: Request) -> None:
        """Drop the request's KV; it is recomputed (prompt + output so far) later."""
        self.running.remove(request)
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def finish(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.block_manager.free(request)
        request.status = RequestStatus.FINISHED

    def find(self, request_id: str) -> Request | None:
        for request in [*self.running, *self.waiting]:
            if request.request_id == request_id:
                return request
        return None
