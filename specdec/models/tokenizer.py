"""A model's tokenizer (with its chat template), from an HF directory or a GGUF file."""
from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path
from typing import Any

from specdec.kernels.disk_cache import specdec_home
from specdec.models.gguf_file import check_gguf
from specdec.models.gguf_loader import is_gguf


def load_tokenizer(model: Path) -> Any:
    """The tokenizer (with its chat template) of an HF directory or a GGUF file. A GGUF's
    is converted by transformers (seconds for a 49k vocabulary) once, then kept under
    $SPECDEC_HOME/tokenizers keyed by the file's path, size and time. A truncated or corrupt
    GGUF is a GGUFFileError naming the file and the field (transformers' own reading of it
    would fail with a numpy or unicode error naming neither)."""
    from transformers import AutoTokenizer

    if not is_gguf(model):
        return AutoTokenizer.from_pretrained(str(model))
    check_gguf(model)
    stat = model.stat()
    key = hashlib.sha256(f"{model.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = specdec_home() / "tokenizers" / f"{model.stem}-{key}"
    if (cached / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(str(cached))
    tokenizer = AutoTokenizer.from_pretrained(str(model.parent), gguf_file=model.name)
    _save_atomically(tokenizer, cached)
    return tokenizer


def _save_atomically(tokenizer: Any, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(dir=target.parent, prefix=target.name + "."))
    try:
        tokenizer.save_pretrained(str(partial))
        partial.rename(target)
    except OSError:  # another process saved it first
        pass
    finally:
        shutil.rmtree(partial, ignore_errors=True)
