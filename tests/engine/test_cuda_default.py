"""Speculation on by default on CUDA: the same adaptive hybrid drafting as on the CPU (the
config, with torch told it sees a GPU), its heads in the model's dtype, and the default run
on the triton attention backend with CUDA graphs replayed eagerly (Triton's interpreter on
CPU tensors), token-identical to plain decoding. A `cuda`-marked test runs it for real."""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch

from specdec import cuda_graphs, head_graphs
from specdec.config import DEFAULT_HEADS, EngineConfig, default_speculative_config
from specdec.cuda_graphs import CudaGraphs
from specdec.drafters.hybrid import HybridDrafter
from specdec.drafters.recurrent_drafter import DYNAMIC_WIDTH
from specdec.head_graphs import HeadGraphs
from specdec.llm import LLM
from specdec.model_registry import DEFAULT_MODEL
from tests.drafters.test_head_graphs import capture_eagerly as capture_heads_eagerly
from tests.engine.test_triton_engine import capture_eagerly
from tests.helpers import NGRAM, assert_all_blocks_free, greedy, random_prompts, token_ids

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.fixture
def seen_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch reports a bf16-capable GPU (config-level tests only: nothing runs on it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)


def test_cuda_default_is_the_cpus_adaptive_hybrid(seen_gpu: None, tiny_model_dir: Path) -> None:
    gpu, cpu = EngineConfig(), EngineConfig(device="cpu")
    assert gpu.torch_device == CUDA
    assert gpu.speculative_config is not None and gpu.speculative_config == cpu.speculative_config
    spec = gpu.speculative_config
    assert (spec.method, spec.adaptive, spec.model) == ("hybrid", True, DEFAULT_HEADS)
    assert spec.num_tree_nodes > 0
    gpu.validate()  # adaptive speculation is no longer refused on CUDA
    other = EngineConfig(model=str(tiny_model_dir))  # heads are trained for the default model only
    assert other.speculative_config is not None
    assert (other.speculative_config.method, other.speculative_config.model) == ("hybrid", None)
    other.validate()
    assert default_speculative_config(DEFAULT_MODEL, CUDA) == default_speculative_config(DEFAULT_MODEL, CPU)


def test_adaptive_speculation_is_accepted_on_cuda(seen_gpu: None) -> None:
    EngineConfig(dtype="float32", speculative_config={**NGRAM, "adaptive": True}).validate()  # type: ignore[arg-type]
    assert EngineConfig(speculative_config="none").speculative_config is None  # type: ignore[arg-type]


def default_with_heads(heads_dir: Path) -> dict[str, Any]:
    """The default speculation, with heads trained (randomly) for the tiny checkpoint."""
    spec = default_speculative_config(DEFAULT_MODEL, CUDA)
    assert spec is not None
    return {**asdict(spec), "model": str(heads_dir)}


def test_the_hybrids_heads_load_in_the_model_dtype(tiny_model_dir: Path, tiny_recurrent_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), dtype="bfloat16", attention_backend="torch", max_model_len=128,
              speculative_config=default_with_heads(tiny_recurrent_dir))
    heads: Any = llm.engine.drafter.heads  # type: ignore[union-attr]
    assert heads.heads.mix.weight.dtype == torch.bfloat16 and heads.embedding.dtype == torch.bfloat16


# ---- the default on the CUDA code path, on the CPU -----------------------------------------------------


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(3, 3)


@pytest.fixture(scope="module")
def plain(tiny_model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(str(tiny_model_dir), max_model_len=128, attention_backend="torch", speculative_config=None)
    return token_ids(llm.generate(prompts, greedy(MAX_TOKENS)))


MAX_TOKENS = 8


def graphed_llm(model_dir: Path, spec: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> LLM:
    """An engine on the triton attention backend whose target steps and draft heads replay
    CUDA graphs, each graph an eager rerun of what it captured (Triton's interpreter runs
    the kernels on CPU tensors)."""
    monkeypatch.setattr(cuda_graphs, "capture_graph", capture_eagerly)
    monkeypatch.setattr(head_graphs, "capture", capture_heads_eagerly)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    llm = LLM(str(model_dir), max_model_len=128, max_num_seqs=4, attention_backend="triton",
              speculative_config=spec)
    engine = llm.engine
    runner = engine.runner
    runner.executor = CudaGraphs(runner.executor, engine.config, runner.kv_cache, engine.device, engine.max_model_len)
    drafter: Any = engine.drafter
    heads: Any = drafter.heads if isinstance(drafter, HybridDrafter) else drafter
    heads.use_graphs(engine.config.max_num_seqs * DYNAMIC_WIDTH)  # what the drafter builds on CUDA
    return llm


def replays(graphs: Any) -> int:
    return sum(step.graph.replays for step in graphs.captured.values())


# Adaptive (the default itself) drafts only where measured costs say so, which on this
# interpreter is seldom: "fixed" grants drafts every step, so the graphs surely run.
@pytest.mark.parametrize("adaptive", [False], ids=["fixed"])
def test_default_hybrid_on_the_cuda_path_equals_plain(adaptive: bool, tiny_model_dir: Path,
                                                      tiny_recurrent_dir: Path, prompts: list[list[int]],
                                                      plain: list[list[int]], monkeypatch: pytest.MonkeyPatch) -> None:
    """The default (adaptive: its drafting depends on measured costs) and the same drafting
    granted every step (so the graphs of verify steps and of the heads surely run)."""
    llm = graphed_llm(tiny_model_dir, {**default_with_heads(tiny_recurrent_dir), "adaptive": adaptive}, monkeypatch)
    assert llm.engine.model.attention_backend.name == "triton"
    assert token_ids(llm.generate(prompts, greedy(MAX_TOKENS))) == plain
    assert_all_blocks_free(llm)
    if not adaptive:
        drafter: Any = llm.engine.drafter
        assert isinstance(drafter.heads.step_rows, HeadGraphs) and replays(drafter.heads.step_rows) > 0
        assert llm.get_metrics()["num_drafts"] > 0
        executor: Any = llm.engine.runner.executor
        assert any(step.graph.replays for shape, step in executor.captured.items() if shape.masked)


def test_medusa_heads_on_the_cuda_path_equal_plain(tiny_model_dir: Path, tiny_medusa_dir: Path,
                                                   prompts: list[list[int]], plain: list[list[int]],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    spec = {"method": "medusa", "model": str(tiny_medusa_dir), "num_speculative_tokens": 3, "num_tree_nodes": 6,
            "tree_choices": [[0], [1], [0, 0], [1, 0], [0, 1], [0, 0, 0]]}
    llm = graphed_llm(tiny_model_dir, spec, monkeypatch)
    assert token_ids(llm.generate(prompts, greedy(MAX_TOKENS))) == plain
    drafter: Any = llm.engine.drafter
    assert replays(drafter.graphs) > 0
    assert_all_blocks_free(llm)


# ---- on a GPU -------------------------------------------------------------------------------------------------


@pytest.mark.cuda
def test_default_hybrid_runs_on_a_gpu_in_graphs(tiny_model_dir: Path, tiny_recurrent_dir: Path) -> None:
    """The default in the model dtype (bf16 here) with its heads in graphs; then in float32,
    as tests/engine/test_cuda.py checks speculation, token-identical to plain."""
    from specdec.kernels import attention_triton

    if type(attention_triton._paged_attention_kernel).__name__ == "InterpretedFunction":
        pytest.skip("Triton runs interpreted in this session; run TRITON_INTERPRET=0 pytest -m cuda")
    prompts = random_prompts(5, 3)
    options: dict[str, Any] = dict(device="cuda", max_model_len=128, max_num_seqs=4, kv_cache_memory=1 << 24)
    default = LLM(str(tiny_model_dir), speculative_config=default_with_heads(tiny_recurrent_dir), **options)
    drafter: Any = default.engine.drafter
    assert default.engine.config.dtype != torch.float32 and default.engine.config.speculative_config.adaptive  # type: ignore[union-attr]
    assert isinstance(default.engine.runner.executor, CudaGraphs)
    assert drafter.heads.heads.mix.weight.dtype == default.engine.config.dtype
    assert isinstance(drafter.heads.step_rows, HeadGraphs)
    assert all(isinstance(c.graph, torch.cuda.CUDAGraph) for c in drafter.heads.step_rows.captured.values())
    assert all(len(o.outputs[0].token_ids) == 16 for o in default.generate(prompts, greedy(16)))
    assert_all_blocks_free(default)
    fp32 = {**options, "dtype": "float32"}
    spec = LLM(str(tiny_model_dir), speculative_config={**default_with_heads(tiny_recurrent_dir), "adaptive": False},
               **fp32)
    plain = LLM(str(tiny_model_dir), speculative_config=None, **fp32)
    assert token_ids(spec.generate(prompts, greedy(16))) == token_ids(plain.generate(prompts, greedy(16)))
    assert spec.get_metrics()["num_drafts"] > 0
    assert_all_blocks_free(spec)
