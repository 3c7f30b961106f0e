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

from specdec.outputs import RequestOutput
from specdec.parallel_sampling import Prompt
from specdec.sampling_params import SamplingParams
from specdec.server.async_engine import EngineDeadError, EngineShuttingDownError, RequestStream
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

    def abort(self) -> None:
        for stream in self.streams:
            stream.abort()


async def start_job(state: ServerState, job: Job, prompts: list[Prompt], params: SamplingParams,
                    speculative: bool, param: str) -> None:
    """Add the job's engine requests; a prompt the engine refuses is a 400 naming `param`
    (and its index among several), and none of the job's requests is left running."""
    state.check_ready()
    index = 0
    try:
        for index, prompt in enumerate(prompts):
            request_id = job.request_id if len(prompts) == 1 else f"{job.request_id}-p{index}"
            job.timers.append(state.metrics.timer())
            job.streams.append(await state.engine.generate(request_id, prompt, params, speculative))
    except ValueError as exc:
        job.abort()
        where = f"{param}[{index}]: " if len(prompts) > 1 else ""
        raise APIError(400, f"{where}{exc}", param=param) from None
    except (EngineDeadError, EngineShuttingDownError) as exc:
        job.abort()
        raise unavailable(str(exc)) from None
    except BaseException:
        job.abort()
        raise


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
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_SECONDS)
    logger.info("client of %s disconnected: aborting", job.request_id)
    job.abort()


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
