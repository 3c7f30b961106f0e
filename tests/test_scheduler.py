"""The scheduler alone, with no model (as vLLM's tests/v1/core/test_scheduler.py): token
budgets, chunked prefill, draft grants asked while planning, preemption order, and the
KV blocks every plan reserves."""
from __future__ import annotations

from typing import Any

import pytest

from specdec.block_manager import BlockManager
from specdec.config import EngineConfig
from specdec.pacing import MIN_CHUNK, PrefillPacer
from specdec.request import Request, RequestStatus
from specdec.sampling_params import SamplingParams
from specdec.scheduler import ScheduledRequest, Scheduler
from specdec.spec.policy import DraftLimit, SpeculationPolicy

BLOCK = 4


def make_scheduler(num_blocks: int = 64, budget: int = 64, spec: dict[str, Any] | None = None,
                   policy: SpeculationPolicy | None = None, max_num_seqs: int = 8) -> Scheduler:
    config = EngineConfig(max_model_len=256, max_num_batched_tokens=budget, block_size=BLOCK,
                          max_num_seqs=max_num_seqs,
                          speculative_config=spec)  # type: ignore[arg-type]  # a dict, made a SpeculativeConfig
    return Scheduler(config, BlockManager(num_blocks, BLOCK, False), policy)


def make_request(request_id: str, prompt_len: int, max_tokens: int = 32) -> Request:
    return Request(request_id, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens), None,
                   max_tokens, set())


def run(items: list[ScheduledRequest], accepted: int = 0) -> None:
    """What the engine's commit does to a plain step: computed tokens advance, and every
    request with logits appends one token (after `accepted` drafts)."""
    for item in items:
        request = item.request
        completes = item.completes_prompt
        request.num_computed_tokens += item.num_new_tokens + (accepted if completes else 0)
        if completes:
            for token in range(accepted + 1):
                request.append_token(1000 + token)


def test_prefill_is_chunked_by_the_token_budget() -> None:
    scheduler = make_scheduler(budget=16)
    request = make_request("a", 40)
    scheduler.add(request)
    chunks = []
    while not request.is_decoding:
        items = scheduler.schedule()
        chunks.append([(i.request.request_id, i.num_new_tokens) for i in items])
        run(items)
    assert chunks == [[("a", 16)], [("a", 16)], [("a", 8)]]
    assert request.output_token_ids == [1000]  # the last chunk completes the prompt


def test_running_requests_go_first_and_waiting_ones_share_the_rest() -> None:
    scheduler = make_scheduler(budget=20)
    first = make_request("first", 12)
    scheduler.add(first)
    run(scheduler.schedule())  # first's whole prompt
    scheduler.add(make_request("second", 30))
    items = scheduler.schedule()
    assert [(i.request.request_id, i.num_new_tokens) for i in items] == [("first", 1), ("second", 19)]


def test_max_num_seqs_caps_admission() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    for i in range(3):
        scheduler.add(make_request(str(i), 5))
    items = scheduler.schedule()
    assert [i.request.request_id for i in items] == ["0", "1"]
    assert [r.request_id for r in scheduler.waiting] == ["2"]


def test_draft_limits_come_from_the_config_and_the_room() -> None:
    scheduler = make_scheduler(spec={"method": "ngram", "num_speculative_tokens": 5})
    short = make_request("short", 4, max_tokens=3)
    scheduler.add(short)
    run(scheduler.schedule())  # prefill: one output token, two more allowed
    (item,) = scheduler.schedule()
    # max_tokens 3, one out: a verify may commit at most 2 tokens, so 1 draft.
    assert (item.num_new_tokens, item.num_draft_tokens, item.max_depth) == (1, 1, 1)


def test_tree_limits_give_nodes_and_depth() -> None:
    scheduler = make_scheduler(spec={"method": "ngram", "num_speculative_tokens": 3, "num_tree_nodes": 10})
    scheduler.add(make_request("a", 4))
    run(scheduler.schedule())
    (item,) = scheduler.schedule()
    assert (item.num_draft_tokens, item.max_depth) == (10, 3)


class RecordingPolicy(SpeculationPolicy):
    """Grants fixed counts and records what the scheduler asked."""

    def __init__(self, grants: dict[str, int]) -> None:
        self.grants = grants
        self.asked: list[tuple[list[tuple[str, int, int]], int, int]] = []

    def grant(self, limits: list[DraftLimit], base_tokens: int, base_commits: int) -> list[int]:
        self.asked.append(([(lim.request.request_id, lim.num_draft_tokens, lim.max_depth) for lim in limits],
                           base_tokens, base_commits))
        return [self.grants[lim.request.request_id] for lim in limits]


def test_the_policy_is_asked_while_planning_and_no_draft_slot_is_reserved() -> None:
    policy = RecordingPolicy({"a": 0, "b": 2})
    scheduler = make_scheduler(spec={"method": "ngram", "num_speculative_tokens": 4}, policy=policy)
    a, b = make_request("a", 3), make_request("b", 3)
    scheduler.add(a)
    scheduler.add(b)
    run(scheduler.schedule())  # both prefills: not decoding yet, nothing asked
    assert policy.asked == []
    scheduler.add(make_request("c", 6))
    items = scheduler.schedule()
    # The policy sees the whole step: two decodes and c's prefill (which commits a token).
    assert policy.asked == [([("a", 4, 4), ("b", 4, 4)], 2 + 6, 3)]
    assert [(i.request.request_id, i.num_draft_tokens, i.max_depth) for i in items] == [
        ("a", 0, 0), ("b", 2, 2), ("c", 0, 0)]
    # KV is reserved for the known tokens only: draft slots are the engine's to reserve
    # once it knows what a step verifies (LLMEngine._reserve_drafts); most steps of open
    # text draft nothing, even where the policy granted a lookup.
    blocks = BlockManager(64, BLOCK, False)
    assert len(a.block_table) == blocks.blocks_needed(a.num_tokens)
    assert len(b.block_table) == blocks.blocks_needed(b.num_tokens) < blocks.blocks_needed(b.num_tokens + 2)
    with pytest.raises(AttributeError):
        items[0].num_draft_tokens = 3  # type: ignore[misc]  # the plan is final


def test_preemption_takes_the_newest_and_requeues_it_first() -> None:
    # 6 blocks of 4 tokens: two requests of 8 prompt tokens fill 4 blocks; growing both
    # past the pool forces the newest out.
    scheduler = make_scheduler(num_blocks=6)
    old, new = make_request("old", 8, max_tokens=64), make_request("new", 8, max_tokens=64)
    scheduler.add(old)
    scheduler.add(new)
    steps = 0
    while scheduler.num_preemptions == 0 and steps < 20:
        run(scheduler.schedule())
        steps += 1
    assert scheduler.num_preemptions == 1
    assert new.status == RequestStatus.WAITING and new.num_computed_tokens == 0
    assert scheduler.waiting[0] is new and scheduler.running == [old]
    assert new.block_table == []


def test_finish_frees_every_block() -> None:
    blocks = BlockManager(16, BLOCK, False)
    config = EngineConfig(max_model_len=256, block_size=BLOCK)
    scheduler = Scheduler(config, blocks)
    request = make_request("a", 10)
    scheduler.add(request)
    run(scheduler.schedule())
    scheduler.finish(request)
    assert blocks.num_free_blocks == 16 and not scheduler.has_unfinished()


def test_prefill_is_paced_only_while_others_decode() -> None:
    pacer = PrefillPacer(target_seconds=0.1, max_tokens=64)
    pacer.seconds_per_token = 0.005  # measured: 20 prefill tokens fit in 100 ms
    scheduler = make_scheduler(budget=64, policy=None)
    scheduler.pacer = pacer
    first = make_request("first", 40)
    scheduler.add(first)
    assert [i.num_new_tokens for i in scheduler.schedule()] == [40]  # alone: the whole prompt
    run([ScheduledRequest(first, 40)])
    scheduler.add(make_request("long", 100))
    items = scheduler.schedule()
    # first decodes, so long's chunk is cut to what fits the step's time target.
    assert [(i.request.request_id, i.num_new_tokens) for i in items] == [("first", 1), ("long", 20)]


def test_pacer_settles_where_the_step_meets_its_target() -> None:
    """Step = 30 ms of decode + 1 ms per prefill token, target 130 ms: 100 tokens a step."""
    pacer = PrefillPacer(target_seconds=0.13, max_tokens=2048)
    for _ in range(60):
        chunk = pacer.limit(others_decoding=True)
        pacer.observe(chunk, 0.030 + 0.001 * chunk)
    assert abs(pacer.limit(others_decoding=True) - 100) <= 2
    assert pacer.limit(others_decoding=False) == 2048
    assert PrefillPacer(0.0, 2048).limit(others_decoding=True) == 2048  # pacing off


def test_a_slow_machine_still_advances_a_long_prompt() -> None:
    pacer = PrefillPacer(target_seconds=0.01, max_tokens=2048)
    pacer.observe(100, 100.0)  # one second per token
    assert pacer.limit(others_decoding=True) == MIN_CHUNK
