"""Logits transforms through the engine: speculative output equals plain output under
penalties, biases, bans and min_tokens, and each transform does what it says."""
from __future__ import annotations

from typing import Any

import pytest

from specdec import SamplingParams
from specdec.llm import LLM
from tests.helpers import NGRAM, assert_all_blocks_free, greedy, random_prompts, token_ids

TRANSFORMS: list[dict[str, Any]] = [
    {"repetition_penalty": 1.3},
    {"frequency_penalty": 0.8, "presence_penalty": 0.4},
    {"logit_bias": {7: 3.0, 9: -100.0}},
    {"bad_words_token_ids": "from plain output"},
    {"allowed_token_ids": list(range(3, 120))},
]


@pytest.fixture(scope="module")
def plain(tiny_model_dir: Any) -> LLM:
    return LLM(str(tiny_model_dir), max_model_len=256, speculative_config=None)


@pytest.mark.parametrize("transform", TRANSFORMS, ids=lambda t: next(iter(t)))
@pytest.mark.parametrize("draft", ["ngram", "draft_tree"])
def test_speculation_is_lossless_under_transforms(plain: LLM, tiny_model_dir: Any, tiny_draft_dir: Any,
                                                  transform: dict[str, Any], draft: str) -> None:
    configs = {"ngram": NGRAM, "draft_tree": {"method": "draft_model", "num_speculative_tokens": 3,
                                             "num_tree_nodes": 6, "model": str(tiny_draft_dir)}}
    spec = LLM(str(tiny_model_dir), max_model_len=256, speculative_config=configs[draft])
    prompts = random_prompts(11, 4)
    untransformed = token_ids(plain.generate(prompts, greedy(24)))
    if transform.get("bad_words_token_ids"):  # ban words plain decoding says: each first token, a later pair
        transform = {"bad_words_token_ids": [[out[0]] for out in untransformed] + [out[4:6] for out in untransformed]}
    params = greedy(24, **transform)
    expected = token_ids(plain.generate(prompts, params))
    assert token_ids(spec.generate(prompts, params)) == expected
    assert untransformed != expected  # the transform mattered
    assert spec.get_metrics()["num_drafts"] > 0
    assert_all_blocks_free(spec)


def test_a_banned_token_never_appears(plain: LLM) -> None:
    prompt = random_prompts(2, 1)[0]
    first = token_ids(plain.generate([prompt], greedy(16)))[0]
    banned = first[0]
    out = token_ids(plain.generate([prompt], greedy(16, logit_bias={banned: -100.0})))[0]
    assert banned not in out


def test_min_tokens_holds_eos_back_then_stops_at_it(tiny_model_dir: Any) -> None:
    llm = LLM(str(tiny_model_dir), max_model_len=256)
    eos = next(iter(llm.engine.eos_token_ids))
    prompt = random_prompts(4, 1)[0]
    # Bias EOS up so that greedy decoding picks it at once, unless min_tokens masks it.
    eager = SamplingParams(temperature=0.0, max_tokens=20, logit_bias={eos: 100.0})
    assert token_ids(llm.generate([prompt], eager))[0] == [eos]
    held = SamplingParams(temperature=0.0, max_tokens=20, logit_bias={eos: 100.0}, min_tokens=5)
    out = llm.generate([prompt], held)[0].outputs[0]
    assert len(out.token_ids) == 6 and out.token_ids[-1] == eos and out.finish_reason == "stop"


def test_bad_words_are_tokenized_by_the_engine(plain: LLM) -> None:
    tokenizer = plain.get_tokenizer()
    text = plain.generate(["The quick brown fox"], greedy(12))[0].outputs[0].text
    word = text.split()[0] if text.split() else text
    out = plain.generate(["The quick brown fox"], greedy(12, bad_words=[word]))[0].outputs[0]
    banned = tokenizer.encode(" " + word, add_special_tokens=False)
    assert out.token_ids[: len(banned)] != banned


def test_token_ids_outside_the_vocabulary_are_refused(plain: LLM) -> None:
    vocab = plain.engine.model_config.vocab_size
    with pytest.raises(ValueError, match="outside the vocabulary"):
        plain.generate(["hi"], greedy(4, logit_bias={vocab + 5: 1.0}))
    assert_all_blocks_free(plain)
