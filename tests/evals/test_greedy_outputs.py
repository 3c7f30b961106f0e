"""greedy_outputs on the tiny checkpoint: a dump compares equal to itself, and a changed
output is reported."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdec.evals import greedy_outputs


def test_dump_then_compare(tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(greedy_outputs, "CATEGORIES", ["qa"])
    first = tmp_path / "a.json"
    assert greedy_outputs.main(["dump", str(first), "--model", str(tiny_model_dir), "--max-tokens", "4",
                                "--configs", "plain,ngram"]) == 0
    assert greedy_outputs.main(["compare", str(first), str(first)]) == 0
    changed = json.loads(first.read_text())
    changed["outputs"]["ngram"][0] = [0]
    second = tmp_path / "b.json"
    second.write_text(json.dumps(changed))
    assert greedy_outputs.main(["compare", str(first), str(second)]) == 1
