"""Serving benchmark for a running `specdec serve` (like `vllm bench serve`).

Sends N streaming requests to the OpenAI-compatible server, at a Poisson request rate
and/or a fixed maximum concurrency, and reports TTFT, TPOT, ITL and end-to-end latency
(mean, p50, p90, p99) plus request and output-token throughput, as a table and JSON.

    .venv/bin/python evals/bench_serving.py --num-prompts 32 --max-concurrency 4
    .venv/bin/python evals/bench_serving.py --request-rate 2 --dataset prompts.jsonl
    .venv/bin/python evals/bench_serving.py --compare-speculation --result-json bench.json

`--compare-speculation` runs the same workload once with `"speculative": false` and once
with `"speculative": true` (alternating the order over `--rounds`), and prints both side
by side with the server's draft acceptance for each. Only 127.0.0.1 / localhost servers
are accepted.

Metrics: TTFT = request sent -> first non-empty content chunk. ITL = gaps between
content chunks (with speculation one chunk may carry several tokens). TPOT = (e2e -
TTFT) / (output tokens - 1), output tokens from the server's usage. A JSONL dataset has
one object per line: {"prompt": "..."} or {"messages": [...]}, optionally "max_tokens".
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx

from specdec.evals.sse_client import event_text, stream

LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1"}
# The default workload when no --dataset is given: short chat tasks of mixed kinds, some
# input-grounded (rewrite, summarise, fix) where drafting from the prompt pays off.
BUILTIN_PROMPTS = Path(__file__).resolve().parent / "prompts" / "bench_serving.json"


@dataclass
class Job:
    prompt: str | list[dict[str, Any]]  # text, or chat messages
    max_tokens: int
    speculative: bool | None  # None: leave the server default


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


# ---- workload ----------------------------------------------------------------------------


def load_prompts(path: str | None) -> list[dict[str, Any]]:
    if path is None:
        return [{"prompt": p} for p in json.loads(BUILTIN_PROMPTS.read_text(encoding="utf-8"))]
    rows = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if line.strip():
            row = json.loads(line)
            if not isinstance(row, dict) or not ("prompt" in row or "messages" in row):
                raise SystemExit(f"{path}:{number}: each line needs a 'prompt' or 'messages'")
            rows.append(row)
    if not rows:
        raise SystemExit(f"{path} holds no prompts")
    return rows


def make_jobs(rows: list[dict[str, Any]], args: argparse.Namespace, speculative: bool | None) -> list[Job]:
    jobs = []
    for i in range(args.num_prompts):
        row = rows[i % len(rows)]
        prompt = row.get("messages") or row["prompt"]
        if args.endpoint == "chat" and isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        if args.endpoint == "completions" and not isinstance(prompt, str):
            raise SystemExit("the completions endpoint needs text prompts, not messages")
        jobs.append(Job(prompt, int(row.get("max_tokens", args.max_tokens)), speculative))
    return jobs


def request_body(job: Job, args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {"model": args.model, "max_tokens": job.max_tokens, "temperature": args.temperature,
                            "stream": True, "stream_options": {"include_usage": True},
                            "ignore_eos": args.ignore_eos}
    body["messages" if args.endpoint == "chat" else "prompt"] = job.prompt
    if job.speculative is not None:
        body["speculative"] = job.speculative
    return body


# ---- one request -------------------------------------------------------------------------


async def send(client: httpx.AsyncClient, job: Job, args: argparse.Namespace) -> Result:
    route = "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"
    result = Result(ok=False)
    start = last = time.perf_counter()

    def on_event(event: dict[str, Any]) -> bool:
        nonlocal last
        if event.get("usage"):
            result.prompt_tokens = event["usage"]["prompt_tokens"]
            result.output_tokens = event["usage"]["completion_tokens"]
        if event_text(event):
            now = time.perf_counter()
            if result.ttft == 0.0:
                result.ttft = now - start
            else:
                result.itl.append(now - last)
            last = now
        return True

    outcome = await stream(client, route, request_body(job, args), on_event)
    if outcome.error is not None:
        result.error = outcome.error
        return result
    result.e2e = time.perf_counter() - start
    result.ok = True
    return result


# ---- one run -----------------------------------------------------------------------------


async def _paced(client: httpx.AsyncClient, job: Job, delay: float, gate: asyncio.Semaphore,
                 args: argparse.Namespace) -> Result:
    await asyncio.sleep(delay)
    async with gate:
        return await send(client, job, args)


def arrival_times(count: int, rate: float, rng: random.Random) -> list[float]:
    """Poisson process: exponential gaps of mean 1/rate; all at t=0 for an infinite rate."""
    if math.isinf(rate):
        return [0.0] * count
    times, now = [], 0.0
    for _ in range(count):
        times.append(now)
        now += rng.expovariate(rate)
    return times


async def run(client: httpx.AsyncClient, jobs: list[Job], args: argparse.Namespace) -> tuple[list[Result], float]:
    gate = asyncio.Semaphore(args.max_concurrency or len(jobs) or 1)
    delays = arrival_times(len(jobs), args.request_rate, random.Random(args.seed))
    start = time.perf_counter()
    results = await asyncio.gather(*(_paced(client, j, d, gate, args) for j, d in zip(jobs, delays)))
    return list(results), time.perf_counter() - start


# ---- server metrics ----------------------------------------------------------------------

_SPEC_COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


async def spec_counters(client: httpx.AsyncClient) -> dict[str, float]:
    try:
        text = (await client.get("/metrics")).text
    except httpx.HTTPError:
        return {}
    counters = {}
    for name in _SPEC_COUNTERS:
        match = re.search(rf"^specdec:{name}_total (\S+)$", text, re.MULTILINE)
        if match:
            counters[name] = float(match.group(1))
    return counters


def counter_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in _SPEC_COUNTERS}


def acceptance(delta: dict[str, float]) -> dict[str, float]:
    """Draft acceptance from spec-decode counter deltas; {} when nothing was drafted."""
    drafts, drafted, accepted = (delta.get(k, 0.0) for k in _SPEC_COUNTERS)
    if not drafts:
        return {}
    return {"num_drafts": drafts, "num_draft_tokens": drafted, "num_accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_accepted_length": 1.0 + accepted / drafts}


# ---- statistics and report -----------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution(values: list[float]) -> dict[str, float]:
    ms = [v * 1000.0 for v in values]
    return {"mean": sum(ms) / len(ms) if ms else 0.0, "p50": percentile(ms, 50), "p90": percentile(ms, 90),
            "p99": percentile(ms, 99)}


def summarize(results: list[Result], duration: float, spec: dict[str, float]) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    return {
        "completed": len(done), "failed": len(results) - len(done), "duration_s": duration,
        "total_input_tokens": sum(r.prompt_tokens for r in done), "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration if duration else 0.0,
        "output_throughput": output_tokens / duration if duration else 0.0,
        "ttft_ms": distribution([r.ttft for r in done]),
        "tpot_ms": distribution([t for r in done if (t := r.tpot) is not None]),
        "itl_ms": distribution([gap for r in done for gap in r.itl]),
        "e2e_ms": distribution([r.e2e for r in done]),
        "spec_decode": spec,
        "errors": sorted({r.error for r in results if not r.ok})[:5],
    }


def _rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    rows = [("Successful requests", f"{summary['completed']}"), ("Failed requests", f"{summary['failed']}"),
            ("Benchmark duration (s)", f"{summary['duration_s']:.2f}"),
            ("Total input tokens", f"{summary['total_input_tokens']}"),
            ("Total output tokens", f"{summary['total_output_tokens']}"),
            ("Request throughput (req/s)", f"{summary['request_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{summary['output_throughput']:.2f}")]
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E latency")):
        for stat in ("mean", "p50", "p90", "p99"):
            rows.append((f"{stat.capitalize() if stat == 'mean' else stat.upper()} {label} (ms)",
                         f"{summary[key][stat]:.2f}"))
    spec = summary["spec_decode"]  # {} when the server drafted nothing
    rows.append(("Draft acceptance rate", f"{spec['acceptance_rate']:.3f}" if spec else "-"))
    rows.append(("Mean accepted length (tokens/step)", f"{spec['mean_accepted_length']:.3f}" if spec else "-"))
    return rows


def table(summaries: dict[str, dict[str, Any]]) -> str:
    names = list(summaries)
    columns = [_rows(summaries[n]) for n in names]
    width = max(len(label) for label, _ in columns[0]) + 2
    lines = ["=" * (width + 16 * len(names)), f"{'Serving benchmark':<{width}}" + "".join(f"{n:>16}" for n in names),
             "-" * (width + 16 * len(names))]
    for i, (label, _) in enumerate(columns[0]):
        lines.append(f"{label:<{width}}" + "".join(f"{col[i][1]:>16}" for col in columns))
    lines.append("=" * (width + 16 * len(names)))
    return "\n".join(lines)


# ---- main ----------------------------------------------------------------------------------


def check_local(url: str) -> None:
    host = urlparse(url).hostname
    if host not in LOCAL_HOSTS:
        raise SystemExit(f"refusing to benchmark {url}: only 127.0.0.1 / localhost servers are allowed")


async def served_model(client: httpx.AsyncClient) -> str:
    response = await client.get("/v1/models")
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])


async def measure(client: httpx.AsyncClient, jobs: list[Job], args: argparse.Namespace) -> dict[str, Any]:
    before = await spec_counters(client)
    results, duration = await run(client, jobs, args)
    delta = counter_delta(before, await spec_counters(client))
    return {"results": results, "duration": duration, "counters": delta}


def merge_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One summary over every round of one mode."""
    results = [r for one in runs for r in one["results"]]
    duration = sum(one["duration"] for one in runs)
    counters = {k: sum(one["counters"][k] for one in runs) for k in _SPEC_COUNTERS}
    return summarize(results, duration, acceptance(counters))


async def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.max_concurrency or max(args.num_prompts, 1))
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=args.timeout,
                                 limits=limits) as client:
        args.model = args.model or await served_model(client)
        rows = load_prompts(args.dataset)
        for job in make_jobs(rows, args, None)[: args.warmup]:
            await send(client, job, args)
        modes: list[tuple[str, bool | None]] = [("default", None)]
        if args.compare_speculation:
            modes = [("spec_off", False), ("spec_on", True)]
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in modes}
        for round_ in range(args.rounds if args.compare_speculation else 1):
            for name, speculative in (modes if round_ % 2 == 0 else modes[::-1]):
                runs[name].append(await measure(client, make_jobs(rows, args, speculative), args))
    return {name: merge_runs(r) for name, r in runs.items()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="default: the server's model")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    parser.add_argument("--dataset", default=None, help="JSONL of {prompt} or {messages}; default: built-in")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (Poisson); default inf")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--ignore-eos", action="store_true", help="always generate max_tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=1, help="requests sent before measuring")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--compare-speculation", action="store_true",
                        help="run the workload with speculative false and true; print both")
    parser.add_argument("--rounds", type=int, default=1, help="with --compare-speculation: off/on rounds")
    parser.add_argument("--result-json", default=None, help="write the JSON report here (else print it)")
    args = parser.parse_args(argv)
    check_local(args.base_url)
    if args.num_prompts < 1 or args.request_rate <= 0 or (args.max_concurrency or 1) < 1 or args.rounds < 1:
        parser.error("--num-prompts, --request-rate, --max-concurrency and --rounds must be positive")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    summaries = asyncio.run(benchmark(args))
    print(table(summaries))
    config = {k: v for k, v in vars(args).items() if k not in {"api_key"}}
    config["request_rate"] = str(config["request_rate"])
    report = json.dumps({"config": config, "results": summaries}, indent=2)
    if args.result_json:
        Path(args.result_json).write_text(report + "\n")
        print(f"wrote {args.result_json}", file=sys.stderr)
    else:
        print(report)


if __name__ == "__main__":
    main()
