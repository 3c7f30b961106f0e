"""Tools and tool calls in the prompt. A chat template that knows tools (it mentions `tools`)
gets them as `apply_chat_template(..., tools=...)` and the history's calls as they are. One that
does not (SmolLM2's) gets them written into the conversation in the Hermes style the hermes
parser reads back: the functions' schemas in a system message, earlier calls as
<tool_call> blocks in the assistant's text, tool results inside <tool_response> tags.
"""
from __future__ import annotations

import json
from typing import Any

from specdec.server.hermes_tool_parser import CLOSE, OPEN

_INSTRUCTIONS = (
    "You may call functions to help with the user's request. Their signatures, one JSON object a line, are "
    "inside <tools></tools>:\n<tools>\n{tools}\n</tools>\n"
    "To call a function, answer with a JSON object with its name and arguments inside "
    f"{OPEN}{CLOSE} tags, one block per call:\n"
    f'{OPEN}\n{{{{"name": <function name>, "arguments": <arguments object>}}}}\n{CLOSE}'
)


def mentions_tools(template: Any) -> bool:
    """Whether the chat template (a string, or named templates) reads a `tools` variable."""
    texts = template.values() if isinstance(template, dict) else [template]
    return any(isinstance(text, str) and "tools" in text for text in texts)


def prompt_inputs(conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                  template: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and the extra apply_chat_template keywords for this template; `tools`
    are OpenAI tool objects, None when they are not to be shown (tool_choice "none")."""
    if mentions_tools(template):
        return conversation, ({"tools": tools} if tools else {})
    messages = [_as_text(message) for message in conversation]
    return (with_tools_message(messages, tools) if tools else messages), {}


def tools_text(tools: list[dict[str, Any]]) -> str:
    lines = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return _INSTRUCTIONS.format(tools=lines)


def with_tools_message(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tools' system text merged after the first system message, or a system message of its own."""
    text = tools_text(tools)
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0])
        first["content"] = f"{first['content']}\n\n{text}" if first["content"] else text
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _as_text(message: dict[str, Any]) -> dict[str, Any]:
    """A message with its calls (or its tool result) written out, for a template that only
    reads `content`."""
    if message.get("tool_calls"):
        calls = "\n".join(call_block(call["function"]) for call in message["tool_calls"])
        content = f"{message['content']}\n{calls}" if message["content"] else calls
        return {key: value for key, value in message.items() if key != "tool_calls"} | {"content": content}
    if message["role"] == "tool":
        return message | {"content": f"<tool_response>\n{message['content']}\n</tool_response>"}
    return message


def call_block(function: dict[str, Any]) -> str:
    """One call as the model writes it: its arguments are an object (for_template parsed them)."""
    body = json.dumps({"name": function["name"], "arguments": function["arguments"]}, ensure_ascii=False)
    return f"{OPEN}\n{body}\n{CLOSE}"
