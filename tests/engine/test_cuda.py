"""The engine's CUDA path: device choice, dtype "auto", the KV cache sized from
gpu_memory_utilization, and CUDA graphs. The host-side parts (the choices, the sizing
arithmetic, the graph shapes and the padding) are tested on the CPU; what needs a GPU is
`cuda`-marked and skipped without one (tests/conftest.py): CUDA graphs with every drafter
token-identical to plain decoding, in float32 and bf16, batched and one at a time;
preemption and chunked prefill under the graphs; structured outputs on the GPU.

On a GPU, run the `cuda` tests with compiled Triton kernels (the test session otherwise
runs Triton's interpreter):  TRITON_INTERPRET=0 .venv/bin/python -m pytest -m cuda tests
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from specdec import cuda_graphs
from specdec.config import EngineConfig, auto_dtype, checkpoint_dtype
from specdec.cuda_graphs import CudaGraphs, GraphShape, choose_shape, graph_batch_sizes, graph_shapes, pad_inputs
from specdec.gpu_memory import draft_model_bytes, kv_cache_blocks, measure_used_bytes, profile_step, step_lengths
from specdec.llm import LLM
from specdec.model_runner import KVCache, StepInputs
from specdec.models.config import ModelConfig
from tests.engine.test_structured_outputs import constrained, generate_following
from tests.engine.test_triton_engine import capture_eagerly
from tests.helpers import NGRAM, assert_all_blocks_free, block_bytes, greedy, random_prompts, token_ids

CUDA = torch.device("cuda")
GiB = 1 << 30
MEDUSA_TREE = {"num_speculative_tokens": 3, "num_tree_nodes": 6,
               "tree_choices": [[0], [1], [0, 0], [1, 0], [0, 1], [0, 0, 0]]}


@pytest.fixture
def seen_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch reports a bf16-capable GPU (config-level tests only: nothing runs on it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)


# ---- device and dtype ------------------------------------------------------------------------------


def test_auto_device_is_cuda_when_torch_sees_a_gpu(seen_gpu: None) -> None:
    assert EngineConfig(device="auto").torch_device == CUDA


def test_cuda_without_a_gpu_refuses_to_start(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="device 'cuda' was asked for, but torch sees no CUDA GPU"):
        LLM(str(tiny_model_dir), device="cuda")


def test_auto_dtype_is_float32_on_the_cpu_and_the_checkpoints_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert [auto_dtype(cpu, stored) for stored in ("bfloat16", "float16", None)] == [torch.float32] * 3
    assert auto_dtype(CUDA, "bfloat16") == torch.bfloat16
    assert auto_dtype(CUDA, "float16") == torch.float16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    assert auto_dtype(CUDA, "float32") == auto_dtype(CUDA, None) == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: False)
    assert auto_dtype(CUDA, "float32") == torch.float16


def test_checkpoint_dtype_is_read_without_pulling(tiny_model_dir: Path, tmp_path: Path) -> None:
    assert checkpoint_dtype(str(tiny_model_dir)) == "float32"
    assert checkpoint_dtype(str(tmp_path / "missing")) is None


def test_cuda_config_resolves_auto_options(seen_gpu: None, tiny_model_dir: Path) -> None:
    config = EngineConfig(model=str(tiny_model_dir))
    assert config.dtype == torch.bfloat16  # a float32 checkpoint on a bf16 GPU
    assert config.kv_cache_memory == 0  # sized from gpu_memory_utilization
    config.validate()
    assert config.linear_backend == "triton"  # the batch-invariant GEMM: cuBLAS rounds by row count
    assert EngineConfig(model=str(tiny_model_dir), dtype="fp16").dtype == torch.float16  # type: ignore[arg-type]
    assert EngineConfig(model=str(tiny_model_dir), kv_cache_memory=1 << 20).kv_cache_memory == 1 << 20


def test_cpu_config_keeps_its_defaults() -> None:
    config = EngineConfig(device="cpu")
    assert config.dtype == torch.float32 and config.kv_cache_memory == 1 << 30


@pytest.mark.parametrize("options, needle", [
    ({"linear_backend": "cpp-fp16"}, "linear_backend 'cpp-fp16' packs weights for the CPU"),
    ({"attention_backend": "torch"}, "attention_backend 'torch' on CUDA needs enforce_eager=True"),
    ({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization must be in"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization must be in"),
])
def test_cuda_options_that_cannot_work_are_refused(seen_gpu: None, options: dict[str, object], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        EngineConfig(dtype="float32", **options).validate()  # type: ignore[arg-type]


def test_torch_attention_on_cuda_runs_eagerly(seen_gpu: None) -> None:
    EngineConfig(dtype="float32", attention_backend="torch", enforce_eager=True).validate()  # type: ignore[arg-type]


# ---- KV cache sizing ---------------------------------------------------------------------------------


def test_kv_cache_gets_what_the_budget_leaves() -> None:
    # 80 GiB at 0.9 is 72 GiB; 20 GiB used leaves 52 GiB: 52 * 1024 blocks of 1 MiB.
    assert kv_cache_blocks(80 * GiB, 20 * GiB, 0.9, 1 << 20) == 52 * 1024
    assert kv_cache_blocks(80 * GiB, 20 * GiB, 0.9, 3 << 20) == 52 * 1024 // 3  # whole blocks only
    assert kv_cache_blocks(80 * GiB, 20 * GiB, 0.5, 1 << 20) == 20 * 1024


def test_no_room_for_the_kv_cache_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.2 of .* leaves -"):
        kv_cache_blocks(80 * GiB, 20 * GiB, 0.2, 1 << 20)
    with pytest.raises(ValueError, match="one KV block needs"):
        kv_cache_blocks(100, 50, 1.0, 64)


def test_profiled_step_is_max_num_batched_tokens_in_requests_that_fit() -> None:
    assert step_lengths(2048, 4096) == [2048]
    assert step_lengths(2048, 512) == [512] * 4
    assert step_lengths(100, 64) == [64, 36]


def test_profile_step_runs_on_the_cpu(tiny_model_dir: Path) -> None:
    """The profiled forward itself is device-agnostic (the CPU stand-in of the GPU profile),
    and writes a throwaway cache, not the engine's."""
    llm = LLM(str(tiny_model_dir), max_model_len=48, max_num_batched_tokens=100, max_num_seqs=4,
              speculative_config=NGRAM, kv_cache_memory=1 << 20)
    profile_step(llm.engine.runner.executor, llm.engine.config, llm.engine.max_model_len, torch.device("cpu"))
    assert not any(cache.any() for layer in llm.engine.runner.kv_cache.layers for cache in layer.tensors())
    assert_all_blocks_free(llm)


def test_a_draft_model_is_counted_in(tiny_draft_dir: Path) -> None:
    spec = {"method": "draft_model", "model": str(tiny_draft_dir), "num_speculative_tokens": 3}
    config = EngineConfig(speculative_config=spec, dtype="float32", max_num_seqs=4)  # type: ignore[arg-type]
    mc = ModelConfig.from_dir(tiny_draft_dir)
    per_block, fixed = draft_model_bytes(config)
    assert per_block == KVCache.bytes_per_block(mc.num_layers, 16, mc.num_kv_heads, mc.head_dim, torch.float32)
    weights = sum(f.stat().st_size for f in tiny_draft_dir.glob("*.safetensors"))
    assert fixed == weights + 4 * per_block
    assert draft_model_bytes(EngineConfig(speculative_config=NGRAM)) == (0, 0)  # type: ignore[arg-type]


# ---- CUDA graph shapes and padding ------------------------------------------------------------------------


def test_graph_batch_sizes() -> None:
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(10) == [1, 2, 4, 8, 10]
    assert graph_batch_sizes(3) == [1, 2, 3]
    assert graph_batch_sizes(1) == [1]


def test_graph_shapes_cover_decode_and_verify() -> None:
    plain = graph_shapes(EngineConfig(max_num_seqs=4, speculative_config=None))
    assert plain == [GraphShape(1, 1, False), GraphShape(2, 1, False), GraphShape(4, 1, False)]
    tree = graph_shapes(EngineConfig(max_num_seqs=2, speculative_config={  # type: ignore[arg-type]
        "method": "medusa", **MEDUSA_TREE}))
    assert {(s.query_len, s.masked) for s in tree} == {(1, False), (7, True)}
    assert [s.num_tokens for s in tree] == sorted(s.num_tokens for s in tree)


def step(query_lens: list[int], masked: bool = False) -> StepInputs:
    """A step of requests with these query lengths, context 5 before each, 16-token blocks."""
    inputs = StepInputs([], [], [], [], [], [], [], [] if masked else None, [])
    for b, q_len in enumerate(query_lens):
        first = len(inputs.token_ids)
        inputs.token_ids += [100 + b] * q_len
        inputs.positions += range(5, 5 + q_len)
        inputs.slots += [b * 16 + p for p in range(5, 5 + q_len)]
        inputs.query_lens.append(q_len)
        inputs.seq_lens.append(5 + q_len)
        inputs.block_tables.append([b])
        inputs.num_rows.append(q_len)
        inputs.logit_rows += range(first, first + q_len)
        if inputs.masks is not None:
            star = torch.eye(q_len, dtype=torch.bool)
            star[:, 0] = True  # a root and its children: each node sees the root and itself
            inputs.masks.append(star)
    return inputs


def test_a_step_takes_the_smallest_shape_it_fits() -> None:
    shapes = graph_shapes(EngineConfig(max_num_seqs=8, speculative_config=NGRAM))  # type: ignore[arg-type]
    assert choose_shape(step([1, 1, 1]), shapes) == GraphShape(4, 1, False)
    assert choose_shape(step([1, 3]), shapes) == GraphShape(2, 5, False)
    assert choose_shape(step([1] * 9), shapes) is None  # more requests than max_num_seqs
    assert choose_shape(step([6]), shapes) is None  # a prefill chunk
    assert choose_shape(step([2], masked=True), shapes) is None  # trees, but only causal shapes


def test_padding_writes_no_kv_and_keeps_each_requests_view() -> None:
    inputs = step([2, 3], masked=True)
    padded = pad_inputs(inputs, GraphShape(4, 4, True), block_size=16)
    assert padded.query_lens == [4] * 4
    assert padded.token_ids == [100, 100, 0, 0, 101, 101, 101, 0] + [0] * 8
    # Real tokens keep their slots; dummy tokens and dummy requests write nowhere.
    assert padded.slots == [5, 6, -1, -1, 21, 22, 23, -1] + [-1] * 8
    # Contexts grow by the padding, so the real tokens keep their keys; tables cover it.
    assert padded.seq_lens == [5 + 4, 5 + 4, 4, 4]
    assert padded.block_tables == [[0], [1], [0], [0]]
    assert padded.logit_rows == [0, 1, 4, 5, 6] and padded.num_rows == [2, 3, 0, 0]
    assert padded.masks is not None and inputs.masks is not None
    assert torch.equal(padded.masks[1][:3, :3], inputs.masks[1])
    assert not padded.masks[1][:3, 3:].any()  # no real token sees a dummy one
    causal = pad_inputs(step([2]), GraphShape(1, 4, True), block_size=16)
    assert causal.masks is not None and torch.equal(causal.masks[0][:2, :2], torch.ones(2, 2, dtype=torch.bool).tril())


def test_padding_lengthens_tables_past_a_block_boundary() -> None:
    inputs = step([3])
    inputs.seq_lens = [16]  # the context ends on a block boundary: the padding spills over
    assert pad_inputs(inputs, GraphShape(1, 5, False), block_size=16).block_tables == [[0, 0]]


# ---- on a GPU -------------------------------------------------------------------------------------------------


@pytest.fixture
def compiled_triton() -> None:
    from specdec.kernels import attention_triton

    if type(attention_triton._paged_attention_kernel).__name__ == "InterpretedFunction":
        pytest.skip("Triton runs interpreted in this session; on a GPU run "
                    "TRITON_INTERPRET=0 pytest -m cuda tests/engine/test_cuda.py")


def cuda_llm(model_dir: Path, dtype: str = "float32", **options: object) -> LLM:
    options = {"max_model_len": 128, "kv_cache_memory": 1 << 24, **options}
    return LLM(str(model_dir), device="cuda", dtype=dtype, max_num_seqs=4, **options)


@pytest.mark.cuda
@pytest.mark.parametrize("method", ["plain", "ngram", "medusa_tree"])
def test_graphs_replay_what_eager_runs(method: str, compiled_triton: None, tiny_model_dir: Path,
                                       tiny_medusa_dir: Path) -> None:
    spec = {"plain": None, "ngram": NGRAM, "medusa_tree": {"method": "medusa", "model": str(tiny_medusa_dir),
                                                           **MEDUSA_TREE}}[method]
    prompts = random_prompts(5, 3)
    eager = cuda_llm(tiny_model_dir, speculative_config=spec, enforce_eager=True)
    graphed = cuda_llm(tiny_model_dir, speculative_config=spec)
    assert isinstance(graphed.engine.runner.executor, CudaGraphs)
    assert graphed.engine.model.attention_backend.name == "triton"
    expected = token_ids(eager.generate(prompts, greedy(12)))
    assert token_ids(graphed.generate(prompts, greedy(12))) == expected
    plain = cuda_llm(tiny_model_dir, enforce_eager=True)
    assert token_ids(plain.generate(prompts, greedy(12))) == expected  # speculation stays lossless on the GPU
    assert_all_blocks_free(graphed)


@pytest.mark.cuda
def test_gpu_memory_utilization_sizes_the_kv_cache(compiled_triton: None, tiny_model_dir: Path) -> None:
    llm = cuda_llm(tiny_model_dir, enforce_eager=True)
    total, used = measure_used_bytes(
        lambda: profile_step(llm.engine.runner.executor, llm.engine.config, 128, CUDA), CUDA)
    assert total == torch.cuda.mem_get_info()[1] and 0 < used < total
    blocks = kv_cache_blocks(total, used, 0.5, 1 << 20)
    assert 0 < blocks * (1 << 20) <= total // 2


@pytest.mark.cuda
def test_dtype_auto_on_cuda_runs_in_half_precision(compiled_triton: None, tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), device="cuda", max_model_len=128, max_num_seqs=2, kv_cache_memory=1 << 24)
    assert llm.engine.config.dtype in (torch.bfloat16, torch.float16)
    assert llm.engine.model.embed_tokens.dtype == llm.engine.config.dtype
    out = llm.generate(random_prompts(6, 2), greedy(8))
    assert all(len(o.outputs[0].token_ids) == 8 for o in out)
    assert_all_blocks_free(llm)


# ---- every drafter, preemption and grammars in CUDA graphs ------------------------------------------------------

DRAFTERS = ["ngram", "suffix", "draft_model", "draft_model_tree", "medusa", "recurrent_heads", "hybrid"]


@pytest.fixture
def drafter_dirs(tiny_draft_dir: Path, tiny_medusa_dir: Path, tiny_recurrent_dir: Path) -> dict[str, Path]:
    return {"draft": tiny_draft_dir, "medusa": tiny_medusa_dir, "recurrent": tiny_recurrent_dir}


def drafter_config(method: str, dirs: dict[str, Path]) -> dict[str, Any]:
    """Every drafter, chains and trees, at sizes the tiny checkpoints draft well with."""
    return {
        "ngram": NGRAM,
        "suffix": {"method": "suffix", "num_speculative_tokens": 4, "num_tree_nodes": 8, "suffix_min_prob": 0.0},
        "draft_model": {"method": "draft_model", "model": str(dirs["draft"]), "num_speculative_tokens": 3},
        "draft_model_tree": {"method": "draft_model", "model": str(dirs["draft"]), "num_speculative_tokens": 3,
                             "num_tree_nodes": 6},
        "medusa": {"method": "medusa", "model": str(dirs["medusa"]), **MEDUSA_TREE},
        "recurrent_heads": {"method": "medusa", "model": str(dirs["recurrent"]), "num_speculative_tokens": 4,
                            "num_tree_nodes": 6},
        "hybrid": {"method": "hybrid", "model": str(dirs["recurrent"]), "num_speculative_tokens": 4,
                   "num_tree_nodes": 8},
    }[method]


@dataclass
class GraphSteps:
    """The graph shapes CudaGraphs chose, step by step (None: the step ran eagerly)."""

    shapes: list[GraphShape | None]

    @property
    def verified_in_graphs(self) -> bool:
        return any(shape is not None and shape.query_len > 1 for shape in self.shapes)


@pytest.fixture
def graph_steps(monkeypatch: pytest.MonkeyPatch) -> GraphSteps:
    steps = GraphSteps([])

    def choose(inputs: StepInputs, shapes: list[GraphShape]) -> GraphShape | None:
        steps.shapes.append(choose_shape(inputs, shapes))
        return steps.shapes[-1]

    monkeypatch.setattr(cuda_graphs, "choose_shape", choose)
    return steps


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("method", DRAFTERS)
def test_every_drafter_in_cuda_graphs_is_token_identical_to_plain(method: str, dtype: str, compiled_triton: None,
                                                                  tiny_model_dir: Path, drafter_dirs: dict[str, Path],
                                                                  graph_steps: GraphSteps) -> None:
    """Lossless on the GPU: greedy output equal to plain decoding's in the same dtype, for
    a batch and for each prompt alone (where suffix drafting also finds the batch's
    outputs), with the verify steps replayed from graphs."""
    prompts = random_prompts(11, 4)
    plain = cuda_llm(tiny_model_dir, dtype)
    expected = token_ids(plain.generate(prompts, greedy(24)))
    spec = cuda_llm(tiny_model_dir, dtype, speculative_config=drafter_config(method, drafter_dirs))
    assert isinstance(spec.engine.runner.executor, CudaGraphs)
    graph_steps.shapes.clear()
    assert token_ids(spec.generate(prompts, greedy(24))) == expected
    assert [token_ids(spec.generate([prompt], greedy(24)))[0] for prompt in prompts] == expected
    assert spec.get_metrics()["num_drafts"] > 0 and graph_steps.verified_in_graphs
    assert_all_blocks_free(spec)


# The drafters tests/engine/test_triton_engine.py does not replay (it has n-gram chains and
# Medusa trees); the draft model as a tree only, which runs its chain's code and more.
@pytest.mark.parametrize("method", ["suffix", "draft_model_tree", "recurrent_heads"])
def test_drafters_in_eagerly_replayed_graphs_equal_plain_on_the_cpu(method: str, tiny_model_dir: Path,
                                                                    drafter_dirs: dict[str, Path],
                                                                    graph_steps: GraphSteps,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU stand-in of the GPU test above for the drafters no other test runs through
    CudaGraphs (n-gram and Medusa: test_triton_engine.py; hybrid: test_cuda_default.py):
    each graph an eager rerun over the static buffers, Triton's interpreter on CPU tensors.
    It also shows that the verify steps do fit graph shapes, as the GPU test asserts."""
    monkeypatch.setattr(cuda_graphs, "capture_graph", capture_eagerly)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    prompts = random_prompts(11, 3)
    plain = LLM(str(tiny_model_dir), max_model_len=128, attention_backend="torch")
    expected = token_ids(plain.generate(prompts, greedy(6)))
    llm = LLM(str(tiny_model_dir), max_model_len=128, max_num_seqs=4, attention_backend="triton",
              speculative_config=drafter_config(method, drafter_dirs))
    engine, runner = llm.engine, llm.engine.runner
    runner.executor = CudaGraphs(runner.executor, engine.config, runner.kv_cache, engine.device, engine.max_model_len)
    graph_steps.shapes.clear()
    for _ in range(2):  # the second time, suffix drafting also finds the first time's outputs
        assert token_ids(llm.generate(prompts, greedy(6))) == expected
    assert llm.get_metrics()["num_drafts"] > 0 and graph_steps.verified_in_graphs
    assert_all_blocks_free(llm)


def preempting_llm(model_dir: Path, device: str, speculative_config: dict[str, Any] | None, block: int) -> LLM:
    """Chunked prefill (24-token steps) and preemption (9 KV blocks of `block` bytes for 6
    requests), as tests/engine/test_speculative.py runs them on the CPU."""
    return LLM(str(model_dir), device=device, dtype="float32", max_num_seqs=4, max_model_len=128,
               max_num_batched_tokens=24, kv_cache_memory=9 * block, speculative_config=speculative_config)


@pytest.mark.parametrize("method", ["plain", "ngram", "draft_model", "hybrid"])
def test_the_preemption_config_preempts_on_the_cpu(method: str, tiny_model_dir: Path,
                                                   drafter_dirs: dict[str, Path]) -> None:
    """The CPU run of the GPU test below: same options, same outputs as without pressure,
    and it does preempt (so the GPU test's claim is not empty)."""
    spec = None if method == "plain" else drafter_config(method, drafter_dirs)
    prompts = random_prompts(100, 6)
    reference = LLM(str(tiny_model_dir), max_model_len=128, max_num_seqs=4)
    expected = token_ids(reference.generate(prompts, greedy()))
    tight = preempting_llm(tiny_model_dir, "cpu", spec, block_bytes(reference))
    assert token_ids(tight.generate(prompts, greedy())) == expected
    assert tight.get_metrics()["num_preemptions"] > 0
    assert_all_blocks_free(tight)


@pytest.mark.cuda
@pytest.mark.parametrize("method", ["plain", "ngram", "draft_model", "hybrid"])
def test_preemption_under_cuda_graphs_changes_no_token(method: str, compiled_triton: None, tiny_model_dir: Path,
                                                      drafter_dirs: dict[str, Path], graph_steps: GraphSteps) -> None:
    spec = None if method == "plain" else drafter_config(method, drafter_dirs)
    prompts = random_prompts(100, 6)
    reference = cuda_llm(tiny_model_dir)
    expected = token_ids(reference.generate(prompts, greedy()))
    tight = preempting_llm(tiny_model_dir, "cuda", spec, block_bytes(reference))
    assert isinstance(tight.engine.runner.executor, CudaGraphs)
    graph_steps.shapes.clear()
    assert token_ids(tight.generate(prompts, greedy())) == expected
    assert tight.get_metrics()["num_preemptions"] > 0
    assert any(shape is not None for shape in graph_steps.shapes)  # decode steps replayed between the preemptions
    assert_all_blocks_free(tight)


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["json", "regex", "choice", "lark"])
def test_structured_outputs_on_cuda_follow_the_grammar_and_speculation_changes_nothing(
        name: str, compiled_triton: None, tiny_model_dir: Path, drafter_dirs: dict[str, Path]) -> None:
    prompts = random_prompts(5, 3)
    plain = cuda_llm(tiny_model_dir, max_model_len=256)
    expected = generate_following(plain, prompts, name)
    for method in ("ngram", "hybrid"):  # a chain and a tree
        spec = cuda_llm(tiny_model_dir, max_model_len=256, speculative_config=drafter_config(method, drafter_dirs))
        assert token_ids(spec.generate(prompts, constrained(name))) == token_ids(expected), method
        assert_all_blocks_free(spec)
