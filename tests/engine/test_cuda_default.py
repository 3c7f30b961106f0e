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

from specdec.config import DEFAULT_HEADS, EngineConfig, default_speculative_config
from specdec.llm import LLM
from specdec.model_registry import DEFAULT_MODEL
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
