"""Overlap scheduling (EngineConfig.async_scheduling, specdec/overlap.py): the engine
launches step n+1 before reading step n's tokens, which feed step n+1 on the device and
are committed one step late. Everything a caller sees must be what the synchronous engine
gives: the same tokens (greedy and seeded sampling), the same stops, the same streamed
outputs in the same order (one step later), aborts and preemption handled, and every KV
block free at the end. On the torch backend, under the Triton interpreter, and on a GPU
with CUDA graphs (`cuda`-marked).
"""
from __future__ import annotations

import os

# Must precede any import of triton (see tests/engine/test_triton_engine.py).
os.environ.setdefault("TRITON_INTERPRET", "1")  # an explicit 0 (`-m cuda` on a GPU) stands

from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from specdec import cuda_graphs  # noqa: E402
from specdec.config import EngineConfig  # noqa: E402
from specdec.cuda_graphs import CudaGraphs  # noqa: E402
from specdec.engine_args import add_engine_args  # noqa: E402
from specdec.llm import LLM  # noqa: E402
from specdec.outputs import RequestOutput  # noqa: E402
from specdec.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402
from specdec.spec.policy import DraftLimit, FixedSpeculation  # noqa: E402
from tests.helpers import NGRAM, assert_all_blocks_free, block_bytes, greedy, random_prompts  # noqa: E402

MAX_TOKENS = 12


def make_llm(model_dir: Path, overlap: bool, **options: Any) -> LLM:
    options.setdefault("speculative_config", None)
    options.setdefault("max_model_len", 128)
    return LLM(str(model_dir), async_scheduling=overlap, **options)


def stream(llm: LLM, prompts: list[list[int]], params: list[SamplingParams],
           abort_after: dict[str, int] | None = None) -> list[tuple[str, list[int], str | None, str]]:
    """Every output LLMEngine.step returns, in order, as (id, tokens, finish reason, text);
    requests in `abort_after` are aborted once that many of their tokens were streamed."""
    engine = llm.engine
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt, p)
    seen: list[tuple[str, list[int], str | None, str]] = []
    aborted: set[str] = set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.append(_entry(out))
        for rid, count in (abort_after or {}).items():
            streamed = [s for s in seen if s[0] == rid]
            if rid not in aborted and streamed and len(streamed[-1][1]) >= count:
                aborted.add(rid)
                aborted_out = engine.abort_request(rid)
                if aborted_out is not None:
                    seen.append(_entry(aborted_out))
    return seen


def _entry(out: RequestOutput) -> tuple[str, list[int], str | None, str]:
    completion = out.outputs[0]
    return out.request_id, list(completion.token_ids), completion.finish_reason, completion.text


def assert_same_runs(make: Any, prompts: list[list[int]], params: list[SamplingParams],
                     abort_after: dict[str, int] | None = None) -> list[tuple[str, list[int], str | None, str]]:
    """The streamed outputs with overlap equal those without, and every KV block is free."""
    runs = []
    for overlap in (False, True):
        llm = make(overlap)
        assert llm.engine.pipeline.enabled is overlap
        runs.append(stream(llm, prompts, params, abort_after))
        assert_all_blocks_free(llm)
        assert llm.engine.pipeline.in_flight is None or all(
            item.request.is_finished for item in llm.engine.pipeline.in_flight.batch)
    assert runs[1] == runs[0]
    return runs[0]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(5, 4)  # different lengths: prefills and decodes share steps


def test_greedy_batched_streams_the_same(tiny_model_dir: Path, prompts: list[list[int]]) -> None:
    seen = assert_same_runs(lambda o: make_llm(tiny_model_dir, o), prompts,
                            [greedy(MAX_TOKENS + i) for i in range(len(prompts))])
    finals = [s for s in seen if s[2] is not None]
    assert [len(tokens) for _, tokens, _, _ in sorted(finals)] == [MAX_TOKENS + i for i in range(len(prompts))]


def test_overlap_leaves_a_step_in_flight(tiny_model_dir: Path, prompts: list[list[int]]) -> None:
    """The overlap really happens: after a decode step the engine holds a step whose tokens
    it has not read, and the next step's roots come from it on the device."""
    llm = make_llm(tiny_model_dir, True)
    engine = llm.engine
    engine.add_request("r0", prompts[0], greedy(MAX_TOKENS))
    fed = []
    execute = engine.runner.execute

    def recording_execute(batch: Any, trees: Any, feed: Any = None) -> Any:
        fed.append(feed is not None)
        return execute(batch, trees, feed)

    engine.runner.execute = recording_execute  # type: ignore[method-assign]
    assert engine.step() == []  # the prefill's token is still "on the device"
    assert engine.pipeline.in_flight is not None
    assert engine.scheduler.running[0].num_pending == 1
    assert len(engine.step()[0].outputs[0].token_ids) == 1  # the first token, one step late
    assert fed == [False, True]


def test_stops_are_exact(tiny_model_dir: Path, prompts: list[list[int]]) -> None:
    """EOS, stop token ids, stop strings and max_tokens end a request at the same token; the
    token of the step already scheduled after it is dropped."""
    probe = make_llm(tiny_model_dir, False).generate(prompts, greedy(MAX_TOKENS))
    outputs = [list(o.outputs[0].token_ids) for o in probe]
    texts = [o.outputs[0].text for o in probe]
    eos = next(iter(make_llm(tiny_model_dir, False).engine.eos_token_ids))
    params = [
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[outputs[0][3]]),
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop=[texts[1][2:5]] if len(texts[1]) >= 5 else None),
        SamplingParams(temperature=0.0, max_tokens=3),
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logit_bias={eos: 100.0}, min_tokens=2),
    ]
    seen = assert_same_runs(lambda o: make_llm(tiny_model_dir, o), prompts, params)
    finals = {rid: (tokens, reason) for rid, tokens, reason, _ in seen if reason is not None}
    assert finals["r0"] == (outputs[0][:4], "stop")
    assert len(finals["r2"][0]) == 3 and finals["r2"][1] == "length"
    assert finals["r3"][1] == "stop" and len(finals["r3"][0]) == 3 and finals["r3"][0][-1] == eos  # after min_tokens


def test_seeded_sampling_and_logprobs(tiny_model_dir: Path, prompts: list[list[int]]) -> None:
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=7 + i, max_tokens=MAX_TOKENS, ignore_eos=True,
                             logprobs=2 if i == 0 else None, repetition_penalty=1.3 if i == 1 else 1.0)
              for i in range(len(prompts))]
    runs = [make_llm(tiny_model_dir, overlap).generate(prompts, params) for overlap in (False, True)]
    assert [o.outputs[0].token_ids for o in runs[1]] == [o.outputs[0].token_ids for o in runs[0]]
    assert runs[1][0].outputs[0].logprobs == runs[0][0].outputs[0].logprobs


def test_grammars_and_penalties(tiny_model_dir: Path, prompts: list[list[int]]) -> None:
    """Logits processors see every token before the one they decide: a step is sampled
    only after the step before was committed (grammars advanced, penalties counted)."""
    constraints = [StructuredOutputsParams(regex=r"(yes|no), [0-9]{2,4}!"),
                   StructuredOutputsParams(choice=["red apple", "green pear", "blue"]),
                   StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}},
                                                 "required": ["a"]})]
    params = [SamplingParams(temperature=0.0, max_tokens=48, structured_outputs=c) for c in constraints]
    params.append(SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, frequency_penalty=1.5,
                                 presence_penalty=0.5, bad_words=["a"]))
    seen = assert_same_runs(lambda o: make_llm(tiny_model_dir, o, max_model_len=256), prompts, params)
    finals = {rid: text for rid, _, reason, text in seen if reason is not None}
    assert finals["r1"] in ("red apple", "green pear", "blue")


def test_abort_mid_generation(tiny_model_dir: Path, prompts: list[list[int]]) -> None:
    seen = assert_same_runs(lambda o: make_llm(tiny_model_dir, o), prompts, [greedy(MAX_TOKENS)] * len(prompts),
                            abort_after={"r1": 3, "r2": 1})
    finals = {rid: (tokens, reason) for rid, tokens, reason, _ in seen if reason is not None}
    assert finals["r1"][1] == "abort" and len(finals["r1"][0]) == 3
    assert finals["r0"][1] == "length"


def test_a_failed_forward_fails_its_step_alone(tiny_model_dir: Path, prompts: list[list[int]]) -> None:
    """A forward that raises fails its step's requests; the tokens of the step before,
    still in flight then, are committed first, as the synchronous engine had committed them."""
    def make(overlap: bool) -> LLM:
        llm = make_llm(tiny_model_dir, overlap)
        runner, calls = llm.engine.runner, [0]
        execute = runner.execute

        def failing_execute(batch: Any, trees: Any, feed: Any = None) -> Any:
            calls[0] += 1
            if calls[0] == 5:
                raise RuntimeError("the device fell over")
            return execute(batch, trees, feed)

        runner.execute = failing_execute  # type: ignore[method-assign]
        return llm

    seen = assert_same_runs(make, prompts, [greedy(MAX_TOKENS)] * len(prompts))
    errors = [tokens for _, tokens, reason, _ in seen if reason == "error"]
    assert errors and all(tokens for tokens in errors)  # they had streamed tokens before


def test_forced_preemption(tiny_model_dir: Path) -> None:
    """A KV pool too small for the batch: requests are preempted (some with a token still
    on the device) and recomputed, with the same tokens as with overlap off."""
    prompts = random_prompts(11, 8)
    blocks = block_bytes(make_llm(tiny_model_dir, False))

    def small(overlap: bool) -> LLM:
        return make_llm(tiny_model_dir, overlap, max_num_batched_tokens=64, kv_cache_memory=10 * blocks)

    llm = small(True)
    outputs = llm.generate(prompts, greedy(40))
    assert llm.get_metrics()["num_preemptions"] > 0
    assert_all_blocks_free(llm)
    expected = make_llm(tiny_model_dir, False).generate(prompts, greedy(40))
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected]


def test_speculating_requests_beside_overlapped_ones(tiny_model_dir: Path, prompts: list[list[int]]) -> None:
    """With a drafter, requests that speculate run synchronously and the others overlap:
    greedy outputs equal plain decoding's."""
    expected = [o.outputs[0].token_ids for o in make_llm(tiny_model_dir, False).generate(prompts, greedy(MAX_TOKENS))]
    llm = make_llm(tiny_model_dir, True, speculative_config=NGRAM)
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, greedy(MAX_TOKENS), use_speculation=i % 2 == 0)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.outputs[0].token_ids
    assert [finals[f"r{i}"] for i in range(len(prompts))] == expected
    assert_all_blocks_free(llm)


class EveryThirdStep(FixedSpeculation):
    """Grants the whole limit on every third step, nothing otherwise: whether it grants
    does not depend on the tokens, as no policy's may."""

    def __init__(self) -> None:
        self.calls = 0

    def grant(self, limits: list[DraftLimit], base_tokens: int, base_commits: int) -> list[int]:
        self.calls += 1
        return [limit.num_draft_tokens if self.calls % 3 == 0 else 0 for limit in limits]


def test_steps_granting_no_drafts_overlap(tiny_model_dir: Path, prompts: list[list[int]]) -> None:
    """A speculating request granted nothing stays in flight like any other; one granted
    drafts while its last token is on the device has it read back before drafting. Greedy
    outputs equal plain decoding's."""
    expected = [o.outputs[0].token_ids for o in make_llm(tiny_model_dir, False).generate(prompts, greedy(24))]
    llm = make_llm(tiny_model_dir, True, speculative_config=NGRAM)
    engine, pipeline = llm.engine, llm.engine.pipeline
    engine.policy = engine.scheduler.policy = EveryThirdStep()
    kept, settled_early = [], []
    keep, must_settle = pipeline.keep, pipeline.must_settle

    def recording_keep(step: Any) -> None:
        kept.append(all(item.request.use_speculation for item in step.batch))
        keep(step)

    def recording_must_settle(batch: Any) -> bool:
        settled_early.append(must_settle(batch))
        return settled_early[-1]

    pipeline.keep = recording_keep  # type: ignore[method-assign]
    pipeline.must_settle = recording_must_settle  # type: ignore[method-assign]
    outputs = llm.generate(prompts, greedy(24))
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert any(kept) and any(settled_early)
    assert llm.get_metrics()["num_drafts"] > 0
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_adaptive_speculation(tiny_model_dir: Path, prompts: list[list[int]], method: str) -> None:
    """The real adaptive policies (their grants follow measured costs) with overlap: greedy
    outputs equal plain decoding's, every block freed."""
    expected = [o.outputs[0].token_ids for o in make_llm(tiny_model_dir, False).generate(prompts, greedy(24))]
    spec: dict[str, Any] = {"method": method, "num_speculative_tokens": 3, "adaptive": True}
    if method == "ngram":
        spec.update(prompt_lookup_min=1, prompt_lookup_max=3)
    llm = make_llm(tiny_model_dir, True, speculative_config=spec)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(24))] == expected
    assert_all_blocks_free(llm)


def test_triton_interpreter(tiny_model_dir: Path) -> None:
    """The same on the triton attention backend (its kernels run by Triton's interpreter)."""
    prompts = random_prompts(3, 3)
    assert_same_runs(lambda o: make_llm(tiny_model_dir, o, attention_backend="triton"), prompts,
                     [greedy(5), SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True), greedy(4)])


def test_cuda_graph_buffers_take_the_fed_roots(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA graph executor with each graph replaced by an eager rerun of its forward
    over the static buffers (tests/engine/test_triton_engine.py's stand-in): roots fed on
    the device land in the padded static input ids, and the streams equal the synchronous
    engine's."""
    from tests.engine.test_triton_engine import capture_eagerly

    monkeypatch.setattr(cuda_graphs, "capture_graph", capture_eagerly)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    replays = []

    def make(overlap: bool) -> LLM:
        llm = make_llm(tiny_model_dir, overlap, max_num_seqs=4, attention_backend="triton")
        engine, runner = llm.engine, llm.engine.runner
        runner.executor = CudaGraphs(runner.executor, engine.config, runner.kv_cache, engine.device,
                                     engine.max_model_len)
        replays.append(runner.executor)
        return llm

    prompts = random_prompts(4, 3)
    assert_same_runs(make, prompts, [greedy(5), greedy(3), SamplingParams(temperature=1.0, seed=2, max_tokens=5,
                                                                          ignore_eos=True)])
    graphs = replays[-1]
    assert any(step.graph.replays for step in graphs.captured.values())  # type: ignore[attr-defined]


def test_async_llm_streams_with_overlap(tiny_model_dir: Path, prompts: list[list[int]]) -> None:
    """AsyncLLM (the server's engine loop) streams each request's tokens one step late,
    growing to what the synchronous engine returns; abort frees every block."""
    import asyncio

    from specdec.async_llm import AsyncLLM

    expected = [o.outputs[0].token_ids for o in make_llm(tiny_model_dir, False).generate(prompts, greedy(MAX_TOKENS))]
    llm = AsyncLLM(str(tiny_model_dir), max_model_len=128, speculative_config=None, async_scheduling=True)

    async def collect(i: int) -> list[RequestOutput]:
        return [out async for out in llm.generate(prompts[i], greedy(MAX_TOKENS), request_id=f"s{i}")]

    async def run_all() -> list[list[RequestOutput]]:
        return list(await asyncio.gather(*(collect(i) for i in range(len(prompts)))))

    try:
        assert llm.engine.pipeline.enabled
        streams = asyncio.run(run_all())
        for stream_outputs, tokens in zip(streams, expected):
            lengths = [len(o.outputs[0].token_ids) for o in stream_outputs]
            assert lengths == sorted(lengths) and stream_outputs[-1].finished
            assert stream_outputs[-1].outputs[0].token_ids == tokens
        assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    finally:
        llm.shutdown()


def test_the_option() -> None:
    """auto: on for CUDA only; the flag and keyword come from EngineConfig; bad values named."""
    assert EngineConfig(device="cpu").overlap_steps is False
    assert EngineConfig(device="cpu", async_scheduling=True).overlap_steps is True
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(device="cpu", async_scheduling="yes").validate()  # type: ignore[arg-type]
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert parser.parse_args([]).async_scheduling is None
    assert parser.parse_args(["--async-scheduling"]).async_scheduling is True
    assert parser.parse_args(["--no-async-scheduling"]).async_scheduling is False


@pytest.mark.cuda
def test_cuda_graphs_overlap(tiny_model_dir: Path, prompts: list[list[int]]) -> None:
    """On a GPU with CUDA graphs: the roots fed into the graphs' static input buffer give
    the synchronous engine's tokens and streams (greedy, seeded, stops, aborts)."""
    from specdec.kernels import attention_triton

    if type(attention_triton._paged_attention_kernel).__name__ == "InterpretedFunction":
        pytest.skip("Triton runs interpreted in this session; on a GPU run "
                    "TRITON_INTERPRET=0 pytest -m cuda tests/engine/test_overlap.py")

    def make(overlap: bool) -> LLM:
        llm = make_llm(tiny_model_dir, overlap, device="cuda", dtype="float32", max_num_seqs=4,
                       kv_cache_memory=1 << 24)
        assert isinstance(llm.engine.runner.executor, CudaGraphs)
        return llm

    params = [greedy(MAX_TOKENS), SamplingParams(temperature=0.8, seed=5, max_tokens=MAX_TOKENS, ignore_eos=True),
              greedy(3), greedy(MAX_TOKENS + 3)]
    assert_same_runs(make, prompts, params, abort_after={"r3": 4})
