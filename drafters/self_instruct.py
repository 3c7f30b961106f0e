"""User prompts written by the target itself (Magpie, Xu et al. 2024).

An instruction-tuned model given only its chat template up to the start of a user turn
writes a plausible user message. Sampling many of them gives open-chat prompts in the
styles the model was tuned on, far more varied than templates x topics, with no data set
to download. The drafters then learn from the target's answers to them.

Prompts are cached as JSON beside the distillation shards, so they are made once.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# Stands in for the user message when the template is rendered; never a real prompt.
_SENTINEL = "\x00user-message\x00"
MAX_PROMPT_TOKENS = 96  # a message still going after this many tokens is dropped
MIN_PROMPT_CHARS = 16
MAX_FRUITLESS_BATCHES = 20


def user_turn_prefix(tokenizer: Any) -> str:
    """The chat template rendered up to where a user's message would begin."""
    text: str = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], tokenize=False)
    return text[:text.index(_SENTINEL)]


def end_of_turn_id(tokenizer: Any, model: Any) -> int:
    """The token that closes a user turn: the template's end marker, else EOS."""
    for marker in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>"):
        token_id = tokenizer.convert_tokens_to_ids(marker)
        if isinstance(token_id, int) and token_id != tokenizer.unk_token_id:
            return token_id
    return int(model.config.eos_token_id)


def keep(message: str, seen: set[str]) -> bool:
    """A usable, new prompt: long enough and not already drawn."""
    return len(message) >= MIN_PROMPT_CHARS and message not in seen


@torch.inference_mode()
def sample_batch(model: Any, tokenizer: Any, batch_size: int, temperature: float) -> list[str]:
    """One batch of user messages; those that did not end their turn are dropped."""
    prefix = tokenizer(user_turn_prefix(tokenizer), add_special_tokens=False, return_tensors="pt")
    end_id = end_of_turn_id(tokenizer, model)
    out = model.generate(
        input_ids=prefix.input_ids.repeat(batch_size, 1),
        attention_mask=prefix.attention_mask.repeat(batch_size, 1),
        do_sample=True, temperature=temperature, top_p=0.95, top_k=None,
        max_new_tokens=MAX_PROMPT_TOKENS, eos_token_id=end_id, pad_token_id=end_id,
    )
    messages = []
    for row in out[:, prefix.input_ids.shape[1]:].tolist():
        if end_id in row:
            messages.append(tokenizer.decode(row[:row.index(end_id)], skip_special_tokens=True).strip())
    return messages


def sample_prompts(model: Any, tokenizer: Any, count: int, seed: int, temperature: float = 1.0,
                   batch_size: int = 64, progress: bool = True) -> list[str]:
    """`count` distinct user messages, deterministic for a given seed and model."""
    from tqdm import tqdm

    torch.manual_seed(seed)
    prompts: list[str] = []
    seen: set[str] = set()
    fruitless = 0
    with tqdm(total=count, desc="self-instruct prompts", disable=not progress) as bar:
        while len(prompts) < count:
            new = [m for m in sample_batch(model, tokenizer, batch_size, temperature) if keep(m, seen)]
            new = list(dict.fromkeys(new))[:count - len(prompts)]
            fruitless = 0 if new else fruitless + 1
            if fruitless == MAX_FRUITLESS_BATCHES:
                raise RuntimeError(f"{fruitless} batches in a row gave no new finished user message; "
                                   "does the model follow its chat template?")
            seen.update(new)
            prompts += new
            bar.update(len(new))
    return prompts


def cached_prompts(path: Path, load: Callable[[], tuple[Any, Any]], count: int,
                   seed: int) -> list[str]:
    """The prompts stored at `path`, sampling and storing them first if absent
    (`load` returns the (model, tokenizer) to sample with; called only then)."""
    if path.exists():
        cached: list[str] = json.loads(path.read_text())
        return cached
    prompts = sample_prompts(*load(), count, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".tmp").write_text(json.dumps(prompts, indent=0))
    path.with_suffix(".tmp").rename(path)
    return prompts
