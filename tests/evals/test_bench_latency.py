"""bench_latency end to end on the tiny checkpoint: every method at batch 1 and at each
concurrency, ratios against plain taken from the same run."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from specdec.evals import bench_latency as bench
from specdec.evals.common import INPUT_GROUNDED, load_prompts


def test_bench_latency_reports_every_method(tiny_model_dir: Path, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "bench.json"
    monkeypatch.setattr(sys, "argv", [
        "bench_latency", "--model", str(tiny_model_dir), "--methods", "plain,ngram-adaptive,ngram@attention=torch",
        "--categories", "qa", "--num-prompts", "1", "--max-tokens", "8", "--max-model-len", "1024",
        "--concurrency", "1,3", "--rounds", "2", "--ttft-lens", "20,50", "--threads", "1", "--json", str(out)])
    bench.main()
    report = json.loads(out.read_text())
    methods = ("plain", "ngram-adaptive", "ngram@attention=torch")
    assert {r["method"] for r in report["batch1"]} == set(methods)
    levels = {(r["concurrency"], r["method"]): r for r in report["concurrency"]}
    assert set(levels) == {(c, m) for c in (1, 3) for m in methods}
    for (c, _), row in levels.items():
        assert row["requests"] == 6 and row["tokens"] == 8 * 6  # the same workload at every level, twice
        assert row["vs_plain"] == pytest.approx(row["tokens_per_s"] / levels[(c, "plain")]["tokens_per_s"])
    ttft = {(r["prompt_tokens"], r["method"]): r for r in report["ttft"]}
    assert set(ttft) == {(n, m) for n in (20, 50) for m in methods}
    assert all(0 < r["min_ms"] <= r["median_ms"] for r in ttft.values())


def test_method_options() -> None:
    assert bench.parse_method("ngram@kv=fp16@attention=torch") == (
        bench.PRESETS["ngram"], {"kv_cache_dtype": "fp16", "attention_backend": "torch"})
    for bad in ("nope", "plain@speed=fast", "plain@kv"):
        with pytest.raises(SystemExit):
            bench.parse_method(bad)


def test_subcategory_selects_input_grounded_code() -> None:
    rewrites = load_prompts("code:rewrite", 100)
    assert "code:rewrite" in INPUT_GROUNDED and "code" not in INPUT_GROUNDED
    assert rewrites and set(rewrites) < set(load_prompts("code", 100))
    assert not set(rewrites) & set(load_prompts("code:complete", 100))
