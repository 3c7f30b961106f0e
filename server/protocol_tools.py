"""The tool fields of a chat request (pydantic 2, strict as protocol.py's): `tools`,
`tool_choice`, and the `tool_calls` of assistant messages in the history, as OpenAI names them.

What they check on their own: function names are OpenAI's `^[a-zA-Z0-9_-]{1,64}$` and
unique, `parameters` is a JSON schema of an object that the grammar engine (llguidance)
compiles, a named tool_choice names one of the tools, and a history call's arguments are a
JSON object. What depends on the server (auto needs `--enable-auto-tool-choice`) is chat.py's.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import llguidance
from pydantic import Discriminator, Field, Tag, field_validator

from specdec.server.protocol_base import StrictBody

FUNCTION_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"


class FunctionDefinition(StrictBody):
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: the function takes no arguments
    strict: bool | None = None  # the arguments must follow `parameters` exactly (a grammar makes sure)

    @field_validator("parameters")
    @classmethod
    def _check_parameters(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is None:
            return None
        if value.get("type", "object") != "object":
            raise ValueError(f"parameters must be the JSON schema of an object (the call's arguments), "
                             f"got type {value.get('type')!r}")
        # Lenient: a keyword or format the grammar engine cannot enforce is not an error here,
        # where the schema may only be shown to the model; a grammar built from it is checked
        # strictly (chat.py).
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            llguidance.LLMatcher.grammar_from_json_schema(value, defaults={"lenient": True}))
        if is_error:
            raise ValueError(f"parameters is not a usable JSON schema: {messages[0]}")
        return value


class ToolDefinition(StrictBody):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictBody):
    name: str


class NamedToolChoice(StrictBody):
    type: Literal["function"]
    function: NamedFunction


def _choice_kind(value: Any) -> str | None:
    if value in ("none", "auto", "required"):
        return "mode"
    return "function" if isinstance(value, (dict, NamedToolChoice)) else None


_CHOICE_SHAPE = 'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
# Tagged, so a bad value gets the error of the one form it tried to be, not one per form.
ToolChoice = Annotated[
    Annotated[Literal["none", "auto", "required"], Tag("mode")] | Annotated[NamedToolChoice, Tag("function")],
    Discriminator(_choice_kind, custom_error_type="tool_choice", custom_error_message=_CHOICE_SHAPE),
]


def check_tools(tools: list[ToolDefinition] | None) -> list[ToolDefinition] | None:
    """Function names must be unique (a call names its function)."""
    names = [tool.function.name for tool in tools or []]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"function names must be unique, {repeated} appear more than once")
    return tools


def check_tool_choice(choice: ToolChoice | None, tools: list[ToolDefinition] | None) -> ToolChoice | None:
    """"none" is fine alone; any other choice needs tools, and a named one one of them."""
    if choice is None or choice == "none":
        return choice
    if not tools:
        raise ValueError(f"tool_choice {describe_tool_choice(choice)} needs tools: give the functions in `tools`")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in tools}:
        raise ValueError(f"tool_choice names the function {choice.function.name!r}, which is not among the tools")
    return choice


def describe_tool_choice(choice: ToolChoice) -> str:
    return f'"{choice}"' if isinstance(choice, str) else f"naming {choice.function.name!r}"


class CalledFunction(StrictBody):
    name: str
    arguments: str  # a JSON object as text, as OpenAI sends it

    @field_validator("arguments")
    @classmethod
    def _check_arguments(cls, value: str) -> str:
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"arguments must be a JSON object as text: {exc}") from None
        if not isinstance(parsed, dict):
            raise ValueError("arguments must be a JSON object as text")  # noqa: TRY004 - pydantic wants ValueError
        return value


class AssistantToolCall(StrictBody):
    """A call the assistant made earlier in the conversation."""

    id: str
    type: Literal["function"]
    function: CalledFunction

    def for_template(self) -> dict[str, Any]:
        """As chat templates read a call: its arguments an object, not text (HF's convention)."""
        function = {"name": self.function.name, "arguments": json.loads(self.function.arguments)}
        return {"id": self.id, "type": "function", "function": function}
