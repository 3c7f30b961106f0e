"""Running one API request: one engine request per prompt, their outputs interleaved as
they come, aborted (KV blocks freed) when the client leaves, failures turned into APIErrors."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request

from specdec.async_engine import EngineDeadError, EngineShuttingDownError, RequestStream
from specdec.outputs import RequestOutput
from specdec.parallel_sampling import Prompt
from specdec.sampling_params import SamplingParams
from specdec.server.errors import APIError, unavailable
from specdec.server.metrics import RequestTimer
from specdec.server.state import ServerState

logger = logging.getLogger(__name__)
DISCONNECT_POLL_SECONDS = 0.2


@dataclass
class Job:
    """One API request: one engine request (RequestStream) per prompt, each with `n`
    completions; choice `p * n + i` is completion i of prompt p."""

    request_id: str
    n: int
    created: int = field(default_factory=lambda: int(time.time()))
    streams: list[RequestStream] = field(default_factory=list)
    timers: list[RequestTimer] = field(default_factory=list)
    prompt_texts: list[str | None] = field(default_factory=list)  # a text prompt as sent (echo)

    def abort(self) -> None:
        for stream in self.streams:
            stream.abort()


@dataclass(frozen=True)
class JobSpec:
    """What the engine is asked for, and the request fields an error names."""

    params: SamplingParams
    speculative: bool
    param: str  # the prompt's field: prompt or messages
    max_tokens_field: str | None = None  # the field that set max_tokens; None: a default, clamped to the room


async def start_job(request: Request, state: ServerState, job: Job, prompts: list[Prompt], spec: JobSpec) -> None:
    """Tokenize the prompts (off the event loop), check them against the server's limits and
    add them to the engine together. A refused prompt is a 400 naming the field (and its index
    among several); if the client leaves meanwhile, nothing more is added and what was is aborted."""
    state.check_ready()
    check_choices(state, len(prompts), spec.params.n)
    async with _stop_if_gone(request, job):
        token_ids = await tokenize(state, prompts, spec)
        job.prompt_texts = [p if isinstance(p, str) else None for p in prompts]
        await _add_all(state, job, token_ids, spec)


def check_choices(state: ServerState, num_prompts: int, n: int) -> None:
    limits = state.limits
    if num_prompts > limits.max_prompts:
        raise APIError(400, f"{num_prompts} prompts is more than the limit of {limits.max_prompts} per request",
                       param="prompt")
    if num_prompts * n > limits.max_choices:
        raise APIError(400, f"n × prompts is {n} × {num_prompts} = {num_prompts * n} choices, more than the "
                            f"limit of {limits.max_choices} per request", param="n")


async def tokenize(state: ServerState, prompts: list[Prompt], spec: JobSpec) -> list[list[int]]:
    """Token ids of each prompt; a prompt that is provably too long is refused untokenized."""
    result, total = [], 0
    for index, prompt in enumerate(prompts):
        where = f"{spec.param}[{index}]: " if len(prompts) > 1 else ""
        if isinstance(prompt, str):
            prompt = await state.encode(prompt, spec.param, where=where)
        total += len(prompt)
        if total > state.limits.max_prompt_tokens:
            raise APIError(400, f"the prompts have at least {total} tokens in all, more than the limit of "
                                f"{state.limits.max_prompt_tokens} per request", param=spec.param)
        _check_room(state, prompt, spec, where)
        result.append(prompt)
    return result


def _check_room(state: ServerState, token_ids: list[int], spec: JobSpec, where: str) -> None:
    """The prompt must leave room for max_tokens when the client set it (vLLM refuses too)."""
    max_tokens, field_name = spec.params.max_tokens, spec.max_tokens_field
    room = state.max_model_len - len(token_ids)
    if max_tokens is None or field_name is None or room < 1 or max_tokens <= room:
        return  # a prompt with no room at all gets the engine's own error
    raise APIError(400, f"{where}{field_name} is {max_tokens}, but the prompt has {len(token_ids)} tokens and "
                        f"max_model_len is {state.max_model_len}: at most {room} tokens can be generated",
                   param=field_name)


async def _add_all(state: ServerState, job: Job, prompts: list[list[int]], spec: JobSpec) -> None:
    """All prompts at once (the engine admits them in one step); on any failure or
    cancellation every request added is aborted."""
    many = len(prompts) > 1
    job.timers = [state.metrics.timer() for _ in prompts]
    adds = [asyncio.create_task(state.engine.generate(f"{job.request_id}-p{i}" if many else job.request_id,
                                                       prompt, spec.params, spec.speculative))
            for i, prompt in enumerate(prompts)]
    try:
        await asyncio.gather(*adds, return_exceptions=True)
    except BaseException:
        _abort_added(adds)  # gather cancelled the adds still pending: each aborts itself
        raise
    errors = [(i, t.exception()) for i, t in enumerate(adds) if t.exception() is not None]
    if errors:
        _abort_added(adds)
        index, error = errors[0]
        raise _add_error(error, f"{spec.param}[{index}]: " if many else "", spec.param)
    job.streams = [t.result() for t in adds]


def _abort_added(adds: list[asyncio.Task[RequestStream]]) -> None:
    for add in adds:
        if add.done() and not add.cancelled() and add.exception() is None:
            add.result().abort()


def _add_error(error: BaseException | None, where: str, param: str) -> BaseException:
    if isinstance(error, ValueError):
        return APIError(400, f"{where}{error}", param=param)
    if isinstance(error, (EngineDeadError, EngineShuttingDownError)):
        return unavailable(str(error))
    return error or RuntimeError("adding the request failed")


@contextlib.asynccontextmanager
async def _stop_if_gone(request: Request, job: Job) -> AsyncIterator[None]:
    """Cancel the enclosed work (tokenizing, adding) if the client leaves meanwhile; the
    handler then ends with a 499 nobody reads, and no traceback."""
    task = asyncio.current_task()
    gone = asyncio.Event()

    async def watch() -> None:
        await _wait_disconnect(request)
        gone.set()
        job.abort()
        if task is not None:
            task.cancel()

    watcher = asyncio.create_task(watch())
    try:
        yield
    except asyncio.CancelledError:
        if not gone.is_set() or task is None:
            raise
        task.uncancel()
        raise APIError(499, "the client closed the request", code="client_closed_request") from None
    finally:
        watcher.cancel()


async def interleaved(job: Job) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """(prompt index, merged cumulative output) as each prompt's request makes progress."""
    pending = {asyncio.ensure_future(s.__anext__()): i for i, s in enumerate(job.streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                index = pending.pop(task)
                output: RequestOutput = task.result()
                job.timers[index].observe(output)
                if not output.finished:
                    pending[asyncio.ensure_future(job.streams[index].__anext__())] = index
                yield index, output
    finally:
        for task in pending:
            task.cancel()


@contextlib.asynccontextmanager
async def abort_on_disconnect(request: Request, job: Job) -> AsyncIterator[None]:
    """Abort the job's engine requests (freeing their KV blocks) if the client leaves or
    the handler is cancelled; a no-op for requests that finished."""
    watcher = asyncio.create_task(_watch_disconnect(request, job))
    try:
        yield
    finally:
        watcher.cancel()
        job.abort()


async def _watch_disconnect(request: Request, job: Job) -> None:
    await _wait_disconnect(request)
    logger.info("client of %s disconnected: aborting", job.request_id)
    job.abort()


async def _wait_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_SECONDS)


def failure(output: RequestOutput) -> APIError | None:
    """The error a failed or aborted output reports to the client; None if it is fine."""
    reasons = {c.finish_reason for c in output.outputs}
    if output.error is not None or "error" in reasons:
        return APIError(500, f"the engine failed the request: {output.error or 'unknown error'}", "server_error",
                        code="internal_error")
    if "abort" in reasons:
        return unavailable("the request was aborted (client gone or server shutting down)")
    return None


async def collect(request: Request, job: Job) -> list[RequestOutput]:
    """Every prompt's final output, in prompt order; raises the first failure."""
    finals: list[RequestOutput | None] = [None] * len(job.streams)
    async with abort_on_disconnect(request, job), contextlib.aclosing(interleaved(job)) as outputs:
        async for index, output in outputs:
            finals[index] = output
            error = failure(output)
            if error is not None:
                raise error
    return [f for f in finals if f is not None]


def usage(outputs: list[RequestOutput]) -> dict[str, int]:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
