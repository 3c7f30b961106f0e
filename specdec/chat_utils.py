"""Chat templates: the `chat_template` engine option (vLLM's --chat-template), and rendering a
conversation to prompt text, shared by `LLM.chat` and the server so both format alike."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension

Conversation = list[dict[str, Any]]  # OpenAI-style messages: {"role": ..., "content": ...}

# apply_chat_template arguments that render_chat sets itself or that would change what it
# returns: chat_template_kwargs may not carry them (everything else reaches the template).
RESERVED_KWARGS = frozenset({
    "conversation", "chat_template", "add_generation_prompt", "continue_final_message", "tools", "tokenize",
    "return_dict", "return_tensors", "return_assistant_tokens_mask", "padding", "truncation", "max_length",
    "tokenizer_kwargs",
})


def load_chat_template(value: str, option: str = "chat_template") -> str:
    """The template a `chat_template` value names: the text of the file at that path, or the
    value itself. ValueError (naming `option`) for a missing file or a template Jinja
    cannot parse."""
    if not isinstance(value, str):
        raise TypeError(f"{option} must be a string (a Jinja template or a file path), got {type(value).__name__}")
    if not value.strip():
        raise ValueError(f"{option} is empty: give a Jinja chat template or the path of a file holding one")
    path = Path(value)
    if _is_file(path):
        text = path.read_text(encoding="utf-8")
    elif _looks_like_path(value):
        raise ValueError(f"{option}: there is no file {value!r} (a value without Jinja markup is read as a path)")
    else:
        text = value
    check_template(text, option)
    return text


def check_template(text: str, option: str = "chat_template") -> None:
    """ValueError (naming `option`) unless `text` parses as a Jinja template."""
    environment = jinja2.Environment(extensions=["jinja2.ext.loopcontrols", _GenerationBlock])
    try:
        environment.parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"{option} is not a valid Jinja template: {exc.message} (line {exc.lineno})") from None


def apply_template_override(tokenizer: Any, chat_template: str | None) -> None:
    """Make the `chat_template` engine option the tokenizer's template (None: keep the model's)."""
    if chat_template is not None:
        tokenizer.chat_template = load_chat_template(chat_template)


def render_chat(
    tokenizer: Any,
    conversation: Conversation,
    *,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The conversation as prompt text, through `chat_template` (a template or a file path)
    or else the tokenizer's own template. ValueError when there is no template, the options
    conflict, or the template rejects the messages."""
    _check_chat_options(conversation, add_generation_prompt, continue_final_message, tools, chat_template_kwargs)
    template = load_chat_template(chat_template) if chat_template is not None else None
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("the model has no chat template: pass chat_template (a Jinja template or a file holding "
                         "one), or start the engine with the chat_template option (--chat-template)")
    try:
        text = tokenizer.apply_chat_template(
            conversation, tools=tools, chat_template=template, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, tokenize=False, **(chat_template_kwargs or {}))
    except Exception as exc:  # noqa: BLE001 - whatever the template raised, the messages are at fault
        raise ValueError(f"the chat template could not format these messages: {exc}") from None
    return str(text)


def _check_chat_options(conversation: Conversation, add_generation_prompt: bool, continue_final_message: bool,
                        tools: list[dict[str, Any]] | None, chat_template_kwargs: dict[str, Any] | None) -> None:
    if not isinstance(conversation, list) or not all(isinstance(m, dict) for m in conversation):
        raise TypeError("a conversation must be a list of message dicts like {'role': 'user', 'content': '...'}")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt are not compatible: use "
                         "continue_final_message to continue the final message, add_generation_prompt to start "
                         "a new assistant message")
    if continue_final_message and not conversation:
        raise ValueError("continue_final_message needs a final message to continue, but the conversation is empty")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise TypeError("tools must be a list of OpenAI tool dicts like {'type': 'function', 'function': {...}}")
    if chat_template_kwargs is not None:
        if not isinstance(chat_template_kwargs, dict) or not all(isinstance(k, str) for k in chat_template_kwargs):
            raise TypeError("chat_template_kwargs must be a dict of template variable names to values")
        reserved = sorted(RESERVED_KWARGS & set(chat_template_kwargs))
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {reserved}: they are arguments of their own")


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # a template too long to be a file name
        return False


def _looks_like_path(value: str) -> bool:
    """A value with no Jinja markup (no braces, one line) cannot be a useful template, so it
    is taken for a file name, as vLLM does."""
    return not any(char in value for char in "{}\n")


class _GenerationBlock(Extension):
    """transformers' `{% generation %}...{% endgeneration %}` block (it marks the assistant's
    tokens for training masks), so templates that use it pass the syntax check."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)
