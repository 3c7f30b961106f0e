"""Server-sent events: cumulative engine outputs become per-choice deltas, a Streamer shapes
them into chunks (completions.py and chat.py subclass it), and `streaming_response` sends
them, an error event on failure and `[DONE]` at the end, with an SSE comment whenever the
stream has been silent for the server's keep-alive interval. A stream the server aborts
(shutdown) first ends each unfinished choice with a chunk whose
finish_reason is "abort", as vLLM's do, so clients that only read finish reasons see it."""
from __future__ import annotations

import abc
import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from specdec.outputs import CompletionOutput, RequestOutput, SampleLogprobs
from specdec.server.jobs import Job, abort_on_disconnect, failure, interleaved, usage
from specdec.server.state import ServerState


@dataclass
class Delta:
    index: int  # the choice index in the response
    text: str
    token_ids: list[int]
    logprobs: SampleLogprobs | None
    finish_reason: str | None
    offset: int  # characters of this choice sent before this delta
    first: bool


@dataclass
class _Progress:
    text_len: int = 0
    num_tokens: int = 0
    finished: bool = False
    started: bool = False


class DeltaTracker:
    """Turns cumulative outputs into per-choice deltas: finish_reason exactly once."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.progress: dict[int, _Progress] = {}

    def deltas(self, prompt_index: int, output: RequestOutput) -> list[Delta]:
        result = []
        for completion in output.outputs:
            index = prompt_index * self.n + completion.index
            delta = self._delta(index, completion)
            if delta is not None:
                result.append(delta)
        return result

    def _delta(self, index: int, completion: CompletionOutput) -> Delta | None:
        prog = self.progress.setdefault(index, _Progress())
        text = completion.text[prog.text_len:]
        token_ids = completion.token_ids[prog.num_tokens:]
        logprobs = None if completion.logprobs is None else completion.logprobs[prog.num_tokens:]
        finish = completion.finish_reason
        if prog.finished or not (text or finish or (token_ids and logprobs)):
            return None
        delta = Delta(index, text, token_ids, logprobs, finish, prog.text_len, not prog.started)
        prog.text_len, prog.num_tokens = len(completion.text), len(completion.token_ids)
        prog.finished, prog.started = finish is not None, True
        return delta

    def finish_rest(self, count: int) -> list[int]:
        """The indices below `count` of choices not finished yet, now marked finished."""
        rest = [index for index in range(count) if not self.progress.get(index, _Progress()).finished]
        for index in rest:
            self.progress.setdefault(index, _Progress()).finished = True
        return rest


class Streamer(abc.ABC):
    """Formats one streaming response; subclasses shape completions / chat chunks."""

    object_name = ""

    def __init__(self, state: ServerState, job: Job, include_usage: bool) -> None:
        self.state, self.job, self.include_usage = state, job, include_usage
        self.tracker = DeltaTracker(job.n)
        self.latest: dict[int, RequestOutput] = {}

    def chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        body: dict[str, Any] = {"id": self.job.request_id, "object": self.object_name, "created": self.job.created,
                                "model": self.state.model_name, "choices": choices}
        if self.include_usage:
            body["usage"] = None
        return body

    def opening(self) -> list[dict[str, Any]]:
        return []

    def on_output(self, prompt_index: int, output: RequestOutput) -> list[dict[str, Any]]:
        self.latest[prompt_index] = output
        return [self.chunk([self.choice(output, d)]) for d in self.tracker.deltas(prompt_index, output)]

    @abc.abstractmethod
    def choice(self, output: RequestOutput, delta: Delta) -> dict[str, Any]:
        """One chunk choice for a delta of one prompt's output."""

    @classmethod
    @abc.abstractmethod
    def abort_choice(cls, index: int) -> dict[str, Any]:
        """The last choice of a stream cut short: nothing new, finish_reason "abort"."""

    def aborted(self) -> list[dict[str, Any]]:
        """A chunk per choice not finished yet, ending it with finish_reason "abort"."""
        count = len(self.job.streams) * self.job.n
        return [self.chunk([self.abort_choice(index)]) for index in self.tracker.finish_rest(count)]

    def closing(self) -> list[dict[str, Any]]:
        if not self.include_usage:
            return []
        body = self.chunk([])
        body["usage"] = usage(list(self.latest.values()))
        return [body]


# Characters json.dumps(ensure_ascii=False) leaves raw that str.splitlines() (and so
# httpx's aiter_lines) treats as line breaks: raw, they would cut an SSE event in two.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(data: dict[str, Any] | str) -> str:
    """One SSE event carrying `data` (JSON, or a bare string such as [DONE])."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload.translate(_LINE_BREAKS)}\n\n"


async def _events(request: Request, job: Job, streamer: Streamer) -> AsyncGenerator[str, None]:
    async with abort_on_disconnect(request, job), contextlib.aclosing(interleaved(job)) as outputs:
        for chunk in streamer.opening():
            yield sse(chunk)
        async for index, output in outputs:
            error = failure(output)
            if error is not None:
                if was_aborted(output):
                    for chunk in streamer.aborted():
                        yield sse(chunk)
                yield sse(error.body())
                break
            for chunk in streamer.on_output(index, output):
                yield sse(chunk)
        else:
            for chunk in streamer.closing():
                yield sse(chunk)
        yield sse("[DONE]")


def was_aborted(output: RequestOutput) -> bool:
    """Whether `failure` reports an abort (an engine error takes precedence there)."""
    reasons = {completion.finish_reason for completion in output.outputs}
    return output.error is None and "error" not in reasons and "abort" in reasons


KEEP_ALIVE = ": keep-alive\n\n"  # an SSE comment: clients skip it, proxies see bytes flow


async def with_keep_alive(events: AsyncGenerator[str, None], interval: float) -> AsyncGenerator[str, None]:
    """`events` unchanged and in order, plus KEEP_ALIVE whenever none has come for
    `interval` seconds (> 0): a request that waits in the queue or prefills a long
    prompt sends nothing for a while, and proxies cut connections that stay silent. Each
    event is awaited in a task of its own, which a comment never interrupts; when the
    stream is closed or cancelled (the client left), that task is cancelled, which ends
    `events` and so aborts the job."""
    if not interval > 0:
        raise ValueError(f"the keep-alive interval must be positive, got {interval}")
    pending: asyncio.Task[str | None] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.create_task(_next_event(events))
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield KEEP_ALIVE
                continue
            event, pending = pending.result(), None
            if event is None:
                return
            yield event
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
        else:
            await events.aclose()


async def _next_event(events: AsyncGenerator[str, None]) -> str | None:
    return await anext(events, None)


def streaming_response(request: Request, job: Job, streamer: Streamer) -> StreamingResponse:
    events = _events(request, job, streamer)
    interval = streamer.state.options.sse_keepalive
    if interval > 0:
        events = with_keep_alive(events, interval)
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
