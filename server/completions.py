"""POST /v1/completions: the route, its response body and its stream chunks."""
from __future__ import annotations

import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from specdec.outputs import CompletionOutput, RequestOutput
from specdec.server.jobs import Job, JobSpec, collect, start_job, usage
from specdec.server.logprobs import completion_logprobs
from specdec.server.protocol import CompletionRequest
from specdec.server.state import ServerState, server_state
from specdec.server.streaming import Delta, Streamer, streaming_response


async def create_completion(request: Request) -> Response:
    state = server_state(request)
    body = await state.parse(request, CompletionRequest)
    params = state.sampling_params(body)
    job = Job(f"cmpl-{uuid.uuid4().hex}", params.n)
    max_tokens_field = "max_tokens" if "max_tokens" in body.model_fields_set else None
    await start_job(request, state, job, body.prompts(), JobSpec(params, body.speculative, "prompt", max_tokens_field))
    if body.stream:
        return streaming_response(request, job, CompletionStreamer(state, job, body.include_usage, body.echo))
    finals = await collect(request, job)
    return JSONResponse(completion_body(state, job, finals, body.echo))


def completion_body(state: ServerState, job: Job, finals: list[RequestOutput], echo: bool) -> dict[str, Any]:
    choices = [_choice(state, job, p, out, c, echo) for p, out in enumerate(finals) for c in out.outputs]
    return {"id": job.request_id, "object": "text_completion", "created": job.created, "model": state.model_name,
            "choices": choices, "usage": usage(finals)}


def _choice(state: ServerState, job: Job, prompt_index: int, output: RequestOutput, completion: CompletionOutput,
            echo: bool) -> dict[str, Any]:
    prefix = _prompt_text(state, job, prompt_index, output) if echo else ""
    logprobs = None
    if completion.logprobs is not None:
        logprobs = completion_logprobs(state.tokens, completion.token_ids, completion.logprobs, len(prefix))
    return {"index": prompt_index * job.n + completion.index, "text": prefix + completion.text, "logprobs": logprobs,
            "finish_reason": completion.finish_reason}


def _prompt_text(state: ServerState, job: Job, prompt_index: int, output: RequestOutput) -> str:
    """The prompt as sent; a prompt of token ids (at most max_model_len) decoded."""
    text = job.prompt_texts[prompt_index] if prompt_index < len(job.prompt_texts) else None
    return text if text is not None else state.tokens.decode(output.prompt_token_ids)


class CompletionStreamer(Streamer):
    object_name = "text_completion"

    def __init__(self, state: ServerState, job: Job, include_usage: bool, echo: bool) -> None:
        super().__init__(state, job, include_usage)
        self.echo = echo

    def choice(self, output: RequestOutput, delta: Delta) -> dict[str, Any]:
        prompt_index = delta.index // self.job.n
        prefix = _prompt_text(self.state, self.job, prompt_index, output) if self.echo and delta.first else ""
        logprobs = None
        if delta.logprobs is not None:
            logprobs = completion_logprobs(self.state.tokens, delta.token_ids, delta.logprobs, delta.offset)
        return {"index": delta.index, "text": prefix + delta.text, "logprobs": logprobs,
                "finish_reason": delta.finish_reason}

    @classmethod
    def abort_choice(cls, index: int) -> dict[str, Any]:
        return {"index": index, "text": "", "logprobs": None, "finish_reason": "abort"}
