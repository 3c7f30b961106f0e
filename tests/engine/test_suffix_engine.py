"""Suffix decoding through the whole engine: lossless (batched, chunked prefill, preemption,
trees), and a repeated request drafted from the cross-request cache, unless sharing is off."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from specdec.llm import LLM
from tests.helpers import assert_all_blocks_free, greedy, random_prompts, token_ids

SUFFIX = {"method": "suffix", "num_speculative_tokens": 4}
SUFFIX_TREE = {**SUFFIX, "num_tree_nodes": 8, "suffix_min_prob": 0.0}


@pytest.fixture(scope="module")
def plain(tiny_model_dir: Path) -> LLM:
    return LLM(str(tiny_model_dir), max_model_len=256, speculative_config=None)


@pytest.mark.parametrize("config", [SUFFIX, SUFFIX_TREE, {**SUFFIX, "adaptive": True}],
                         ids=["chain", "tree", "adaptive"])
def test_greedy_suffix_decoding_is_lossless(plain: LLM, tiny_model_dir: Path, config: dict[str, Any]) -> None:
    spec = LLM(str(tiny_model_dir), max_model_len=256, speculative_config=config)
    for seed in range(4):
        prompts = random_prompts(seed, 4)
        assert token_ids(spec.generate(prompts, greedy())) == token_ids(plain.generate(prompts, greedy()))
    metrics = spec.get_metrics()
    assert metrics["num_drafts"] > 0
    if not config.get("adaptive"):  # the adaptive policy learns to grant few drafts on the tiny model
        assert metrics["num_accepted_tokens"] > 0
    assert_all_blocks_free(spec)


def accepted_and_drafted(llm: LLM, prompt: list[int]) -> tuple[list[int], int, int]:
    before = llm.get_metrics()
    output = llm.generate([prompt], greedy(max_tokens=48))[0].outputs[0].token_ids
    after = llm.get_metrics()
    return list(output), (after["num_accepted_tokens"] - before["num_accepted_tokens"]), \
        (after["num_draft_tokens"] - before["num_draft_tokens"])


@pytest.mark.parametrize("cross_request", [True, False])
def test_a_repeated_request_is_drafted_from_the_cache(plain: LLM, tiny_model_dir: Path, cross_request: bool) -> None:
    prompt = list(range(40, 90))  # no repeated n-gram: its own context offers nothing at first
    spec = LLM(str(tiny_model_dir), max_model_len=256,
               speculative_config={**SUFFIX, "suffix_cross_request": cross_request})
    first, accepted_first, drafted_first = accepted_and_drafted(spec, prompt)
    second, accepted_second, drafted_second = accepted_and_drafted(spec, prompt)
    assert first == second == token_ids(plain.generate([prompt], greedy(max_tokens=48)))[0]
    if cross_request:  # each step commits 4 drafts and a bonus token, but for the first request's last step
        assert accepted_second >= 0.7 * len(second) > 2 * accepted_first
        assert accepted_second >= 0.9 * drafted_second
    else:  # nothing of the first request reached the second
        assert (accepted_second, drafted_second) == (accepted_first, drafted_first)
    assert_all_blocks_free(spec)
