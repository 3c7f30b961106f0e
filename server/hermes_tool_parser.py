"""The Hermes tool-call format (Qwen, Hermes and SmolLM2-style templates): each call is

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Reading it (`HermesToolParser`, `--tool-call-parser hermes`) and constraining an output to
it (`hermes_grammar`, a Lark grammar for tool_choice "required" or a named function).
"""
from __future__ import annotations

import json
from typing import Any

import llguidance

from specdec.server.tool_parsers import (
    ExtractedToolCalls,
    StreamedDelta,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    register_tool_parser,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# The JSON inside a constrained call is laid out as json.dumps lays it out (as the prompt shows
# it): fixed separators keep a model from padding it with whitespace until max_tokens.
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@register_tool_parser("hermes")
class HermesToolParser(ToolParser):
    """Calls are sent whole, each as two deltas (id and name, then its arguments), once their
    closing tag has come: only then is it known whether the block is a valid call or text to
    send as content (a malformed or unfinished block is content, as the model wrote it). A
    client cannot run a call before its arguments are complete anyway."""

    def __init__(self) -> None:
        self.pos = 0  # characters of the text handled: sent, or dropped as a call's markup
        self.held = ""  # trailing whitespace of the content, sent only if more content follows
        self.leading = True  # no content sent yet: whitespace before the first content is dropped
        self.num_calls = 0

    def extract(self, text: str) -> ExtractedToolCalls:
        content, calls = HermesToolParser().advance(text, True)
        return ExtractedToolCalls(content or None, calls)

    def stream(self, text: str, finished: bool) -> StreamedDelta:
        content, calls = self.advance(text, finished)
        deltas = []
        for call in calls:
            deltas += [ToolCallDelta(self.num_calls, "", call.id, call.name),
                       ToolCallDelta(self.num_calls, call.arguments)]
            self.num_calls += 1
        return StreamedDelta(content, deltas)

    def advance(self, text: str, finished: bool) -> tuple[str, list[ToolCall]]:
        """The content and the calls that `text` completes beyond what was handled before."""
        pieces, calls = [], []
        while (block := _next_block(text, self.pos)) is not None:
            start, end = block
            call = parse_call(text[start + len(OPEN):end - len(CLOSE)])
            if call is None:
                pieces.append(self.release(text[self.pos:end], segment_ends=False))
            else:
                pieces.append(self.release(text[self.pos:start], segment_ends=True))
                calls.append(call)
            self.pos = end
        cut = len(text) if finished else _safe_end(text, self.pos)
        pieces.append(self.release(text[self.pos:cut], segment_ends=finished))
        self.pos = cut
        return "".join(pieces), calls

    def release(self, piece: str, segment_ends: bool) -> str:
        """`piece` as content, less whitespace that only pads a call or the output's ends."""
        text = self.held + piece
        if self.leading:
            text = text.lstrip()
            self.leading = not text
        kept = text.rstrip()
        self.held = "" if segment_ends else text[len(kept):]
        return kept


def parse_call(body: str) -> ToolCall | None:
    """The call a block holds: a JSON object with a string `name` and an object `arguments`;
    None when it is anything else."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict):
        return None
    name, arguments = value.get("name"), value.get("arguments")
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


def _next_block(text: str, pos: int) -> tuple[int, int] | None:
    """(start, end) of the first whole <tool_call>...</tool_call> block at or after pos."""
    start = text.find(OPEN, pos)
    if start < 0:
        return None
    close = text.find(CLOSE, start + len(OPEN))
    return None if close < 0 else (start, close + len(CLOSE))


def _safe_end(text: str, pos: int) -> int:
    """Where the text that is surely content ends: before an open call, or before a tail
    that may be the start of one (`<tool`)."""
    start = text.find(OPEN, pos)
    if start >= 0:
        return start
    for size in range(min(len(OPEN) - 1, len(text) - pos), 0, -1):
        if text.endswith(OPEN[:size]):
            return len(text) - size
    return len(text)


def hermes_grammar(functions: dict[str, dict[str, Any] | None], parallel: bool) -> str:
    """A Lark grammar (llguidance's dialect) for one call, or with `parallel` one or more
    calls a line apart, of these functions (name -> parameters schema, None: no parameters):
    the name one of them and the arguments valid for that function's schema."""
    rules = [f"fn_{i}" for i in range(len(functions))]
    lines = ['start: call ("\\n" call)*' if parallel else "start: call",
             'call: "<tool_call>\\n" (' + " | ".join(rules) + ') "\\n</tool_call>"']
    for rule, (name, parameters) in zip(rules, functions.items()):
        lines.append(f"{rule}: %json {json.dumps(call_schema(name, parameters), ensure_ascii=False)}")
    return "\n".join(lines)


def grammar_error(grammar: str) -> str | None:
    """Why llguidance cannot compile this grammar (a keyword or format of a schema it cannot
    enforce, say); None when it can."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        llguidance.LLMatcher.grammar_from_lark(grammar))
    return messages[0] if is_error else None


def call_schema(name: str, parameters: dict[str, Any] | None) -> dict[str, Any]:
    """The JSON schema of one call's object. The parameters' own definitions move to its root,
    where their `#/$defs/...` references now point."""
    arguments = dict(parameters) if parameters is not None else dict(_NO_PARAMETERS)
    definitions = {key: arguments.pop(key) for key in ("$defs", "definitions") if key in arguments}
    arguments.setdefault("type", "object")  # a call's arguments are always an object
    return {"type": "object", "properties": {"name": {"const": name}, "arguments": arguments},
            "required": ["name", "arguments"], "additionalProperties": False, **definitions,
            "x-guidance": _JSON_LAYOUT}
