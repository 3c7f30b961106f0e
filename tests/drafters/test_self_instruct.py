"""Self-instruct (Magpie) prompts: the target writes user turns from its template's prefix."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from specdec.drafters import self_instruct as si

Target = tuple[Any, Any]  # (model, tokenizer)


@pytest.fixture(scope="module")
def target(tiny_model_dir: Path) -> Target:
    """The tiny model, nudged towards ending its turn so messages finish within the cap."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    end_id = si.end_of_turn_id(tokenizer, model)
    bias = torch.zeros(model.config.vocab_size)
    bias[end_id] = 3.0
    model.lm_head.register_forward_hook(lambda module, inputs, out: out + bias)
    return model, tokenizer


def test_prefix_is_the_template_up_to_the_user_message(target: Target) -> None:
    _, tokenizer = target
    assert si.user_turn_prefix(tokenizer) == "<|im_start|>user\n"


def test_end_of_turn_is_the_templates_marker(target: Target) -> None:
    model, tokenizer = target
    assert si.end_of_turn_id(tokenizer, model) == tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_samples_are_distinct_finished_turns_and_seeded(target: Target) -> None:
    model, tokenizer = target
    prompts = si.sample_prompts(model, tokenizer, 12, seed=3, batch_size=8, progress=False)
    assert len(prompts) == len(set(prompts)) == 12
    assert all(len(p) >= si.MIN_PROMPT_CHARS and "<|im_end|>" not in p for p in prompts)
    assert si.sample_prompts(model, tokenizer, 12, seed=3, batch_size=8, progress=False) == prompts
    assert si.sample_prompts(model, tokenizer, 12, seed=4, batch_size=8, progress=False) != prompts


def test_unfinished_messages_are_dropped(target: Target) -> None:
    model, tokenizer = target
    handle = model.lm_head.register_forward_hook(
        lambda module, inputs, out: out - 1e4 * (torch.arange(out.shape[-1]) == si.end_of_turn_id(tokenizer, model)))
    try:
        assert si.sample_batch(model, tokenizer, 4, temperature=1.0) == []
    finally:
        handle.remove()


def test_cache_is_written_once_and_reused(target: Target, tmp_path: Path) -> None:
    calls: list[int] = []

    def load() -> Target:
        calls.append(1)
        return target

    path = tmp_path / "self_instruct.json"
    first = si.cached_prompts(path, load, 5, seed=0)
    assert si.cached_prompts(path, load, 5, seed=0) == first and len(first) == 5
    assert calls == [1]


def test_a_model_that_never_ends_its_turn_is_an_error(target: Target, monkeypatch: pytest.MonkeyPatch) -> None:
    model, tokenizer = target
    monkeypatch.setattr(si, "sample_batch", lambda *args: [])
    with pytest.raises(RuntimeError, match="no new finished user message"):
        si.sample_prompts(model, tokenizer, 3, seed=0, progress=False)
