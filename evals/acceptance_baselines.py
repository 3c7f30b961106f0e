"""Hugging Face transformers baselines for `specdec eval acceptance --hf-baselines`:
greedy, prompt lookup and assisted generation timed on the same prompts as our plain
decoding, interleaved per prompt so that machine noise hits every method alike.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdec.evals.acceptance_run import Generate, Prompts, Run, converse

if TYPE_CHECKING:
    from specdec.llm import LLM

REFERENCE = "specdec-plain"  # every baseline is compared with this method


@dataclass
class HFResult:
    category: str
    prompt_id: str
    runs: dict[str, Run] = field(default_factory=dict)  # method -> run

    def to_record(self) -> dict[str, Any]:
        return {"category": self.category, "id": self.prompt_id,
                "runs": {method: run.to_record() for method, run in self.runs.items()}}


def num_methods(draft_model: str | None) -> int:
    """How many methods run per prompt (assisted generation needs a draft)."""
    return 4 if draft_model else 3


def load_hf_models(model_dir: Path, draft: str | None, dtype: Any) -> tuple[Any, Any]:
    """The target, and the assistant (None without a draft) with the target's embeddings
    filled in when its checkpoint leaves them out (as our distilled drafts do)."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    if not draft:
        return target, None
    from specdec.drafters.draft_model import resolve_draft_dir

    loaded: Any = AutoModelForCausalLM.from_pretrained(
        str(resolve_draft_dir(draft)), dtype=dtype, output_loading_info=True)
    assistant, info = loaded
    if any("embed_tokens" in key or "lm_head" in key for key in info["missing_keys"]):
        assistant.set_input_embeddings(target.get_input_embeddings())
        assistant.tie_weights()
    return target, assistant.eval()


def hf_generators(llm: LLM, target: Any, assistant: Any, max_tokens: int, num_tokens: int) -> dict[str, Generate]:
    """Method name -> generate function, ours first (the reference), all greedy."""
    from specdec.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    tokenizer = llm.get_tokenizer()
    eos = sorted(llm.engine.eos_token_ids)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    config = {"max_new_tokens": max_tokens, "do_sample": False, "eos_token_id": eos, "pad_token_id": pad}

    def ours(prompt: list[int]) -> tuple[list[int], str]:
        ids = list(llm.generate([prompt], params, use_speculation=False)[0].outputs[0].token_ids)
        # Decoded like the HF runs (the engine's incremental detokenizer holds back a trailing
        # partial UTF-8 sequence), so that equal tokens give equal second-turn prompts.
        return ids, tokenizer.decode(ids, skip_special_tokens=True)

    methods: dict[str, Generate] = {REFERENCE: ours,
                                    "hf-greedy": _hf_generate(target, tokenizer, config),
                                    "hf-prompt-lookup": _hf_generate(target, tokenizer, config,
                                                                     prompt_lookup_num_tokens=num_tokens)}
    if assistant is not None:
        methods["hf-assisted"] = _hf_generate(target, tokenizer, config, assistant_model=assistant,
                                              num_assistant_tokens=num_tokens,
                                              num_assistant_tokens_schedule="constant")
    return methods


def _hf_generate(model: Any, tokenizer: Any, config: dict[str, Any], **extra: Any) -> Generate:
    import torch
    from transformers import GenerationConfig

    assistant = extra.pop("assistant_model", None)
    generation_config = GenerationConfig(**config, **extra)

    def generate(prompt: list[int]) -> tuple[list[int], str]:
        input_ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                 generation_config=generation_config, assistant_model=assistant)
        ids = out[0, len(prompt):].tolist()
        return ids, tokenizer.decode(ids, skip_special_tokens=True)

    return generate


def run_hf_baselines(llm: LLM, prompts: Prompts, args: argparse.Namespace, bar: Any) -> list[HFResult]:
    import torch

    dtype = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
             "fp16": torch.float16}.get(args.dtype, torch.float32)  # the engine's names for its dtypes
    target, assistant = load_hf_models(llm.model_dir, args.draft_model, dtype)
    methods = hf_generators(llm, target, assistant, args.max_tokens, args.hf_num_tokens)
    names = list(methods)
    first = next(iter(prompts.values()))[0]["turns"][:1]
    for _ in range(args.warmup):  # one-off costs out of the timings, as for the engine runs
        for name in names:
            converse(first, llm.apply_chat_template, methods[name])
    results, turn = [], 0
    for category, items in prompts.items():
        for item in items:
            runs: dict[str, Run] = {}
            shift = turn % len(names)  # rotate the order per prompt, as for plain vs speculative
            for name in names[shift:] + names[:shift]:
                runs[name] = converse(item["turns"], llm.apply_chat_template, methods[name])
                bar.update(1)
            turn += 1
            results.append(HFResult(category, item["id"], {name: runs[name] for name in names}))
    return results
