"""End-to-end on the real default model (pulled and converted once per machine)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specdec import SamplingParams
from specdec.llm import LLM
from specdec.model_registry import DEFAULT_MODEL

CHATS = [
    "Explain in detail how a bicycle works, covering the frame, the wheels, the gears and the brakes.",
    "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring.",
    "Rewrite this code with clearer names:\n\ndef f(a, b):\n    c = []\n    for x in a:\n"
    "        if x in b:\n            c.append(x)\n    return c\n",
    "Summarise this text: The city council met on Tuesday to discuss the new park. Residents asked for "
    "more trees, a playground and better lighting. The council agreed to fund the playground this year "
    "and to plan the lighting for next year.",
    "List five tips for learning a new language and explain each one in a sentence.",
    "What is photosynthesis? Answer for a ten-year-old.",
    "Translate to French: The weather is nice today and we are going to the beach.",
    "A shop sells apples at 3 dollars each. Tom buys 4 apples and pays with a 20 dollar bill. "
    "How much change does he get? Think step by step.",
    # A copy: suffix decoding surely drafts it (open chat alone may draft nothing in 64 tokens
    # when the start-up calibration prices a verify row high, which failed the default's test).
    "Repeat this paragraph exactly, word for word: The old lighthouse stood on the rocky cliff above the "
    "harbour. Every night its keeper climbed the narrow stairs, lit the great lamp and watched the ships "
    "come home safely through the fog.",
]
MAX_TOKENS = 64
SHIPPED_DRAFT = Path(__file__).parents[2] / "drafters" / "weights" / "smollm2-135m-draft"
SHIPPED_RECURRENT = Path(__file__).parents[2] / "drafters" / "weights" / "smollm2-135m-medusa-recurrent"


@pytest.fixture(scope="module")
def llm() -> LLM:
    """Plain decoding (the engine's default speculates)."""
    return LLM(DEFAULT_MODEL, max_model_len=1024, speculative_config=None)


def chat_ids(llm: LLM, text: str) -> list[int]:
    return llm.apply_chat_template([{"role": "user", "content": text}])


def test_plain_greedy_matches_transformers() -> None:
    from transformers import AutoModelForCausalLM

    # fp32 weights and K/V like the reference
    llm = LLM(DEFAULT_MODEL, max_model_len=1024, linear_backend="fp32", kv_cache_dtype="fp32",
              speculative_config=None)
    hf = AutoModelForCausalLM.from_pretrained(str(llm.model_dir), dtype=torch.float32)
    prompts = [chat_ids(llm, c) for c in CHATS[:5]]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    for ids, out in zip(prompts, outs):
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)[0, len(ids):].tolist()
        assert out.outputs[0].token_ids == ref


CONFIGS: dict[str, dict[str, object] | str] = {
    "default": "auto",  # what LLM(model) runs: adaptive hybrid drafting with the shipped heads
    "ngram": {"method": "ngram", "num_speculative_tokens": 5},
    "draft_model": {"method": "draft_model", "model": str(SHIPPED_DRAFT), "num_speculative_tokens": 3},
    "draft_tree": {"method": "draft_model", "model": str(SHIPPED_DRAFT), "num_speculative_tokens": 4,
                   "num_tree_nodes": 12},
    "medusa": {"method": "medusa", "num_speculative_tokens": 4},
    "medusa_tree": {"method": "medusa", "num_speculative_tokens": 4, "num_tree_nodes": 24},
    "medusa_recurrent": {"method": "medusa", "model": str(SHIPPED_RECURRENT), "num_speculative_tokens": 4},
    "medusa_recurrent_tree": {"method": "medusa", "model": str(SHIPPED_RECURRENT), "num_speculative_tokens": 5,
                              "num_tree_nodes": 24},
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_speculation_equals_plain(llm: LLM, name: str) -> None:
    spec = LLM(DEFAULT_MODEL, max_model_len=1024, speculative_config=CONFIGS[name])
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    prompts = [chat_ids(llm, c) for c in CHATS]
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == plain
    # The copy alone too: with nine requests sharing each step the default's cost model may
    # rightly find no verify row worth it (9 drafts in the batch on an idle machine, none in
    # one CI run under load); alone, its long match pays (5-6 drafts, 31 tokens accepted).
    assert spec.generate(prompts[-1:], params)[0].outputs[0].token_ids == plain[-1]
    metrics = spec.get_metrics()
    assert metrics["num_accepted_tokens"] > 0
    bm = spec.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("name", ["ngram", "draft_tree"])
def test_greedy_speculation_equals_plain_with_fp8_kv(name: str) -> None:
    """fp8 KV rounds per slot: verify rows (and moved tree paths, scales included) must
    store and read exactly what plain decoding does."""
    plain = LLM(DEFAULT_MODEL, max_model_len=1024, kv_cache_dtype="fp8", speculative_config=None)
    spec = LLM(DEFAULT_MODEL, max_model_len=1024, kv_cache_dtype="fp8", speculative_config=CONFIGS[name])
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    prompts = [chat_ids(plain, c) for c in CHATS]
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == expected
    assert spec.get_metrics()["num_accepted_tokens"] > 0
