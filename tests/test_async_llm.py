"""AsyncLLM on the tiny checkpoint: streamed outputs grow to what LLM.generate returns,
requests run side by side, abort and cancellation free their KV blocks, bad input is
refused before streaming, and shutdown stops the engine thread."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from specdec.async_engine import EngineDeadError
from specdec.async_llm import AsyncLLM
from specdec.llm import LLM
from specdec.outputs import RequestOutput
from specdec.sampling_params import SamplingParams
from tests.helpers import greedy, slow_engine_steps

OPTIONS: dict[str, Any] = {"max_model_len": 96, "kv_cache_memory": 1 << 20}
PROMPTS = ["The quick brown fox", "def add(a, b):"]


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> LLM:
    return LLM(str(tiny_model_dir), **OPTIONS)


@pytest.fixture(scope="module")
def async_llm(tiny_model_dir: Path) -> Iterator[AsyncLLM]:
    llm = AsyncLLM(str(tiny_model_dir), **OPTIONS)
    yield llm
    llm.shutdown()  # from synchronous code
    assert not llm.is_running


def free_blocks(llm: AsyncLLM) -> int:
    return int(llm.engine.block_manager.num_free_blocks)


async def collect(llm: AsyncLLM, prompt: Any, params: SamplingParams, **kwargs: Any) -> list[RequestOutput]:
    return [output async for output in llm.generate(prompt, params, **kwargs)]


async def wait_for_free_blocks(llm: AsyncLLM, expected: int) -> bool:
    for _ in range(500):
        if free_blocks(llm) == expected and not llm.engine.has_unfinished_requests():
            return True
        await asyncio.sleep(0.01)
    return False


def test_streamed_outputs_grow_to_the_offline_result(async_llm: AsyncLLM, reference: LLM) -> None:
    [expected] = reference.generate(PROMPTS[0], greedy(24))
    outputs = asyncio.run(collect(async_llm, PROMPTS[0], greedy(24), request_id="mine"))
    assert len(outputs) > 1 and all(o.request_id == "mine" for o in outputs)
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    assert lengths == sorted(lengths) and lengths[0] < lengths[-1]
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    final = outputs[-1].outputs[0]
    assert final.token_ids == expected.outputs[0].token_ids and final.text == expected.outputs[0].text
    assert final.finish_reason == "length"


def test_prompt_forms_and_n(async_llm: AsyncLLM, reference: LLM) -> None:
    ids = reference.get_tokenizer().encode(PROMPTS[1])
    [expected] = reference.generate(PROMPTS[1], greedy(8))

    async def run() -> list[RequestOutput]:
        return [(await collect(async_llm, prompt, greedy(8)))[-1]
                for prompt in ({"prompt": PROMPTS[1]}, {"prompt_token_ids": ids}, ids)]

    finals = asyncio.run(run())
    assert all(f.outputs[0].token_ids == expected.outputs[0].token_ids for f in finals)
    params = SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=6, ignore_eos=True)
    [merged] = asyncio.run(collect(async_llm, PROMPTS[0], params))[-1:]
    assert [c.index for c in merged.outputs] == [0, 1] and all(len(c.token_ids) == 6 for c in merged.outputs)


def test_two_concurrent_generators(async_llm: AsyncLLM, reference: LLM) -> None:
    expected = reference.generate(PROMPTS, greedy(20))

    async def run() -> tuple[list[RequestOutput], list[RequestOutput]]:
        return await asyncio.gather(collect(async_llm, PROMPTS[0], greedy(20)),
                                    collect(async_llm, PROMPTS[1], greedy(20)))

    first, second = asyncio.run(run())
    assert first[-1].request_id != second[-1].request_id
    assert [first[-1].outputs[0].token_ids, second[-1].outputs[0].token_ids] == \
        [e.outputs[0].token_ids for e in expected]


def test_abort_ends_the_stream_and_frees_blocks(async_llm: AsyncLLM, monkeypatch: pytest.MonkeyPatch) -> None:
    slow_engine_steps(async_llm, monkeypatch)  # type: ignore[arg-type]
    start = free_blocks(async_llm)

    async def run() -> list[RequestOutput]:
        outputs = []
        async for output in async_llm.generate(PROMPTS[0], greedy(80), request_id="to-abort"):
            outputs.append(output)
            if len(outputs) == 1:
                assert free_blocks(async_llm) < start
                await async_llm.abort("to-abort")
        assert await wait_for_free_blocks(async_llm, start)
        return outputs

    outputs = asyncio.run(run())
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
    assert len(outputs[-1].outputs[0].token_ids) < 80


def test_leaving_the_loop_or_cancelling_frees_blocks(async_llm: AsyncLLM, monkeypatch: pytest.MonkeyPatch) -> None:
    slow_engine_steps(async_llm, monkeypatch)  # type: ignore[arg-type]
    start = free_blocks(async_llm)

    async def leave_early() -> bool:
        # generate is an async generator (annotated as an AsyncIterator): it can be closed.
        stream = cast("AsyncGenerator[RequestOutput, None]", async_llm.generate(PROMPTS[0], greedy(80)))
        async with contextlib.aclosing(stream):
            async for _ in stream:
                break
        return await wait_for_free_blocks(async_llm, start)

    async def cancel_task() -> bool:
        started = asyncio.Event()

        async def consume() -> None:
            async for _ in async_llm.generate(PROMPTS[1], SamplingParams(n=2, max_tokens=80, ignore_eos=True)):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        assert free_blocks(async_llm) < start
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await wait_for_free_blocks(async_llm, start)

    async def drop_generator() -> bool:
        async for _ in async_llm.generate(PROMPTS[0], greedy(80)):
            break  # no aclosing: the event loop's async-generator finaliser closes it
        return await wait_for_free_blocks(async_llm, start)

    assert asyncio.run(leave_early())
    assert asyncio.run(cancel_task())
    assert asyncio.run(drop_generator())


@pytest.mark.parametrize("prompt, params, error, message", [
    (PROMPTS[0], SamplingParams(stop_token_ids=[100_000]), ValueError, "outside the vocabulary"),
    ({"prompt": PROMPTS[0], "extra": 1}, None, ValueError, r"unknown prompt dict keys \['extra'\]"),
    ([5000, 1], None, ValueError, "outside the vocabulary"),
    ("x " * 200, None, ValueError, "max_model_len"),
    (PROMPTS[0], {"max_tokens": 4}, TypeError, "sampling_params must be a SamplingParams"),
])
def test_bad_input_raises_from_generate(async_llm: AsyncLLM, prompt: Any, params: Any, error: type[Exception],
                                        message: str) -> None:
    start = free_blocks(async_llm)
    with pytest.raises(error, match=message):
        asyncio.run(collect(async_llm, prompt, params))
    assert free_blocks(async_llm) == start and async_llm.is_running
    assert asyncio.run(collect(async_llm, PROMPTS[0], greedy(2)))[-1].finished  # the engine goes on


def test_a_request_id_in_use_is_refused(async_llm: AsyncLLM, monkeypatch: pytest.MonkeyPatch) -> None:
    slow_engine_steps(async_llm, monkeypatch)  # type: ignore[arg-type]

    async def run() -> None:
        first = cast("AsyncGenerator[RequestOutput, None]",
                     async_llm.generate(PROMPTS[0], greedy(40), request_id="same"))
        await first.__anext__()
        with pytest.raises(ValueError, match="already in use"):
            await collect(async_llm, PROMPTS[1], greedy(4), request_id="same")
        await first.aclose()

    asyncio.run(run())


def test_context_manager_shuts_down(tiny_model_dir: Path) -> None:
    async def run() -> AsyncLLM:
        async with AsyncLLM(str(tiny_model_dir), **OPTIONS) as llm:
            assert llm.is_running
            assert (await collect(llm, PROMPTS[0], greedy(3)))[-1].finished
        assert not llm.is_running
        with pytest.raises(EngineDeadError):
            await collect(llm, PROMPTS[0], greedy(3))
        llm.shutdown()  # a second time is a no-op
        return llm

    asyncio.run(run())


def test_unknown_option_is_a_type_error(tiny_model_dir: Path) -> None:
    with pytest.raises(TypeError, match=r"unknown engine options \['max_batch'\]"):
        AsyncLLM(str(tiny_model_dir), max_batch=4)
