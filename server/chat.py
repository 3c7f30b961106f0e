"""POST /v1/chat/completions: the route, chat prompt building, its response body and its
stream chunks."""
from __future__ import annotations

import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from specdec.outputs import CompletionOutput, RequestOutput
from specdec.server.errors import APIError
from specdec.server.jobs import Job, JobSpec, collect, start_job, usage
from specdec.server.logprobs import chat_logprobs
from specdec.server.protocol import ChatCompletionRequest
from specdec.server.state import ServerState, server_state
from specdec.server.streaming import Delta, Streamer, streaming_response


async def create_chat_completion(request: Request) -> Response:
    state = server_state(request)
    body = await state.parse(request, ChatCompletionRequest)
    params = state.sampling_params(body)
    prompt = await chat_prompt(state, body.conversation(), body.add_generation_prompt)
    job = Job(f"chatcmpl-{uuid.uuid4().hex}", params.n)
    spec = JobSpec(params, body.speculative, "messages", _max_tokens_field(body))
    await start_job(request, state, job, [prompt], spec)
    num_top = body.top_logprobs or 0
    if body.stream:
        return streaming_response(request, job, ChatStreamer(state, job, body.include_usage, num_top))
    finals = await collect(request, job)
    return JSONResponse(chat_body(state, job, finals[0], num_top))


def _max_tokens_field(body: ChatCompletionRequest) -> str | None:
    """The field that set max_tokens, if the client set it (else it is the room left)."""
    for name in ("max_completion_tokens", "max_tokens"):
        if getattr(body, name) is not None and name in body.model_fields_set:
            return name
    return None


async def chat_prompt(state: ServerState, conversation: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
    """The conversation through the model's chat template, as token ids, both done on the
    tokenizer thread; a 400 when the model has no template, the template rejects the
    messages, or the text provably has max_model_len tokens or more."""
    tokenizer = state.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, f"the model `{state.model_name}` has no chat template, so chat messages cannot be "
                            "formatted; use /v1/completions with a plain prompt instead", param="messages",
                       code="no_chat_template")
    try:
        text = await state.text.run(tokenizer.apply_chat_template, conversation, tokenize=False,
                                    add_generation_prompt=add_generation_prompt)
    except Exception as exc:  # noqa: BLE001 - a template that rejects these messages
        raise APIError(400, f"the chat template could not format these messages: {exc}", param="messages") from None
    return await state.encode(str(text), "messages", add_special_tokens=False)


def chat_body(state: ServerState, job: Job, final: RequestOutput, num_top: int) -> dict[str, Any]:
    choices = [_choice(state, c, num_top) for c in final.outputs]
    return {"id": job.request_id, "object": "chat.completion", "created": job.created, "model": state.model_name,
            "choices": choices, "usage": usage([final])}


def _choice(state: ServerState, completion: CompletionOutput, num_top: int) -> dict[str, Any]:
    logprobs = None
    if completion.logprobs is not None:
        logprobs = chat_logprobs(state.tokens, completion.token_ids, completion.logprobs, num_top)
    return {"index": completion.index, "message": {"role": "assistant", "content": completion.text},
            "logprobs": logprobs, "finish_reason": completion.finish_reason}


class ChatStreamer(Streamer):
    object_name = "chat.completion.chunk"

    def __init__(self, state: ServerState, job: Job, include_usage: bool, num_top: int) -> None:
        super().__init__(state, job, include_usage)
        self.num_top = num_top

    def opening(self) -> list[dict[str, Any]]:
        """The assistant role first, once per choice, as OpenAI streams it."""
        count = len(self.job.streams) * self.job.n
        return [self.chunk([{"index": i, "delta": {"role": "assistant"}, "logprobs": None, "finish_reason": None}])
                for i in range(count)]

    def choice(self, output: RequestOutput, delta: Delta) -> dict[str, Any]:
        logprobs = None
        if delta.logprobs is not None:
            logprobs = chat_logprobs(self.state.tokens, delta.token_ids, delta.logprobs, self.num_top)
        content = {"content": delta.text} if delta.text or delta.finish_reason is None else {}
        return {"index": delta.index, "delta": content, "logprobs": logprobs, "finish_reason": delta.finish_reason}
