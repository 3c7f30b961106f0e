"""The engine's plain decoding: equals HF greedy, and batching changes nothing."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specdec import SamplingParams
from specdec.llm import LLM
from tests.helpers import assert_all_blocks_free, block_bytes, token_ids

PROMPTS = [
    "The quick brown fox",
    "def add(a, b):\n    return a + b\n" * 3,
    "Paris",
    "Speculative decoding drafts tokens and the target model verifies them in one pass. " * 4,
    "héllo wörld",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def hf_greedy(model_dir: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=None, min_new_tokens=max_new_tokens)
    return out[0, len(prompt_ids):].tolist()


def test_plain_greedy_matches_transformers(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), max_model_len=256, linear_backend="fp32", speculative_config=None)
    tok = llm.get_tokenizer()
    assert GREEDY.max_tokens is not None
    for prompt in PROMPTS[:3]:
        ids = tok.encode(prompt)
        ours = llm.generate([ids], GREEDY)[0].outputs[0].token_ids
        assert ours == hf_greedy(tiny_model_dir, ids, GREEDY.max_tokens)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_batched_equals_one_at_a_time(tiny_model_dir: Path, prefix_caching: bool) -> None:
    single = LLM(str(tiny_model_dir), max_model_len=256, speculative_config=None)
    expected = [token_ids(single.generate([p], GREEDY))[0] for p in PROMPTS]
    # A budget of 16 tokens forces chunked prefill; 12 blocks of 16 force preemption.
    batched = LLM(str(tiny_model_dir), max_model_len=192, max_num_batched_tokens=16, speculative_config=None,
                  kv_cache_memory=12 * block_bytes(single), enable_prefix_caching=prefix_caching)
    assert token_ids(batched.generate(PROMPTS, GREEDY)) == expected
    assert batched.get_metrics()["num_preemptions"] > 0
    assert_all_blocks_free(batched)
    if prefix_caching:  # a second pass hits the cache and still agrees
        assert token_ids(batched.generate(PROMPTS, GREEDY)) == expected
        assert_all_blocks_free(batched)


def test_prefix_cache_hits(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), max_model_len=256, enable_prefix_caching=True)
    shared = PROMPTS[3]
    first = llm.generate([shared + " one"], GREEDY)[0]
    second = llm.generate([shared + " two"], GREEDY)[0]
    assert first.metrics["num_cached_tokens"] == 0
    assert second.metrics["num_cached_tokens"] >= 16
    fresh = LLM(str(tiny_model_dir), max_model_len=256, speculative_config=None)
    assert second.outputs[0].token_ids == fresh.generate([shared + " two"], GREEDY)[0].outputs[0].token_ids
    assert_all_blocks_free(llm)


def test_results_in_input_order_with_n(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), max_model_len=256)
    params = SamplingParams(temperature=1.0, n=3, seed=7, max_tokens=8, ignore_eos=True)
    outs = llm.generate(PROMPTS[:2], params)
    assert [len(o.outputs) for o in outs] == [3, 3]
    assert [c.index for c in outs[0].outputs] == [0, 1, 2]
    again = llm.generate(PROMPTS[:2], params)
    assert [token_ids([o]) for o in outs] != [] and outs[1].outputs[2].token_ids == again[1].outputs[2].token_ids
    assert len({tuple(c.token_ids) for c in outs[0].outputs}) > 1


def test_prompt_over_max_model_len_is_rejected(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), max_model_len=32)
    with pytest.raises(ValueError, match=r"has 40 tokens but max_model_len is 32"):
        llm.generate([[5] * 40], GREEDY)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[5, 10**6]], GREEDY)
    assert_all_blocks_free(llm)
    out = llm.generate([[5] * 30], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 2


def test_unknown_architecture_fails_clearly(tmp_path: Path) -> None:
    import json

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel|gpt2"):
        LLM(str(tmp_path))


def test_each_token_costs_one_step(tiny_model_dir: Path) -> None:
    """Prefill once, then one decode step per token: nothing is recomputed."""
    llm = LLM(str(tiny_model_dir), max_model_len=256)
    llm.generate([PROMPTS[1]], GREEDY)
    assert llm.get_metrics()["num_steps"] == GREEDY.max_tokens


def test_outputs_report_first_token_latency(tiny_model_dir: Path) -> None:
    import time

    llm = LLM(str(tiny_model_dir), max_model_len=256, speculative_config=None)
    start = time.monotonic()
    out = llm.generate(PROMPTS[:2], GREEDY)
    wall = time.monotonic() - start
    latencies = [o.metrics["first_token_latency"] for o in out]
    assert all(0 < latency <= wall for latency in latencies)
    engine = llm.engine
    engine.add_request("queued", token_ids(out)[0][:4], SamplingParams(temperature=0.0, max_tokens=4))
    aborted = engine.abort_request("queued")
    assert aborted is not None
    assert "first_token_latency" not in aborted.metrics  # no token yet: not reported
