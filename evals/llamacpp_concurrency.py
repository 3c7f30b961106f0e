"""The llama.cpp comparison's concurrency mode (evals/bench_llamacpp.py --concurrency N):
the same N requests sent at once to llama-server (-np N, continuous batching), to
`specdec serve --quantization gguf` and through LLM.generate(all N), and the resident
memory of both servers and of an LLM in a fresh process, stage by stage."""
from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specdec.evals.common import markdown_table
from specdec.evals.llamacpp_methods import KV_CACHE_MEMORY, METHODS, Prompt, chat_prompts, dash, load, parse_method
from specdec.evals.llamacpp_setup import BUILD, llama_server, note
from specdec.evals.processes import Server, free_port, peak_rss, post_json, started
from specdec.llm import LLM
from specdec.sampling_params import SamplingParams

# Runs in a fresh project python: resident memory stage by stage of one LLM on the GGUF.
MEMORY_PROBE = """
import json, sys, time
def status():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {key: int(fields[key].split()[0]) * 1024 for key in ("VmRSS", "VmHWM")}
spec = json.load(sys.stdin)
stages = {"python": status()}
import torch
torch.set_num_threads(spec["threads"])
stages["import torch"] = status()
from specdec.llm import LLM
from specdec.sampling_params import SamplingParams
stages["import specdec"] = status()
llm = LLM(spec["model"], quantization="gguf", max_model_len=spec["max_model_len"], **spec["options"])
stages["LLM loaded"] = status()
params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
llm.generate([spec["prompts"][0]], params)
stages["after 1 request"] = status()
llm.generate(spec["prompts"], params)
stages[f"after {len(spec['prompts'])} concurrent"] = status()
kv = sum(t.nbytes for layer in llm.engine.runner.kv_cache.layers for t in vars(layer).values() if t is not None)
json.dump({"stages": stages, "kv_cache_bytes": kv}, sys.stdout)
"""



def llama_server_command(binary: Path, model: Path, port: int, slots: int, n_ctx_slot: int,
                         args: argparse.Namespace) -> list[str]:
    # no host prompt cache (-cram 0, cache_prompt false): every round prefills, as specdec's does
    return [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-t", str(args.threads),
            "-tb", str(args.threads), "-np", str(slots), "-c", str(slots * n_ctx_slot), "-cb", "--cache-ram", "0",
            "--no-webui"]


def llama_server_send(port: int, max_tokens: int) -> Callable[[list[int]], int]:
    def send(ids: list[int]) -> int:
        body = {"prompt": ids, "n_predict": max_tokens, "temperature": 0.0, "top_k": 1, "ignore_eos": True,
                "cache_prompt": False}
        return int(post_json(f"http://127.0.0.1:{port}/completion", body)["tokens_predicted"])
    return send


def specdec_server_command(model: Path, port: int, method: str, args: argparse.Namespace) -> list[str]:
    _, speculative, (quantization, activations) = parse_method(method)
    # The server's own default ("auto") speculates: plain decoding must say "none".
    spec = speculative if isinstance(speculative, str) else json.dumps(speculative) if speculative else "none"
    return [str(Path(sys.executable).with_name("specdec")), "serve", str(model), "--host", "127.0.0.1",
            "--port", str(port), "--quantization", quantization, "--quantized-activations", activations,
            "--served-model-name", "bench", "--max-model-len", str(args.max_model_len), "--log-level", "warning",
            "--speculative-config", spec]


def specdec_server_send(port: int, max_tokens: int) -> Callable[[list[int]], int]:
    def send(ids: list[int]) -> int:
        body = {"model": "bench", "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
        return int(post_json(f"http://127.0.0.1:{port}/v1/completions", body)["usage"]["completion_tokens"])
    return send


def serve_round(server: Server, workload: list[list[int]]) -> dict[str, Any]:
    """All requests at once; output tokens, wall seconds and the peak resident memory."""
    with peak_rss(server.process.pid) as peak, ThreadPoolExecutor(len(workload)) as pool:
        start = time.perf_counter()
        tokens = sum(pool.map(server.send, workload))
        seconds = time.perf_counter() - start
    return {"tokens": tokens, "seconds": seconds, "peak_rss": peak[0]}


def generate_round(llm: LLM, workload: list[list[int]], max_tokens: int) -> dict[str, Any]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(workload, params)
    seconds = time.perf_counter() - start
    return {"tokens": sum(len(o.outputs[0].token_ids) for o in outs), "seconds": seconds}


def make_workload(prompts: list[Prompt], n: int) -> list[list[int]]:
    """n prompts round-robin over the categories, so long and short prompts mix."""
    by_category: dict[str, list[list[int]]] = {}
    for p in prompts:
        by_category.setdefault(p.category, []).append(p.ids)
    mixed = [ids for row in itertools.zip_longest(*by_category.values()) for ids in row if ids is not None]
    return [mixed[i % len(mixed)] for i in range(n)]


def bench_concurrency(args: argparse.Namespace, model: Path, python: Path) -> dict[str, Any]:
    engines = {f"specdec LLM.generate {m}": LLM(str(model), quantization="gguf", speculative_config=METHODS[m],
                                                 max_model_len=args.max_model_len) for m in args.generate_methods}
    torch.set_num_threads(args.threads)
    chat = next(iter(engines.values()), None) or LLM(str(model), kv_cache_memory=KV_CACHE_MEMORY)
    workload = make_workload(chat_prompts(chat, args.num_prompts), args.concurrency)
    report: dict[str, Any] = {"requests": len(workload), "max_tokens": args.max_tokens,
                              "prompt_tokens": sum(len(ids) for ids in workload)}
    report["memory_probe"] = memory_probe(model, workload, args)
    for llm in engines.values():
        llm.generate([workload[0]], SamplingParams(temperature=0.0, max_tokens=8))
    rounds: dict[str, list[dict[str, Any]]] = {}
    with servers(args, model, python, len(workload)) as running:
        report["server_errors"] = running.errors
        report["idle_rss"] = {s.label: s.idle_rss for s in running.servers}
        for server in running.servers:  # warm-up
            serve_round(server, workload[:2])
        for r in range(args.rounds):
            for server in running.servers:
                note(f"concurrency round {r + 1}/{args.rounds}: {server.label}, load {load():.2f}")
                rounds.setdefault(server.label, []).append(serve_round(server, workload))
            for label, llm in engines.items():
                note(f"concurrency round {r + 1}/{args.rounds}: {label}, load {load():.2f}")
                rounds.setdefault(label, []).append(generate_round(llm, workload, args.max_tokens))
    report["rounds"] = rounds
    report["rows"] = concurrency_rows(rounds, report["idle_rss"])
    return report


@dataclass
class Running:
    servers: list[Server]
    errors: dict[str, str]


@contextmanager
def servers(args: argparse.Namespace, model: Path, python: Path, slots: int) -> Iterator[Running]:
    """llama-server (if it builds) and a specdec server per --server-methods, all up at
    once so their rounds can alternate; a server that fails is reported, not fatal."""
    running = Running([], {})
    n_ctx_slot = args.max_model_len
    with ExitStack() as stack:
        try:
            binary = llama_server(python, args.threads)
            port = free_port()
            running.servers.append(stack.enter_context(started(
                "llama-server", llama_server_command(binary, model, port, slots, n_ctx_slot, args),
                f"http://127.0.0.1:{port}/health", llama_server_send(port, args.max_tokens), BUILD)))
        except (subprocess.SubprocessError, OSError, RuntimeError) as error:
            running.errors["llama-server"] = f"{type(error).__name__}: {error}"
            note(f"llama-server unavailable: {error}")
        for method in args.server_methods:
            port = free_port()
            env = os.environ | {"OMP_NUM_THREADS": str(args.threads)}
            label = f"specdec serve {method}"
            try:
                running.servers.append(stack.enter_context(started(
                    label, specdec_server_command(model, port, method, args), f"http://127.0.0.1:{port}/health",
                    specdec_server_send(port, args.max_tokens), BUILD, env)))
            except (OSError, RuntimeError) as error:
                running.errors[label] = f"{type(error).__name__}: {error}"
        yield running


def memory_probe(model: Path, workload: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    """An LLM with quantization gguf and the default kv_cache_memory in a fresh process:
    resident memory after each stage, and the KV pool's size."""
    spec = {"model": str(model), "threads": args.threads, "max_model_len": args.max_model_len,
            "max_tokens": args.max_tokens, "prompts": workload, "options": {}}
    done = subprocess.run([sys.executable, "-c", MEMORY_PROBE], input=json.dumps(spec), capture_output=True, text=True,
                          timeout=3600)
    if done.returncode:
        return {"error": done.stderr[-4000:]}
    return dict(json.loads(done.stdout))


def concurrency_rows(rounds: dict[str, list[dict[str, Any]]], idle_rss: dict[str, int]) -> list[dict[str, Any]]:
    """Per engine the best round: output tok/s, the ratio to llama-server, memory."""
    best = {label: min(runs, key=lambda run: run["seconds"]) for label, runs in rounds.items()}
    base = best.get("llama-server")
    base_rate = base["tokens"] / base["seconds"] if base else float("nan")
    rows = []
    for label, run in best.items():
        rate = run["tokens"] / run["seconds"]
        peak = max((r.get("peak_rss", 0) for r in rounds[label]), default=0)
        rows.append({"engine": label, "tokens": run["tokens"], "seconds": run["seconds"], "tok/s": rate,
                     "vs llama-server": rate / base_rate, "idle RSS MB": idle_rss[label] / 2**20 if label in idle_rss
                     else None, "peak RSS MB": peak / 2**20 if peak else None})
    return rows


def print_concurrency(report: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"\n## {report['requests']} concurrent requests: {args.max_tokens} output tokens each, greedy, EOS ignored, "
          f"{report['prompt_tokens']} prompt tokens in all; best of {args.rounds} rounds, load now {load():.2f}\n")
    print(markdown_table(["engine", "output tokens", "seconds", "output tok/s", "vs llama-server", "idle RSS MB",
                          "peak RSS MB while serving"],
                         [[r["engine"], r["tokens"], r["seconds"], r["tok/s"], r["vs llama-server"],
                           dash(r["idle RSS MB"]), dash(r["peak RSS MB"])] for r in report["rows"]]))
    for label, error in report.get("server_errors", {}).items():
        print(f"\n{label} did not run: {error}")
    probe = report["memory_probe"]
    if "error" in probe:
        print(f"\nmemory probe failed: {probe['error']}")
        return
    print(f"\n### LLM(quantization='gguf', default kv_cache_memory) in a fresh process "
          f"(KV pool {probe['kv_cache_bytes'] / 2**20:.0f} MB)\n")
    print(markdown_table(["stage", "RSS MB", "peak RSS MB (VmHWM)"],
                         [[stage, v["VmRSS"] / 2**20, v["VmHWM"] / 2**20] for stage, v in probe["stages"].items()]))
