"""Random-weight checkpoints of real model shapes for evals/bench_gpu.py, with no download
and no multi-gigabyte file: the directory holds config.json, a small word-level tokenizer
and one real tensor (the final norm), and while `random_weights` is open every engine built
on it gets the rest from the loader's fallback weights, made on the engine's device in its
dtype (a single-tensor parameter takes the random tensor as is, a fused one is filled from
it), so an 8B model is never on the host.
"""
from __future__ import annotations

import json
import zlib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from specdec import engine as engine_module

# Model shapes by name: Llama-3.1-8B, Llama-3.2-1B, SmolLM2-135M (the default model's), and
# a tiny one for tests on the CPU.
SHAPES: dict[str, dict[str, Any]] = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
               rope_theta=500000.0),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0),
    "135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True,
                 rope_theta=100000.0),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=384, tie_word_embeddings=True, rope_theta=10000.0),
}
INIT_STD = 0.02  # transformers' initializer_range for Llama
TOKENIZER_WORDS = 1024  # the tokenizer's vocabulary; the model's may be larger (ids past it decode to nothing)


def write_checkpoint(path: Path, shape: str, max_positions: int) -> Path:
    """config.json, a tokenizer and the final norm for the named shape, in `path`."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    dims = SHAPES[shape]
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
              "rms_norm_eps": 1e-5, "max_position_embeddings": max_positions, "bos_token_id": 1,
              "eos_token_id": 2, "pad_token_id": 0, "torch_dtype": "bfloat16", **dims}
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file({"model.norm.weight": torch.ones(dims["hidden_size"])}, str(path / "model.safetensors"))
    write_tokenizer(path, min(TOKENIZER_WORDS, dims["vocab_size"]))
    return path


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer of `vocab_size` made-up words (ids 0-2: pad, bos, eos)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>"]
    vocab = {word: i for i, word in enumerate(specials + [f"w{i}" for i in range(len(specials), vocab_size)])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<pad>")
    fast.save_pretrained(str(path))


class RandomWeights(Mapping[str, torch.Tensor]):
    """HF tensor name -> a random tensor of its shape on `device` in `dtype`, made when asked
    for (the same one each time: seeded by its name); norms are ones."""

    def __init__(self, config_dir: Path, dtype: torch.dtype, device: torch.device, seed: int = 0) -> None:
        self.shapes = hf_shapes(config_dir)
        self.dtype, self.device, self.seed = dtype, device, seed

    def __getitem__(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]
        if name.endswith("norm.weight"):
            return torch.ones(shape, dtype=self.dtype, device=self.device)
        generator = torch.Generator(self.device).manual_seed(self.seed + zlib.crc32(name.encode()))
        weight = torch.randn(shape, generator=generator, dtype=self.dtype, device=self.device)
        return weight.mul_(INIT_STD)

    def __contains__(self, name: object) -> bool:  # without making the tensor (Mapping's would)
        return name in self.shapes

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def hf_shapes(config_dir: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor name and shape of the transformers model of config_dir (built on the meta
    device: no memory)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(config_dir))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


@contextmanager
def random_weights(model_dir: Path) -> Iterator[None]:
    """While open, an engine built on model_dir loads through the real loader with
    RandomWeights as its fallback weights (every tensor the directory lacks)."""
    real = engine_module.load_model

    def load(path: Any, dtype: torch.dtype = torch.float32, device: Any = "cpu", **options: Any) -> Any:
        if Path(path) == model_dir:
            options["fallback_weights"] = RandomWeights(model_dir, dtype, torch.device(device))
        return real(path, dtype=dtype, device=device, **options)

    engine_module.load_model = load  # type: ignore[assignment]
    try:
        yield
    finally:
        engine_module.load_model = real
