"""The tool-call parser interface, its results, and the registry `--tool-call-parser` names.

A parser turns a model's output text into OpenAI tool calls and the content around them, in
one of two ways, as vLLM's ToolParser does: `extract` reads a whole output; `stream` is fed
the growing text of one choice and returns only what is new to send. A parser instance keeps
the streaming state of one choice, so each choice gets its own.
"""
from __future__ import annotations

import abc
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


def make_tool_call_id() -> str:
    """An id in OpenAI's shape: `call_` and 24 random characters."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI sends arguments as a string)
    id: str = field(default_factory=make_tool_call_id)

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ExtractedToolCalls:
    content: str | None  # the text outside the calls; None when there is none
    tool_calls: list[ToolCall]


@dataclass(frozen=True)
class ToolCallDelta:
    """One streamed piece of a call: the first carries its id and name (and arguments ""),
    later ones argument fragments, as OpenAI streams them."""

    index: int  # the call's position among this choice's calls
    arguments: str
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict[str, Any]:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class StreamedDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class ToolParser(abc.ABC):
    @abc.abstractmethod
    def extract(self, text: str) -> ExtractedToolCalls:
        """The calls and the content of a whole output (leaves this parser's stream state alone)."""

    @abc.abstractmethod
    def stream(self, text: str, finished: bool) -> StreamedDelta:
        """What to send now, given the choice's whole text so far; `finished` on its last
        output, when anything held back (an unfinished call, a partial tag) must go out."""


_PARSERS: dict[str, type[ToolParser]] = {}


def register_tool_parser(name: str) -> Callable[[type[ToolParser]], type[ToolParser]]:
    """Class decorator: makes the parser available as `--tool-call-parser NAME`."""

    def register(cls: type[ToolParser]) -> type[ToolParser]:
        _PARSERS[name] = cls
        return cls

    return register


def tool_parser_class(name: str) -> type[ToolParser]:
    if name not in _PARSERS:
        raise ValueError(f"unknown tool call parser {name!r} (--tool-call-parser); known: {sorted(_PARSERS)}")
    return _PARSERS[name]


@dataclass(frozen=True)
class ToolCallSettings:
    """The server's tool-call flags: `--tool-call-parser` and `--enable-auto-tool-choice`."""

    parser: str | None = None
    auto_tool_choice: bool = False

    def __post_init__(self) -> None:
        if self.parser is not None:
            tool_parser_class(self.parser)
        if self.auto_tool_choice and self.parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser to say how to read the calls")


def tool_call_settings(args: Any) -> ToolCallSettings:
    """The settings from `specdec serve` flags (a ValueError naming a bad one)."""
    return ToolCallSettings(getattr(args, "tool_call_parser", None),
                            bool(getattr(args, "enable_auto_tool_choice", False)))
