"""`specdec models pull` records a checksum of every file it writes, and resolving the model
checks them: damaged weights are a clear error, not garbage output (issue 23, defect 9).
Directories without a manifest (brought by a user, or pulled before manifests) load as
before. The pull converts a tiny GGUF of the tiny checkpoint (tests/models/test_gguf_load.py): no network."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from specdec import SamplingParams, model_registry
from specdec.checksums import MODEL_MANIFEST, CorruptModelError
from specdec.kernels.disk_cache import sha256_file
from specdec.llm import LLM
from tests.models.test_gguf_load import write_gguf


@pytest.fixture
def pulled(tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The default model's name pulled into a fresh model cache, from a GGUF of the tiny
    checkpoint (kernels stay in their usual cache: building them again would be slow)."""
    gguf_file = write_gguf(tmp_path / "tiny.gguf", tiny_model_dir)
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
def test_damaged_weights_are_a_clear_error(pulled: Path, damage) -> None:
    damage(pulled / "model.safetensors")
    with pytest.raises(CorruptModelError, match=r"model\.safetensors is corrupt.*specdec models pull --force"):
        model_registry.resolve_model(model_registry.DEFAULT_MODEL)


def test_engine_refuses_damaged_files(pulled: Path) -> None:
    _flip_a_byte(pulled / "tokenizer.json")
    with pytest.raises(CorruptModelError, match=r"tokenizer\.json is corrupt.*re-pull with "
                                                 r"`specdec models pull --force smollm2-135m-instruct`"):
        LLM(str(pulled), max_model_len=64)


def test_intact_pull_loads_and_generates(pulled: Path) -> None:
    # Plain: the default speculation would attach the real model's heads to this stand-in.
    llm = LLM(model_registry.DEFAULT_MODEL, max_model_len=64, speculative_config=None)
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
