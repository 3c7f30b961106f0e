"""specdec and llama.cpp side by side on one GGUF file: greedy decoding at batch 1, and a
fixed workload of 16 concurrent requests.

llama.cpp runs through llama-cpp-python, installed into a venv of its own under
build/llamacpp-venv (compiled from source with -march=native: minutes the first time, on
2 cores; the build log is build/llamacpp-install.log), never into the project's venv and
never in CI; a driver script runs in that venv in a subprocess and writes JSON back. The
--concurrency mode also builds llama.cpp's own `llama-server` from the llama.cpp sources
that llama-cpp-python's sdist vendors (build/llamacpp-server; log build/llama-server.log).

Batch 1. Both engines get the same prompts (first turns of evals/prompts, the chat
template applied by specdec's tokenizer, as token ids), the same thread count, greedy
decoding and exactly --max-tokens new tokens (EOS ignored by both: llama-cpp-python's
`generate` never stops by itself, specdec gets ignore_eos). The rate is the decode rate:
tokens after the first / seconds after the first token, both stamped inside one run (for
specdec by stepping the engine). Runs alternate in one sitting: a llama.cpp round over all
prompts, then a specdec round of each method, repeated --rounds times; per prompt the
fastest round is kept (--keep best, the default: noise on a shared machine only adds
time) or the median round (--keep median). A group's rate is its decode tokens over its
decode seconds. specdec runs the file on its own Q4_1 blocks (quantization "gguf"); a
method written "plain@none" runs the file dequantized on the default fp16 backend, for
reference, and "plain@int8" on its blocks with int8 activations (the lossy opt-in).

    python evals/bench_llamacpp.py --num-prompts 2 --max-tokens 96 --rounds 2 --json build/llamacpp.json
    python evals/bench_llamacpp.py --skip-batch1 --concurrency 16 --json build/llamacpp-16.json

Concurrency (--concurrency N): the same N requests (prompts round-robin over the
categories, --max-tokens each, EOS ignored, greedy) sent at once to llama-server (-np N,
continuous batching), to `specdec serve --quantization gguf` and through
LLM.generate(all N); output tokens / wall seconds, best of --rounds, engines alternating
per round. Resident memory of both servers (idle after load, peak while serving) and of
an LLM in a fresh process, stage by stage, is measured alongside.

The issue's targets: specdec plain >= 1.2x llama.cpp plain at batch 1. Check `uptime`
first: on a shared box the numbers mean little (see evals/bench_kernels.py).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from specdec.evals.common import markdown_table
from specdec.evals.llamacpp_concurrency import bench_concurrency, print_concurrency
from specdec.evals.llamacpp_methods import (
    DEFAULT_METHODS,
    GROUPS,
    LLAMACPP,
    METHODS,
    Prompt,
    build_engines,
    chat_prompts,
    dash,
    load,
    parse_method,
)
from specdec.evals.llamacpp_setup import REQUIREMENT, llama_server, llamacpp_python, llamacpp_version, note
from specdec.llm import LLM
from specdec.metrics import EngineMetrics
from specdec.model_registry import DEFAULT_MODEL, resolve_model
from specdec.sampling_params import SamplingParams

# Runs in llama.cpp's venv: reads {"model", "threads", "prompts", "max_tokens", "n_ctx"} on
# stdin, writes per prompt the seconds to the first token, to the last, and the tokens.
# reset() before each prompt: no KV prefix is reused from the previous generation.
DRIVER = """
import json, sys, time
from llama_cpp import Llama
spec = json.load(sys.stdin)
llm = Llama(model_path=spec["model"], n_threads=spec["threads"], n_threads_batch=spec["threads"],
            n_ctx=spec["n_ctx"], n_batch=spec["n_ctx"], verbose=False)

def run(ids, max_tokens):
    llm.reset()
    start, stamps, tokens = time.perf_counter(), [], []
    for token in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        stamps.append(time.perf_counter() - start)
        tokens.append(int(token))
        if len(tokens) == max_tokens:
            break
    return {"first_s": stamps[0], "last_s": stamps[-1], "tokens": tokens}

run(spec["prompts"][0], 8)
json.dump([run(ids, spec["max_tokens"]) for ids in spec["prompts"]], sys.stdout)
"""

# ---- batch 1 ---------------------------------------------------------------------------

def run_specdec(llm: LLM, ids: list[int], max_tokens: int) -> dict[str, Any]:
    """One greedy generation, stepping the engine so the first token is stamped in the
    same run as the last; the drafts and accepted tokens it counted."""
    engine = llm.engine
    request_id = f"bench-{next(_request_ids)}"
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    before = EngineMetrics.from_dict(llm.get_metrics())
    start = time.perf_counter()
    engine.add_request(request_id, ids, params)
    first_s, tokens = None, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id != request_id:
                continue
            if first_s is None and out.outputs[0].token_ids:
                first_s = time.perf_counter() - start
            tokens = list(out.outputs[0].token_ids)
    last_s = time.perf_counter() - start
    delta = EngineMetrics.from_dict(llm.get_metrics()) - before
    return {"first_s": first_s, "last_s": last_s, "tokens": tokens, "drafts": delta.num_drafts,
            "drafted": delta.num_draft_tokens, "accepted": delta.num_accepted_tokens}


_request_ids = itertools.count()


def run_llamacpp(python: Path, model: Path, prompts: list[Prompt], args: argparse.Namespace) -> list[dict[str, Any]]:
    """One round over every prompt in a fresh llama.cpp process (a short warm-up first)."""
    ids = [p.ids for p in prompts]
    spec = {"model": str(model), "threads": args.threads, "prompts": ids, "max_tokens": args.max_tokens,
            "n_ctx": max(len(p) for p in ids) + args.max_tokens + 8}
    done = subprocess.run([str(python), "-c", DRIVER], input=json.dumps(spec), capture_output=True, text=True,
                          timeout=3600)
    if done.returncode:
        raise RuntimeError(f"the llama.cpp driver failed:\n{done.stderr[-4000:]}")
    return list(json.loads(done.stdout))


def bench_batch1(args: argparse.Namespace, model: Path, python: Path) -> tuple[dict[str, Any], list[Prompt]]:
    engines = build_engines(model, args)
    prompts = chat_prompts(next(iter(engines.values())), args.num_prompts)
    for llm in engines.values():  # warm-up: kernels built, buffers sized
        run_specdec(llm, prompts[0].ids, 8)
    rounds: dict[str, list[list[dict[str, Any]]]] = {label: [] for label in (LLAMACPP, *engines)}
    for r in range(args.rounds):
        note(f"round {r + 1}/{args.rounds}: {LLAMACPP}, load {load():.2f}")
        rounds[LLAMACPP].append(run_llamacpp(python, model, prompts, args))
        for label in rotated(list(engines), r):
            note(f"round {r + 1}/{args.rounds}: {label}, load {load():.2f}")
            forget_earlier_rounds(engines[label])
            rounds[label].append([run_specdec(engines[label], p.ids, args.max_tokens) for p in prompts])
    kept = {label: keep_per_prompt(runs, args.keep) for label, runs in rounds.items()}
    result = {"prompts": [{"category": p.category, "group": p.group, "prompt_tokens": len(p.ids)} for p in prompts],
              "rounds": rounds, "kept": kept, "rows": batch1_rows(kept, prompts)}
    return result, prompts


def forget_earlier_rounds(llm: LLM) -> None:
    """Empty the drafter's cross-request cache (suffix decoding's): a round must not draft a
    prompt's answer from that prompt's run in an earlier round or the warm-up. Within a
    round the prompts differ, and earlier answers are drafted from as a server would."""
    if llm.engine.drafter is not None:
        llm.engine.drafter.forget_cached()


def rotated(items: list[str], shift: int) -> list[str]:
    """items started at shift: each round runs the specdec engines in another order."""
    shift %= max(len(items), 1)
    return items[shift:] + items[:shift]


def decode_seconds(run: dict[str, Any]) -> float:
    return float(run["last_s"] - run["first_s"])


def keep_per_prompt(rounds: list[list[dict[str, Any]]], keep: str) -> list[dict[str, Any]]:
    """Per prompt, the round with the shortest decode time ("best") or the median one
    ("median": the lower middle round of an even count, so it is a real run)."""
    kept = []
    for runs in zip(*rounds):
        ordered = sorted(runs, key=decode_seconds)
        kept.append(ordered[0] if keep == "best" else ordered[(len(ordered) - 1) // 2])
    return kept


def decode_rate(runs: list[dict[str, Any]]) -> float:
    """Tokens after the first over the seconds after the first token, summed over runs."""
    tokens = sum(len(run["tokens"]) - 1 for run in runs)
    seconds = sum(decode_seconds(run) for run in runs)
    return tokens / seconds if seconds > 0 else float("nan")


def leading_agreement(ours: list[int], theirs: list[int]) -> int:
    """How many leading tokens two outputs share."""
    return next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))


def batch1_rows(kept: dict[str, list[dict[str, Any]]], prompts: list[Prompt]) -> list[dict[str, Any]]:
    """One row per engine: decode rate per group and overall, the ratio to llama.cpp plain,
    τ and acceptance, and how far its tokens follow llama.cpp's and specdec plain's."""
    groups = {g: [i for i, p in enumerate(prompts) if p.group == g] for g in GROUPS}
    groups["overall"] = list(range(len(prompts)))
    base = {g: decode_rate([kept[LLAMACPP][i] for i in idx]) for g, idx in groups.items()}
    plain = kept.get("specdec plain")
    rows = []
    for label, runs in kept.items():
        row: dict[str, Any] = {"engine": label}
        for g, idx in groups.items():
            rate = decode_rate([runs[i] for i in idx])
            row[f"{g} tok/s"], row[f"{g} vs llama.cpp"] = rate, rate / base[g]
        drafts, drafted, accepted = (sum(run.get(key, 0) for run in runs) for key in ("drafts", "drafted", "accepted"))
        row["tau"] = 1 + accepted / drafts if drafts else None
        row["acceptance"] = accepted / drafted if drafted else None
        row["agree llama.cpp"] = statistics.mean(
            leading_agreement(run["tokens"], theirs["tokens"]) for run, theirs in zip(runs, kept[LLAMACPP]))
        row["same as plain"] = None if plain is None else sum(r["tokens"] == p["tokens"] for r, p in zip(runs, plain))
        rows.append(row)
    return rows


def category_rates(kept: dict[str, list[dict[str, Any]]], prompts: list[Prompt]) -> list[list[Any]]:
    categories = list(dict.fromkeys(p.category for p in prompts))
    return [[label, *(decode_rate([r for r, p in zip(runs, prompts) if p.category == c]) for c in categories)]
            for label, runs in kept.items()]


def print_batch1(result: dict[str, Any], prompts: list[Prompt], args: argparse.Namespace) -> None:
    print(f"\n## Batch 1: greedy decode rate, {len(prompts)} prompts, {args.max_tokens} tokens each, "
          f"{args.threads} threads, {args.keep} of {args.rounds} rounds per prompt, load now {load():.2f}\n")
    print(markdown_table(
        ["engine", "input-grounded tok/s", "vs llama.cpp", "other tok/s", "vs llama.cpp", "overall tok/s",
         "vs llama.cpp", "τ", "accept", "leading tokens = llama.cpp", f"= specdec plain (of {len(prompts)})"],
        [[r["engine"], r["input-grounded tok/s"], r["input-grounded vs llama.cpp"], r["other tok/s"],
          r["other vs llama.cpp"], r["overall tok/s"], r["overall vs llama.cpp"], dash(r["tau"]),
          dash(r["acceptance"]), r["agree llama.cpp"], dash(r["same as plain"])] for r in result["rows"]]))
    print("\n### Decode tok/s per category\n")
    categories = list(dict.fromkeys(p.category for p in prompts))
    print(markdown_table(["engine", *categories], category_rates(result["kept"], prompts)))


# ---- main ------------------------------------------------------------------------------

def machine() -> dict[str, Any]:
    """lscpu's model name and whether the flags the kernels care about are present."""
    lines = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
    fields = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    flags = set(fields.get("Flags", "").split())
    return {"model_name": fields.get("Model name", "?"), "cpus": os.cpu_count(),
            **{flag: flag in flags for flag in ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16")}}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help="a .gguf file or a known model name (its GGUF)")
    parser.add_argument("--threads", type=int, default=2, help="of both engines, and the build's jobs")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--num-prompts", type=int, default=2, help="first turns per category")
    parser.add_argument("--methods", default=DEFAULT_METHODS, type=lambda s: s.split(","),
                        help=f"specdec engines at batch 1: {', '.join(METHODS)}; '@none': run the GGUF dequantized, "
                             "'@int8': on its blocks with int8 activations")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds over every prompt")
    parser.add_argument("--keep", choices=("best", "median"), default="best", help="which round each prompt keeps")
    parser.add_argument("--skip-batch1", action="store_true")
    parser.add_argument("--concurrency", type=int, default=0, help="also send this many requests at once")
    parser.add_argument("--server-methods", default="plain", type=lambda s: [m for m in s.split(",") if m],
                        help="a `specdec serve` per method in the concurrency mode")
    parser.add_argument("--generate-methods", default="plain", type=lambda s: [m for m in s.split(",") if m],
                        help="LLM.generate engines (quantization gguf) in the concurrency mode")
    parser.add_argument("--requirement", default=REQUIREMENT, help="pip requirement of llama-cpp-python")
    parser.add_argument("--setup-only", action="store_true", help="install llama-cpp-python (and llama-server "
                        "with --concurrency), then stop")
    parser.add_argument("--json", type=Path, default=None, help="also write every number here")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    for method in args.methods + args.server_methods:
        parse_method(method)
    torch.set_num_threads(args.threads)
    model = resolve_model(args.model, gguf=True)
    if model.suffix != ".gguf":
        raise SystemExit(f"{args.model} has no GGUF file to compare on")
    python = llamacpp_python(args.requirement, args.threads)
    report: dict[str, Any] = {"model": str(model), "llama_cpp_python": llamacpp_version(python),
                              "args": {k: str(v) for k, v in vars(args).items()}, "machine": machine(),
                              "loadavg_start": os.getloadavg()}
    if args.setup_only:
        if args.concurrency:
            llama_server(python, args.threads)
        return report
    note(f"{model.name}, llama-cpp-python {report['llama_cpp_python']}, {report['machine']}, load {load():.2f}")
    if not args.skip_batch1:
        report["batch1"], prompts = bench_batch1(args, model, python)
        print_batch1(report["batch1"], prompts, args)
        write(args.json, report)  # a later failure keeps the batch-1 numbers
    if args.concurrency:
        report["concurrency"] = bench_concurrency(args, model, python)
        print_concurrency(report["concurrency"], args)
    report["loadavg_end"] = os.getloadavg()
    write(args.json, report)
    return report


def write(path: Path | None, report: dict[str, Any]) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
