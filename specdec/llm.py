"""The offline Python API, shaped like vLLM's `LLM`, and the prompt forms it takes.

A prompt is a string, a list of token ids, or one of vLLM's prompt dicts:
`{"prompt": "text"}` or `{"prompt_token_ids": [1, 2, 3]}`. Prompts and sampling params
are checked when `generate` or `chat` is called, before any request runs: a bad one is
named (`prompts[2]`, `sampling_params`) by a ValueError, or a TypeError for a wrong type.
"""
from __future__ import annotations

import inspect
import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypedDict

import torch
from tqdm import tqdm

from specdec.chat_utils import Conversation, render_chat
from specdec.config import EngineConfig, engine_options
from specdec.engine import LLMEngine
from specdec.gc_heap import collect_startup_garbage
from specdec.model_registry import DEFAULT_MODEL
from specdec.outputs import RequestOutput
from specdec.parallel_sampling import ParentRequest, Prompt
from specdec.sampling_params import SamplingParams, lone_surrogate


class TextPrompt(TypedDict):
    prompt: str


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]


PromptType = str | list[int] | TextPrompt | TokensPrompt
PROMPT_KEYS = ("prompt", "prompt_token_ids")


class LLM:
    """`LLM(model, **options)`: the options are EngineConfig's fields (see its help texts,
    or `specdec serve --help`); an unknown one is a TypeError."""

    def __init__(self, model: str = DEFAULT_MODEL, **options: Any) -> None:
        self.engine = build_engine(model, options)
        self.model_dir: Path = self.engine.model_dir
        self._ids = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        use_speculation: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; results come back in input order. Every prompt is
        checked before any runs: a bad one is a ValueError and nothing is left running."""
        prompt_list = as_prompt_list(prompts)
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
        messages: Conversation | list[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        use_speculation: bool = True,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, as vLLM's `LLM.chat`:
        chat_template (a template or a file path) replaces the model's for this call;
        continue_final_message continues the last message instead of opening a new turn;
        tools and chat_template_kwargs reach the template."""
        _check_chat_texts(messages=messages, tools=tools, chat_template_kwargs=chat_template_kwargs)
        texts = [render_chat(self.engine.tokenizer, conversation, chat_template=chat_template,
                             add_generation_prompt=add_generation_prompt,
                             continue_final_message=continue_final_message, tools=tools,
                             chat_template_kwargs=chat_template_kwargs)
                 for conversation in _conversations(messages)]
        outputs = self.generate([self._encode(text) for text in texts], sampling_params, use_tqdm, use_speculation)
        for output, text in zip(outputs, texts):
            output.prompt = text  # the rendered conversation, as vLLM reports it
        return outputs

    def apply_chat_template(
        self,
        conversation: Conversation,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """The token ids `chat` would generate from for this conversation."""
        _check_chat_texts(conversation=conversation, tools=tools, chat_template_kwargs=chat_template_kwargs)
        text = render_chat(self.engine.tokenizer, conversation, chat_template=chat_template,
                           add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                           tools=tools, chat_template_kwargs=chat_template_kwargs)
        return self._encode(text)

    def get_metrics(self) -> dict[str, Any]:
        return self.engine.get_metrics()

    def _encode(self, text: str) -> list[int]:
        # the template writes any BOS itself
        return list(self.engine.tokenizer.encode(text, add_special_tokens=False))

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


def build_engine(model: str, options: dict[str, Any]) -> LLMEngine:
    """The engine `LLM(model, **options)` runs (AsyncLLM builds its own the same way)."""
    config = EngineConfig(model=model, **_checked_options(options))
    torch.manual_seed(config.seed)
    engine = LLMEngine(config)
    collect_startup_garbage()
    return engine


def _checked_options(options: dict[str, Any]) -> dict[str, Any]:
    known = [f.name for f in engine_options() if f.name != "model"]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise TypeError(f"got unknown engine options {unknown}; the options are {known}")
    return options


def options_signature() -> inspect.Signature:
    """The signature help() and IDEs should show for `LLM(...)` and `AsyncLLM(...)`: `model`,
    then every other engine option as a keyword with its default."""
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    for option in engine_options():
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD if option.name == "model" else inspect.Parameter.KEYWORD_ONLY
        params.append(inspect.Parameter(option.name, kind, default=option.default, annotation=option.type))
    return inspect.Signature(params)


LLM.__init__.__signature__ = options_signature()  # type: ignore[attr-defined]


def _conversations(messages: Conversation | list[Conversation]) -> list[Conversation]:
    """One conversation (a list of message dicts) or a list of them, as a list of them."""
    if messages and isinstance(messages[0], list):
        return messages
    return [messages]  # type: ignore[list-item]


def as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[Prompt]:
    """One prompt or a list of them (of any form, mixed) as the engine's prompts."""
    if isinstance(prompts, (str, dict)):
        return [parse_prompt(prompts, "prompts[0]")]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}")
    if prompts and all(_is_token_id(t) for t in prompts):
        return [list(prompts)]  # one prompt of token ids
    return [parse_prompt(prompt, f"prompts[{i}]") for i, prompt in enumerate(prompts)]


def parse_prompt(prompt: Any, name: str = "the prompt") -> Prompt:
    """A string, a list of token ids, or a vLLM prompt dict, as the engine's prompt;
    errors call it `name`."""
    if isinstance(prompt, str):
        return _text(prompt, name)
    if isinstance(prompt, dict):
        return _parse_prompt_dict(prompt, name)
    if isinstance(prompt, (list, tuple)):
        return _token_ids(prompt, name)
    raise TypeError(f"{name} must be a string, a list of token ids, or a dict with one of {list(PROMPT_KEYS)}; "
                    f"got {type(prompt).__name__}")


def _text(text: str, name: str) -> str:
    """The text, unless it has a lone surrogate (which the tokenizer refuses with an error
    naming neither the prompt nor the character)."""
    at = lone_surrogate(text)
    if at is not None:
        raise ValueError(f"{name} is not valid text: it contains a lone surrogate at position {at}")
    return text


def _check_chat_texts(**arguments: Any) -> None:
    """The strings of chat's arguments valid text, named by argument and place."""
    for name, value in arguments.items():
        _check_texts(value, name)


def _check_texts(value: Any, name: str) -> None:
    """Every string inside `value` (a conversation: lists and dicts) valid text, naming the
    first that is not by its place."""
    if isinstance(value, str):
        _text(value, name)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_texts(item, f"{name}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check_texts(item, f"{name}[{index}]")


def _parse_prompt_dict(prompt: dict[str, Any], name: str) -> Prompt:
    if "multi_modal_data" in prompt:
        raise ValueError("multi_modal_data is not supported: specdec runs text-only models")
    unknown = sorted(set(prompt) - set(PROMPT_KEYS), key=str)
    if unknown:
        raise ValueError(f"unknown prompt dict keys {unknown}; a prompt dict has one of {list(PROMPT_KEYS)}")
    given = [key for key in PROMPT_KEYS if key in prompt]
    if len(given) != 1:
        raise ValueError(f"a prompt dict needs exactly one of {list(PROMPT_KEYS)}, got {given or 'neither'}")
    if given == ["prompt_token_ids"]:
        return _token_ids(prompt["prompt_token_ids"], "prompt_token_ids")
    if not isinstance(prompt["prompt"], str):
        raise ValueError(f"'prompt' must be a string, got {type(prompt['prompt']).__name__}")
    return _text(prompt["prompt"], f"{name}['prompt']")


def _token_ids(value: Any, what: str) -> list[int]:
    if not isinstance(value, (list, tuple)) or not all(_is_token_id(t) for t in value):
        raise ValueError(f"{what} must be a list of int token ids, got {value!r:.80}")
    return list(value)


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    """One SamplingParams per prompt, from one for all or a list of one per prompt. Any
    other object (a dict of settings, say) is a TypeError here, not an AttributeError
    from inside the engine."""
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    if not isinstance(params, (list, tuple)):
        raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got {type(params).__name__}")
    for index, item in enumerate(params):
        if not isinstance(item, SamplingParams):
            raise TypeError(f"sampling_params[{index}] must be a SamplingParams, got {type(item).__name__}")
    if len(params) != n:
        raise ValueError(f"sampling_params has {len(params)} entries for {n} prompts: give one SamplingParams "
                         "or one per prompt")
    return list(params)
