"""A KV pool far too small for the offered load (24 requests wanting ~12x the pool):
every request completes with the same greedy tokens as with ample KV, the pool ends all
free, and nobody starves: the scheduler serves the oldest request first and preempts the
newest, so the oldest unfinished request is scheduled on every step and never preempted.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from specdec.llm import LLM
from specdec.sampling_params import SamplingParams
from specdec.scheduler import ScheduledRequest
from tests.helpers import assert_all_blocks_free, block_bytes, random_prompts

NUM_REQUESTS = 24
MAX_TOKENS = 40
MAX_MODEL_LEN = 96  # 6 blocks of 16: one request always fits in the small pool
SMALL_POOL = 10  # blocks; each request grows to up to 6
AMPLE_POOL = NUM_REQUESTS * 7
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@dataclass
class Trace:
    """What happened to each request of one run, step by step."""

    ids: list[str]
    outputs: dict[str, list[int]] = field(default_factory=dict)
    finish_step: dict[str, int] = field(default_factory=dict)
    preemptions: list[tuple[str, str]] = field(default_factory=list)  # (victim, oldest unfinished then)
    starved_steps: list[int] = field(default_factory=list)  # the oldest unfinished was not scheduled
    step: int = 0

    def oldest_unfinished(self) -> str:
        return next(rid for rid in self.ids if rid not in self.finish_step)


def instrument(llm: LLM, trace: Trace) -> None:
    """Wrap the scheduler's preempt and schedule to record victims and starved steps."""
    scheduler = llm.engine.scheduler
    preempt, schedule = scheduler.preempt, scheduler.schedule

    def recording_preempt(request: Any) -> None:
        trace.preemptions.append((request.request_id, trace.oldest_unfinished()))
        preempt(request)

    def checking_schedule() -> list[ScheduledRequest]:
        batch = schedule()
        if trace.oldest_unfinished() not in {item.request.request_id for item in batch}:
            trace.starved_steps.append(trace.step)
        return batch

    scheduler.preempt = recording_preempt  # type: ignore[method-assign]
    scheduler.schedule = checking_schedule  # type: ignore[method-assign]


def run(llm: LLM, prompts: list[list[int]]) -> Trace:
    """Submit every request at once (ids in arrival order), then step to the end."""
    trace = Trace([f"r{i:02d}" for i in range(len(prompts))])
    instrument(llm, trace)
    for rid, prompt in zip(trace.ids, prompts):
        llm.engine.add_request(rid, prompt, GREEDY)
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            if out.finished:
                assert out.outputs[0].finish_reason == "length", out
                trace.outputs[out.request_id] = out.outputs[0].token_ids
                trace.finish_step[out.request_id] = trace.step
        trace.step += 1
    return trace


def engine(model_dir: Any, blocks: int, speculative: dict[str, Any] | None) -> LLM:
    probe = LLM(str(model_dir), max_model_len=MAX_MODEL_LEN, kv_cache_memory=AMPLE_POOL * 8192)
    return LLM(str(model_dir), max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=64,
               kv_cache_memory=blocks * block_bytes(probe), speculative_config=speculative)


@pytest.mark.parametrize("speculative", [None, NGRAM], ids=["plain", "ngram"])
def test_exhausted_kv_completes_everything_in_order(tiny_model_dir: Any, speculative: dict[str, Any] | None) -> None:
    # Prompts of 3..64 tokens plus 40 outputs: 24 requests want ~140 blocks of a 10-block pool.
    prompts = random_prompts(seed=3, count=NUM_REQUESTS)
    ample = run(engine(tiny_model_dir, AMPLE_POOL, speculative), prompts)
    small_llm = engine(tiny_model_dir, SMALL_POOL, speculative)
    assert small_llm.engine.block_manager.num_blocks == SMALL_POOL
    small = run(small_llm, prompts)

    assert ample.preemptions == [] and len(small.preemptions) >= NUM_REQUESTS  # the pool really ran out
    assert small.outputs == ample.outputs and len(small.outputs) == NUM_REQUESTS
    assert_all_blocks_free(small_llm)
    assert small_llm.get_metrics()["num_preemptions"] == len(small.preemptions)
    # No starvation: the oldest unfinished request is never the victim and runs every step.
    assert all(victim != oldest for victim, oldest in small.preemptions)
    assert small.starved_steps == []
    if speculative is None:
        # One token per step each, oldest served first: requests finish in arrival order
        # (several may finish on the same step).
        steps = [small.finish_step[rid] for rid in small.ids]
        assert steps == sorted(steps)


def test_draft_slots_are_reserved_once_drafted_and_a_full_pool_cuts_the_draft(tiny_model_dir: Any) -> None:
    """The scheduler reserves KV for known tokens only; the engine reserves a tree's draft
    slots once it is drafted, and where the pool has no room the tree is cut to its root
    (a draft never preempts a request)."""
    from specdec.request import Request
    from specdec.spec.tree import DraftTree

    llm = engine(tiny_model_dir, AMPLE_POOL, NGRAM)
    core, blocks = llm.engine, llm.engine.block_manager
    request = Request("r", list(range(1, 15)), SamplingParams(max_tokens=8), None, 8, set())  # 14 tokens
    request.num_computed_tokens = 14
    blocks.allocate(request, 0)
    item = ScheduledRequest(request, 1, 4, 4)
    held = len(request.block_table)
    drafted = DraftTree.chain([5, 6, 7, 8])
    assert core._reserve_drafts([item], [drafted]) == [drafted]
    assert len(request.block_table) == blocks.blocks_needed(14 + 1 + 3) > held
    blocks.truncate(request, 14)
    taken = [blocks._take_free() for _ in range(blocks.num_free_blocks)]  # nothing left
    cut = core._reserve_drafts([item], [drafted])[0]
    assert cut.token_ids == [5] and len(request.block_table) == held
    for block in taken:
        blocks._release(block.block_id)
    blocks.free(request)
