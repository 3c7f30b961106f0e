"""Our Llama-family model vs transformers on tiny random checkpoints, through the paged cache."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
)

from specdec.kernels import PagedKV
from specdec.models import LlamaForCausalLM, ModelConfig, load_model
from specdec.models.config import parse_rope
from tests.helpers import make_kv_caches, random_block_table, single_request_meta

ATOL = 1e-4
NUM_BLOCKS = 12
SMALL: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=160,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)

# name -> (config, save_pretrained kwargs)
VARIANTS: dict[str, Callable[[], tuple[PretrainedConfig, dict[str, Any]]]] = {
    "llama": lambda: (
        LlamaConfig(**{**SMALL, "num_hidden_layers": 3}, tie_word_embeddings=False),
        {},
    ),
    "llama3_rope_tied_bias": lambda: (
        LlamaConfig(
            **SMALL,
            tie_word_embeddings=True,
            attention_bias=True,
            mlp_bias=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                # with head_dim 16: some frequencies kept, one blended, the rest scaled
                "original_max_position_embeddings": 64,
            },
        ),
        {},
    ),
    "qwen2_tied_sharded": lambda: (
        Qwen2Config(**SMALL, tie_word_embeddings=True),
        {"max_shard_size": "100KB"},
    ),
    "qwen3": lambda: (Qwen3Config(**SMALL, head_dim=32, tie_word_embeddings=False), {}),
    "mistral": lambda: (MistralConfig(**SMALL, sliding_window=None, tie_word_embeddings=False), {}),
}


@pytest.fixture(autouse=True, scope="module")
def _single_thread() -> Iterator[None]:
    """Tiny matmuls gain nothing from threads, and OpenMP spinning on a busy 2-core box
    slows them several-fold; restore the setting for other modules."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@dataclass
class Checkpoint:
    path: Path
    hf: PreTrainedModel
    vocab_size: int


def _randomize(model: PreTrainedModel) -> None:
    """Weights large enough that logits differ clearly; norms near 1; biases non-zero."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.15)


def _build(name: str, path: Path) -> Checkpoint:
    config, save_kwargs = VARIANTS[name]()
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    _randomize(hf)
    hf.save_pretrained(path, **save_kwargs)
    return Checkpoint(path, hf, config.vocab_size)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Checkpoint]:
    """Builds each variant's checkpoint once per session, on first use."""
    cache: dict[str, Checkpoint] = {}

    def get(name: str) -> Checkpoint:
        if name not in cache:
            cache[name] = _build(name, tmp_path_factory.mktemp(name))
        return cache[name]

    return get


def _hf_logits(hf: PreTrainedModel, ids: Tensor) -> Tensor:  # [T] -> [T, vocab]
    with torch.inference_mode():
        return hf(ids[None]).logits[0].float()


def _run(
    model: LlamaForCausalLM,
    ids: Tensor,  # [q_len]
    prefix_len: int,
    caches: list[PagedKV],
    table: list[int],
    block_size: int,
    positions: Tensor | None = None,
    tree_mask: Tensor | None = None,
) -> Tensor:  # [q_len, vocab]
    meta = single_request_meta(prefix_len, len(ids), table, block_size, tree_mask)
    if positions is None:
        positions = torch.arange(prefix_len, prefix_len + len(ids))
    with torch.inference_mode():
        return model.compute_logits(model(ids, positions, caches, meta))


def _fresh_caches(model: LlamaForCausalLM, block_size: int) -> list[PagedKV]:
    c = model.config
    return make_kv_caches(
        c.num_layers, NUM_BLOCKS, block_size, c.num_kv_heads, c.head_dim, fill=float("nan")
    )


def _prompt(vocab: int, length: int, seed: int = 1) -> Tensor:
    return torch.randint(vocab, (length,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_prefill_matches_transformers(checkpoint: Callable[[str], Checkpoint], name: str) -> None:
    ckpt = checkpoint(name)
    model = load_model(ckpt.path)
    ids = _prompt(ckpt.vocab_size, 21)
    expected = _hf_logits(ckpt.hf, ids)
    assert expected.std() > 0.3  # the comparison is not between near-constant logits
    table = random_block_table(len(ids), 4, NUM_BLOCKS, seed=3)
    got = _run(model, ids, 0, _fresh_caches(model, 4), table, 4)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_chunked_prefill_then_decode_matches_full(
    checkpoint: Callable[[str], Checkpoint], name: str, block_size: int
) -> None:
    ckpt = checkpoint(name)
    model = load_model(ckpt.path)
    ids = _prompt(ckpt.vocab_size, 23, seed=2)
    expected = _hf_logits(ckpt.hf, ids)
    caches, table = (
        _fresh_caches(model, block_size),
        random_block_table(len(ids), block_size, NUM_BLOCKS, seed=5),
    )
    bounds = [(0, 7), (7, 15)] + [(p, p + 1) for p in range(15, len(ids))]
    got = torch.cat([_run(model, ids[a:b], a, caches, table, block_size) for a, b in bounds])
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["llama3_rope_tied_bias", "qwen3"])
def test_tree_query_matches_each_path(checkpoint: Callable[[str], Checkpoint], name: str) -> None:
    """Tree nodes a -> {b -> d, c}: positions are prefix_len + depth, visibility = ancestors."""
    ckpt = checkpoint(name)
    model = load_model(ckpt.path)
    prefix, (a, b, c, d) = _prompt(ckpt.vocab_size, 10, seed=4), _prompt(ckpt.vocab_size, 4, seed=6)
    caches, table = _fresh_caches(model, 4), random_block_table(14, 4, NUM_BLOCKS, seed=7)
    _run(model, prefix, 0, caches, table, 4)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    got = _run(
        model, torch.stack([a, b, c, d]), 10, caches, table, 4, torch.tensor([10, 11, 11, 12]), tree
    )
    path_abd = _hf_logits(ckpt.hf, torch.cat([prefix, torch.stack([a, b, d])]))[10:]
    path_ac = _hf_logits(ckpt.hf, torch.cat([prefix, torch.stack([a, c])]))[10:]
    torch.testing.assert_close(got[[0, 1, 3]], path_abd, atol=ATOL, rtol=0)
    torch.testing.assert_close(got[2], path_ac[1], atol=ATOL, rtol=0)


def test_unsupported_architecture_raises(tmp_path: Path) -> None:
    GPT2Config(n_layer=1, n_embd=32, n_head=2, architectures=["GPT2LMHeadModel"]).save_pretrained(
        tmp_path
    )
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        load_model(tmp_path)


def _copy_without(ckpt: Checkpoint, dest: Path, drop: set[str]) -> Path:
    dest.mkdir()
    (dest / "config.json").write_text((ckpt.path / "config.json").read_text())
    tensors = load_file(ckpt.path / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if k not in drop}, dest / "model.safetensors")
    return dest


def test_missing_weight_is_named(checkpoint: Callable[[str], Checkpoint], tmp_path: Path) -> None:
    path = _copy_without(
        checkpoint("llama"), tmp_path / "ckpt", {"model.layers.1.mlp.down_proj.weight"}
    )
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj\.weight"):
        load_model(path)


def test_fallback_weights_fill_missing_embedding(
    checkpoint: Callable[[str], Checkpoint], tmp_path: Path
) -> None:
    ckpt = checkpoint("llama")
    shared = {"model.embed_tokens.weight", "lm_head.weight"}
    path = _copy_without(ckpt, tmp_path / "draft", shared)
    with pytest.raises(ValueError, match=r"model\.embed_tokens\.weight.*lm_head\.weight"):
        load_model(path)
    target = load_model(ckpt.path)
    draft = load_model(path, fallback_weights=target.hf_embedding_weights())
    assert draft.embed_tokens.data_ptr() == target.embed_tokens.data_ptr()  # shared, no copy
    assert draft.lm_head_weight.data_ptr() == target.lm_head_weight.data_ptr()
    ids = _prompt(ckpt.vocab_size, 9)
    got = _run(draft, ids, 0, _fresh_caches(draft, 4), random_block_table(9, 4, NUM_BLOCKS), 4)
    torch.testing.assert_close(got, _hf_logits(ckpt.hf, ids), atol=ATOL, rtol=0)


def test_fallback_with_wrong_shape_is_rejected(
    checkpoint: Callable[[str], Checkpoint], tmp_path: Path
) -> None:
    path = _copy_without(checkpoint("llama"), tmp_path / "draft", {"lm_head.weight"})
    with pytest.raises(ValueError, match=r"lm_head\.weight has shape \(3, 64\)"):
        load_model(path, fallback_weights={"lm_head.weight": torch.zeros(3, 64)})


def test_old_and_new_rope_config_styles_agree() -> None:
    scaling = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    old = {"rope_theta": 500000.0, "rope_scaling": {"type": "llama3", **scaling}}
    new = {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **scaling}}
    assert parse_rope(old) == parse_rope(new)
    assert parse_rope(new).theta == 500000.0 and parse_rope(new).factor == 8.0
    assert parse_rope({"rope_theta": 1e6, "rope_scaling": None}).rope_type == "default"
    with pytest.raises(ValueError, match="yarn"):
        parse_rope({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}})


def test_model_config_fields(checkpoint: Callable[[str], Checkpoint]) -> None:
    qwen3 = ModelConfig.from_dir(checkpoint("qwen3").path)
    assert (qwen3.model_type, qwen3.architecture) == ("qwen3", "Qwen3ForCausalLM")
    assert (qwen3.head_dim, qwen3.num_kv_heads, qwen3.qk_norm) == (32, 2, True)
    qwen2 = ModelConfig.from_dir(checkpoint("qwen2_tied_sharded").path)
    assert qwen2.attention_bias and not qwen2.o_proj_bias and qwen2.tie_word_embeddings
    assert qwen2.sliding_window is None
    raw = json.loads((checkpoint("llama").path / "config.json").read_text())
    raw["eos_token_id"] = [2, 7]
    assert ModelConfig.from_dict(raw, {"eos_token_id": [7, 9]}).eos_token_ids == (2, 7, 9)


def test_bfloat16_load_stays_close(checkpoint: Callable[[str], Checkpoint]) -> None:
    """bf16 weights/activations: fp32 logits, within bf16 noise of the fp32 reference."""
    ckpt = checkpoint("qwen3")
    model = load_model(ckpt.path, dtype=torch.bfloat16)
    ids = _prompt(ckpt.vocab_size, 12)
    c = model.config
    caches = make_kv_caches(
        c.num_layers, NUM_BLOCKS, 4, c.num_kv_heads, c.head_dim, dtype=torch.bfloat16
    )
    got = _run(model, ids, 0, caches, random_block_table(12, 4, NUM_BLOCKS), 4)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, _hf_logits(ckpt.hf, ids), atol=0.3, rtol=0)
