"""Acceptance-rate evaluation of speculative decoding: `specdec eval acceptance`.

For one target model and a list of speculative configs, every prompt of the chosen
categories is generated twice per config and temperature: plain and speculative, on
the same `LLM` instance (same weights, same kernels), alternating which goes first so
that machine noise hits both equally. Conversations run one at a time (batch size 1, as
in Spec-Bench); multi-turn items send turn 1, append the model's own answer, then send
turn 2. Reported per config x temperature x category:

- acceptance rate (accepted / drafted), mean accepted length tau (tokens committed per
  verify step, bonus/recovered token included), acceptance per draft position;
- tokens/s (output tokens / wall time of the generate calls, prefill included) and the
  speedup over plain decoding measured in the same run;
- at temperature 0, how many conversations differ from plain decoding (must be 0).

Spec counters are `EngineMetrics` deltas of `llm.get_metrics()` around each generation,
so the per-category numbers plus the warm-up add up exactly to the engine's own totals.
`--hf-baselines` also times Hugging Face transformers on the same prompts (greedy,
prompt lookup, assisted generation) against our plain decoding, interleaved per prompt.

This file is the command line and the run's order of work; the engine runs and their
journal are in acceptance_run.py, the transformers baselines in acceptance_baselines.py,
the summaries, tables and plots in acceptance_report.py.

    specdec eval acceptance --configs ngram-k3 ngram-k5 --temperatures 0 --num-prompts 3
    python evals/eval_acceptance.py --configs '{"method": "ngram", "num_speculative_tokens": 4}'
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdec.config import QUANTIZATION_CHOICES, EngineConfig
from specdec.evals.acceptance_baselines import num_methods, run_hf_baselines
from specdec.evals.acceptance_report import build_report, markdown_table, write_reports
from specdec.evals.acceptance_run import (
    DEFAULT_DRAFT,
    PRESETS,
    Journal,
    MakeLLM,
    PromptResult,
    default_llm,
    engine_counters,
    evaluate_config,
    load_prompts,
    parse_configs,
    plan,
    warm_up,
)
from specdec.metrics import EngineMetrics

if TYPE_CHECKING:
    from specdec.evals.acceptance_baselines import HFResult
    from specdec.llm import LLM


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from specdec.model_registry import DEFAULT_MODEL

    parser.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    parser.add_argument("--configs", nargs="+", default=["ngram-k3", "ngram-k5"],
                        help=f"presets (default: the engine's own, {', '.join(PRESETS)}) or speculative_config JSON; "
                             'a "name" key in the JSON labels it')
    parser.add_argument("--prompts", nargs="+", default=None,
                        help="categories (files in evals/prompts) or .jsonl paths; default: all")
    parser.add_argument("--num-prompts", type=int, default=None, help="first N prompts per category")
    parser.add_argument("--temperatures", nargs="+", type=float, default=[0.0])
    parser.add_argument("--max-tokens", type=int, default=128, help="per assistant turn")
    parser.add_argument("--draft-model", default=None,
                        help=f"draft dir/name for draft_model configs without one (default {DEFAULT_DRAFT}) "
                             "and for HF assisted generation")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quantization", default="auto", choices=QUANTIZATION_CHOICES,
                        help="the engine's quantization (auto: the engine's default, which for the default "
                             "model is gguf, its own Q4_1 blocks; none: its dequantized float weights)")
    parser.add_argument("--seed", type=int, default=0, help="engine seed; prompt i samples with seed+i")
    parser.add_argument("--warmup", type=int, default=1, help="warm-up conversations per config (not reported)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--hf-baselines", action="store_true",
                        help="also time HF transformers greedy / prompt lookup / assisted generation")
    parser.add_argument("--hf-num-tokens", type=int, default=5,
                        help="prompt_lookup_num_tokens and num_assistant_tokens for the HF baselines")
    parser.add_argument("--out", type=Path, default=None, help="report dir (default evals/results/<timestamp>)")
    parser.add_argument("--resume", action="store_true",
                        help="reuse the finished prompts recorded in --out/prompts.jsonl by an earlier run")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eval_acceptance", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return parser


def evaluate(args: argparse.Namespace, make_llm: MakeLLM | None = None) -> dict[str, Any]:
    """Run everything; return the report (every number) as a JSON-able dict."""
    from tqdm import tqdm

    make_llm = make_llm or default_llm
    # "auto" as the engine resolves it, so that the report and the journal name what ran.
    args.quantization = EngineConfig(model=args.model, dtype=args.dtype, quantization=args.quantization,
                                     speculative_config=None).quantization
    configs = parse_configs(args.configs, args.draft_model, args.model)
    prompts = load_prompts(args.prompts, args.num_prompts)
    num_prompts = sum(len(items) for items in prompts.values())
    hf_methods = num_methods(args.draft_model) if args.hf_baselines else 0
    total = (2 * len(configs) * len(args.temperatures) + hf_methods) * num_prompts
    bar = tqdm(total=total, desc="eval acceptance", unit="gen")
    journal = Journal(args.out / "prompts.jsonl" if args.out else None, args.resume)
    results: list[PromptResult] = []
    config_info: dict[str, Any] = {}
    llm: LLM | None = None
    for label, config in configs.items():
        bar.set_postfix_str(label)
        journal.set_setup(label, {"model": args.model, "speculative_config": config, "max_tokens": args.max_tokens,
                                  "dtype": args.dtype, "quantization": args.quantization, "seed": args.seed})
        pending = [key for key, _, _ in plan(label, prompts, args.temperatures) if journal.get(key) is None]
        llm = None  # free the previous engine (weights + KV cache) before building the next
        llm = make_llm(args.model, config, args) if pending else None
        warmup = warm_up(llm, args.warmup) if llm and args.warmup else EngineMetrics()
        results += evaluate_config(llm, label, prompts, args, bar, journal)
        config_info[label] = {"speculative_config": config, "warmup_counters": warmup.counters(),
                              "engine_totals": engine_counters(llm).counters() if llm else None,
                              "num_resumed_prompts": len(plan(label, prompts, args.temperatures)) - len(pending)}
    hf: list[HFResult] = []
    if args.hf_baselines:
        llm = llm or make_llm(args.model, None, args)  # a plain engine when everything was resumed
        hf = run_hf_baselines(llm, prompts, args, bar)
    bar.close()
    return build_report(args, configs, config_info, results, hf, llm)


def main(args: argparse.Namespace | list[str] | None = None) -> dict[str, Any]:
    if not isinstance(args, argparse.Namespace):
        args = build_parser().parse_args(args)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    args.out = args.out or Path("evals/results") / time.strftime("%Y%m%d-%H%M%S")
    report = evaluate(args)
    paths = write_reports(report, args.out)
    for temperature in args.temperatures:  # the headline: every config over all categories
        rows = [r for r in report["results"] if r["category"] == "all" and r["temperature"] == temperature]
        print(f"temperature {temperature:g}", *markdown_table(rows), sep="\n")
    print(f"reports: {', '.join(str(p) for p in paths)}")
    return report


if __name__ == "__main__":
    main()
