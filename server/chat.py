"""POST /v1/chat/completions: the route, chat prompt building, its response body and its
stream chunks, with tool calls: the tools in the prompt, a grammar for tool_choice "required"
or a named function, and the calls read back out of the output by a tool parser."""
from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from specdec.outputs import CompletionOutput, RequestOutput
from specdec.sampling_params import SamplingParams, StructuredOutputsParams
from specdec.server.errors import APIError
from specdec.server.hermes_tool_parser import HermesToolParser, grammar_error, hermes_grammar
from specdec.server.jobs import Job, JobSpec, collect, start_job, usage
from specdec.server.logprobs import chat_logprobs
from specdec.server.protocol import ChatCompletionRequest
from specdec.server.protocol_tools import ToolChoice, describe_tool_choice
from specdec.server.state import ServerState, server_state
from specdec.server.streaming import Delta, Streamer, streaming_response
from specdec.server.tool_parsers import ToolCallDelta, ToolParser, tool_parser_class
from specdec.server.tool_prompt import prompt_inputs


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tool fields ask of the route."""

    shown: list[dict[str, Any]] | None = None  # the tools the prompt shows; None: none
    parser: type[ToolParser] | None = None  # None: the output is plain content
    grammar: str | None = None  # the Lark grammar the output must follow
    parallel: bool = True  # False: at most one call


async def create_chat_completion(request: Request) -> Response:
    state = server_state(request)
    body = await state.parse(request, ChatCompletionRequest)
    params = state.sampling_params(body)
    plan = plan_tools(state, body)
    params = constrain(params, plan)
    prompt = await chat_prompt(state, body.conversation(), body.add_generation_prompt, plan.shown)
    job = Job(f"chatcmpl-{uuid.uuid4().hex}", params.n)
    spec = JobSpec(params, body.speculative, "messages", _max_tokens_field(body))
    await start_job(request, state, job, [prompt], spec)
    num_top = body.top_logprobs or 0
    if body.stream:
        return streaming_response(request, job, ChatStreamer(state, job, body.include_usage, num_top, plan))
    finals = await collect(request, job)
    return JSONResponse(chat_body(state, job, finals[0], num_top, plan))


def _max_tokens_field(body: ChatCompletionRequest) -> str | None:
    """The field that set max_tokens, if the client set it (else it is the room left)."""
    for name in ("max_completion_tokens", "max_tokens"):
        if getattr(body, name) is not None and name in body.model_fields_set:
            return name
    return None


def plan_tools(state: ServerState, body: ChatCompletionRequest) -> ToolPlan:
    """As vLLM: tools without tool_choice mean "auto", which needs the server's parser and
    --enable-auto-tool-choice; "required" and a named function need only the tools (a grammar
    makes the output Hermes calls, read back with the hermes parser); "none" ignores the tools."""
    tools = body.tools or []
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
    if choice == "none":
        return ToolPlan()
    shown = [tool.model_dump(exclude_none=True) for tool in tools]
    if choice == "auto":
        return ToolPlan(shown, _pick_auto_parser(state, body), None, body.parallel_tool_calls)
    return ToolPlan(shown, HermesToolParser, _build_call_grammar(body, choice), body.parallel_tool_calls)


def _build_call_grammar(body: ChatCompletionRequest, choice: ToolChoice) -> str:
    """The grammar of "required" (calls of any of the tools) or of a named function (of that
    one); a 400 when a schema uses what the grammar engine cannot enforce."""
    tools = body.tools or []
    called = [t for t in tools if isinstance(choice, str) or t.function.name == choice.function.name]
    grammar = hermes_grammar({t.function.name: t.function.parameters for t in called}, body.parallel_tool_calls)
    error = grammar_error(grammar)
    if error is not None:
        raise APIError(400, f"the tools' parameters cannot be enforced for tool_choice "
                            f"{describe_tool_choice(choice)}: {error}", param="tools")
    return grammar


def _pick_auto_parser(state: ServerState, body: ChatCompletionRequest) -> type[ToolParser]:
    settings = state.tool_calls
    if not settings.auto_tool_choice or settings.parser is None:
        raise APIError(400, 'tool_choice "auto" (the default when tools are given) needs a server started with '
                            "--enable-auto-tool-choice and --tool-call-parser; send tool_choice \"required\", a "
                            'named function or "none" instead', param="tool_choice")
    strict = [tool.function.name for tool in body.tools or [] if tool.function.strict]
    if strict:
        raise APIError(400, f"tools {strict} are strict, but with tool_choice \"auto\" the output is not constrained, "
                            'so their arguments cannot be promised to follow the schema; use tool_choice "required" '
                            "or a named function, or strict false", param="tools")
    return tool_parser_class(settings.parser)


def constrain(params: SamplingParams, plan: ToolPlan) -> SamplingParams:
    """The sampling parameters with the plan's grammar, which cannot be combined with another."""
    if plan.grammar is None:
        return params
    if params.structured_outputs is not None:
        raise APIError(400, "response_format (or guided_*) cannot be combined with tool_choice \"required\" or a "
                            "named function: both constrain the output; send one of them", param="tool_choice")
    return dataclasses.replace(params, structured_outputs=StructuredOutputsParams(grammar=plan.grammar))


async def chat_prompt(state: ServerState, conversation: list[dict[str, Any]], add_generation_prompt: bool,
                      tools: list[dict[str, Any]] | None = None) -> list[int]:
    """The conversation (and tools to show) through the model's chat template, as token ids,
    both done on the tokenizer thread; a 400 when the model has no template, the template
    rejects the messages, or the text provably has max_model_len tokens or more."""
    tokenizer = state.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, f"the model `{state.model_name}` has no chat template, so chat messages cannot be "
                            "formatted; use /v1/completions with a plain prompt instead", param="messages",
                       code="no_chat_template")
    messages, extra = prompt_inputs(conversation, tools, tokenizer.chat_template)
    try:
        text = await state.text.run(tokenizer.apply_chat_template, messages, tokenize=False,
                                    add_generation_prompt=add_generation_prompt, **extra)
    except Exception as exc:  # noqa: BLE001 - a template that rejects these messages
        raise APIError(400, f"the chat template could not format these messages: {exc}", param="messages") from None
    return await state.encode(str(text), "messages", add_special_tokens=False)


def chat_body(state: ServerState, job: Job, final: RequestOutput, num_top: int,
              plan: ToolPlan | None = None) -> dict[str, Any]:
    choices = [_choice(state, c, num_top, plan or ToolPlan()) for c in final.outputs]
    return {"id": job.request_id, "object": "chat.completion", "created": job.created, "model": state.model_name,
            "choices": choices, "usage": usage([final])}


def _choice(state: ServerState, completion: CompletionOutput, num_top: int, plan: ToolPlan) -> dict[str, Any]:
    logprobs = None
    if completion.logprobs is not None:
        logprobs = chat_logprobs(state.tokens, completion.token_ids, completion.logprobs, num_top)
    message: dict[str, Any] = {"role": "assistant", "content": completion.text}
    finish_reason = completion.finish_reason
    if plan.parser is not None:
        extracted = plan.parser().extract(completion.text)
        calls = extracted.tool_calls if plan.parallel else extracted.tool_calls[:1]
        message["content"] = extracted.content
        if calls:
            message["tool_calls"] = [call.to_openai() for call in calls]
        finish_reason = _finish_reason(finish_reason, bool(calls))
    return {"index": completion.index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def _finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's "tool_calls" when the output ended by itself after calling (a truncated
    output keeps "length": its unfinished call is content)."""
    return "tool_calls" if called and reason == "stop" else reason


class ChatStreamer(Streamer):
    object_name = "chat.completion.chunk"

    def __init__(self, state: ServerState, job: Job, include_usage: bool, num_top: int,
                 plan: ToolPlan | None = None) -> None:
        super().__init__(state, job, include_usage)
        self.num_top = num_top
        self.plan = plan or ToolPlan()
        self.parsers: dict[int, ToolParser] = {}  # per choice
        self.texts: dict[int, str] = {}  # per choice: its text so far
        self.called: set[int] = set()  # choices that sent a call

    def opening(self) -> list[dict[str, Any]]:
        """The assistant role first, once per choice, as OpenAI streams it."""
        count = len(self.job.streams) * self.job.n
        return [self.chunk([{"index": i, "delta": {"role": "assistant"}, "logprobs": None, "finish_reason": None}])
                for i in range(count)]

    def on_output(self, prompt_index: int, output: RequestOutput) -> list[dict[str, Any]]:
        parser_class = self.plan.parser
        if parser_class is None:
            return super().on_output(prompt_index, output)
        self.latest[prompt_index] = output
        return [self.chunk([choice]) for delta in self.tracker.deltas(prompt_index, output)
                for choice in self.tool_choices(delta, parser_class)]

    def choice(self, output: RequestOutput, delta: Delta) -> dict[str, Any]:
        logprobs = self.logprobs(delta)
        content = {"content": delta.text} if delta.text or delta.finish_reason is None else {}
        return {"index": delta.index, "delta": content, "logprobs": logprobs, "finish_reason": delta.finish_reason}

    @classmethod
    def abort_choice(cls, index: int) -> dict[str, Any]:
        return {"index": index, "delta": {}, "logprobs": None, "finish_reason": "abort"}

    def logprobs(self, delta: Delta) -> dict[str, Any] | None:
        if delta.logprobs is None:
            return None
        return chat_logprobs(self.state.tokens, delta.token_ids, delta.logprobs, self.num_top)

    def tool_choices(self, delta: Delta, parser_class: type[ToolParser]) -> list[dict[str, Any]]:
        """A delta as chunk choices: its content less any call markup (with its logprobs),
        a choice per call delta, and the finish reason last on its own, as OpenAI streams them."""
        index, finished = delta.index, delta.finish_reason is not None
        parser = self.parsers.setdefault(index, parser_class())
        self.texts[index] = self.texts.get(index, "") + delta.text
        streamed = parser.stream(self.texts[index], finished)
        choices = []
        logprobs = self.logprobs(delta)
        if streamed.content or logprobs is not None:
            content = {"content": streamed.content} if streamed.content else {}
            choices.append({"index": index, "delta": content, "logprobs": logprobs, "finish_reason": None})
        for call in self.limit_calls(streamed.tool_calls):
            self.called.add(index)
            choices.append({"index": index, "delta": {"tool_calls": [call.to_openai()]}, "logprobs": None,
                            "finish_reason": None})
        if finished:
            reason = _finish_reason(delta.finish_reason, index in self.called)
            choices.append({"index": index, "delta": {}, "logprobs": None, "finish_reason": reason})
        return choices

    def limit_calls(self, calls: list[ToolCallDelta]) -> list[ToolCallDelta]:
        """Without parallel_tool_calls, only the first call of a choice is sent."""
        return calls if self.plan.parallel else [call for call in calls if call.index == 0]
