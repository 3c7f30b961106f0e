"""Tree speculation through the engine: Medusa (Medusa-1 and recurrent heads) and draft-model chains
and trees are lossless."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from specdec.drafters.draft_model import DraftModelDrafter
from specdec.drafters.recurrent_drafter import RecurrentDrafter
from specdec.llm import LLM
from tests.helpers import assert_all_blocks_free, block_bytes, greedy, random_prompts, token_ids


def medusa(heads_dir: Path, **extra: object) -> dict[str, Any]:
    """A method: medusa config for Medusa-1 or recurrent heads in heads_dir."""
    return {"method": "medusa", "num_speculative_tokens": 3, "model": str(heads_dir), **extra}


def test_medusa_chain_and_tree_are_lossless(tiny_model_dir: Path, tiny_medusa_dir: Path) -> None:
    plain = LLM(str(tiny_model_dir), max_model_len=256, speculative_config=None)
    chain = LLM(str(tiny_model_dir), max_model_len=256, speculative_config=medusa(tiny_medusa_dir))
    tree = LLM(str(tiny_model_dir), max_model_len=256,
               speculative_config=medusa(tiny_medusa_dir, num_tree_nodes=12,
                                         tree_choices=[[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [2, 0],
                                                       [0, 2], [1, 1], [0, 0, 1], [0, 1, 0]]))
    for seed in range(4):
        prompts = random_prompts(seed, 4)
        expected = token_ids(plain.generate(prompts, greedy()))
        assert token_ids(chain.generate(prompts, greedy())) == expected
        assert token_ids(tree.generate(prompts, greedy())) == expected
    for llm in (chain, tree):
        assert llm.get_metrics()["num_drafts"] > 0
        assert_all_blocks_free(llm)


@pytest.mark.parametrize("heads, seed", [("tiny_medusa_dir", 5), ("tiny_recurrent_dir", 6)])
def test_chain_as_tree_equals_chain(tiny_model_dir: Path, request: pytest.FixtureRequest, heads: str,
                                    seed: int) -> None:
    heads_dir = request.getfixturevalue(heads)
    chain = LLM(str(tiny_model_dir), max_model_len=256, speculative_config=medusa(heads_dir))
    as_tree = LLM(str(tiny_model_dir), max_model_len=256,
                  speculative_config=medusa(heads_dir, num_tree_nodes=3, tree_choices=[[0], [0, 0], [0, 0, 0]]))
    # Greedy here; tests/spec/test_tree_rejection.py checks the stochastic chain equivalence.
    prompts = random_prompts(seed, 4)
    assert token_ids(as_tree.generate(prompts, greedy())) == token_ids(chain.generate(prompts, greedy()))
    a, b = chain.get_metrics(), as_tree.get_metrics()
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos"):
        assert a[key] == b[key]


def test_tree_with_chunked_prefill_and_preemption(tiny_model_dir: Path, tiny_medusa_dir: Path) -> None:
    plain = LLM(str(tiny_model_dir), max_model_len=128, speculative_config=None)
    prompts = random_prompts(21, 6)
    expected = token_ids(plain.generate(prompts, greedy()))
    tree = LLM(str(tiny_model_dir), max_model_len=128, max_num_batched_tokens=32,
               kv_cache_memory=10 * block_bytes(plain),
               speculative_config=medusa(tiny_medusa_dir, num_tree_nodes=8))
    assert token_ids(tree.generate(prompts, greedy())) == expected
    assert tree.get_metrics()["num_preemptions"] > 0
    assert_all_blocks_free(tree)


def test_draft_model_tree_is_lossless(tiny_model_dir: Path, tiny_draft_dir: Path) -> None:
    plain = LLM(str(tiny_model_dir), max_model_len=256, speculative_config=None)
    tree = LLM(str(tiny_model_dir), max_model_len=256, max_num_batched_tokens=64,
               speculative_config={"method": "draft_model", "model": str(tiny_draft_dir),
                                   "num_speculative_tokens": 3, "num_tree_nodes": 10})
    for seed in range(3):
        prompts = random_prompts(seed + 30, 4)
        assert token_ids(tree.generate(prompts, greedy())) == token_ids(plain.generate(prompts, greedy()))
    assert tree.get_metrics()["num_drafts"] > 0
    assert_all_blocks_free(tree)
    assert isinstance(tree.engine.drafter, DraftModelDrafter)
    bm = tree.engine.drafter.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # the drafter's own pool is clean too


def test_recurrent_heads_chain_and_tree_are_lossless(tiny_model_dir: Path, tiny_recurrent_dir: Path) -> None:
    plain = LLM(str(tiny_model_dir), max_model_len=256, speculative_config=None)
    chain = LLM(str(tiny_model_dir), max_model_len=256, speculative_config=medusa(tiny_recurrent_dir))
    tree = LLM(str(tiny_model_dir), max_model_len=256, max_num_batched_tokens=64,
               speculative_config=medusa(tiny_recurrent_dir, num_tree_nodes=10,
                                            tree_choices=[[0], [1], [0, 0], [2], [0, 1], [1, 0], [0, 0, 0], [1, 1],
                                                          [0, 0, 1], [2, 0]]))
    dynamic = LLM(str(tiny_model_dir), max_model_len=256, max_num_batched_tokens=64,
                  speculative_config=medusa(tiny_recurrent_dir, num_tree_nodes=10))
    for seed in range(4):
        prompts = random_prompts(seed + 40, 4)
        expected = token_ids(plain.generate(prompts, greedy()))
        assert token_ids(chain.generate(prompts, greedy())) == expected
        assert token_ids(tree.generate(prompts, greedy())) == expected
        assert token_ids(dynamic.generate(prompts, greedy())) == expected
    assert isinstance(dynamic.engine.drafter, RecurrentDrafter) and isinstance(tree.engine.drafter, RecurrentDrafter)
    assert dynamic.engine.drafter.dynamic and not tree.engine.drafter.dynamic
    for llm in (chain, tree, dynamic):
        assert llm.get_metrics()["num_accepted_tokens"] > 0
        assert_all_blocks_free(llm)


def test_recurrent_heads_sample_and_free_every_block(tiny_model_dir: Path, tiny_recurrent_dir: Path) -> None:
    from specdec import SamplingParams

    params = SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=24, ignore_eos=True)
    for extra in ({}, {"num_tree_nodes": 8}):
        llm = LLM(str(tiny_model_dir), max_model_len=256, speculative_config=medusa(tiny_recurrent_dir, **extra))
        outs = llm.generate(random_prompts(50, 4), params)
        assert [len(o.outputs[0].token_ids) for o in outs] == [24] * 4
        assert llm.get_metrics()["num_draft_tokens"] > 0
        assert_all_blocks_free(llm)
