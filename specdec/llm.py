"""The offline Python API, shaped like vLLM's `LLM`."""
from __future__ import annotations

import inspect
import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from specdec.config import EngineConfig, engine_options
from specdec.engine import LLMEngine
from specdec.model_registry import DEFAULT_MODEL
from specdec.outputs import RequestOutput
from specdec.parallel_sampling import ParentRequest, Prompt
from specdec.sampling_params import SamplingParams


class LLM:
    """`LLM(model, **options)`: the options are EngineConfig's fields (see its help texts,
    or `specdec serve --help`); an unknown one is a TypeError."""

    def __init__(self, model: str = DEFAULT_MODEL, **options: Any) -> None:
        config = EngineConfig(model=model, **_checked_options(options))
        torch.manual_seed(config.seed)
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
        parents: list[ParentRequest] = []
        try:
            for prompt, sp in zip(prompt_list, params):
                parent = ParentRequest(str(next(self._ids)), sp)
                parent.add_to(self.engine, prompt, use_speculation)
                parents.append(parent)
        except BaseException:  # a bad prompt: run none of this call's requests
            for parent in parents:
                parent.abort_in(self.engine)
            raise
        self._run(parents, use_tqdm)
        return [parent.merged() for parent in parents]

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

    def _run(self, parents: list[ParentRequest], use_tqdm: bool) -> None:
        by_child = {child.request_id: parent for parent in parents for child in parent.children}
        bar = tqdm(total=len(by_child), desc="generating", disable=not use_tqdm)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                parent = by_child.get(out.request_id)
                if parent is not None and out.finished:  # the offline API returns final outputs only
                    parent.update(out)
                    bar.update(1)
        bar.close()


def _checked_options(options: dict[str, Any]) -> dict[str, Any]:
    known = [f.name for f in engine_options() if f.name != "model"]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise TypeError(f"LLM() got unknown engine options {unknown}; the options are {known}")
    return options


def _signature() -> inspect.Signature:
    """LLM's signature as help() and IDEs should show it: `model`, then every other
    engine option as a keyword with its default."""
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    for option in engine_options():
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD if option.name == "model" else inspect.Parameter.KEYWORD_ONLY
        params.append(inspect.Parameter(option.name, kind, default=option.default, annotation=option.type))
    return inspect.Signature(params)


LLM.__init__.__signature__ = _signature()  # type: ignore[attr-defined]


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
