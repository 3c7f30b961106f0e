"""evals/bench_gpu.py end to end at the tiny shape on the CPU (torch attention, no compile):
every section's structure, positive figures, token identity where it must hold, and the
Markdown report's tables. The figures themselves mean something on a GPU only."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from specdec.evals import bench_gpu
from specdec.evals.gpu_checkpoint import RandomWeights, hf_shapes, random_weights, write_checkpoint
from specdec.llm import LLM
from tests.helpers import NGRAM


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path, Path]:
    out = tmp_path_factory.mktemp("bench_gpu")
    json_path, md_path = out / "report.json", out / "report.md"
    bench_gpu.main(["--shape", "tiny", "--device", "cpu", "--no-compile", "--no-drafters", "--depths", "1,3",
                    "--max-tokens", "12", "--out", str(json_path), str(md_path)])
    return json.loads(json_path.read_text()), json_path, md_path


def test_the_json_report_has_every_section_with_positive_figures(report: tuple[dict, Path, Path]) -> None:
    data = report[0]
    assert data["shape"] == "tiny" and data["dtype"] == "float32" and data["copy_bandwidth_gb_s"] > 0
    plain = data["plain"]
    assert plain["weight_bytes"] > 0 and plain["ttft_ms"] > 0
    assert [row["batch"] for row in plain["rows"]] == [1, 16]
    for row in plain["rows"]:
        assert min(row["tok_s"], row["ms_per_step"], row["roofline_tok_s"], row["fraction_of_roofline"]) > 0
    assert [row["rows"] for row in data["verify"]] == list(bench_gpu.VERIFY_ROWS)
    assert data["verify"][0]["relative"] == 1.0 and all(row["ms"] > 0 for row in data["verify"])
    assert [row["depth"] for row in data["oracle"]] == [0, 1, 3]
    assert all(row["identical"] and row["tok_s"] > 0 and row["speedup"] > 0 for row in data["oracle"])
    assert [row["engine"] for row in data["transformers"]] == ["transformers, eager", "transformers, static cache"]
    assert all(row["tok_s"] > 0 for row in data["transformers"])
    assert data["drafters"] == {"skipped": "--no-drafters"}
    assert "skipped" in data["idle"]


def test_the_markdown_report_has_every_table(report: tuple[dict, Path, Path]) -> None:
    text = report[2].read_text()
    for heading in ("## Plain decoding", "## Verify cost per row count", "## Oracle ceiling",
                    "## transformers", "## Drafters on the default model", "## GPU idle time"):
        assert heading in text
    assert "| batch | tok/s | ms a step | roofline tok/s | of roofline |" in text
    assert "Skipped: --no-drafters." in text


def test_random_weights_stand_in_for_a_checkpoint(tmp_path: Path) -> None:
    model_dir = write_checkpoint(tmp_path / "tiny", "tiny", 256)
    weights = RandomWeights(model_dir, torch.float32, torch.device("cpu"))
    shapes = hf_shapes(model_dir)
    assert "model.layers.1.mlp.down_proj.weight" in weights and "nonexistent" not in weights
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(weights[name], weights[name]) and tuple(weights[name].shape) == shapes[name]  # seeded
    assert torch.equal(weights["model.norm.weight"], torch.ones(64))
    with random_weights(model_dir):
        llm = LLM(str(model_dir), device="cpu", attention_backend="torch", speculative_config=None,
                  kv_cache_memory=1 << 20, max_model_len=128)
    model: Any = llm.engine.model
    assert torch.equal(model.layers[0].qkv_proj.weight[:64], weights[name])  # the fused projection, filled in
    with pytest.raises(ValueError, match="missing"):  # outside the context the checkpoint is incomplete
        LLM(str(model_dir), device="cpu", attention_backend="torch", speculative_config=None, kv_cache_memory=1 << 20)


def test_drafters_section_reports_each_drafter_per_category(tiny_model_dir: Path) -> None:
    rig = bench_gpu.Rig(bench_gpu.parse_args(["--shape", "tiny", "--device", "cpu"]))
    rows = bench_gpu.drafters_section(rig, str(tiny_model_dir), {"plain": None, "ngram": NGRAM}, ["qa"], 1, 8)
    assert [(row["drafter"], row["category"]) for row in rows] == [("plain", "qa"), ("ngram", "qa")]
    assert all(row["identical"] == row["prompts"] == 1 and row["tok_s"] > 0 for row in rows)
    assert rows[0]["tau"] is None and rows[0]["x_plain"] == 1.0
    assert rows[1]["tau"] is None or rows[1]["tau"] >= 1
