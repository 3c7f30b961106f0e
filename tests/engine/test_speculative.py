"""Speculative decoding through the whole engine: lossless, batched, rolled back, counted."""
from __future__ import annotations

from pathlib import Path

import pytest

from specdec import SamplingParams
from specdec.llm import LLM
from tests.helpers import NGRAM, assert_all_blocks_free, block_bytes, greedy, random_prompts, step_mixed, token_ids


@pytest.fixture(scope="module")
def plain(tiny_model_dir: Path) -> LLM:
    return LLM(str(tiny_model_dir), max_model_len=256, speculative_config=None)


def spec_configs(tiny_model_dir: Path, tiny_draft_dir: Path) -> dict[str, dict]:
    return {"ngram": NGRAM,
            "draft_model": {"method": "draft_model", "num_speculative_tokens": 3, "model": str(tiny_draft_dir)},
            "suffix": {"method": "suffix", "num_speculative_tokens": 4, "num_tree_nodes": 8, "suffix_min_prob": 0.0}}


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_speculation_is_lossless(plain: LLM, tiny_model_dir: Path, tiny_draft_dir: Path, method: str) -> None:
    spec = LLM(str(tiny_model_dir), max_model_len=256,
               speculative_config=spec_configs(tiny_model_dir, tiny_draft_dir)[method])
    for seed in range(6):
        prompts = random_prompts(seed, 4)
        assert token_ids(spec.generate(prompts, greedy())) == token_ids(plain.generate(prompts, greedy()))
    metrics = spec.get_metrics()
    assert metrics["num_drafts"] > 0 and metrics["num_accepted_tokens"] > 0
    assert sum(metrics["num_accepted_tokens_per_pos"]) == metrics["num_accepted_tokens"]
    assert_all_blocks_free(spec)


@pytest.mark.parametrize("method", ["ngram", "draft_model", "suffix"])
def test_mixed_batch_with_chunked_prefill_and_preemption(plain: LLM, tiny_model_dir: Path, tiny_draft_dir: Path,
                                                         method: str) -> None:
    prompts = random_prompts(100, 6)
    expected = token_ids(plain.generate(prompts, greedy()))
    spec = LLM(str(tiny_model_dir), max_model_len=128, max_num_batched_tokens=24,
               kv_cache_memory=9 * block_bytes(plain),
               speculative_config=spec_configs(tiny_model_dir, tiny_draft_dir)[method])
    engine = spec.engine
    assert step_mixed(engine, prompts, greedy()) == expected
    assert spec.get_metrics()["num_preemptions"] > 0
    assert spec.get_metrics()["num_drafts"] > 0
    assert_all_blocks_free(spec)
    assert getattr(engine.drafter, "contexts", {}) == {}  # a drafter with per-request state freed every request


def test_draft_equal_to_target_accepts_everything(tiny_model_dir: Path) -> None:
    k = 3
    spec = LLM(str(tiny_model_dir), max_model_len=256,
               speculative_config={"method": "draft_model", "num_speculative_tokens": k, "model": str(tiny_model_dir)})
    max_tokens = 1 + 5 * (k + 1)  # every verify step has room for k full drafts
    for temperature in (0.0, 1.0):
        spec.generate(random_prompts(7, 3), SamplingParams(temperature=temperature, max_tokens=max_tokens,
                                                           ignore_eos=True, seed=3))
    m = spec.get_metrics()
    assert m["num_accepted_tokens"] == m["num_draft_tokens"] > 0
    assert m["acceptance_rate"] == 1.0
    assert m["mean_accepted_length"] == k + 1
    assert m["num_accepted_tokens_per_pos"] == [m["num_drafts"]] * k


def test_lookahead_near_max_model_len(plain: LLM, tiny_model_dir: Path) -> None:
    spec = LLM(str(tiny_model_dir), max_model_len=64, speculative_config=NGRAM)
    limited = LLM(str(tiny_model_dir), max_model_len=64)
    prompt = ([7, 8, 9] * 21)[:61]
    out = spec.generate([prompt], greedy(max_tokens=50))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3
    assert out.token_ids == limited.generate([prompt], greedy(max_tokens=50))[0].outputs[0].token_ids
    assert_all_blocks_free(spec)


def test_stops_inside_an_accepted_run(plain: LLM, tiny_model_dir: Path) -> None:
    spec = LLM(str(tiny_model_dir), max_model_len=256, speculative_config=NGRAM)
    prompts = random_prompts(11, 4)
    full = token_ids(plain.generate(prompts, greedy()))
    emitted = 0
    for prompt, ref in zip(prompts, full):
        stop_token = ref[len(ref) // 2]
        cut = ref[: ref.index(stop_token) + 1]
        out = spec.generate([prompt], greedy(stop_token_ids=[stop_token]))[0].outputs[0]
        assert out.token_ids == cut and out.finish_reason == "stop" and out.stop_reason == stop_token
        emitted += len(cut)
        for n in (1, 2, 3, 5):
            assert spec.generate([prompt], greedy(max_tokens=n))[0].outputs[0].token_ids == ref[:n]
            emitted += n
    assert spec.get_metrics()["num_generation_tokens"] == emitted  # nothing past a stop is counted
    assert_all_blocks_free(spec)


def test_stop_string_inside_an_accepted_run(plain: LLM, tiny_model_dir: Path) -> None:
    spec = LLM(str(tiny_model_dir), max_model_len=256, speculative_config=NGRAM)
    for prompt in random_prompts(12, 4):
        ref = plain.generate([prompt], greedy())[0].outputs[0].text
        stop = ref[len(ref) // 2 : len(ref) // 2 + 2]
        if not stop.strip() or "\ufffd" in stop:
            continue
        out = spec.generate([prompt], greedy(stop=[stop]))[0].outputs[0]
        assert out.text == ref[: ref.index(stop)] and out.finish_reason == "stop" and out.stop_reason == stop


def test_bad_speculative_config_is_named(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="unknown speculative_config keys"):
        LLM(str(tiny_model_dir), speculative_config={"method": "ngram", "k": 3})
    with pytest.raises(ValueError, match="is not one of"):
        LLM(str(tiny_model_dir), speculative_config={"method": "eagle"})
    with pytest.raises(ValueError, match="needs 'model'"):
        LLM(str(tiny_model_dir), speculative_config={"method": "draft_model"})


@pytest.mark.parametrize("attention", ["cpp", "torch"])
@pytest.mark.parametrize("method", ["ngram", "draft_model", "draft_tree"])
def test_verify_reproduces_decode_bit_for_bit(tiny_model_dir: Path, tiny_draft_dir: Path, method: str,
                                              attention: str) -> None:
    """With row-invariant linears (fp16) and attention, a verify row computes exactly what
    a decode step computes: the logprobs of every emitted token agree to the last bit."""
    plain = LLM(str(tiny_model_dir), max_model_len=256, linear_backend="cpp-fp16", attention_backend=attention,
                speculative_config=None)
    # The target as its own draft: long accepted runs, so many rows are verified.
    configs = {**spec_configs(tiny_model_dir, tiny_model_dir),
               "draft_tree": {"method": "draft_model", "num_speculative_tokens": 3, "num_tree_nodes": 8,
                              "model": str(tiny_model_dir)}}
    spec = LLM(str(tiny_model_dir), max_model_len=256, linear_backend="cpp-fp16", attention_backend=attention,
               speculative_config=configs[method])
    prompts = random_prompts(40, 4)
    params = greedy(logprobs=2)
    expected = [o.outputs[0].logprobs for o in plain.generate(prompts, params)]
    assert [o.outputs[0].logprobs for o in spec.generate(prompts, params)] == expected
    assert spec.get_metrics()["num_accepted_tokens"] > 0
