"""EngineConfig is the one definition of the engine options: conversions, the device
option, and `LLM(...)` taking exactly its fields."""
from __future__ import annotations

import inspect
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from specdec.config import ATTENTION_BACKENDS, DEFAULT_KV_CACHE_MEMORY, EngineConfig, SpeculativeConfig
from specdec.llm import LLM
from specdec.structured_output import GrammarLimits


def test_raw_values_are_converted_once() -> None:
    config = EngineConfig(model="m", dtype="bf16", kv_cache_memory=None,  # type: ignore[arg-type]
                          speculative_config='{"method": "ngram"}')  # type: ignore[arg-type]
    assert config.dtype == torch.bfloat16 and config.kv_cache_memory == DEFAULT_KV_CACHE_MEMORY
    assert config.speculative_config == SpeculativeConfig(method="ngram")
    from_dict = EngineConfig(speculative_config={"method": "ngram"})  # type: ignore[arg-type]
    assert from_dict.speculative_config == config.speculative_config
    with pytest.raises(ValueError, match="float64"):
        EngineConfig(dtype="float64")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="JSON"):
        EngineConfig(speculative_config="{method: ngram}")  # type: ignore[arg-type]


def test_unknown_device_is_named() -> None:
    with pytest.raises(ValueError, match="'tpu'"):
        EngineConfig(device="tpu")


def test_cuda_without_a_gpu_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="device 'cuda'.*no CUDA GPU"):
        EngineConfig(device="cuda")
    assert EngineConfig(device="auto").torch_device == torch.device("cpu")
    assert EngineConfig(device="cpu").torch_device == torch.device("cpu")


def test_attention_backend_choices_are_the_kernels() -> None:
    from specdec.kernels.attention import BACKENDS

    assert tuple(BACKENDS) == ATTENTION_BACKENDS


def test_llm_signature_is_the_fields() -> None:
    params = inspect.signature(LLM).parameters
    assert list(params) == [f.name for f in fields(EngineConfig)]
    assert {name: p.default for name, p in params.items()} == {f.name: f.default for f in fields(EngineConfig)}


def test_llm_refuses_an_unknown_option_by_name() -> None:
    with pytest.raises(TypeError, match="max_len"):
        LLM("unused", max_len=128)


def test_llm_passes_every_option_through(tiny_model_dir: Path) -> None:
    options = dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}, max_model_len=64,
                   max_num_batched_tokens=32, max_num_seqs=2, block_size=8, kv_cache_memory=1 << 20,
                   kv_cache_dtype="fp32", enable_prefix_caching=True, dtype="float32", linear_backend="fp32",
                   attention_backend="torch", seed=3, device="cpu", prefill_step_target_ms=100.0,
                   chat_template="{{ messages }}", quantization="none", quantized_activations="float32",
                   gpu_memory_utilization=0.5, max_grammar_compile_s=2.5, max_guided_choices=7,
                   max_grammar_bytes=4096, enforce_eager=True, async_scheduling=True)
    assert set(options) | {"model"} == {f.name for f in fields(EngineConfig)}
    engine = LLM(str(tiny_model_dir), **options).engine
    config = engine.config
    assert engine.grammars.limits == GrammarLimits(compile_s=2.5, max_choices=7, max_bytes=4096)
    assert engine.pipeline.enabled  # async_scheduling
    expected = EngineConfig(model=str(tiny_model_dir), **options)  # type: ignore[arg-type]
    assert {f.name: getattr(config, f.name) for f in fields(EngineConfig)} == \
        {f.name: getattr(expected, f.name) for f in fields(EngineConfig)}


@pytest.mark.parametrize(("option", "needle"), [
    ({"max_grammar_compile_s": 0.0}, "max_grammar_compile_s must be a positive number"),
    ({"max_grammar_compile_s": float("nan")}, "max_grammar_compile_s must be a positive number"),
    ({"max_guided_choices": 0}, "max_guided_choices must be positive"),
    ({"max_grammar_bytes": -1}, "max_grammar_bytes must be positive"),
])
def test_grammar_limits_are_checked(tiny_model_dir: Path, option: dict[str, float], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        LLM(str(tiny_model_dir), speculative_config=None, **option)
