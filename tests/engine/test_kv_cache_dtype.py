"""--kv-cache-dtype through the engine: the pool grows as K/V shrink, and greedy speculation
stays token-identical to plain greedy decoding with the same KV cache dtype."""
from __future__ import annotations

from typing import Any

import pytest
import torch

import specdec.model_runner
from specdec.cli import build_parser
from specdec.config import KV_CACHE_DTYPES, EngineConfig
from specdec.engine_args import KV_CACHE_DTYPE_NAMES, engine_kwargs
from specdec.kernels.kv_ops import move_kv
from specdec.llm import LLM
from tests.helpers import NGRAM, assert_all_blocks_free, greedy, random_prompts, token_ids

LOW_DTYPES = ["fp16", "bf16", "fp8"]


def spec_config(method: str, tiny_model_dir: Any, tiny_draft_dir: Any) -> dict[str, Any]:
    # The target as its own (fp32-KV) draft accepts often whatever the target's KV dtype; the
    # unrelated tiny draft makes trees whose accepted paths need moving.
    chain = {"method": "draft_model", "num_speculative_tokens": 3, "model": str(tiny_model_dir)}
    tree = {**chain, "model": str(tiny_draft_dir), "num_tree_nodes": 8}
    return {"ngram": NGRAM, "draft_model": chain, "draft_tree": tree}[method]


@pytest.fixture(scope="module", params=LOW_DTYPES)
def plain(request: pytest.FixtureRequest, tiny_model_dir: Any) -> LLM:
    return LLM(str(tiny_model_dir), max_model_len=256, kv_cache_dtype=request.param)


@pytest.mark.parametrize("method", ["ngram", "draft_model", "draft_tree"])
def test_greedy_speculation_is_lossless(plain: LLM, tiny_model_dir: Any, tiny_draft_dir: Any, method: str,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    moves: list[int] = []

    def counting_move_kv(*args: Any) -> None:
        moves.append(len(args[1]))
        move_kv(*args)

    monkeypatch.setattr(specdec.model_runner, "move_kv", counting_move_kv)
    kv_dtype = plain.engine.config.kv_cache_dtype
    spec = LLM(str(tiny_model_dir), max_model_len=256, max_num_batched_tokens=64, kv_cache_dtype=kv_dtype,
               speculative_config=spec_config(method, tiny_model_dir, tiny_draft_dir))
    for seed in range(2):
        prompts = random_prompts(seed + 50, 4)
        assert token_ids(spec.generate(prompts, greedy())) == token_ids(plain.generate(prompts, greedy()))
    assert spec.get_metrics()["num_accepted_tokens"] > 0
    assert bool(moves) == (method == "draft_tree")  # accepted tree paths moved K/V (and fp8 scales)
    assert_all_blocks_free(spec)


def test_pool_block_count_scales_with_kv_dtype(tiny_model_dir: Any) -> None:
    def num_blocks(kv_dtype: str) -> int:
        llm = LLM(str(tiny_model_dir), max_model_len=64, kv_cache_memory=budget, kv_cache_dtype=kv_dtype)
        assert llm.engine.runner.kv_cache.layers[0].k.dtype == (KV_CACHE_DTYPES[kv_dtype] or torch.float16)
        return llm.engine.block_manager.num_blocks

    mc = LLM(str(tiny_model_dir), max_model_len=64).engine.model_config
    fp32_block = 2 * mc.num_layers * 16 * mc.num_kv_heads * mc.head_dim * 4
    budget = 40 * fp32_block
    assert num_blocks("fp32") == 40
    assert num_blocks("auto") == num_blocks("fp16") == num_blocks("bf16") == 80  # auto: fp16 for a float32 model
    fp8_block = 2 * mc.num_layers * 16 * mc.num_kv_heads * (mc.head_dim + 4)  # + one fp32 scale per head
    assert num_blocks("fp8") == budget // fp8_block > 3 * 40


def test_bad_kv_cache_dtype_is_named(tiny_model_dir: Any) -> None:
    with pytest.raises(ValueError, match=r"kv_cache_dtype 'fp4' is not one of \['auto', 'fp32'"):
        LLM(str(tiny_model_dir), kv_cache_dtype="fp4")
    with pytest.raises(ValueError, match="'float8'"):
        EngineConfig(model="m", kv_cache_dtype="float8").validate()
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--prompt", "x", "--kv-cache-dtype", "int8"])


def test_cli_passes_kv_cache_dtype() -> None:
    assert KV_CACHE_DTYPE_NAMES == tuple(KV_CACHE_DTYPES)
    for command in (["serve"], ["generate", "--prompt", "x"]):
        args = build_parser().parse_args([*command, "--kv-cache-dtype", "fp8"])
        assert engine_kwargs(args)["kv_cache_dtype"] == "fp8"
    assert engine_kwargs(build_parser().parse_args(["serve"]))["kv_cache_dtype"] == "auto"
