"""Lossless speculation on the GPU path, run on CPU tensors by Triton's interpreter: the
tiny model on the triton attention backend, the triton (batch-invariant GEMM) linear
backend and the fused Triton layer ops.

- The model: every row of a verify forward (a chain, a tree) gives, bit for bit, the
  logits that decoding its token alone after its accepted path gives.
- The engine: greedy speculative decoding (n-gram chains, Medusa trees) is token for
  token plain greedy decoding on the same backends, in float32 and bfloat16.

The `cuda` variants run the compiled kernels:
`TRITON_INTERPRET=0 pytest -m cuda tests/engine/test_triton_invariant_engine.py`.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from specdec.kernels.kv_cache import PagedKV
from specdec.kernels.linear_triton import TritonLinear
from specdec.llm import LLM
from specdec.models import LlamaForCausalLM
from specdec.models.loader import load_model
from tests.helpers import (
    NGRAM,
    assert_all_blocks_free,
    greedy,
    random_parents,
    random_prompts,
    single_request_meta,
    token_ids,
    tree_mask_from_parents,
)

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRETED, reason="CPU tensors need TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
        INTERPRETED, reason="the compiled kernels: run with TRITON_INTERPRET=0")]),
]
DTYPES = [torch.float32, torch.bfloat16]
BLOCK_SIZE, NUM_BLOCKS = 8, 12
MEDUSA_TREE = [[0], [1], [0, 0], [1, 0], [0, 1], [0, 0, 0]]


class Forward:
    """One request through the model, step by step, on its own KV caches."""

    def __init__(self, model: LlamaForCausalLM, device: str) -> None:
        config = model.config
        self.model, self.device = model, device
        kv_dtype = torch.float16 if model.dtype == torch.float32 else model.dtype
        self.caches = [PagedKV.zeros(NUM_BLOCKS, BLOCK_SIZE, config.num_kv_heads, config.head_dim, kv_dtype, device)
                       for _ in range(config.num_layers)]
        self.table = list(range(NUM_BLOCKS - 1, -1, -1))  # not in order, on purpose
        self.length = 0

    def fork(self) -> Forward:
        """The same request so far, on copies of the caches."""
        copy = Forward.__new__(Forward)
        copy.model, copy.device, copy.table, copy.length = self.model, self.device, self.table, self.length
        copy.caches = [PagedKV(*(t.clone() for t in cache.tensors())) for cache in self.caches]
        return copy

    def step(self, tokens: list[int], tree: torch.Tensor | None = None) -> torch.Tensor:  # [T, vocab] float32
        """Run `tokens` after the first `length` ones (a tree: at depths by `tree`, [T, T]
        bool); the context grows by them."""
        depths = range(len(tokens)) if tree is None else (tree.sum(1) - 1).tolist()
        positions = torch.tensor([self.length + d for d in depths], device=self.device)
        meta = single_request_meta(self.length, len(tokens), self.table, BLOCK_SIZE, tree)
        meta = type(meta)(meta.slot_mapping.to(self.device), meta.query_start_loc.to(self.device),
                          meta.seq_lens.to(self.device), meta.block_tables.to(self.device), meta.query_lens_cpu,
                          meta.seq_lens_cpu, None if tree is None else tree.to(self.device))
        with torch.inference_mode():
            hidden = self.model(torch.tensor(tokens, device=self.device), positions, self.caches, meta)
            logits = self.model.compute_logits(hidden)
        self.length += len(tokens)
        return logits


def triton_model(model_dir: Path, dtype: torch.dtype, device: str) -> LlamaForCausalLM:
    model = load_model(model_dir, dtype=dtype, device=device, linear_backend="triton", attention_backend="triton")
    assert isinstance(model.linear_backend, TritonLinear) and model.layer_ops.name == "triton"
    return model


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_verify_rows_equal_decode_logits(tiny_model_dir: Path, device: str, dtype: torch.dtype) -> None:
    """A 1 + 3 chain and a 6-node tree verified in one forward each: every row's logits
    equal those of decoding its path one token at a time."""
    model = triton_model(tiny_model_dir, dtype, device)
    prompted = Forward(model, device)
    prompted.step(random_prompts(1, 1)[0][:13])
    chain = [5, 77, 301, 9]
    chain_logits = prompted.fork().step(chain)
    decode = prompted.fork()
    for i, token in enumerate(chain):
        assert torch.equal(decode.step([token])[0], chain_logits[i]), f"chain row {i}"

    mask = tree_mask_from_parents(random_parents(6, torch.Generator().manual_seed(3)))
    nodes = [int(t) for t in torch.randint(0, 384, (6,), generator=torch.Generator().manual_seed(4))]
    tree_logits = prompted.fork().step(nodes, mask)
    for i in range(len(nodes)):
        path = prompted.fork()
        for j in [j for j in range(len(nodes)) if mask[i, j]]:
            logits = path.step([nodes[j]])[0]
        assert torch.equal(logits, tree_logits[i]), f"tree node {i}"


def spec_config(method: str, medusa_dir: Path) -> dict[str, Any] | None:
    return {"plain": None, "ngram": NGRAM,
            "medusa_tree": {"method": "medusa", "model": str(medusa_dir), "num_speculative_tokens": 3,
                            "num_tree_nodes": 6, "tree_choices": MEDUSA_TREE}}[method]


def make_llm(model_dir: Path, medusa_dir: Path, method: str, dtype: str, device: str) -> LLM:
    return LLM(str(model_dir), max_model_len=128, attention_backend="triton", linear_backend="triton",
               dtype=dtype, device=device, speculative_config=spec_config(method, medusa_dir))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method,dtype", [("ngram", "float32"), ("medusa_tree", "bfloat16")])
def test_greedy_speculation_equals_plain(tiny_model_dir: Path, tiny_medusa_dir: Path, device: str, method: str,
                                         dtype: str) -> None:
    prompts = random_prompts(5, 2)
    plain = make_llm(tiny_model_dir, tiny_medusa_dir, "plain", dtype, device)
    assert plain.engine.model.linear_backend.name == "triton"
    expected = token_ids(plain.generate(prompts, greedy(6)))
    spec = make_llm(tiny_model_dir, tiny_medusa_dir, method, dtype, device)
    assert token_ids(spec.generate(prompts, greedy(6))) == expected
    assert spec.get_metrics()["num_drafts"] > 0
    assert_all_blocks_free(spec)
