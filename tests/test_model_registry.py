"""`specdec models pull` records a checksum of every file it writes, and resolving the model
checks them: damaged weights are a clear error, not garbage output (issue 23, defect 9).
Directories without a manifest (brought by a user, or pulled before manifests) load as
before. The pull converts a tiny GGUF written here from the tiny checkpoint: no network."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from safetensors.torch import load_file

from specdec import LLM, SamplingParams, model_registry
from specdec.checksums import MODEL_MANIFEST, CorruptModelError, sha256_file

# HF tensor names (after "model.layers.{i}.") -> llama.cpp's, as llama.cpp's converter names them.
_GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
_GGUF_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}


def _gguf_name(hf_name: str) -> str:
    if hf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[hf_name]
    _, _, layer, *module, kind = hf_name.split(".")
    return f"blk.{layer}.{_GGUF_LAYER_NAMES['.'.join(module)]}.{kind}"


def make_gguf(path: Path, model_dir: Path) -> Path:
    """An fp32 llama GGUF (weights and BPE tokenizer) of an HF checkpoint directory."""
    import gguf

    config = json.loads((model_dir / "config.json").read_text())
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())["model"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(sorted(tokenizer["vocab"], key=tokenizer["vocab"].get))
    writer.add_token_types([1] * len(tokenizer["vocab"]))
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tokenizer["merges"]])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    for name, tensor in load_file(str(model_dir / "model.safetensors")).items():
        writer.add_tensor(_gguf_name(name), tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def pulled(tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The default model's name pulled into a fresh model cache, from a GGUF of the tiny
    checkpoint (kernels stay in their usual cache: building them again would be slow)."""
    gguf_file = make_gguf(tmp_path / "tiny.gguf", tiny_model_dir)
    monkeypatch.setattr(model_registry, "model_cache_dir", lambda name: tmp_path / "models" / name)
    monkeypatch.setattr(model_registry, "_gguf_path", lambda known: gguf_file)
    return model_registry.pull(model_registry.DEFAULT_MODEL)


def _overwrite(path: Path, offset: int, data: bytes) -> None:
    with path.open("r+b") as file:
        file.seek(offset)
        file.write(data)


def _flip_a_byte(path: Path) -> None:
    middle = path.stat().st_size // 2
    _overwrite(path, middle, bytes([path.read_bytes()[middle] ^ 0xFF]))


def _random_block(path: Path) -> None:
    """The measured case in small: random bytes over part of the weights, size unchanged."""
    _overwrite(path, path.stat().st_size // 4, os.urandom(path.stat().st_size // 4))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:1000])


def test_pull_records_every_file_it_writes(pulled: Path) -> None:
    manifest = json.loads((pulled / MODEL_MANIFEST).read_text())
    files = {p.name for p in pulled.iterdir()} - {MODEL_MANIFEST}
    assert set(manifest["files"]) == files >= {"model.safetensors", "config.json", "tokenizer.json"}
    weights = manifest["files"]["model.safetensors"]
    assert weights == {"size": (pulled / "model.safetensors").stat().st_size,
                       "sha256": sha256_file(pulled / "model.safetensors")}
    assert manifest["model"] == model_registry.DEFAULT_MODEL


@pytest.mark.parametrize("damage", [_flip_a_byte, _random_block, _truncate])
def test_damaged_weights_are_a_clear_error(pulled: Path, damage) -> None:  # type: ignore[no-untyped-def]
    damage(pulled / "model.safetensors")
    with pytest.raises(CorruptModelError, match=r"model\.safetensors is corrupt.*specdec models pull --force"):
        model_registry.resolve_model(model_registry.DEFAULT_MODEL)


def test_engine_refuses_damaged_files(pulled: Path) -> None:
    _flip_a_byte(pulled / "tokenizer.json")
    with pytest.raises(CorruptModelError, match=r"tokenizer\.json is corrupt.*re-pull with "
                                                 r"`specdec models pull --force smollm2-135m-instruct`"):
        LLM(str(pulled), max_model_len=64)


def test_intact_pull_loads_and_generates(pulled: Path) -> None:
    llm = LLM(model_registry.DEFAULT_MODEL, max_model_len=64)
    out = llm.generate(["The quick"], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_directories_without_a_manifest_load_as_before(pulled: Path, tiny_model_dir: Path) -> None:
    assert model_registry.resolve_model(str(tiny_model_dir)) == tiny_model_dir
    (pulled / MODEL_MANIFEST).unlink()  # pulled before manifests existed
    _flip_a_byte(pulled / "model.safetensors")  # undetectable now, and not refused
    assert model_registry.resolve_model(model_registry.DEFAULT_MODEL) == pulled


def test_only_a_forced_pull_adds_a_manifest_to_an_old_pull(pulled: Path) -> None:
    (pulled / MODEL_MANIFEST).unlink()
    model_registry.pull(model_registry.DEFAULT_MODEL)
    assert not (pulled / MODEL_MANIFEST).exists()
    model_registry.pull(model_registry.DEFAULT_MODEL, force=True)
    assert (pulled / MODEL_MANIFEST).is_file()


def test_unreadable_manifest_is_a_clear_error(pulled: Path) -> None:
    (pulled / MODEL_MANIFEST).write_text("{")
    with pytest.raises(CorruptModelError, match="manifest .* is unreadable"):
        model_registry.resolve_model(model_registry.DEFAULT_MODEL)
