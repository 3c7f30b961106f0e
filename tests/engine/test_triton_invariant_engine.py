"""Lossless speculation on the GPU path, run on CPU tensors by Triton's interpreter: the
tiny model on the triton attention backend, the triton (batch-invariant GEMM) linear
backend and the fused Triton layer ops.

- The model: every row of a verify forward (a chain, a tree) gives, bit for bit, the
  logits that decoding its token alone after its accepted path gives. In float32 its
  logits and the residual stream it captures (EAGLE-3's features) are the torch ops'
  within rounding, though it carries the residual across layers to fuse every add with
  the norm after it: a layer is nine kernels, with no separate add.
- The engine: greedy speculative decoding (n-gram chains, Medusa trees) is token for
  token plain greedy decoding on the same backends, in float32 and bfloat16.

The `cuda` variants run the compiled kernels:
`TRITON_INTERPRET=0 pytest -m cuda tests/engine/test_triton_invariant_engine.py`.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import triton
from torch.utils._python_dispatch import TorchDispatchMode

from specdec.kernels.kv_cache import PagedKV
from specdec.kernels.linear_triton import TritonLinear
from specdec.llm import LLM
from specdec.models import LlamaForCausalLM
from specdec.models.loader import load_model
from tests.helpers import (
    NGRAM,
    TRITON_DEVICES,
    assert_all_blocks_free,
    greedy,
    random_parents,
    random_prompts,
    single_request_meta,
    token_ids,
    tree_mask_from_parents,
)

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

    def step(self, tokens: list[int], tree: torch.Tensor | None = None,
             capture: tuple[Sequence[int], torch.Tensor] | None = None) -> torch.Tensor:  # [T, vocab] float32
        """Run `tokens` after the first `length` ones (a tree: at depths by `tree`, [T, T]
        bool; `capture`: the model's); the context grows by them."""
        depths = range(len(tokens)) if tree is None else (tree.sum(1) - 1).tolist()
        positions = torch.tensor([self.length + d for d in depths], device=self.device)
        meta = single_request_meta(self.length, len(tokens), self.table, BLOCK_SIZE, tree)
        meta = type(meta)(meta.slot_mapping.to(self.device), meta.query_start_loc.to(self.device),
                          meta.seq_lens.to(self.device), meta.block_tables.to(self.device), meta.query_lens_cpu,
                          meta.seq_lens_cpu, None if tree is None else tree.to(self.device))
        with torch.inference_mode():
            hidden = self.model(torch.tensor(tokens, device=self.device), positions, self.caches, meta, capture)
            logits = self.model.compute_logits(hidden)
        self.length += len(tokens)
        return logits


def triton_model(model_dir: Path, dtype: torch.dtype, device: str) -> LlamaForCausalLM:
    model = load_model(model_dir, dtype=dtype, device=device, linear_backend="triton", attention_backend="triton")
    assert isinstance(model.linear_backend, TritonLinear) and model.layer_ops.name == "triton"
    return model


@pytest.mark.parametrize("device", TRITON_DEVICES)
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


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_triton_ops_compute_what_the_torch_ops_compute(tiny_model_dir: Path, device: str) -> None:
    """float32, a prompt then a 1 + 3 chain: the Triton path's logits, and the residual
    stream entering each layer that it captures, equal the torch path's (torch attention,
    fp32 linear, torch layer ops) within rounding."""
    triton_path = triton_model(tiny_model_dir, torch.float32, device)
    torch_path = load_model(tiny_model_dir, device=device, attention_backend="torch")
    assert torch_path.layer_ops.name == "torch"
    num_layers, width = triton_path.config.num_layers, triton_path.config.hidden_size
    layers = list(range(num_layers))
    prompt, chain = random_prompts(1, 5)[0][:13], [5, 77, 301, 9]
    results = []
    for model in (triton_path, torch_path):
        forward = Forward(model, device)
        features = [torch.zeros(n, num_layers * width, device=device) for n in (len(prompt), len(chain))]
        logits = [forward.step(tokens, capture=(layers, out)) for tokens, out in zip((prompt, chain), features)]
        results.append((logits, features))
    (triton_logits, triton_features), (torch_logits, torch_features) = results
    for got, want in zip(triton_logits + triton_features, torch_logits + torch_features, strict=True):
        assert want.abs().max() > 0.1  # something was computed and captured
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


class AtenOps(TorchDispatchMode):
    """Counts the torch ops run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def triton_launches(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[str]]:
    """Counts Triton kernel launches (`kernel[grid](...)`) by kernel name, compiled or interpreted."""
    launches: Counter[str] = Counter()
    launch = triton.runtime.jit.KernelInterface.__getitem__

    def counting(kernel: Any, grid: Any) -> Callable[..., Any]:
        launches[kernel.fn.__name__] += 1
        return launch(kernel, grid)

    monkeypatch.setattr(triton.runtime.jit.KernelInterface, "__getitem__", counting)
    yield launches


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_every_residual_add_is_fused_with_a_norm(tiny_model_dir: Path, device: str,
                                                 triton_launches: Counter[str]) -> None:
    """A layer launches nine kernels: four GEMMs, two add + RMSNorm (the first layer's
    input, the embedding, takes a plain RMSNorm), RoPE with the store, attention and
    SiLU-and-multiply; the final norm is one more add + RMSNorm. Torch adds nothing in place."""
    model = triton_model(tiny_model_dir, torch.float32, device)
    forward = Forward(model, device)
    forward.step([3, 50, 7])
    triton_launches.clear()
    with AtenOps() as aten:
        forward.step([11, 12])
    layers = model.config.num_layers
    assert triton_launches == Counter({"_linear_kernel": 4 * layers + 1,  # and the LM head
                                       "_add_rms_norm_kernel": 2 * layers, "_rms_norm_kernel": 1,
                                       "_rope_store_kernel": layers, "_paged_attention_kernel": layers,
                                       "_silu_mul_kernel": layers})
    assert aten.counts["aten.add_.Tensor"] == 0, aten.counts


def spec_config(method: str, medusa_dir: Path) -> dict[str, Any] | None:
    return {"plain": None, "ngram": NGRAM,
            "medusa_tree": {"method": "medusa", "model": str(medusa_dir), "num_speculative_tokens": 3,
                            "num_tree_nodes": 6, "tree_choices": MEDUSA_TREE}}[method]


def make_llm(model_dir: Path, medusa_dir: Path, method: str, dtype: str, device: str) -> LLM:
    return LLM(str(model_dir), max_model_len=128, attention_backend="triton", linear_backend="triton",
               dtype=dtype, device=device, speculative_config=spec_config(method, medusa_dir))


@pytest.mark.parametrize("device", TRITON_DEVICES)
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
