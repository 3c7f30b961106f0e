"""The acceptance-rate eval end to end on tiny checkpoints: its numbers are the engine's."""
from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from specdec.cli import load_eval
from specdec.cli import main as cli_main
from specdec.evals.acceptance_report import write_reports
from specdec.evals.acceptance_run import default_llm, load_prompts, parse_configs
from specdec.metrics import EngineMetrics

NGRAM = json.dumps({"name": "ngram-k3", "method": "ngram", "num_speculative_tokens": 3,
                    "prompt_lookup_min": 1, "prompt_lookup_max": 3})
TEMPERATURES = (0.0, 1.0)


@pytest.fixture(scope="module")
def ev() -> ModuleType:
    module = load_eval("eval_acceptance")  # the same loading path the CLI uses
    assert module is not None
    return module


def eval_argv(model: Path, draft: Path, out: Path) -> list[str]:
    return [str(model), "--configs", NGRAM, "draft-k3", "--draft-model", str(draft),
            "--prompts", "qa", "mt_bench", "--num-prompts", "2", "--max-tokens", "16",
            "--temperatures", *map(str, TEMPERATURES), "--max-model-len", "512",
            "--warmup", "0",  # so that the reported counters are all the engine ever counted
            "--out", str(out)]


@pytest.fixture(scope="module")
def run(ev: ModuleType, tiny_model_dir: Path, tiny_draft_dir: Path,
        tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("eval-report")
    args = ev.build_parser().parse_args(eval_argv(tiny_model_dir, tiny_draft_dir, out))
    llms: dict[str, Any] = {}

    def make_llm(model: str, config: dict[str, Any], a: Any) -> Any:
        llm = default_llm(model, config, a)
        llms[config["method"]] = llm
        return llm

    report = ev.evaluate(args, make_llm=make_llm)
    paths = write_reports(report, out)
    return {"report": report, "llms": llms, "out": out, "paths": paths}


def rows(report: dict[str, Any], config: str, all_rows: bool = False) -> list[dict[str, Any]]:
    return [r for r in report["results"] if r["config"] == config and (r["category"] == "all") == all_rows]


def test_reported_counters_equal_the_engines(run: dict[str, Any]) -> None:
    report = run["report"]
    for label, method in (("ngram-k3", "ngram"), ("draft-k3", "draft_model")):
        engine = run["llms"][method].get_metrics()
        per_category = sum((EngineMetrics.from_dict(r) for r in rows(report, label)), EngineMetrics()).counters()
        for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos"):
            assert per_category[key] == engine[key], (label, key)
        assert report["configs"][label]["engine_totals"]["num_drafts"] == engine["num_drafts"]
        # All generation the engine did, plain runs included, is in the per-prompt records.
        records = [p for p in report["prompts"] if p["config"] == label]
        generated = sum(p[m]["counters"]["num_generation_tokens"] for p in records for m in ("spec", "plain"))
        assert generated == engine["num_generation_tokens"]
    assert run["llms"]["draft_model"].get_metrics()["num_drafts"] > 0


def test_summary_numbers_are_consistent(run: dict[str, Any]) -> None:
    report = run["report"]
    assert len(report["results"]) == 2 * len(TEMPERATURES) * 3  # configs x temperatures x (2 categories + all)
    for row in report["results"]:
        assert row["num_prompts"] == (4 if row["category"] == "all" else 2)
        assert row["spec_tokens"] == row["num_generation_tokens"]  # outputs == what the engine counted
        assert row["acceptance_rate"] == pytest.approx(row["num_accepted_tokens"] / max(row["num_draft_tokens"], 1))
        assert row["mean_accepted_length"] == pytest.approx(1 + row["num_accepted_tokens"] / max(row["num_drafts"], 1))
        assert sum(row["num_accepted_tokens_per_pos"]) == row["num_accepted_tokens"]
        assert len(row["acceptance_per_pos"]) == 3
        assert row["speedup"] == pytest.approx(row["spec_tokens_per_s"] / row["plain_tokens_per_s"])
    for label in ("ngram-k3", "draft-k3"):
        for temperature in TEMPERATURES:
            cats = [r for r in rows(report, label) if r["temperature"] == temperature]
            (total,) = [r for r in rows(report, label, all_rows=True) if r["temperature"] == temperature]
            assert total["num_accepted_tokens"] == sum(r["num_accepted_tokens"] for r in cats)


def test_greedy_outputs_match_plain_decoding(run: dict[str, Any]) -> None:
    report = run["report"]
    greedy = [p for p in report["prompts"] if p["temperature"] == 0]
    assert len(greedy) == 8
    assert all(p["spec"]["token_ids"] == p["plain"]["token_ids"] for p in greedy)
    assert all(len(p["spec"]["token_ids"]) == 2 for p in greedy if p["category"] == "mt_bench")  # two turns
    for row in report["results"]:
        assert row["mismatches"] == (0 if row["temperature"] == 0 else None)


def test_report_files(run: dict[str, Any]) -> None:
    out: Path = run["out"]
    assert json.loads((out / "results.json").read_text())["results"] == run["report"]["results"]
    markdown = (out / "report.md").read_text()
    assert "## Temperature 0" in markdown and "| draft-k3 | mt_bench | 2 |" in markdown
    for name in ("acceptance_curves_T0", "acceptance_curves_T1", "speedup_T0", "speedup_T1"):
        assert (out / f"{name}.png").read_bytes().startswith(b"\x89PNG")


def test_cli_with_hf_baselines(tiny_model_dir: Path, tiny_draft_dir: Path, tmp_path: Path) -> None:
    cli_main(["eval", "acceptance", str(tiny_model_dir), "--configs", "ngram-k3", "--prompts", "qa",
              "--num-prompts", "2", "--max-tokens", "8", "--max-model-len", "512", "--hf-baselines",
              "--draft-model", str(tiny_draft_dir), "--out", str(tmp_path)])
    report = json.loads((tmp_path / "results.json").read_text())
    info = report["configs"]["ngram-k3"]
    # Warm-up plus the per-category counters add up to the engine's totals.
    assert info["warmup_counters"]["num_steps"] > 0
    measured = [r for r in report["results"] if r["category"] != "all"]
    steps = sum(r["num_steps"] + r["plain_num_steps"] for r in measured)
    assert info["warmup_counters"]["num_steps"] + steps == info["engine_totals"]["num_steps"]
    hf = {r["method"]: r for r in report["hf_baselines"]["results"] if r["category"] == "all"}
    assert set(hf) == {"specdec-plain", "hf-greedy", "hf-prompt-lookup", "hf-assisted"}
    assert all(r["mismatches_vs_specdec_plain"] == 0 for r in hf.values())  # all greedy, same fp32 model
    assert (tmp_path / "hf_baselines.png").is_file()
    assert "hf-assisted" in (tmp_path / "report.md").read_text()


def test_configs_and_prompt_sets() -> None:
    configs = parse_configs(["ngram-k5", "draft-k3", '{"method": "ngram", "num_speculative_tokens": 2}'], "/d", "m")
    assert configs == {"ngram-k5": {"method": "ngram", "num_speculative_tokens": 5},
                       "draft-k3": {"method": "draft_model", "num_speculative_tokens": 3, "model": "/d"},
                       "ngram-k2": {"method": "ngram", "num_speculative_tokens": 2}}
    with pytest.raises(ValueError, match="labelled"):
        parse_configs(["ngram-k3", '{"method": "ngram", "num_speculative_tokens": 3}'], None, "m")
    default = parse_configs(["default"], None, "smollm2-135m-instruct")["default"]  # the engine's, with heads
    assert default["method"] == "hybrid" and default["adaptive"] and default["model"].endswith("recurrent")
    assert "model" not in parse_configs(["default"], None, "other-model")["default"]
    prompts = load_prompts(None, None)
    assert set(prompts) == {"mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag", "code",
                            "edit_loop", "template_extraction", "tool_call"}
    ids = [item["id"] for items in prompts.values() for item in items]
    assert len(ids) == len(set(ids))
    assert all(len(items) >= 10 for items in prompts.values())
    assert all(len(item["turns"]) == 2 for item in prompts["mt_bench"])
    assert all(item["input_grounded"] for cat in ("summarization", "rag") for item in prompts[cat])


def test_resume_reuses_the_journal(ev: ModuleType, run: dict[str, Any], tiny_model_dir: Path,
                                   tiny_draft_dir: Path) -> None:
    out: Path = run["out"]
    assert len((out / "prompts.jsonl").read_text().splitlines()) == 2 * len(TEMPERATURES) * 4
    args = ev.build_parser().parse_args([*eval_argv(tiny_model_dir, tiny_draft_dir, out), "--resume"])

    def no_llm(*_: Any) -> Any:
        raise AssertionError("nothing is pending, so no engine should be built")

    report = ev.evaluate(args, make_llm=no_llm)
    assert report["results"] == run["report"]["results"]
    assert report["configs"]["draft-k3"]["num_resumed_prompts"] == 2 * len(TEMPERATURES) * 2


def test_metric_snapshots_subtract_and_add() -> None:
    before = EngineMetrics.from_dict({"num_drafts": 2, "num_draft_tokens": 6, "num_accepted_tokens": 3,
                                      "num_accepted_tokens_per_pos": [2, 1, 0], "num_prompt_tokens": 10,
                                      "num_generation_tokens": 7, "num_steps": 5, "num_preemptions": 0})
    after = EngineMetrics(3, num_accepted_tokens_per_pos=[2, 1, 0], num_prompt_tokens=10,
                          num_generation_tokens=7, num_steps=5, num_drafts=2, num_draft_tokens=6,
                          num_accepted_tokens=3)
    after.observe_draft(3, 2)
    delta = after - before
    assert delta.counters() == {"num_drafts": 1, "num_draft_tokens": 3, "num_accepted_tokens": 2,
                                "num_prompt_tokens": 0, "num_generation_tokens": 0, "num_steps": 0,
                                "num_accepted_tokens_per_pos": [1, 1, 0]}
    assert (delta.acceptance_rate, delta.mean_accepted_length, delta.acceptance_per_pos) == (2 / 3, 3.0, [1, 1, 0])
    total = EngineMetrics() + delta + EngineMetrics(5)  # per-position lists pad to the longest
    assert total.num_accepted_tokens_per_pos == [1, 1, 0, 0, 0] and total.num_drafts == 1
    assert EngineMetrics.from_dict(total.as_dict()) == total


def test_both_runs_of_a_prompt_find_the_same_prefix_cache(tiny_model_dir: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse
    from types import SimpleNamespace

    from specdec.evals import acceptance_run

    args = argparse.Namespace(max_model_len=512, dtype="auto", seed=0, quantization="none")
    llm = default_llm(str(tiny_model_dir), {"method": "ngram", "num_speculative_tokens": 3}, args)
    hits: list[int] = []
    engine_run = acceptance_run.engine_run

    def counted(*a: Any, **k: Any) -> Any:
        before = llm.get_metrics()["prefix_cache_hits"]
        run = engine_run(*a, **k)
        hits.append(llm.get_metrics()["prefix_cache_hits"] - before)
        return run

    monkeypatch.setattr(acceptance_run, "engine_run", counted)
    turns = ["a b c d e f g h i j k l m n o p q r s t u v w x y z " * 3, "and again"]
    params = acceptance_run.sampling_params(0.0, 8, 0)
    acceptance_run.run_prompt(llm, ("ngram-k3", 0.0, "qa", "x"), turns, params, plain_first=True,
                              bar=SimpleNamespace(update=lambda n: None))
    # The second turn reuses the first's blocks in each run, and the second run does not
    # reuse the first run's prefill of the same prompt.
    assert hits[0] > 0 and hits[0] == hits[1]
