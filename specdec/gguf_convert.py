"""GGUF → HF-style directory (config.json, model.safetensors, tokenizer, chat template)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from tqdm import tqdm

from specdec.checksums import model_dir_written
from specdec.models.gguf_file import check_gguf
from specdec.models.gguf_names import hf_name, qk_row_order


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write an HF directory for a llama-architecture GGUF; atomic (tmp dir, then rename).
    A manifest records every file's sha256, so loading catches later damage (named after
    out_dir, the known model it is pulled as). GGUFFileError for a truncated or corrupt file."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    check_gguf(gguf_path)
    meta = load_gguf_checkpoint(str(gguf_path))
    config = meta["config"]
    if config.get("model_type") != "llama":
        raise ValueError(f"GGUF architecture {config.get('model_type')!r} is not supported (llama only)")
    with model_dir_written(out_dir, out_dir.name) as tmp:
        reader = gguf.GGUFReader(str(gguf_path))
        save_file(_tensors(reader, config), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        _write_config(tmp, config)
        _write_tokenizer(gguf_path, tmp)


def _tensors(reader, config: dict) -> dict[str, torch.Tensor]:
    from gguf.quants import dequantize

    tensors = {}
    for t in tqdm(reader.tensors, desc="dequantizing GGUF", unit="tensor"):
        name = hf_name(t.name)
        array = dequantize(t.data, t.tensor_type).astype(np.float32)
        weight = torch.from_numpy(array.reshape([int(d) for d in reversed(t.shape)]).copy())
        tensors[name] = _unpermute(name, weight, config)
    if config.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    return tensors


def _unpermute(name: str, weight: torch.Tensor, config: dict) -> torch.Tensor:
    """llama.cpp interleaves q/k rows for its RoPE; HF uses rotate-half: undo it."""
    if name.endswith("q_proj.weight"):
        return weight[qk_row_order(weight.shape[0], config["num_attention_heads"])]
    if name.endswith("k_proj.weight"):
        return weight[qk_row_order(weight.shape[0], config["num_key_value_heads"])]
    return weight


def _write_config(out: Path, config: dict) -> None:
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    config.update(architectures=["LlamaForCausalLM"], torch_dtype="float32")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))


def _write_tokenizer(gguf_path: Path, out: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(str(out))
