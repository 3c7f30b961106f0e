"""Prefill pacing through the engine: a long prompt is cut into short chunks while others
decode, and the outputs do not change."""
from __future__ import annotations

from typing import Any

from specdec.llm import LLM
from tests.helpers import NGRAM, assert_all_blocks_free, greedy, random_prompts, token_ids


def test_paced_chunks_change_no_output(tiny_model_dir: Any) -> None:
    prompts = random_prompts(3, 6)
    prompts[2] = prompts[2] * 8  # one long prompt among short ones
    unpaced = LLM(str(tiny_model_dir), max_model_len=512, prefill_step_target_ms=0, speculative_config=None)
    expected = token_ids(unpaced.generate(prompts, greedy()))
    # A tiny target: every prefill that shares a step with a decode runs in minimum chunks.
    for spec in (None, NGRAM):
        paced = LLM(str(tiny_model_dir), max_model_len=512, prefill_step_target_ms=0.001, speculative_config=spec)
        assert token_ids(paced.generate(prompts, greedy())) == expected
        assert_all_blocks_free(paced)


def test_a_decoding_request_keeps_stepping_while_a_long_prompt_prefills(tiny_model_dir: Any) -> None:
    llm = LLM(str(tiny_model_dir), max_model_len=512, max_num_batched_tokens=256, prefill_step_target_ms=0.001)
    engine = llm.engine
    engine.add_request("short", [5, 6, 7], greedy(64))
    engine.step()  # short's prefill
    engine.add_request("long", list(range(10, 10 + 300)), greedy(4))
    steps_until_long_starts_decoding = 0
    while engine.scheduler.find("long") is None or not engine.scheduler.find("long").is_decoding:  # type: ignore[union-attr]
        outputs = engine.step()
        assert any(o.request_id == "short" for o in outputs)  # a token for short every step
        steps_until_long_starts_decoding += 1
    assert steps_until_long_starts_decoding > 2  # long's 300 tokens took several paced chunks
