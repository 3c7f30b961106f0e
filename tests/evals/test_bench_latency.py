"""bench_latency end to end on the tiny checkpoint: every method at batch 1 and at each
concurrency, ratios against plain taken from the same run."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).parents[2] / "evals" / "bench_latency.py"


def test_bench_latency_reports_every_method(tiny_model_dir: Path, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    spec = importlib.util.spec_from_file_location("bench_latency", BENCH)
    assert spec is not None and spec.loader is not None
    bench: Any = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "bench.json"
    monkeypatch.setattr(sys, "argv", [
        "bench_latency", "--model", str(tiny_model_dir), "--methods", "plain,ngram,ngram-adaptive",
        "--categories", "qa", "--num-prompts", "1", "--max-tokens", "8", "--max-model-len", "1024",
        "--concurrency", "1,3", "--threads", "1", "--json", str(out)])
    bench.main()
    report = json.loads(out.read_text())
    assert {r["method"] for r in report["batch1"]} == {"plain", "ngram", "ngram-adaptive"}
    levels = {(r["concurrency"], r["method"]): r for r in report["concurrency"]}
    assert set(levels) == {(c, m) for c in (1, 3) for m in ("plain", "ngram", "ngram-adaptive")}
    for (c, method), row in levels.items():
        assert row["requests"] == 3 and row["tokens"] == 8 * 3  # the same workload at every level
        assert row["vs_plain"] == pytest.approx(row["tokens_per_s"] / levels[(c, "plain")]["tokens_per_s"])


def test_subcategory_selects_input_grounded_code() -> None:
    sys.path.insert(0, str(BENCH.parent))
    from common import INPUT_GROUNDED, load_prompts

    rewrites = load_prompts("code:rewrite", 100)
    assert "code:rewrite" in INPUT_GROUNDED and "code" not in INPUT_GROUNDED
    assert rewrites and set(rewrites) < set(load_prompts("code", 100))
    assert not set(rewrites) & set(load_prompts("code:complete", 100))
