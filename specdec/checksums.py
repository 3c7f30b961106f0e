"""Size and sha256 records of files, kept in JSON manifests beside them, so a file that was
truncated, zero-filled or overwritten is caught before it is loaded: a damaged kernel
library would crash the process with SIGBUS when called, damaged weights would load
without complaint and produce garbage.

Manifests are written atomically (a temporary file renamed into place), so a reader sees
the old manifest or the new one, never half of one.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

PARTIAL_SUFFIX = ".partial"  # temporary files being written; a killed writer leaves them
MODEL_MANIFEST = "specdec-manifest.json"


class CorruptModelError(ValueError):
    """A model file does not match the checksum recorded when it was pulled."""


def sha256_file(path: Path) -> str:
    with path.open("rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def file_record(path: Path) -> dict[str, Any]:
    """What a manifest records of one file."""
    return {"size": path.stat().st_size, "sha256": sha256_file(path)}


def mismatch(path: Path, record: Any) -> str | None:
    """How `path` differs from its manifest record, or None if it matches."""
    if not (isinstance(record, dict) and isinstance(record.get("size"), int)
            and isinstance(record.get("sha256"), str)):
        return "its manifest record is malformed"
    if not path.is_file():
        return "it is missing"
    size = path.stat().st_size
    if size != record["size"]:
        return f"it has {size} bytes, its manifest says {record['size']} (truncated or overwritten)"
    if sha256_file(path) != record["sha256"]:
        return "its sha256 differs from its manifest (the bytes were changed)"
    return None


def write_json_atomic(path: Path, data: Any) -> None:
    """Write `data` as JSON to `path` through a temporary file renamed into place."""
    fd, partial = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=PARTIAL_SUFFIX)
    try:
        with os.fdopen(fd, "w") as file:
            json.dump(data, file, indent=2)
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def write_model_manifest(model_dir: Path, model: str) -> None:
    """Record the size and sha256 of every file in `model_dir` (subfolders included), as
    `specdec models pull` wrote them for the known model `model`."""
    files = sorted(p for p in model_dir.rglob("*") if p.is_file() and p.name != MODEL_MANIFEST)
    records = {p.relative_to(model_dir).as_posix(): file_record(p) for p in files}
    write_json_atomic(model_dir / MODEL_MANIFEST, {"version": 1, "model": model, "files": records})


@contextmanager
def model_dir_written(target: Path, model: str) -> Iterator[Path]:
    """A fresh directory beside `target` to write a model into. When the block ends
    normally its manifest is written and it replaces `target` whole, so no reader sees a
    half-written model; on an error it is removed and `target` stays as it was."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(dir=target.parent, prefix=target.name + ".tmp"))
    try:
        yield partial
        write_model_manifest(partial, model)
        if target.exists():
            shutil.rmtree(target)
        partial.rename(target)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def verify_model_manifest(model_dir: Path) -> None:
    """Check every file the manifest in `model_dir` records: CorruptModelError naming the
    first bad one and how to fetch it again. A directory without a manifest (one a user
    brought, or one pulled before manifests existed) is not checked."""
    manifest = model_dir / MODEL_MANIFEST
    if not manifest.is_file():
        return
    repull = f"re-pull with `specdec models pull --force {model_dir.name}`"
    try:
        content = json.loads(manifest.read_text())
        repull = f"re-pull with `specdec models pull --force {content.get('model', model_dir.name)}`"
        records = list(content["files"].items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise CorruptModelError(f"model manifest {manifest} is unreadable ({error!r}); {repull}") from error
    for name, record in records:
        problem = mismatch(model_dir / name, record)
        if problem is not None:
            raise CorruptModelError(f"model file {model_dir / name} is corrupt: {problem}; {repull}")
