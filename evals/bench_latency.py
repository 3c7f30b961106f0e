"""Batch-1 latency of plain, speculative and Hugging Face decoding, plus batched throughput.

Methods run alternately prompt by prompt in one process, so machine noise hits them
alike; speedups are ratios of tokens/s measured side by side.

    python evals/bench_latency.py --methods hf,plain,ngram,draft_model \
        --categories summarization,rag,code:rewrite,qa,math_reasoning --num-prompts 3 --concurrency 1,4,16

A method may add engine options after "@" (plain@attention=torch, ngram@kv=fp16@linear=int8):
the same preset on an engine with that attention_backend, kv_cache_dtype or linear_backend,
to compare them side by side.
"""
from __future__ import annotations

import argparse
import functools
import itertools
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from specdec.evals.common import ALL_CATEGORIES, INPUT_GROUNDED, load_prompts, markdown_table, mean, timed
from specdec.llm import LLM
from specdec.metrics import EngineMetrics
from specdec.model_registry import DEFAULT_MODEL
from specdec.sampling_params import SamplingParams

DRAFT_DIR = Path(__file__).parents[1] / "drafters" / "weights" / "smollm2-135m-draft"
MEDUSA_DIR = Path(__file__).parents[1] / "drafters" / "weights" / "smollm2-135m-medusa"
RECURRENT_DIR = Path(__file__).parents[1] / "drafters" / "weights" / "smollm2-135m-medusa-recurrent"
EAGLE3_DIR = Path(__file__).parents[1] / "drafters" / "weights" / "smollm2-135m-eagle3"
PRESETS: dict[str, dict[str, Any] | str | None] = {
    "plain": None,
    "default": "auto",  # what the engine runs when given no speculative_config
    "ngram": {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 5},
    "ngram-k3": {"method": "ngram", "num_speculative_tokens": 3},
    "suffix": {"method": "suffix", "num_speculative_tokens": 8},
    # matches a single token: a value's first token (the free bonus after a forced key) finds its source
    "ngram-min1": {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1, "prompt_lookup_max": 5},
    "ngram-k8": {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2, "prompt_lookup_max": 5},
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 4, "model": str(DRAFT_DIR)},
    "draft-tree": {"method": "draft_model", "num_speculative_tokens": 4, "num_tree_nodes": 16, "model": str(DRAFT_DIR)},
    "draft-k6": {"method": "draft_model", "num_speculative_tokens": 6, "model": str(DRAFT_DIR)},
    "draft-tree6": {"method": "draft_model", "num_speculative_tokens": 4, "num_tree_nodes": 6, "model": str(DRAFT_DIR)},
    "medusa": {"method": "medusa", "num_speculative_tokens": 4, "model": str(MEDUSA_DIR)},
    "medusa-tree": {"method": "medusa", "num_speculative_tokens": 4, "num_tree_nodes": 24, "model": str(MEDUSA_DIR)},
    "medusa-tree4": {"method": "medusa", "num_speculative_tokens": 4, "num_tree_nodes": 4, "model": str(MEDUSA_DIR)},
    "medusa-tree64": {"method": "medusa", "num_speculative_tokens": 4, "num_tree_nodes": 64, "model": str(MEDUSA_DIR)},
}
# Recurrent Medusa heads: chains of k drafts ("medusa-rec" is k=6, the depth they were
# trained to) and EAGLE-2 dynamic trees of n drafts up to depth 6 ("medusa-rec-tree<n>";
# dynamic because no tree_choices are given).
PRESETS.update({f"medusa-rec{'' if k == 6 else f'-k{k}'}": {
    "method": "medusa", "num_speculative_tokens": k, "model": str(RECURRENT_DIR)} for k in (5, 6, 8, 16)})
PRESETS.update({f"medusa-rec-tree{n}": {"method": "medusa", "num_speculative_tokens": 6, "num_tree_nodes": n,
                                         "model": str(RECURRENT_DIR)} for n in (6, 8, 16, 24, 64)})
# The shipped EAGLE-3 head: dynamic trees of n drafts up to depth 6 (the depth it was trained
# to), and the default's adaptive hybrid with it in place of the recurrent heads.
PRESETS.update({f"eagle3-tree{n}": {"method": "eagle3", "num_speculative_tokens": 6, "num_tree_nodes": n,
                                     "model": str(EAGLE3_DIR)} for n in (6, 8, 16, 24)})
PRESETS["default-eagle3"] = {"method": "hybrid", "num_speculative_tokens": 16, "num_tree_nodes": 16,
                             "adaptive": True, "model": str(EAGLE3_DIR)}
# "<preset>-adaptive": the same drafter with adaptive speculation (k chosen per step, down to 0).
PRESETS.update({f"{name}-adaptive": {**config, "adaptive": True} for name, config in PRESETS.items()
                if isinstance(config, dict)})
ENGINE_OPTIONS = {"attention": "attention_backend", "kv": "kv_cache_dtype", "linear": "linear_backend"}


def parse_method(method: str) -> tuple[dict[str, Any] | str | None, dict[str, str]]:
    """A method name -> (speculative config, LLM keyword arguments)."""
    preset, *options = method.split("@")
    if preset not in PRESETS:
        raise SystemExit(f"unknown method {preset!r}; presets: {', '.join(PRESETS)}")
    kwargs = {}
    for option in options:
        key, _, value = option.partition("=")
        if key not in ENGINE_OPTIONS or not value:
            raise SystemExit(f"bad engine option {option!r} in {method!r}: use {'|'.join(ENGINE_OPTIONS)}=<value>")
        kwargs[ENGINE_OPTIONS[key]] = value
    return PRESETS[preset], kwargs


class HFRunner:
    """transformers' greedy generate on the same checkpoint, for the baseline."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()

    def generate(self, ids: list[int], max_tokens: int) -> int:
        with torch.inference_mode():
            out = self.model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False)
        return out.shape[1] - len(ids)


def build_runners(args: argparse.Namespace) -> dict[str, Any]:
    runners: dict[str, Any] = {}
    for method in args.methods:
        if method == "hf":
            continue
        speculative, options = parse_method(method)
        runners[method] = LLM(args.model, speculative_config=speculative, max_model_len=args.max_model_len,
                              **options)
    if "hf" in args.methods:
        base = next(iter(runners.values()), None) or LLM(args.model, max_model_len=args.max_model_len)
        runners["hf"] = HFRunner(base.model_dir)
    return runners


def run_one(runner: Any, ids: list[int], max_tokens: int) -> tuple[int, dict[str, Any]]:
    if isinstance(runner, HFRunner):
        return runner.generate(ids, max_tokens), {}
    before = EngineMetrics.from_dict(runner.get_metrics())
    out = runner.generate([ids], SamplingParams(temperature=0.0, max_tokens=max_tokens))[0]
    delta = EngineMetrics.from_dict(runner.get_metrics()) - before
    return len(out.outputs[0].token_ids), delta.counters()


def bench_batch1(args: argparse.Namespace, runners: dict[str, Any]) -> list[dict[str, Any]]:
    chat = next(r for r in runners.values() if isinstance(r, LLM))
    results = []
    for category in args.categories:
        stats = {m: {"tokens": 0, "seconds": 0.0, "drafts": 0, "accepted": 0, "drafted": 0} for m in args.methods}
        for text in load_prompts(category, args.num_prompts):
            ids = chat.apply_chat_template([{"role": "user", "content": text}])
            for method in args.methods:  # alternate methods on every prompt
                (tokens, delta), seconds = timed(functools.partial(run_one, runners[method], ids, args.max_tokens))
                s = stats[method]
                s["tokens"] += tokens
                s["seconds"] += seconds
                s["drafts"] += delta.get("num_drafts", 0)
                s["drafted"] += delta.get("num_draft_tokens", 0)
                s["accepted"] += delta.get("num_accepted_tokens", 0)
                print(f"{category} {method}: {tokens} tokens in {seconds:.2f}s", file=sys.stderr, flush=True)
        results += [_row(category, m, s, stats) for m, s in stats.items()]
    return results


def _row(category: str, method: str, s: dict[str, Any], stats: dict[str, dict[str, Any]]) -> dict[str, Any]:
    tps = s["tokens"] / s["seconds"]
    plain = stats.get("plain")
    plain_tps = plain["tokens"] / plain["seconds"] if plain else float("nan")
    hf = stats.get("hf")
    hf_tps = hf["tokens"] / hf["seconds"] if hf else float("nan")
    return {
        "category": category, "method": method, "tokens": s["tokens"], "tokens_per_s": tps,
        "speedup_vs_plain": tps / plain_tps, "speedup_vs_hf": tps / hf_tps,
        "tau": 1 + s["accepted"] / s["drafts"] if s["drafts"] else None,
        "acceptance_rate": s["accepted"] / s["drafted"] if s["drafted"] else None,
    }


def bench_concurrency(args: argparse.Namespace, runners: dict[str, Any]) -> list[dict[str, Any]]:
    """Throughput of one fixed workload at each concurrency: the same N = max(levels)
    requests (prompts taken round-robin over the categories, so long and short prompts mix),
    served with at most `c` in flight (waves of c; every request has the same max_tokens
    and ignores EOS, so a wave ends together). Level 1 is the requests one after another,
    the batch-1 baseline of the same work. Methods alternate per level, and the whole
    sweep repeats `--rounds` times; a row sums its rounds."""
    methods = _engine_methods(args, runners)
    prompts = workload(args, runners[methods[0]], max(args.concurrency))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    totals: dict[tuple[int, str], dict[str, Any]] = {}
    for _ in range(args.rounds):
        for concurrency in args.concurrency:
            for method in methods:
                outs, seconds = timed(functools.partial(serve_in_waves, runners[method], prompts, params, concurrency))
                row = totals.setdefault((concurrency, method), {
                    "concurrency": concurrency, "method": method, "requests": 0, "tokens": 0, "prompt_tokens": 0,
                    "seconds": 0.0})
                row["requests"] += len(outs)
                row["tokens"] += sum(len(o.outputs[0].token_ids) for o in outs)
                row["prompt_tokens"] += sum(len(o.prompt_token_ids) for o in outs)
                row["seconds"] += seconds
                print(f"concurrency {concurrency} {method}: {row['tokens'] / row['seconds']:.1f} tok/s so far",
                      file=sys.stderr, flush=True)
    results = list(totals.values())
    for r in results:
        r["tokens_per_s"] = r["tokens"] / r["seconds"]
        r["total_tokens_per_s"] = (r["tokens"] + r["prompt_tokens"]) / r["seconds"]
    speed = {(r["concurrency"], r["method"]): r["tokens_per_s"] for r in results}
    for r in results:
        plain = speed.get((r["concurrency"], "plain"))
        r["vs_plain"] = r["tokens_per_s"] / plain if plain else float("nan")
        r["vs_first_level"] = r["tokens_per_s"] / speed[(args.concurrency[0], r["method"])]
    return results


def bench_ttft(args: argparse.Namespace, runners: dict[str, Any]) -> list[dict[str, Any]]:
    """Time to the first token (prefill plus one sampled token) of one prompt of each
    length in --ttft-lens, methods alternating, --rounds times; min and median."""
    methods = _engine_methods(args, runners)
    llm = runners[methods[0]]
    text = " ".join(load_prompts("summarization", 64) + load_prompts("rag", 64))
    ids = llm.get_tokenizer().encode(text)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    seconds: dict[tuple[int, str], list[float]] = {}
    for _ in range(max(args.rounds, 3)):
        for length in args.ttft_lens:
            prompt = (ids * (1 + length // len(ids)))[:length]
            for method in methods:
                _, took = timed(functools.partial(runners[method].generate, [prompt], params))
                seconds.setdefault((length, method), []).append(took)
    results: list[dict[str, Any]] = [
        {"prompt_tokens": length, "method": method, "min_ms": 1e3 * min(times),
         "median_ms": 1e3 * statistics.median(times)} for (length, method), times in seconds.items()]
    for r in results:
        plain = seconds.get((r["prompt_tokens"], "plain"))
        r["vs_plain"] = min(plain) * 1e3 / r["min_ms"] if plain else float("nan")
    return results


def _engine_methods(args: argparse.Namespace, runners: dict[str, Any]) -> list[str]:
    """The methods run by our engine (not the transformers baseline)."""
    return [m for m in args.methods if isinstance(runners[m], LLM)]


def workload(args: argparse.Namespace, llm: LLM, n: int) -> list[list[int]]:
    """n chat prompts, round-robin over the categories."""
    by_category = [load_prompts(c, 64) for c in args.categories]
    texts = [t for row in itertools.zip_longest(*by_category) for t in row if t is not None]
    return [llm.apply_chat_template([{"role": "user", "content": texts[i % len(texts)]}]) for i in range(n)]


def serve_in_waves(llm: LLM, prompts: list[list[int]], params: SamplingParams,
                   concurrency: int) -> list[Any]:
    outs = []
    for start in range(0, len(prompts), concurrency):
        outs += llm.generate(prompts[start:start + concurrency], params)
    return outs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--methods", default="hf,plain,ngram", type=lambda s: s.split(","))
    parser.add_argument("--categories", default=",".join(ALL_CATEGORIES), type=lambda s: s.split(","))
    parser.add_argument("--num-prompts", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--concurrency", default="", type=lambda s: [int(x) for x in s.split(",") if x])
    parser.add_argument("--rounds", type=int, default=1, help="repeat the concurrency sweep; rows sum the rounds")
    parser.add_argument("--ttft-lens", default="", type=lambda s: [int(x) for x in s.split(",") if x],
                        help="also time the first token of one prompt of each of these lengths")
    parser.add_argument("--skip-batch1", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None, help="also write every number here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    runners = build_runners(args)
    report: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    if not args.skip_batch1:
        report["batch1"] = bench_batch1(args, runners)
        print(markdown_table(["category", "method", "tok/s", "vs plain", "vs HF", "τ", "accept"],
                             [[r["category"], r["method"], r["tokens_per_s"], r["speedup_vs_plain"],
                               r["speedup_vs_hf"], r["tau"] if r["tau"] is not None else "-",
                               r["acceptance_rate"] if r["acceptance_rate"] is not None else "-"]
                              for r in report["batch1"]]))
        print()
        print(markdown_table(["method", "input-grounded tok/s", "vs plain", "other tok/s", "vs plain"],
                             _summary(report["batch1"], args.methods)))
    if args.ttft_lens:
        report["ttft"] = bench_ttft(args, runners)
        print()
        print(markdown_table(["prompt tokens", "method", "TTFT min ms", "TTFT median ms", "plain / this (min)"],
                             [[r["prompt_tokens"], r["method"], r["min_ms"], r["median_ms"], r["vs_plain"]]
                              for r in report["ttft"]]))
    if args.concurrency:
        report["concurrency"] = bench_concurrency(args, runners)
        print()
        print(markdown_table(["concurrency", "method", "requests", "output tokens", "prompt tokens", "seconds",
                              "output tok/s", "prompt+output tok/s", "vs plain",
                              f"vs concurrency {args.concurrency[0]}"],
                             [[r["concurrency"], r["method"], r["requests"], r["tokens"], r["prompt_tokens"],
                               r["seconds"], r["tokens_per_s"], r["total_tokens_per_s"], r["vs_plain"],
                               r["vs_first_level"]] for r in report["concurrency"]]))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


def _summary(rows: list[dict[str, Any]], methods: list[str]) -> list[list[Any]]:
    out = []
    for method in methods:
        grounded = [r for r in rows if r["method"] == method and r["category"] in INPUT_GROUNDED]
        other = [r for r in rows if r["method"] == method and r["category"] not in INPUT_GROUNDED]
        out.append([method, *_means(grounded), *_means(other)])
    return out


def _means(rows: list[dict[str, Any]]) -> list[Any]:
    """Mean tok/s and mean speedup of some rows ("-" when there are none)."""
    if not rows:
        return ["-", "-"]
    return [mean([r["tokens_per_s"] for r in rows]), mean([r["speedup_vs_plain"] for r in rows])]


if __name__ == "__main__":
    main()
