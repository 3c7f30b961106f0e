"""Warm-up: one short generation through a fresh engine before it serves anyone.

The first forward builds what is built lazily (the C++ kernels of kernels/cpu_build.py,
Triton's compiled kernels, a drafter's own model and buffers): seconds, on a fresh
$SPECDEC_HOME. `specdec serve` runs `warm_up` before its port opens, so its first
request, and the first /health that answers, find a ready engine.

The warm-up leaves no trace: its counters, the prefill pacer's timing estimate (the
first step's time includes the builds), the global random state and the prefix-cache
entries of its prompt are put back as they were, every KV block it took is free again,
and the drafter's cross-request cache (suffix decoding's) is emptied.
"""
from __future__ import annotations

import copy
import logging
import time
from typing import TYPE_CHECKING

import torch

from specdec.sampling_params import SamplingParams

if TYPE_CHECKING:
    from specdec.engine import LLMEngine

logger = logging.getLogger(__name__)

# Repeated, so that prompt-lookup drafters (ngram, suffix) find matches and propose.
WARM_UP_TEXT = "The quick brown fox jumps. " * 3
WARM_UP_PROMPT_TOKENS = 12  # a multi-token prefill, yet a single chunk under any token budget
WARM_UP_OUTPUT_TOKENS = 8  # a few decode and verify steps after the prefill
REQUEST_ID = "specdec-warm-up-{kind}"


def warm_up(engine: LLMEngine) -> float:
    """Run one speculative request (when the engine has a drafter) and one plain request,
    each with a multi-token prompt, to the end; then put the engine's counters and caches
    back. Returns the seconds it took. The engine must be idle (ValueError otherwise); a
    failed warm-up step raises RuntimeError."""
    if engine.has_unfinished_requests():
        raise ValueError("warm_up needs an idle engine: requests are still running")
    start = time.perf_counter()
    metrics, preemptions = copy.deepcopy(engine.metrics), engine.scheduler.num_preemptions
    seconds_per_token = engine.pacer.seconds_per_token
    cached_before = set(engine.block_manager.cached)
    lookups = engine.block_manager.num_prefix_queries, engine.block_manager.num_prefix_hits
    free_before = engine.block_manager.num_free_blocks
    with torch.random.fork_rng(devices=_cuda_devices(engine)):
        num_steps = _generate(engine)
    engine.metrics, engine.scheduler.num_preemptions = metrics, preemptions
    engine.pacer.seconds_per_token = seconds_per_token
    engine.block_manager.num_prefix_queries, engine.block_manager.num_prefix_hits = lookups
    engine.block_manager.forget_cached(cached_before)
    if engine.drafter is not None:  # a suffix drafter would otherwise draft from the warm-up's text
        engine.drafter.forget_cached()  # no later request hits the warm-up prompt
    if engine.block_manager.num_free_blocks != free_before:
        raise RuntimeError(f"the warm-up left {free_before - engine.block_manager.num_free_blocks} KV blocks "
                           "allocated")
    seconds = time.perf_counter() - start
    logger.info("warm-up: %d engine steps in %.2f s", num_steps, seconds)
    return seconds


def _generate(engine: LLMEngine) -> int:
    """The warm-up requests, run to the end; the number of steps taken."""
    prompt = warm_up_prompt(engine)
    params = SamplingParams(temperature=0.0, max_tokens=WARM_UP_OUTPUT_TOKENS, ignore_eos=True)
    engine.add_request(REQUEST_ID.format(kind="speculative"), prompt, params, use_speculation=True)
    engine.add_request(REQUEST_ID.format(kind="plain"), prompt[::-1], params, use_speculation=False)
    num_steps = 0
    try:
        while engine.has_unfinished_requests():
            num_steps += 1
            for output in engine.step():
                if output.error is not None:
                    raise RuntimeError(f"the warm-up generation failed: {output.error}")
    finally:
        for kind in ("speculative", "plain"):
            engine.abort_request(REQUEST_ID.format(kind=kind))  # a no-op for a finished request
    return num_steps


def warm_up_prompt(engine: LLMEngine) -> list[int]:
    """WARM_UP_PROMPT_TOKENS tokens of ordinary text, fewer when max_model_len is tiny."""
    ids = list(engine.tokenizer.encode(WARM_UP_TEXT, add_special_tokens=False)) or [0]
    length = max(1, min(WARM_UP_PROMPT_TOKENS, engine.max_model_len // 2))
    return [ids[i % len(ids)] for i in range(length)]


def _cuda_devices(engine: LLMEngine) -> list[int]:
    """The CUDA device whose random state fork_rng keeps (none on CPU)."""
    device = engine.device
    if device.type != "cuda":
        return []
    return [device.index if device.index is not None else torch.cuda.current_device()]
