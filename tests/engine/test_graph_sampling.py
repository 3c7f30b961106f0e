"""Sampling inside the decode graphs (specdec/graph_sampling.py): with overlap scheduling
and CUDA graphs, a decode step's rows are sampled in its graph, except those needing what
the graph cannot do (logits processors, grammars, top-k / top-p / min-p), which
`sample_roots` samples on the host path. Which rows is decided once per step from the
batch's params. Outputs are token-identical with and without it: greedy, seeded
temperature sampling, mixed batches, stops and aborts. Under the Triton interpreter with
the graphs replayed eagerly (tests/engine/test_triton_engine.py's stand-in), and
`cuda`-marked with graphs captured for real.
"""
from __future__ import annotations

import os

# Must precede any import of triton (see tests/engine/test_triton_engine.py).
os.environ.setdefault("TRITON_INTERPRET", "1")  # an explicit 0 (`-m cuda` on a GPU) stands

from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from specdec import cuda_graphs, overlap  # noqa: E402
from specdec import engine as engine_module  # noqa: E402
from specdec.cuda_graphs import CudaGraphs  # noqa: E402
from specdec.graph_sampling import NO_TOKEN, GraphSampler, RootSampling  # noqa: E402
from specdec.llm import LLM  # noqa: E402
from specdec.model_runner import ForwardOutput  # noqa: E402
from specdec.request import Request  # noqa: E402
from specdec.sampler import SamplingTensors, argmax, keyed_race_noise, logits_to_probs, sample_keyed  # noqa: E402
from specdec.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402
from specdec.scheduler import ScheduledRequest  # noqa: E402
from tests.engine.test_overlap import make_llm, stream  # noqa: E402
from tests.engine.test_triton_engine import capture_eagerly  # noqa: E402
from tests.helpers import assert_all_blocks_free, greedy, random_prompts  # noqa: E402

VOCAB = 3000  # more than one of the Triton argmax's 1024-wide chunks


def sampled(temperature: float, seed: int | None, **options: Any) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=8, ignore_eos=True, **options)


# ---- the sampler on its own ---------------------------------------------------------------


@pytest.mark.parametrize("use_triton", [False, True])
def test_sampler_takes_the_host_paths_tokens(use_triton: bool) -> None:
    """Greedy rows take the argmax, seeded rows the keyed race of sample_keyed (bit for bit:
    the same operations on the same noise), inactive rows NO_TOKEN; dummy rows too."""
    torch.manual_seed(0)
    logits = torch.randn(6, VOCAB) * 3  # [B, V]
    logits[0, 2500] = logits[0, 1000] = 50.0  # a tie across chunks goes to the lowest index
    plan = RootSampling(rows=[0, 1, 2, 4], temperature=[0.0, 0.7, 1.3, 0.0, 0.0],
                        keys=[None, (11, 40), (12, 7), None, None])
    sampler = GraphSampler(8, VOCAB, torch.device("cpu"), use_triton)
    sampler.fill(plan, batch_size=6)
    tokens = sampler.sample(logits).tolist()
    assert tokens[0] == 1000 and tokens[4] == int(argmax(logits[4]))
    for row, (temperature, key) in ((1, (0.7, (11, 40))), (2, (1.3, (12, 7)))):
        probs = logits_to_probs(logits[row:row + 1], SamplingTensors.from_params([sampled(temperature, key[0])]))
        assert tokens[row] == int(sample_keyed(probs, [key[0]], [key[1]])[0])
    assert tokens[3] == tokens[5] == NO_TOKEN


def test_sampler_races_unseeded_rows_on_fresh_noise() -> None:
    """An unseeded row samples from its distribution: a near one-hot one gives its mode,
    and each fill draws new noise (a flat row does not repeat its token)."""
    logits = torch.zeros(2, VOCAB)
    logits[0, 17] = 40.0
    plan = RootSampling(rows=[0, 1], temperature=[1.0, 1.0], keys=[None, None])
    sampler = GraphSampler(2, VOCAB, torch.device("cpu"), use_triton=False)
    draws = []
    for _ in range(4):
        sampler.fill(plan, batch_size=2)
        draws.append(sampler.sample(logits).tolist())
    assert all(row0 == 17 for row0, _ in draws)
    assert len({row1 for _, row1 in draws}) > 1


def test_keyed_noise_is_the_verifiers_draw() -> None:
    """The host path's race (sample_keyed) run on keyed_race_noise picks the same token."""
    torch.manual_seed(1)
    probs = torch.softmax(torch.randn(1, VOCAB), dim=-1)
    race = keyed_race_noise(5, 9, VOCAB).clamp(min=torch.finfo(torch.float32).tiny)
    assert int(argmax(probs / race)[0]) == int(sample_keyed(probs, [5], [9])[0])


# ---- the decision, once per step ----------------------------------------------------------


def scheduled(params: SamplingParams, computed: int = 4, new: int = 1, drafts: int = 0,
              grammar: object = None) -> ScheduledRequest:
    request = Request("r", list(range(5)), params, None, 8, {0}, grammar=grammar)  # type: ignore[arg-type]
    request.num_computed_tokens = computed
    return ScheduledRequest(request, new, drafts)


def test_the_plan_keeps_processed_rows_on_the_host() -> None:
    batch = [
        scheduled(greedy(8)),  # 0: in the graph
        scheduled(sampled(0.8, 3)),  # 1: in the graph, keyed by the position it decides
        scheduled(sampled(0.8, None)),  # 2: in the graph, device noise
        scheduled(sampled(0.8, 3, top_p=0.9)),  # 3-5: host path
        scheduled(sampled(0.8, 3, top_k=5)),
        scheduled(sampled(0.8, 3, min_p=0.1)),
        scheduled(SamplingParams(temperature=0.0, repetition_penalty=1.2)),  # 6-9: logits processors
        scheduled(SamplingParams(temperature=0.0, logit_bias={3: 1.0})),
        scheduled(SamplingParams(temperature=0.0, min_tokens=2)),
        scheduled(greedy(8), grammar=object()),
        scheduled(SamplingParams(temperature=0.0, logprobs=2)),  # 10: in the graph, logprobs from the logits
        scheduled(greedy(8), computed=2, new=1),  # 11: a prefill chunk of one token short of the end: no row
        scheduled(SamplingParams(temperature=0.0, top_k=5)),  # 12: in the graph, top-k means nothing when greedy
    ]
    plan = overlap.plan_sampling(batch)
    assert plan is not None
    assert plan.rows == [0, 1, 2, 10, 12]
    assert plan.temperature[:3] == [0.0, 0.8, 0.8] and plan.temperature[3] == 0.0
    assert plan.keys[1] == (3, 5) and plan.keys[2] is None and plan.keys[0] is None
    assert overlap.plan_sampling([scheduled(greedy(8)), scheduled(greedy(8), drafts=2)]) is None  # may verify
    assert overlap.plan_sampling([scheduled(greedy(8)), scheduled(greedy(8), computed=0, new=5)]) is None  # prefill
    assert overlap.plan_sampling([scheduled(sampled(0.8, 3, top_p=0.5))]) is None  # nothing for the graph


def test_the_pipeline_plans_only_with_overlap() -> None:
    batch = [scheduled(greedy(8))]
    on, off = overlap.Pipeline(True), overlap.Pipeline(False)
    feed = on.feed(batch)
    assert feed is not None and feed.sampling is not None and feed.requests == []
    assert off.feed(batch) is None


# ---- whole runs, graphs replayed eagerly -------------------------------------------------


@pytest.fixture
def eager_graphs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[int] | None, int]]:
    """CUDA graphs replayed eagerly on the CPU; records each overlapped step's
    (rows sampled in its graph or None, batch size)."""
    monkeypatch.setattr(cuda_graphs, "capture_graph", capture_eagerly)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    steps: list[tuple[list[int] | None, int]] = []
    sample_roots = overlap.sample_roots

    def recording(batch: list[ScheduledRequest], trees: Any, output: ForwardOutput) -> overlap.SampledStep:
        steps.append((None if output.sampled is None else list(output.sampled.rows), len(batch)))
        return sample_roots(batch, trees, output)

    monkeypatch.setattr(engine_module, "sample_roots", recording)
    return steps


def graph_llm(model_dir: Path, overlap_on: bool, **options: Any) -> LLM:
    llm = make_llm(model_dir, overlap_on, max_num_seqs=4, attention_backend="triton", **options)
    engine, runner = llm.engine, llm.engine.runner
    runner.executor = CudaGraphs(runner.executor, engine.config, runner.kv_cache, engine.device, engine.max_model_len)
    return llm


Stream = list[tuple[str, list[int], str | None, str]]


def by_request(seen: Stream) -> dict[str, Stream]:
    """Each request's outputs in order (with overlap a request admitted mid-run streams
    one step later relative to the others, so only the order across requests differs)."""
    out: dict[str, Stream] = {}
    for entry in seen:
        out.setdefault(entry[0], []).append(entry)
    return out


def assert_runs_agree(make: Callable[[bool], LLM], monkeypatch: pytest.MonkeyPatch, prompts: list[list[int]],
                      params: list[SamplingParams], abort_after: dict[str, int] | None = None) -> Stream:
    """Overlap with in-graph sampling streams exactly what overlap with every row sampled on
    the host path does, and per request what the synchronous engine does; every block freed."""
    runs = []
    for overlap_on, in_graph in ((False, False), (True, True), (True, False)):
        with monkeypatch.context() as patch:
            if not in_graph:
                patch.setattr(overlap, "plan_sampling", lambda batch: None)
            llm = make(overlap_on)
            runs.append(stream(llm, prompts, params, abort_after))
            assert_all_blocks_free(llm)
    sync, graph, host = runs
    assert graph == host
    assert by_request(graph) == by_request(sync)
    return sync


def test_greedy_and_seeded_in_the_graph(tiny_model_dir: Path, eager_graphs: list[tuple[list[int] | None, int]],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = random_prompts(3, 3)
    prompts.append(prompts[0])
    params = [greedy(6), sampled(0.9, 4), greedy(4), sampled(1.2, 21)]
    assert_runs_agree(lambda o: graph_llm(tiny_model_dir, o), monkeypatch, prompts, params)
    in_graph = [(rows, size) for rows, size in eager_graphs if rows is not None]
    assert any(len(rows) == size for rows, size in in_graph)  # whole steps sampled in their graphs
    assert any(rows is None for rows, _ in eager_graphs)  # prefills, and the run without


def test_mixed_batches_stops_and_aborts(tiny_model_dir: Path, eager_graphs: list[tuple[list[int] | None, int]],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows the graph cannot sample (a penalty with logprobs, top-p, a grammar) take the
    host path in the same steps as rows it samples; a stop token, max_tokens and an abort
    end requests at the same token; a fifth request waits for a free slot."""
    prompts = random_prompts(4, 4)
    probe = stream(graph_llm(tiny_model_dir, False), prompts[:1], [greedy(6)])[-1][1]
    params = [
        SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=[probe[2]]),
        SamplingParams(temperature=0.0, max_tokens=6, repetition_penalty=1.5, logprobs=1),
        sampled(0.8, 5, top_p=0.8),
        SamplingParams(temperature=0.0, max_tokens=6,
                       structured_outputs=StructuredOutputsParams(choice=["red apple", "green pear"])),
        sampled(0.7, 9),
    ]
    prompts.append(prompts[1])
    seen = assert_runs_agree(lambda o: graph_llm(tiny_model_dir, o), monkeypatch, prompts, params, {"r4": 3})
    finals = {rid: (tokens, reason) for rid, tokens, reason, _ in seen if reason is not None}
    assert finals["r0"] == (probe[:probe.index(probe[2]) + 1], "stop") and finals["r4"][1] == "abort"
    assert any(0 < len(rows) < size for rows, size in eager_graphs if rows is not None)  # mixed steps


# ---- on a GPU, graphs captured for real ---------------------------------------------------


def _skip_interpreted() -> None:
    from specdec.kernels import attention_triton

    if type(attention_triton._paged_attention_kernel).__name__ == "InterpretedFunction":
        pytest.skip("Triton runs interpreted in this session; on a GPU run "
                    "TRITON_INTERPRET=0 pytest -m cuda tests/engine/test_graph_sampling.py")


@pytest.mark.cuda
def test_captured_sampler_matches_the_host_path() -> None:
    """GraphSampler.sample captured in a CUDA graph: replays with new plans give the host
    path's tokens (greedy and seeded)."""
    _skip_interpreted()
    device = torch.device("cuda")
    sampler = GraphSampler(4, VOCAB, device, use_triton=True)
    logits = torch.zeros(4, VOCAB, device=device)
    sampler.fill(RootSampling([0], [0.0] * 4, [None] * 4), 4)
    sampler.sample(logits)  # compiles the Triton kernel off the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tokens = sampler.sample(logits)
    for step in range(3):
        torch.manual_seed(step)
        logits.copy_(torch.randn(4, VOCAB, device=device) * 2)
        plan = RootSampling([0, 1, 2], [0.0, 0.6, 1.1, 0.0], [None, (1, step), (2, step), None])
        sampler.fill(plan, 4)
        graph.replay()
        got = tokens.tolist()
        assert got[0] == int(logits[0].argmax()) and got[3] == NO_TOKEN
        for row in (1, 2):
            seed, position = plan.keys[row]  # type: ignore[misc]
            params = SamplingTensors.from_params([sampled(plan.temperature[row], seed)])
            probs = logits_to_probs(logits[row:row + 1], params)
            assert got[row] == int(sample_keyed(probs, [seed], [position])[0])


@pytest.mark.cuda
def test_cuda_graphs_sample_in_the_graph(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine on a GPU with captured graphs: overlap with in-graph sampling streams what
    overlap with host sampling and the synchronous engine do (greedy, seeded, a penalty row
    on the host path, stops, an abort), and decode steps did sample in their graphs."""
    _skip_interpreted()
    steps: list[bool] = []
    sample_roots = overlap.sample_roots

    def recording(batch: list[ScheduledRequest], trees: Any, output: ForwardOutput) -> overlap.SampledStep:
        steps.append(output.sampled is not None)
        return sample_roots(batch, trees, output)

    monkeypatch.setattr(engine_module, "sample_roots", recording)

    def make(overlap_on: bool) -> LLM:
        llm = make_llm(tiny_model_dir, overlap_on, device="cuda", dtype="float32", max_num_seqs=4,
                       kv_cache_memory=1 << 24)
        assert isinstance(llm.engine.runner.executor, CudaGraphs)
        return llm

    prompts = random_prompts(4, 4)
    params = [greedy(10), sampled(0.8, 5), SamplingParams(temperature=0.0, max_tokens=10, repetition_penalty=1.4),
              greedy(13)]
    assert_runs_agree(make, monkeypatch, prompts, params, {"r3": 4})
    assert any(steps)
