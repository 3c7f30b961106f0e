"""Model manifests: `specdec models pull` records the size and sha256 of every file it
writes (kernels/disk_cache.py keeps the records and their atomic JSON writes, shared with
the kernel library cache), and resolving the model checks them, so damaged weights fail
loudly instead of loading without complaint and producing garbage.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from specdec.kernels.disk_cache import file_record, mismatch, write_json_atomic

MODEL_MANIFEST = "specdec-manifest.json"


class CorruptModelError(ValueError):
    """A model file does not match the checksum recorded when it was pulled."""


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
