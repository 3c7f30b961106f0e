"""Where specdec keeps what it caches on disk ($SPECDEC_HOME: built kernel libraries,
pulled models, tokenizers), and the size and sha256 records that guard cached files, kept
in JSON manifests beside them, so a file that was truncated, zero-filled or overwritten
is caught before it is loaded: a damaged kernel library would crash the process with
SIGBUS when called, damaged weights would load without complaint and produce garbage.

It lives in kernels/ because kernels import nothing else of specdec (cpu_build.py caches
its libraries here); the model manifests are specdec/checksums.py's. Manifests are
written atomically (a temporary file renamed into place), so a reader sees the old
manifest or the new one, never half of one.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

PARTIAL_SUFFIX = ".partial"  # temporary files being written; a killed writer leaves them


def specdec_home() -> Path:
    """The cache root: $SPECDEC_HOME, else ~/.cache/specdec."""
    return Path(os.environ.get("SPECDEC_HOME", Path.home() / ".cache" / "specdec"))


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
