"""Continuous batching under one token budget (vLLM v1 style).

Every scheduled request simply gets some number of new tokens: a prefill chunk, one
decode token, or one token plus the draft tokens the speculation policy grants it. The
policy is asked once the step's requests are known (it weighs drafts against the whole
step's cost), and each ScheduledRequest is built once, from its grant: nothing edits it
afterwards. Running requests go
first (oldest first); when KV blocks run out the newest running request is preempted
and later recomputed from scratch.

No request starves: waiting requests are admitted strictly from the front (admission
stops at the first that does not fit), and victims, taken newest first, go back to the
front, so the queue stays in arrival order and every running request arrived before
every waiting one. The oldest unfinished request is therefore always running, scheduled
first and never the victim (tests/engine/test_kv_exhaustion.py checks this).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from specdec.block_manager import BlockManager
from specdec.config import EngineConfig, SpeculativeConfig
from specdec.pacing import PrefillPacer
from specdec.request import Request, RequestStatus
from specdec.spec.policy import DraftLimit, FixedSpeculation, SpeculationPolicy
from specdec.spec.tree import DraftTree

PENDING_ROOT = 0  # the root id a step is laid out with while the real one is on the device


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step. The step's query for it is its known tokens up to
    the last one, then its draft tree, whose root is that last known token."""

    request: Request
    num_new_tokens: int  # known tokens to run (prefill chunk or the last sampled token)
    num_draft_tokens: int = 0  # draft tree nodes beyond the root granted (KV slots: reserved once drafted)
    max_depth: int = 0  # the longest draft path that can still be committed this step

    def num_query_tokens(self, tree: DraftTree) -> int:
        """Rows this request adds to the forward: its known tokens before the root, then the tree."""
        return self.num_new_tokens - 1 + tree.num_nodes

    @property
    def root_token(self) -> int:
        """The last known token this step runs: the root of the request's draft tree;
        PENDING_ROOT when that token is still on the device (overlap scheduling: the model
        runner feeds it there, see specdec/overlap.py)."""
        req = self.request
        index = req.num_computed_tokens + self.num_new_tokens - 1
        return req.all_token_ids[index] if index < len(req.all_token_ids) else PENDING_ROOT

    @property
    def completes_prompt(self) -> bool:
        """After this step every known token is computed: logits are needed."""
        req = self.request
        return req.num_computed_tokens + self.num_new_tokens == req.num_tokens


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager,
                 policy: SpeculationPolicy | None = None, pacer: PrefillPacer | None = None) -> None:
        self.config = config
        self.block_manager = block_manager
        self.spec: SpeculativeConfig | None = config.speculative_config
        self.policy = policy or FixedSpeculation()
        self.pacer = pacer or PrefillPacer.from_config(config)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledRequest]:
        budget = _StepBudget(self.config.max_num_batched_tokens,
                             self.pacer.limit(others_decoding=any(r.is_decoding for r in self.running)))
        running, preempted = self._schedule_running(budget)
        admitted = [] if preempted else self._schedule_waiting(budget)
        grants = self._grant(running, admitted)
        return [ScheduledRequest(request, num_new, drafts, min(limit.max_depth, drafts) if limit else 0)
                for (request, num_new, limit), drafts in zip(running, grants)] + admitted

    def _schedule_running(self, budget: _StepBudget) -> tuple[list[tuple[Request, int, DraftLimit | None]], bool]:
        """Known tokens and draft limit per running request, oldest first, while the token
        budget lasts; KV blocks are reserved for the known tokens (draft slots by the engine,
        for the drafts a step verifies: most steps of open text draft nothing)."""
        planned: list[tuple[Request, int, DraftLimit | None]] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget.tokens > 0:
            request = self.running[i]
            num_new = 0 if request.ends_when_settled else budget.chunk(request)
            if num_new == 0:  # a prefill, and the step's prefill share is spent (or nothing left to run)
                i += 1
                continue
            limit = self._draft_limit(request, budget.tokens)
            if not self._reserve(request, num_new):
                preempted = True
                continue  # the list shrank from the end; retry the same index
            planned.append((request, num_new, limit))
            budget.take(request, num_new, limit.num_draft_tokens if limit else 0)
            i += 1
        return planned, preempted

    def _grant(self, running: list[tuple[Request, int, DraftLimit | None]],
               admitted: list[ScheduledRequest]) -> list[int]:
        """Draft tokens per running request, from the policy, which sees the whole step."""
        limits = [limit for _, _, limit in running if limit is not None]
        base_tokens = sum(num_new for _, num_new, _ in running) + sum(i.num_new_tokens for i in admitted)
        base_commits = (sum(r.num_computed_tokens + num_new == r.num_tokens for r, num_new, _ in running)
                        + sum(i.completes_prompt for i in admitted))
        grants = iter(self.policy.grant(limits, base_tokens, base_commits) if limits else [])
        return [next(grants) if limit is not None else 0 for _, _, limit in running]

    def _draft_limit(self, request: Request, budget: int) -> DraftLimit | None:
        if self.spec is None or not (request.is_decoding and request.use_speculation):
            return None
        depth = max(0, min(self.spec.num_speculative_tokens, budget - 1, self._room(request)))
        if depth == 0:
            return None
        nodes = min(self.spec.num_tree_nodes, budget - 1) if self.spec.num_tree_nodes else depth
        return DraftLimit(request, nodes, min(depth, nodes))

    def _reserve(self, request: Request, tokens: int) -> bool:
        """Allocate blocks for `tokens` more, preempting the newest requests as needed."""
        while not self.block_manager.can_allocate(request, tokens):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is request:
                return False
        self.block_manager.allocate(request, tokens)
        return True

    def _room(self, request: Request) -> int:
        """Draft tokens that can still be committed: the step commits accepted + 1."""
        by_length = self.config.max_model_len - request.num_tokens - 1
        by_max_tokens = request.max_tokens - request.num_output_tokens - request.num_pending - 1
        return min(by_length, by_max_tokens)

    def _schedule_waiting(self, budget: _StepBudget) -> list[ScheduledRequest]:
        scheduled: list[ScheduledRequest] = []
        while self.waiting and budget.tokens > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.num_pending:  # preempted with a token on the device: recomputed once it is read
                break
            self.block_manager.match_prefix(request)
            item = ScheduledRequest(request, budget.chunk(request))
            if item.num_new_tokens == 0 or not self.block_manager.can_allocate(request, item.num_new_tokens):
                self._unmatch(request)
                break
            self.block_manager.allocate(request, item.num_new_tokens)
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(item)
            budget.take(request, item.num_new_tokens, 0)
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


class _StepBudget:
    """What is left of one step's tokens, and of the share prefill chunks may take."""

    def __init__(self, tokens: int, prefill_tokens: int) -> None:
        self.tokens = tokens
        self.prefill_tokens = prefill_tokens

    def chunk(self, request: Request) -> int:
        """Known tokens to run for the request: all it has, within what is left (0: none)."""
        remaining = request.num_tokens - request.num_computed_tokens
        if remaining == 1:  # decoding: never held back by prefill pacing
            return min(1, self.tokens)
        return max(0, min(remaining, self.tokens, self.prefill_tokens))

    def take(self, request: Request, num_new: int, num_draft_tokens: int) -> None:
        self.tokens -= num_new + num_draft_tokens
        if request.num_tokens - request.num_computed_tokens > 1:
            self.prefill_tokens -= num_new
