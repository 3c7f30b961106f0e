"""Request bodies of the OpenAI-compatible API (pydantic 2): their models, their strict
parsing off the wire (`parse_body`), and their validation errors.

Beyond OpenAI's fields every generation request takes vLLM-style extras: `top_k`,
`min_p`, `repetition_penalty`, `allowed_token_ids`, `bad_words`, `min_tokens`,
`ignore_eos`, `stop_token_ids`, `skip_special_tokens`,
`include_stop_str_in_output`, and the specdec switch

    speculative: bool = true

which turns speculative decoding off for this one request (plain decoding of the same
target model). With temperature 0 both give the same tokens; with speculation they
usually arrive sooner, several per step. It is a no-op on a server started without a
`--speculative-config`.

Output constraints (`response_format`, `guided_*`, `structured_outputs`) are described in
server/protocol_structured.py, chat's `tools`, `tool_choice` and `parallel_tool_calls` in
server/protocol_tools.py.

Every field is either honoured or refused: an unknown field (a typo such as `temprature`,
or a feature not built, such as `guided_whitespace_pattern`) is a 400 that names it,
never silently ignored. `user` (OpenAI's end-user id) is accepted and unused, as in vLLM.
Known fields are strict: `true` or `1.5` where an integer is expected is a 400 naming the field.

`parse_body` reads at most `max_bytes` of a body and refuses JSON nested deeper than
`max_depth` or holding lone UTF-16 surrogates (`"\\ud800"`) before validating it. Validators
that see a `BodyContext` (ServerState passes one) also refuse too many prompts, too many
choices and token-id lists longer than max_model_len, each before any per-item work.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from fastapi import Request
from pydantic import (
    BaseModel,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails

from specdec.sampling_params import MAX_INT64, MAX_N, MAX_STOP_STRINGS, SamplingParams
from specdec.server.errors import APIError
from specdec.server.json_body import DEFAULT_MAX_JSON_DEPTH, load_json
from specdec.server.protocol_base import StrictBody as _Body
from specdec.server.protocol_structured import StructuredFields
from specdec.server.protocol_tools import AssistantToolCall, ToolChoice, ToolDefinition, check_tool_choice, check_tools

MAX_LOGPROBS = 20
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
PromptInput = str | list[str] | list[int] | list[list[int]]
Body = TypeVar("Body", bound=BaseModel)


@dataclass(frozen=True)
class BodyContext:
    """The server's limits that validators need (pydantic's validation context)."""

    max_model_len: int
    max_prompts: int
    max_choices: int


def _context(info: ValidationInfo) -> BodyContext | None:
    return info.context if isinstance(info.context, BodyContext) else None


class StreamOptions(_Body):
    include_usage: bool = False


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_token_ids(value: list[Any], what: str) -> None:
    if not value:
        raise ValueError(f"{what} is empty: at least one token is needed")
    if not all(_is_int(t) for t in value):
        raise ValueError(f"{what} must contain only integer token ids")


def check_length(token_ids: list[Any], max_model_len: int) -> None:
    """A prompt must leave room for one generated token (the engine's own rule)."""
    if len(token_ids) >= max_model_len:
        raise ValueError(f"the prompt has {len(token_ids)} tokens but max_model_len is {max_model_len}: "
                         "the prompt must be shorter than max_model_len to leave room for output")


def check_sizes(value: Any, context: BodyContext | None) -> None:
    """Counts first, so a huge list is refused before any per-item work."""
    if context is None or not isinstance(value, list) or not value:
        return
    if isinstance(value[0], int):
        check_length(value, context.max_model_len)
        return
    if len(value) > context.max_prompts:
        raise ValueError(f"{len(value)} prompts is more than the limit of {context.max_prompts} per request")
    for item in value:
        if isinstance(item, list):
            check_length(item, context.max_model_len)


def check_prompt(value: Any) -> Any:
    """A string, a list of strings, a list of token ids, or a list of lists of token ids."""
    if isinstance(value, str):
        if not value:
            raise ValueError("the prompt is empty: at least one token is needed")
        return value
    if not isinstance(value, list) or not value:
        raise ValueError("prompt must be a non-empty string, a list of strings, a list of token ids "
                         "or a list of lists of token ids")
    if all(isinstance(p, str) for p in value):
        if not all(value):
            raise ValueError("the prompt is empty: at least one token is needed")
        return value
    if all(_is_int(t) for t in value):
        return value
    if all(isinstance(p, list) for p in value):
        for p in value:
            _check_token_ids(p, "a prompt of token ids")
        return value
    raise ValueError("prompt must be a string, a list of strings, a list of token ids "
                     "or a list of lists of token ids (not a mix)")


def check_stop(value: Any) -> Any:
    stops = [value] if isinstance(value, str) else value
    if stops is None:
        return None
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ValueError("stop must be a non-empty string or a list of non-empty strings")
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}")
    return value


class _Sampling(StructuredFields):
    """The fields every generation request shares (the output constraints among them)."""

    model: str | None = None  # None: the served model
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1, lt=MAX_INT64)
    seed: int | None = Field(default=None, ge=-1, lt=MAX_INT64)  # -1: random, as vLLM
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    logit_bias: dict[str, float] | None = None  # token id (as a JSON key) -> bias in [-100, 100]
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    speculative: bool = True  # False: plain decoding for this request
    user: str | None = None  # OpenAI's end-user id: accepted, not used

    _check_stop = field_validator("stop", mode="before")(check_stop)

    @field_validator("stop_token_ids")
    @classmethod
    def _check_stop_token_ids(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and any(t < 0 for t in value):
            raise ValueError("stop_token_ids must be non-negative integers")
        return value

    @model_validator(mode="after")
    def _check_stream_options(self) -> _Sampling:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """May raise ValueError (SamplingParams' own checks)."""
        return SamplingParams(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
            max_tokens=max_tokens, min_tokens=self.min_tokens, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, min_p=self.min_p,
            logit_bias=_token_bias(self.logit_bias),
            allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
            structured_outputs=self.structured_outputs_params(),
        )


def _token_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """logit_bias with its JSON string keys as token ids."""
    if bias is None:
        return None
    for key in bias:
        if not key.isdigit():
            raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
    return {int(key): value for key, value in bias.items()}


class CompletionRequest(_Sampling):
    prompt: PromptInput
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, value: Any, info: ValidationInfo) -> Any:
        check_sizes(value, _context(info))
        return check_prompt(value)

    @model_validator(mode="after")
    def _check_choices(self, info: ValidationInfo) -> CompletionRequest:
        context = _context(info)
        choices = self.n * len(self.prompts())
        if context is not None and choices > context.max_choices:
            raise ValueError(f"n × prompts is {self.n} × {len(self.prompts())} = {choices} choices, more than "
                             f"the limit of {context.max_choices} per request")
        return self

    @model_validator(mode="after")
    def _check_unsupported(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.echo and self.logprobs is not None:
            raise ValueError("echo with logprobs is not supported: prompt logprobs are not computed")
        return self

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt in the batch."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if all(isinstance(t, int) for t in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        return list(prompt)  # type: ignore[arg-type]

    def to_sampling_params(self) -> SamplingParams:
        return self.sampling_params(self.max_tokens, self.logprobs)


class TextPart(_Body):
    type: Literal["text"]
    text: str


def check_content(value: Any) -> Any:
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ValueError("content must be a string or a list of content parts")  # noqa: TRY004 - pydantic wants ValueError
    for part in value:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ValueError('only text content parts are supported: {"type": "text", "text": "..."}')
    return value


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[AssistantToolCall] | None = None  # an assistant's earlier calls (its content may be null)

    _check_content = field_validator("content", mode="before")(check_content)

    @model_validator(mode="after")
    def _check_tool_fields(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls is only allowed on assistant messages")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)

    def for_template(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [call.for_template() for call in self.tool_calls]
        return message


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    tools: list[ToolDefinition] | None = Field(default=None, min_length=1)
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, else "none"
    parallel_tool_calls: bool = True  # False: at most one call

    _check_tools = field_validator("tools")(check_tools)

    @field_validator("tool_choice")
    @classmethod
    def _check_tool_choice(cls, value: ToolChoice | None, info: ValidationInfo) -> ToolChoice | None:
        if "tools" not in info.data:  # tools failed its own checks: that is the error to report
            return value
        return check_tool_choice(value, info.data["tools"])

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return self

    def conversation(self) -> list[dict[str, Any]]:
        return [m.for_template() for m in self.messages]

    def to_sampling_params(self) -> SamplingParams:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(max_tokens, logprobs)  # None: up to max_model_len


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]

    @field_validator("tokens", mode="before")
    @classmethod
    def _check_tokens(cls, value: Any, info: ValidationInfo) -> Any:
        context = _context(info)
        if context is not None and isinstance(value, list) and len(value) > context.max_model_len:
            raise ValueError(f"{len(value)} tokens is more than max_model_len ({context.max_model_len}): "
                             "no sequence of this model is that long")
        return value


# ---- validation errors -> one clear message ------------------------------------------------


def _location(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _message(error: ErrorDetails) -> str:
    if error.get("type") == "extra_forbidden":
        return "unknown field: this server does not support it (see the API docs for the fields it takes)"
    msg = str(error.get("msg", "invalid value"))
    for prefix in ("Value error, ", "Assertion failed, "):
        msg = msg.removeprefix(prefix)
    return msg


def format_validation_error(exc: ValidationError) -> tuple[str, str | None]:
    """(message, param) built from field locations and messages only: no URLs, no inputs."""
    parts, param = [], None
    for error in exc.errors(include_url=False, include_input=False, include_context=False):
        where = _location(tuple(error.get("loc", ())))
        param = param or where or None
        parts.append(f"{where}: {_message(error)}" if where else _message(error))
    return "; ".join(parts) or "invalid request", param


# ---- reading a body off the wire -------------------------------------------------------------


async def parse_body(request: Request, model: type[Body], max_bytes: int = DEFAULT_MAX_BODY_BYTES,
                     max_depth: int = DEFAULT_MAX_JSON_DEPTH, context: BodyContext | None = None) -> Body:
    """Strict JSON parsing with OpenAI-style 4xx errors (no framework internals leak)."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type != "application/json":
        raise APIError(415, f"Content-Type must be application/json, got {content_type or 'none'!r}",
                       code="unsupported_media_type")
    data = load_json(await read_body(request, max_bytes), max_depth)
    try:
        return model.model_validate(data, context=context)
    except ValidationError as exc:
        message, param = format_validation_error(exc)
        raise APIError(400, message, param=param) from None


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The body, refused with a 413 as soon as it is known to be over `max_bytes`: a declared
    Content-Length before reading anything, a chunked body once that many bytes came in."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(max_bytes: int) -> APIError:
    return APIError(413, f"the request body is larger than the server's limit of {max_bytes} bytes "
                         "(--max-body-bytes)", code="request_too_large")
