"""AsyncLLM: the engine as an asyncio streaming API, for embedding it in another server.

    async with AsyncLLM("path/to/model", speculative_config={"method": "ngram"}) as llm:
        async for output in llm.generate("Hello", SamplingParams(max_tokens=32)):
            print(output.outputs[0].text)  # cumulative: the whole text so far

`AsyncLLM(model, **options)` takes the options `LLM` takes. The engine runs on its own
thread (specdec.async_engine.AsyncEngine, the server's engine front), so the event
loop never blocks on a step. Each output of `generate` is cumulative, as vLLM's default
output kind; the last has `finished=True`. Leaving the loop early, or cancelling the
task that iterates, aborts the request and frees its KV blocks. `n > 1` fans out into
child requests (specdec.parallel_sampling) merged back into one output, as in `LLM`.
"""
from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Any

from specdec.async_engine import AsyncEngine
from specdec.llm import PromptType, build_engine, options_signature, parse_prompt
from specdec.model_registry import DEFAULT_MODEL
from specdec.outputs import RequestOutput
from specdec.sampling_params import SamplingParams

SHUTDOWN_TIMEOUT = 30.0  # seconds to wait for the engine thread to stop


class EngineGenerateError(RuntimeError):
    """The engine failed while running this request (the engine itself goes on)."""


class AsyncLLM:
    """`AsyncLLM(model, **options)`: the options are EngineConfig's fields, as for `LLM`."""

    def __init__(self, model: str = DEFAULT_MODEL, **options: Any) -> None:
        self.engine = build_engine(model, options)
        self.model_dir: Path = self.engine.model_dir
        self._front = AsyncEngine(self.engine)
        self._prefix = uuid.uuid4().hex[:8]  # ids of different AsyncLLMs never meet, but stay readable
        self._ids = itertools.count()
        self._stopped = False

    @property
    def is_running(self) -> bool:
        """True while the engine thread is up and takes requests."""
        return self._front.is_accepting

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_metrics(self) -> dict[str, Any]:
        """The engine's counters and gauges as of its last step (EngineMetrics and scheduler state)."""
        return dict(self._front.stats)

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        use_speculation: bool = True,
    ) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs of one request as its tokens arrive, the last with finished=True.

        A bad prompt or bad params raise ValueError (TypeError for a wrong type) before
        anything is yielded; a request the engine fails raises EngineGenerateError. After
        `abort(request_id)` the last output has finish_reason "abort".
        """
        params = _checked_params(sampling_params)
        engine_prompt = parse_prompt(prompt)
        request_id = request_id if request_id is not None else f"{self._prefix}-{next(self._ids)}"
        stream = await self._front.generate(request_id, engine_prompt, params, use_speculation)
        try:
            async for output in stream:
                _raise_on_error(output)
                yield output
        finally:
            stream.abort()  # a no-op once finished; else the consumer left early or was cancelled

    async def abort(self, request_id: str | list[str]) -> None:
        """Abort requests by id (unknown or finished ones are skipped); their streams end."""
        for one in [request_id] if isinstance(request_id, str) else request_id:
            await self._front.abort(one)

    def shutdown(self, timeout: float = SHUTDOWN_TIMEOUT) -> None:
        """Abort what is in flight and stop the engine thread; waits for it to stop. Safe to
        call twice, from synchronous code or from a coroutine."""
        if self._stopped:
            return
        self._stopped = True
        # AsyncEngine.shutdown is a coroutine that waits for the thread; a loop of its own on a
        # helper thread runs it, so this works whether or not the caller's loop is running.
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="specdec-shutdown") as pool:
            pool.submit(asyncio.run, self._front.shutdown(drain=False, timeout=timeout)).result()

    async def __aenter__(self) -> AsyncLLM:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        traceback: TracebackType | None) -> None:
        if not self._stopped:
            self._stopped = True
            await self._front.shutdown(drain=False, timeout=SHUTDOWN_TIMEOUT)


AsyncLLM.__init__.__signature__ = options_signature()  # type: ignore[attr-defined]


def _checked_params(params: SamplingParams | None) -> SamplingParams:
    if params is None:
        return SamplingParams()
    if not isinstance(params, SamplingParams):
        raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
    return params


def _raise_on_error(output: RequestOutput) -> None:
    failed = [c for c in output.outputs if c.finish_reason == "error"]
    if failed:
        raise EngineGenerateError(f"request {output.request_id!r} failed: {output.error or 'engine error'}")
