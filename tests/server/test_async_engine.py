"""AsyncEngine on a scripted fake engine: n > 1 merging, errors before streaming, abort,
step failures, a dead loop (health 503) and draining shutdown."""
from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from specdec.async_engine import AsyncEngine, EngineShuttingDownError
from specdec.outputs import CompletionOutput, RequestOutput
from specdec.sampling_params import SamplingParams
from specdec.server.app import build_app
from tests.helpers import wait_until


class FakeEngine:
    """One token per step per request; token ids count up from 10. Records the thread
    of every call: all must come from the one loop thread."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = 64
        self.model_config = SimpleNamespace(vocab_size=384)
        self.requests: dict[str, tuple[list[int], SamplingParams, list[int]]] = {}
        self.threads: set[str] = set()
        self.fail_steps = 0
        self.broken = False

    def _called(self) -> None:
        self.threads.add(threading.current_thread().name)

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams, use_speculation: bool = True,
                    grammar: Any = None) -> None:
        self._called()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("the prompt is empty: at least one token is needed")
        self.requests[request_id] = (ids, params, [])

    async def compile_grammar(self, params: SamplingParams) -> Any:
        return None

    def prepare_grammars(self) -> None:
        return None  # called at construction, on the caller's thread

    def _output(self, request_id: str, reason: str | None) -> RequestOutput:
        ids, _, out = self.requests[request_id]
        text = "".join(chr(ord("a") + t % 26) for t in out)
        completion = CompletionOutput(0, text, list(out), reason)
        return RequestOutput(request_id, None, ids, [completion], reason is not None)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        self._called()
        if request_id not in self.requests:
            return None
        output = self._output(request_id, "abort")
        del self.requests[request_id]
        return output

    def step(self) -> list[RequestOutput]:
        self._called()
        time.sleep(0.0005)  # a real step releases the GIL; without it the loop starves the test
        if self.fail_steps:
            self.fail_steps -= 1
            raise RuntimeError("scripted step failure")
        outputs = []
        for request_id, (_, params, out) in list(self.requests.items()):
            out.append(10 + len(out) + (params.seed or 0))
            done = len(out) >= (params.max_tokens or 4)
            outputs.append(self._output(request_id, "length" if done else None))
            if done:
                del self.requests[request_id]
        return outputs

    def has_unfinished_requests(self) -> bool:
        self._called()
        if self.broken:
            raise RuntimeError("the loop broke")
        return bool(self.requests)

    def get_metrics(self) -> dict[str, Any]:
        return {"num_prompt_tokens": 0, "num_generation_tokens": 0, "num_requests_running": len(self.requests),
                "num_requests_waiting": 0, "kv_cache_usage": 0.0}


@pytest.fixture()
def fake(tiny_model_dir: Any) -> FakeEngine:
    from transformers import AutoTokenizer

    return FakeEngine(AutoTokenizer.from_pretrained(str(tiny_model_dir)))


async def _drain(stream: Any) -> list[RequestOutput]:
    return [output async for output in stream]


def test_n_merged_and_bad_prompt(fake: FakeEngine) -> None:
    async def run() -> None:
        engine = AsyncEngine(fake)
        stream = await engine.generate("r1", [1, 2], SamplingParams(n=3, seed=100, max_tokens=3))
        outputs = await _drain(stream)
        final = outputs[-1]
        assert final.finished and [o.finished for o in outputs].count(True) == 1
        assert [c.index for c in final.outputs] == [0, 1, 2]
        assert [c.token_ids for c in final.outputs] == [[110, 111, 112], [111, 112, 113], [112, 113, 114]]
        with pytest.raises(ValueError, match="empty"):
            await engine.generate("r2", "", SamplingParams())
        await engine.shutdown(drain=False)
        assert not engine.is_alive and fake.threads == {"specdec-engine"}

    asyncio.run(run())


def test_abort_and_step_failure(fake: FakeEngine) -> None:
    async def run() -> None:
        engine = AsyncEngine(fake)
        stream = await engine.generate("a", [1], SamplingParams(max_tokens=1000))
        await stream.__anext__()
        await engine.abort("a")
        rest = await _drain(stream)
        assert rest[-1].outputs[0].finish_reason == "abort" and not fake.requests
        fake.fail_steps = 1
        failed = await _drain(await engine.generate("b", [1], SamplingParams(max_tokens=2)))
        assert failed[-1].outputs[0].finish_reason == "error"
        assert "step failed" in (failed[-1].error or "") and "scripted" not in (failed[-1].error or "")
        ok = await _drain(await engine.generate("c", [1], SamplingParams(max_tokens=2)))
        assert ok[-1].outputs[0].finish_reason == "length" and engine.is_alive
        await engine.shutdown(drain=False)

    asyncio.run(run())


def test_draining_shutdown_finishes_in_flight(fake: FakeEngine) -> None:
    async def run() -> None:
        engine = AsyncEngine(fake)
        stream = await engine.generate("d", [1], SamplingParams(max_tokens=50))
        engine.begin_shutdown()
        with pytest.raises(EngineShuttingDownError):
            await engine.generate("e", [1], SamplingParams())
        await engine.shutdown(drain=True)
        outputs = await _drain(stream)
        assert outputs[-1].outputs[0].finish_reason == "length" and len(outputs[-1].outputs[0].token_ids) == 50

    asyncio.run(run())


def test_dead_loop_reports_503(fake: FakeEngine) -> None:
    async def run() -> None:
        engine = AsyncEngine(fake)
        app = build_app(engine, "fake")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            assert (await client.get("/health")).status_code == 200
            # never finishes on its own, so the loop is still stepping when it breaks
            stream = await engine.generate("x", [1], SamplingParams(max_tokens=10**9))
            fake.broken = True
            assert await asyncio.to_thread(wait_until, lambda: not engine.is_alive)
            outputs = await _drain(stream)  # the in-flight request is failed, not left hanging
            assert outputs[-1].outputs[0].finish_reason == "error"
            health = await client.get("/health")
            message = health.json()["error"]["message"]
            assert health.status_code == 503 and "RuntimeError" in message and "the loop broke" not in message
            response = await client.post("/v1/completions", json={"prompt": "hi"})
            assert response.status_code == 503 and response.json()["error"]["type"] == "server_error"

    asyncio.run(run())
