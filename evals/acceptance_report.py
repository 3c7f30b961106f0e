"""The report of `specdec eval acceptance`: per-prompt results summed into rows per
(config, temperature, category), then written as results.json, report.md and PNG plots.

Spec counters are sums of `EngineMetrics` deltas, and the rates come from `EngineMetrics`
itself, so every number here is computed the way the engine computes its own.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdec.evals.acceptance_baselines import REFERENCE, HFResult
from specdec.evals.acceptance_run import PromptResult, Run
from specdec.metrics import EngineMetrics

if TYPE_CHECKING:
    from specdec.llm import LLM


# ---- summaries ---------------------------------------------------------------------------


def summarise(results: list[PromptResult]) -> dict[str, Any]:
    """Every number of one (config, temperature, category) cell."""
    spec = sum((r.spec.counters for r in results if r.spec.counters), EngineMetrics())
    plain = sum((r.plain.counters for r in results if r.plain.counters), EngineMetrics())
    summary: dict[str, Any] = {"num_prompts": len(results), **spec.counters(),
                               "acceptance_rate": spec.acceptance_rate,
                               "mean_accepted_length": spec.mean_accepted_length,
                               "acceptance_per_pos": spec.acceptance_per_pos}
    summary.update(throughput("spec", [r.spec for r in results]))
    summary.update(throughput("plain", [r.plain for r in results]))
    summary["plain_num_steps"] = plain.num_steps
    # Output tokens per target forward pass (prefill steps included): what speculation buys
    # before the cost of a wider verify pass, counting steps where no draft was found.
    summary["spec_tokens_per_step"] = spec.num_generation_tokens / max(spec.num_steps, 1)
    summary["plain_tokens_per_step"] = plain.num_generation_tokens / max(plain.num_steps, 1)
    summary["speedup"] = summary["spec_tokens_per_s"] / max(summary["plain_tokens_per_s"], 1e-9)
    greedy = all(r.temperature == 0 for r in results)
    summary["mismatches"] = sum(r.spec.token_ids != r.plain.token_ids for r in results) if greedy else None
    return summary


def throughput(prefix: str, runs: list[Run]) -> dict[str, float]:
    tokens = sum(r.num_tokens for r in runs)
    seconds = sum(r.seconds for r in runs)
    return {f"{prefix}_tokens": tokens, f"{prefix}_seconds": seconds,
            f"{prefix}_tokens_per_s": tokens / max(seconds, 1e-9)}


def summary_rows(results: list[PromptResult]) -> list[dict[str, Any]]:
    """One row per (config, temperature, category), each group closed by an "all" row."""
    cells: dict[tuple[str, float], dict[str, list[PromptResult]]] = {}
    for r in results:
        cells.setdefault((r.config, r.temperature), {}).setdefault(r.category, []).append(r)
    rows = []
    for (config, temperature), by_category in cells.items():
        everything = [r for group in by_category.values() for r in group]
        for category, group in [*by_category.items(), ("all", everything)]:
            rows.append({"config": config, "temperature": temperature, "category": category, **summarise(group)})
    return rows


def hf_rows(results: list[HFResult]) -> list[dict[str, Any]]:
    """Per (method, category) and "all": tokens/s, speedup over our plain decoding, mismatches."""
    groups: dict[str, list[HFResult]] = {}
    for r in results:
        groups.setdefault(r.category, []).append(r)
    groups["all"] = list(results)
    rows = []
    for category, group in groups.items():
        reference = throughput("", [r.runs[REFERENCE] for r in group])["_tokens_per_s"]
        for method in group[0].runs:
            stats = throughput("", [r.runs[method] for r in group])
            rows.append({"method": method, "category": category, "num_prompts": len(group),
                         "tokens": stats["_tokens"], "seconds": stats["_seconds"],
                         "tokens_per_s": stats["_tokens_per_s"],
                         "speedup_vs_specdec_plain": stats["_tokens_per_s"] / max(reference, 1e-9),
                         "mismatches_vs_specdec_plain": sum(
                             r.runs[method].token_ids != r.runs[REFERENCE].token_ids for r in group)})
    return rows


def build_report(args: argparse.Namespace, configs: dict[str, Any], config_info: dict[str, Any],
                 results: list[PromptResult], hf: list[HFResult], llm: LLM | None) -> dict[str, Any]:
    """Every number of the run, JSON-able: what results.json holds."""
    import torch

    meta = {"model": args.model, "model_dir": str(llm.model_dir) if llm else None,
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"), "max_tokens": args.max_tokens,
            "temperatures": args.temperatures, "num_prompts_per_category": args.num_prompts,
            "dtype": args.dtype, "quantization": args.quantization, "seed": args.seed, "warmup": args.warmup,
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "machine": platform.platform(),
            "configs": list(configs)}
    return {
        "meta": meta,
        "configs": config_info,
        "results": summary_rows(results),
        "prompts": [r.to_record() for r in results],
        "hf_baselines": {"num_tokens": args.hf_num_tokens, "draft_model": args.draft_model,
                         "results": hf_rows(hf) if hf else [],
                         "prompts": [r.to_record() for r in hf]},
    }


# ---- files -------------------------------------------------------------------------------


def write_reports(report: dict[str, Any], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "results.json", out / "report.md"]
    paths[0].write_text(json.dumps(report, indent=1) + "\n")
    paths[1].write_text(markdown(report))
    return paths + write_plots(report, out)


def markdown(report: dict[str, Any]) -> str:
    meta = report["meta"]
    setup = (f"{meta['timestamp']} · max_tokens {meta['max_tokens']} per turn · "
             f"{meta['num_prompts_per_category'] or 'all'} prompts per category · {meta['dtype']} · "
             f"quantization {meta.get('quantization', 'none')} · "
             f"torch {meta['torch']}, {meta['torch_threads']} threads · batch size 1")
    lines = [f"# Acceptance-rate evaluation: {meta['model']}", "", setup, ""]
    for temperature in meta["temperatures"]:
        rows = [r for r in report["results"] if r["temperature"] == temperature]
        lines += [f"## Temperature {temperature:g}", "", *markdown_table(rows), ""]
    if report["hf_baselines"]["results"]:
        note = ("Speedup is tokens/s over our plain decoding of the same prompts, interleaved per prompt. "
                f"Prompt lookup / assistant tokens: {report['hf_baselines']['num_tokens']}.")
        lines += ["## Hugging Face transformers baselines (greedy)", "", note, "",
                  *hf_table(report["hf_baselines"]["results"]), ""]
    return "\n".join(lines)


def markdown_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [("| config | category | prompts | drafts | acc. rate | τ | acceptance per position | "
              "spec tok/s | plain tok/s | speedup | ≠ plain |"),
             "|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        per_pos = " / ".join(f"{p:.2f}" for p in r["acceptance_per_pos"])
        mismatches = "–" if r["mismatches"] is None else str(r["mismatches"])
        category = f"**{r['category']}**" if r["category"] == "all" else r["category"]
        lines.append(f"| {r['config']} | {category} | {r['num_prompts']} | {r['num_drafts']} | "
                     f"{r['acceptance_rate']:.3f} | {r['mean_accepted_length']:.2f} | {per_pos} | "
                     f"{r['spec_tokens_per_s']:.1f} | {r['plain_tokens_per_s']:.1f} | {r['speedup']:.2f}× | "
                     f"{mismatches} |")
    return lines


def hf_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| method | category | prompts | tokens | tok/s | speedup vs specdec plain | ≠ specdec plain |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['category']} | {r['num_prompts']} | {r['tokens']} | "
                     f"{r['tokens_per_s']:.1f} | {r['speedup_vs_specdec_plain']:.2f}× | "
                     f"{r['mismatches_vs_specdec_plain']} |")
    return lines


# ---- plots -------------------------------------------------------------------------------


def write_plots(report: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    paths = []
    for temperature in report["meta"]["temperatures"]:
        rows = [r for r in report["results"] if r["temperature"] == temperature]
        paths.append(plot_acceptance_curves(rows, out / f"acceptance_curves_T{temperature:g}.png", temperature))
        paths.append(plot_speedups(rows, out / f"speedup_T{temperature:g}.png", temperature))
    if report["hf_baselines"]["results"]:
        paths.append(plot_hf(report["hf_baselines"]["results"], out / "hf_baselines.png"))
    return paths


def plot_acceptance_curves(rows: list[dict[str, Any]], path: Path, temperature: float) -> Path:
    """One panel per category, one line per config: P(draft position i accepted)."""
    import matplotlib.pyplot as plt

    categories = _ordered(r["category"] for r in rows)
    cols = min(4, len(categories))
    nrows = -(-len(categories) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(3.2 * cols, 2.8 * nrows), squeeze=False, sharey=True)
    for ax, category in zip(axes.flat, categories):
        for r in (r for r in rows if r["category"] == category):
            positions = range(1, len(r["acceptance_per_pos"]) + 1)
            ax.plot(positions, r["acceptance_per_pos"], marker="o", label=r["config"])
        ax.set_title(category)
        ax.set_xticks(range(1, 1 + max((len(r["acceptance_per_pos"]) for r in rows), default=1)))
        ax.set_xlabel("draft position")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(categories):]:
        ax.axis("off")
    axes[0][0].set_ylabel("acceptance")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"Per-position acceptance, temperature {temperature:g}")
    return _save(fig, path)


def plot_speedups(rows: list[dict[str, Any]], path: Path, temperature: float) -> Path:
    """Grouped bars: categories on x, one bar per config; 1.0 = plain decoding."""
    configs = _ordered(r["config"] for r in rows)
    values = {(r["config"], r["category"]): r["speedup"] for r in rows}
    return _bars(configs, _ordered(r["category"] for r in rows), values, path,
                 f"Speedup over plain decoding, temperature {temperature:g}")


def plot_hf(rows: list[dict[str, Any]], path: Path) -> Path:
    methods = _ordered(r["method"] for r in rows)
    values = {(r["method"], r["category"]): r["speedup_vs_specdec_plain"] for r in rows}
    return _bars(methods, _ordered(r["category"] for r in rows), values, path,
                 "HF transformers vs specdec plain decoding (greedy)")


def _bars(series: list[str], categories: list[str], values: dict[tuple[str, str], float],
          path: Path, title: str) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(categories) * max(1, len(series)) ** 0.5), 3.6))
    width = 0.8 / max(len(series), 1)
    for i, name in enumerate(series):
        xs = [c + (i - (len(series) - 1) / 2) * width for c in range(len(categories))]
        ax.bar(xs, [values.get((name, cat), 0.0) for cat in categories], width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(categories)), categories, rotation=20)
    ax.set_ylabel("speedup (×)")
    ax.set_title(title)
    ax.legend(fontsize=7)
    return _save(fig, path)


def _ordered(values: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(values))


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
