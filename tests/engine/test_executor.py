"""The executor (specdec/executor.py): the engine's runner holds exactly one, chosen when
the engine is built, and the C++ layer loop gives the Python layers' logits (up to the
rounding of its own RoPE, SiLU and residual adds, as tests/kernels/test_decoder_cpu.py
finds too)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specdec.executor import CppLayerLoop, Executor, PythonLayers
from specdec.kernels import PagedKV, decoder_cpu
from specdec.llm import LLM
from specdec.model_runner import ModelRunner, StepInputs
from tests.fixtures import make_checkpoint
from tests.helpers import make_kv_caches, random_block_table

needs_the_loop = pytest.mark.skipif(not decoder_cpu.builds(), reason="the C++ kernels do not build here")


@pytest.fixture(scope="module")
def d32_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Head dim 32: one the C++ attention is built for (the shared tiny model's 16 is not).
    return make_checkpoint(tmp_path_factory.mktemp("tiny-d32"), head_dim=32)


def _executors(runner: ModelRunner) -> list[Executor]:
    return [value for value in vars(runner).values() if isinstance(value, Executor)]


def test_a_head_dim_the_cpp_attention_lacks_runs_the_python_layers(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), max_model_len=128)
    runner = llm.engine.runner
    assert _executors(runner) == [runner.executor]
    assert type(runner.executor) is PythonLayers and runner.executor.model is llm.engine.model


@needs_the_loop
def test_the_default_cpu_engine_runs_the_cpp_layer_loop(d32_dir: Path) -> None:
    llm = LLM(str(d32_dir), max_model_len=128)
    runner = llm.engine.runner
    assert _executors(runner) == [runner.executor]
    assert isinstance(runner.executor, CppLayerLoop) and runner.executor.layers is not None
    assert runner.executor.model is llm.engine.model


def _step(token_ids: list[list[int]], starts: list[int], tables: list[list[int]], block_size: int) -> StepInputs:
    """Requests of token_ids[b] after starts[b] cached tokens, every row's logits wanted."""
    inputs = StepInputs([], [], [], [], [], [], [], None, [])
    for ids, start, table in zip(token_ids, starts, tables, strict=True):
        positions = range(start, start + len(ids))
        inputs.logit_rows += range(len(inputs.token_ids), len(inputs.token_ids) + len(ids))
        inputs.token_ids += ids
        inputs.positions += positions
        inputs.slots += [table[p // block_size] * block_size + p % block_size for p in positions]
        inputs.query_lens.append(len(ids))
        inputs.seq_lens.append(start + len(ids))
        inputs.block_tables.append(table)
        inputs.num_rows.append(len(ids))
    return inputs


def _logits(executor: Executor, caches: list[PagedKV]) -> torch.Tensor:  # [rows, V]
    """A batched prefill of two requests, then a decode of both."""
    vocab = executor.model.config.vocab_size
    prompts = torch.randint(3, vocab, (2, 10), generator=torch.Generator().manual_seed(9)).tolist()
    tables = [random_block_table(10, 4, 8, seed=seed) for seed in (1, 2)]
    tables[1] = [block + 8 for block in tables[1]]  # the two requests' blocks apart
    steps = [_step([prompts[0][:9], prompts[1][:6]], [0, 0], tables, 4),
             _step([prompts[0][9:], prompts[1][6:7]], [9, 6], tables, 4)]
    with torch.inference_mode():
        return torch.cat([executor.run(step, caches, torch.device("cpu")).logits for step in steps])


@needs_the_loop
def test_the_cpp_layer_loop_gives_the_python_layers_logits_up_to_rounding(d32_dir: Path) -> None:
    llm = LLM(str(d32_dir), max_model_len=128)
    loop = llm.engine.runner.executor
    assert isinstance(loop, CppLayerLoop)
    c = llm.engine.model_config
    logits = [_logits(executor, make_kv_caches(c.num_layers, 16, 4, c.num_kv_heads, c.head_dim, fill=float("nan")))
              for executor in (loop, PythonLayers(loop.model))]
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)
    assert torch.equal(logits[0].argmax(-1), logits[1].argmax(-1))
