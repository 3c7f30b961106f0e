"""specdec and llama.cpp side by side on one GGUF file: greedy decoding at batch 1.

llama.cpp runs through llama-cpp-python, installed into a venv of its own under
build/llamacpp-venv (compiled from source for this CPU: minutes the first time, on 2
cores), never into the project's venv and never in CI; this script drives it in a
subprocess and reads JSON back. Both engines get the same prompts (the chat template
applied by specdec's tokenizer, as token ids), the same thread count, greedy decoding and
--max-tokens new tokens with EOS ignored. The rate counts decoding only: for specdec a
1-token generation of the same prompt is timed and subtracted, for llama.cpp the time to
its first token. specdec runs the file on its own blocks (quantization "gguf") and, for
reference, dequantized on its default fp16 backend ("none").

    python evals/bench_llamacpp.py --threads 2 --max-tokens 128 --json /tmp/llamacpp.json

The issue's targets: specdec plain >= 1.2x llama.cpp plain at batch 1. Check `uptime`
first: on a shared box the numbers mean little (see evals/bench_kernels.py).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import venv
from pathlib import Path
from typing import Any

import torch

from specdec.llm import LLM
from specdec.model_registry import DEFAULT_MODEL, resolve_model
from specdec.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / "build" / "llamacpp-venv"
REQUIREMENT = "llama-cpp-python==0.3.36"
QUESTIONS = [
    "Explain in detail how a bicycle works, covering the frame, the wheels, the gears and the brakes.",
    "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring.",
    "List five tips for learning a new language and explain each one in a sentence.",
    "What is photosynthesis? Answer for a ten-year-old.",
    "Summarise the causes of the French Revolution in a paragraph.",
]
# Runs in llama.cpp's venv: reads {"model", "threads", "prompts", "max_tokens", "n_ctx"} on
# stdin, writes per prompt the seconds to the first token, to the last, and the tokens.
DRIVER = """
import json, sys, time
from llama_cpp import Llama
spec = json.load(sys.stdin)
llm = Llama(model_path=spec["model"], n_threads=spec["threads"], n_threads_batch=spec["threads"],
            n_ctx=spec["n_ctx"], verbose=False)
runs = []
for ids in spec["prompts"]:
    llm.reset()
    start, stamps, tokens = time.perf_counter(), [], []
    for token in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        stamps.append(time.perf_counter() - start)
        tokens.append(int(token))
        if len(tokens) == spec["max_tokens"]:
            break
    runs.append({"first_s": stamps[0], "last_s": stamps[-1], "tokens": tokens})
json.dump(runs, sys.stdout)
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help="a .gguf file or a known model name (its GGUF)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="each prompt this many times; the best is kept")
    parser.add_argument("--requirement", default=REQUIREMENT, help="pip requirement of llama-cpp-python")
    parser.add_argument("--skip-dequantized", action="store_true", help="time only specdec's gguf path")
    parser.add_argument("--json", type=Path, default=None, help="also write every number here")


def llamacpp_python(requirement: str) -> Path:
    """The python of the venv with llama-cpp-python, created and installed on first use."""
    python = VENV / "bin" / "python"
    check = [str(python), "-c", "import llama_cpp"]
    if python.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return python
    print(f"installing {requirement} into {VENV} (builds llama.cpp from source)", file=sys.stderr, flush=True)
    venv.create(VENV, with_pip=True, clear=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", requirement], check=True)
    return python


def run_llamacpp(python: Path, model: Path, prompts: list[list[int]], args: argparse.Namespace) -> list[dict[str, Any]]:
    spec = {"model": str(model), "threads": args.threads, "prompts": prompts, "max_tokens": args.max_tokens,
            "n_ctx": max(len(p) for p in prompts) + args.max_tokens + 8}
    best: list[dict[str, Any]] = []
    for _ in range(args.rounds):
        done = subprocess.run([str(python), "-c", DRIVER], input=json.dumps(spec), capture_output=True, text=True,
                              check=True)
        runs = json.loads(done.stdout)
        best = runs if not best else [min(a, b, key=_decode_seconds) for a, b in zip(best, runs)]
    return best


def _decode_seconds(run: dict[str, Any]) -> float:
    return float(run["last_s"] - run["first_s"])


def run_specdec(llm: LLM, prompts: list[list[int]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Per prompt: seconds for 1 token and for max_tokens (best of the rounds), and the tokens."""
    def timed(ids: list[int], max_tokens: int) -> tuple[float, list[int]]:
        start = time.perf_counter()
        out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        return time.perf_counter() - start, list(out[0].outputs[0].token_ids)

    runs = []
    for ids in prompts:
        timed(ids, 2)  # warm-up: kernels built, buffers sized
        first = min(timed(ids, 1)[0] for _ in range(args.rounds))
        last, tokens = min(timed(ids, args.max_tokens) for _ in range(args.rounds))
        runs.append({"first_s": first, "last_s": last, "tokens": tokens})
    return runs


def decode_rate(runs: list[dict[str, Any]], max_tokens: int) -> float:
    """Median over prompts of the tokens per second after the first token."""
    return statistics.median((max_tokens - 1) / _decode_seconds(run) for run in runs)


def agreement(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> float:
    """Mean count of leading tokens equal to llama.cpp's (its Q4_1 products quantize the
    activations to 8 bits, so long greedy outputs may part)."""
    def common(a: list[int], b: list[int]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    return statistics.mean(common(a["tokens"], b["tokens"]) for a, b in zip(ours, theirs))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = resolve_model(args.model, gguf=True)
    if model.suffix != ".gguf":
        raise SystemExit(f"{args.model} has no GGUF file to compare on")
    python = llamacpp_python(args.requirement)
    engines = {"specdec gguf": "gguf"} | ({} if args.skip_dequantized else {"specdec dequantized": "none"})
    results: dict[str, list[dict[str, Any]]] = {}
    prompts: list[list[int]] = []
    for label, quantization in engines.items():
        llm = LLM(str(model), quantization=quantization, max_model_len=2048, kv_cache_memory=1 << 28)
        torch.set_num_threads(args.threads)
        prompts = prompts or [llm.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
        results[label] = run_specdec(llm, prompts, args)
        del llm
    results["llama.cpp"] = run_llamacpp(python, model, prompts, args)
    rates = {label: decode_rate(runs, args.max_tokens) for label, runs in results.items()}
    rows = [f"| {label} | {args.threads} | {rate:.1f} | {rate / rates['llama.cpp']:.2f}x | "
            f"{agreement(results[label], results['llama.cpp']):.1f} |" for label, rate in rates.items()]
    print(f"# {model.name}: greedy decode at batch 1, {args.max_tokens} tokens, load average "
          f"{os.getloadavg()[0]:.2f}\n\n| engine | threads | tok/s | vs llama.cpp | tokens equal to llama.cpp's |\n"
          "|---|---|---|---|---|\n" + "\n".join(rows))
    report = {"model": str(model), "threads": args.threads, "max_tokens": args.max_tokens, "rates": rates,
              "runs": results, "llama_cpp": args.requirement, "loadavg": os.getloadavg()}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
