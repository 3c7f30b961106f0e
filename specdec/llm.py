"""The offline Python API, shaped like vLLM's `LLM`."""
from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

import torch
from tqdm import tqdm

from specdec.config import EngineConfig, SpeculativeConfig
from specdec.engine import LLMEngine
from specdec.outputs import RequestOutput
from specdec.sampling_params import SamplingParams

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "auto": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}

Prompt = str | list[int]


class LLM:
    def __init__(
        self,
        model: str = "smollm2-135m-instruct",
        speculative_config: dict[str, Any] | None = None,
        max_model_len: int = 4096,
        max_num_batched_tokens: int = 2048,
        max_num_seqs: int = 64,
        block_size: int = 16,
        kv_cache_memory: int | None = None,
        kv_cache_dtype: str = "auto",
        enable_prefix_caching: bool = False,
        dtype: str = "float32",
        seed: int = 0,
        linear_backend: str = "auto",
        attention_backend: str = "auto",
    ) -> None:
        if dtype not in _DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one of {sorted(_DTYPES)}")
        config = EngineConfig(
            model=model, max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs, block_size=block_size, kv_cache_dtype=kv_cache_dtype,
            enable_prefix_caching=enable_prefix_caching,
            speculative_config=SpeculativeConfig.from_dict(speculative_config), dtype=_DTYPES[dtype], seed=seed,
            linear_backend=linear_backend, attention_backend=attention_backend,
        )
        if kv_cache_memory is not None:
            config.kv_cache_memory = kv_cache_memory
        torch.manual_seed(seed)
        self.engine = LLMEngine(config)
        self.model_dir: Path = self.engine.model_dir
        self._ids = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        use_speculation: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; results come back in input order."""
        prompt_list = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompt_list))
        groups = [self._add(p, sp, use_speculation) for p, sp in zip(prompt_list, params)]
        finals = self._run([rid for group in groups for rid in group], use_tqdm)
        return [_merge([finals[rid] for rid in group]) for group in groups]

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        use_speculation: bool = True,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(c) for c in conversations]  # type: ignore[arg-type]
        return self.generate(prompts, sampling_params, use_tqdm, use_speculation)

    def apply_chat_template(self, conversation: list[dict[str, str]]) -> list[int]:
        tokenizer = self.engine.tokenizer
        if not tokenizer.chat_template:
            raise ValueError(f"the tokenizer of {self.model_dir} has no chat template")
        text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        return list(tokenizer.encode(text, add_special_tokens=False))

    def get_metrics(self) -> dict[str, Any]:
        return self.engine.get_metrics()

    def _add(self, prompt: Prompt, params: SamplingParams, use_speculation: bool) -> list[str]:
        base = str(next(self._ids))
        ids = []
        for i in range(params.n):
            child = params if params.n == 1 else _child_params(params, i)
            request_id = base if params.n == 1 else f"{base}-{i}"
            self.engine.add_request(request_id, prompt, child, use_speculation)
            ids.append(request_id)
        return ids

    def _run(self, request_ids: list[str], use_tqdm: bool) -> dict[str, RequestOutput]:
        finals: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="generating", disable=not use_tqdm)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    finals[out.request_id] = out
                    bar.update(1)
        bar.close()
        return finals


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    seed = None if params.seed is None else params.seed + index
    return replace(params, n=1, seed=seed)


def _merge(outputs: list[RequestOutput]) -> RequestOutput:
    first = outputs[0]
    completions = []
    for index, out in enumerate(outputs):
        completion = out.outputs[0]
        completion.index = index
        completions.append(completion)
    request_id = first.request_id.split("-")[0] if len(outputs) > 1 else first.request_id
    return replace(first, request_id=request_id, outputs=completions,
                   finished=all(o.finished for o in outputs))


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if prompts and isinstance(prompts[0], int):
        return [list(prompts)]  # type: ignore[arg-type]
    return list(prompts)  # type: ignore[arg-type]


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts")
    return list(params)
