"""Load and fault test of an OpenAI-compatible `specdec serve` (issue #8).

Many concurrent streaming clients send requests back to back for a fixed time: random
prompt lengths and max_tokens, completions and chat, some with `"speculative": false`,
some greedy and some sampled, and a share cancelled mid-stream by closing the stream.
Then it checks that the server held up, prints a JSON summary and a Markdown table, and
exits 1 when a check fails:

- no_5xx: no response with a 5xx status, nor a stream that ended in an error event;
- no_errors: no other failure either (4xx, broken connection, stream without [DONE]);
- finish_reasons: every request not cancelled finished with "length" exactly when its
  usage shows it hit max_tokens (or max_model_len), else with "stop";
- kv_blocks_free: once the clients are done, no KV block is in use and no request is
  running or waiting (the /metrics gauges);
- rss_flat: the server's resident memory peaks no more than --max-rss-growth-mb higher
  in the second half of the load window than in the first (from /proc/<pid>/status when
  this script started the server, else from /metrics' process_resident_memory_bytes);
- served: at least one request completed.

It also reports the RSS once the KV cache had been filled once (its pages become resident as
requests first write them), estimated from the requests' usage and the pool's size in our own
server's start-up log (specdec/memory_report.py `rss_once_filled`); None for another server.

    OMP_NUM_THREADS=1 .venv/bin/python evals/load_test.py --start-server \\
        --speculative-config '{"method":"ngram","num_speculative_tokens":5}'
    .venv/bin/python evals/load_test.py --base-url http://127.0.0.1:8000 --clients 16 --duration 20

Only 127.0.0.1 / localhost servers are accepted.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from specdec.evals.bench_serving import (
    acceptance,
    check_local,
    counter_delta,
    percentile,
    spec_counters,
)
from specdec.evals.common import markdown_table
from specdec.evals.sse_client import choice_text, stream
from specdec.memory_report import rss_once_filled
from specdec.model_registry import DEFAULT_MODEL
from specdec.server.stats_log import kv_pool_tokens

WORDS = (
    "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "speculative", "decoding", "drafts", "tokens",
    "and", "target", "model", "verifies", "them", "in", "one", "pass", "paris", "is", "capital", "of", "france",
    "berlin", "germany", "summarise", "following", "text", "sentence", "please", "def", "add", "return", "list",
    "tuple", "python", "function", "water", "cycle", "ocean", "haiku",
)
SETTLE_POLL_SECONDS = 0.2


# ---- one request -------------------------------------------------------------------------


@dataclass
class Plan:
    """One request as a client will send it."""

    route: str  # "/v1/completions" or "/v1/chat/completions"
    body: dict[str, Any]
    max_tokens: int
    cancel_after: int | None  # close the stream after this many content chunks


@dataclass
class Outcome:
    plan: Plan
    status: int = 0  # HTTP status, 0 when no response came
    cancelled: bool = False  # the client closed the stream before it finished
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    ttft: float | None = None  # seconds to the first content chunk
    error: str | None = None
    server_error: bool = False  # a 5xx, or an error event inside a 200 stream
    started_at: float = 0.0  # seconds from the start of the load window
    latency: float | None = None  # seconds from sending to the stream's end


def plan_request(rng: random.Random, args: argparse.Namespace, model: str) -> Plan:
    words = rng.randint(args.min_prompt_words, args.max_prompt_words)
    text = " ".join(rng.choice(WORDS) for _ in range(words))
    max_tokens = rng.randint(1, args.max_tokens)
    body: dict[str, Any] = {
        "model": model, "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True},
        "temperature": rng.choice([0.0, 0.7, 1.0]), "speculative": rng.random() >= args.no_spec_fraction,
    }
    chat = rng.random() < args.chat_fraction
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    cancel_after = rng.randint(1, 3) if rng.random() < args.cancel_fraction else None
    return Plan("/v1/chat/completions" if chat else "/v1/completions", body, max_tokens, cancel_after)


def _on_event(outcome: Outcome, event: dict[str, Any], start: float) -> bool:
    """Fold one SSE event into the outcome; True when it carried content."""
    if event.get("usage"):
        outcome.prompt_tokens = event["usage"]["prompt_tokens"]
        outcome.completion_tokens = event["usage"]["completion_tokens"]
    has_content = False
    for choice in event.get("choices") or []:
        outcome.finish_reason = choice.get("finish_reason") or outcome.finish_reason
        has_content = has_content or bool(choice_text(choice))
    if has_content and outcome.ttft is None:
        outcome.ttft = time.perf_counter() - start
    return has_content


async def send(client: httpx.AsyncClient, plan: Plan) -> Outcome:
    outcome = Outcome(plan)
    start = time.perf_counter()
    chunks = 0

    def on_event(event: dict[str, Any]) -> bool:
        """False (close the stream) once a request planned for cancelling has had its chunks."""
        nonlocal chunks
        chunks += _on_event(outcome, event, start)
        return plan.cancel_after is None or chunks < plan.cancel_after or outcome.finish_reason is not None

    result = await stream(client, plan.route, plan.body, on_event)
    outcome.status, outcome.cancelled = result.status, result.stopped
    outcome.error, outcome.server_error = result.error, result.server_error
    return outcome


async def client_loop(client: httpx.AsyncClient, rng: random.Random, args: argparse.Namespace, model: str,
                      deadline: float, outcomes: list[Outcome]) -> None:
    """One client: requests back to back until the deadline (the last one may run past it)."""
    load_start = deadline - args.duration
    while (sent := time.monotonic()) < deadline:
        outcome = await send(client, plan_request(rng, args, model))
        outcome.started_at, outcome.latency = sent - load_start, time.monotonic() - sent
        outcomes.append(outcome)


# ---- server observations -----------------------------------------------------------------


def metric(text: str, name: str) -> float | None:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else None


async def scrape(client: httpx.AsyncClient) -> str:
    response = await client.get("/metrics")
    response.raise_for_status()
    return response.text


def proc_rss(pid: int) -> float:
    """VmRSS of a process, in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    raise RuntimeError(f"no VmRSS for pid {pid}")


async def rss_mib(client: httpx.AsyncClient, pid: int | None) -> float | None:
    if pid is not None:
        return proc_rss(pid)
    value = metric(await scrape(client), "process_resident_memory_bytes")
    return None if value is None else value / 2**20


async def sample_rss(client: httpx.AsyncClient, pid: int | None, start: float, interval: float,
                     samples: list[tuple[float, float]]) -> None:
    """(seconds since start, RSS MiB) until cancelled."""
    while True:
        value = await rss_mib(client, pid)
        if value is not None:
            samples.append((time.monotonic() - start, value))
        await asyncio.sleep(interval)


async def settle(client: httpx.AsyncClient, timeout: float) -> dict[str, float | None]:
    """Wait for the KV gauges to drop to zero (aborts of closed streams land asynchronously)."""
    names = ("specdec:kv_cache_usage_perc", "specdec:num_requests_running", "specdec:num_requests_waiting")
    deadline = time.monotonic() + timeout
    while True:
        text = await scrape(client)
        gauges = {name.split(":")[1]: metric(text, name) for name in names}
        if all(v == 0 for v in gauges.values()) or time.monotonic() > deadline:
            return gauges
        await asyncio.sleep(SETTLE_POLL_SECONDS)


# ---- the run -----------------------------------------------------------------------------


@dataclass
class Run:
    outcomes: list[Outcome]
    elapsed: float  # the load window plus the tail of the requests still running at its end
    rss: list[tuple[float, float]]  # (seconds since start, MiB) over the load window
    rss_after: float | None  # MiB once every request is done
    gauges: dict[str, float | None]
    preemptions: int | None
    spec_decode: dict[str, float]  # draft acceptance over the run ({} without speculation)
    max_model_len: int
    rss_source: str  # "/proc" (our own server) or "/metrics"
    kv_tokens: int | None = None  # the KV pool's size in tokens (our own server's start-up log)


async def load(base_url: str, pid: int | None, args: argparse.Namespace) -> Run:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.clients + 4)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=args.timeout, limits=limits) as client:
        model_card = (await client.get("/v1/models")).json()["data"][0]
        preempted_before = metric(await scrape(client), "specdec:num_preemptions_total")
        spec_before = await spec_counters(client)
        outcomes: list[Outcome] = []
        rss: list[tuple[float, float]] = []
        start = time.monotonic()
        sampler = asyncio.create_task(sample_rss(client, pid, start, args.rss_interval, rss))
        rngs = [random.Random(f"{args.seed}-{i}") for i in range(args.clients)]
        clients = asyncio.gather(*(client_loop(client, rng, args, model_card["id"], start + args.duration,
                                               outcomes) for rng in rngs))
        await asyncio.sleep(args.duration)
        sampler.cancel()  # RSS halves compare steady load, not the draining tail
        await clients
        elapsed = time.monotonic() - start
        gauges = await settle(client, args.settle_timeout)
        preempted_after = metric(await scrape(client), "specdec:num_preemptions_total")
        spec = acceptance(counter_delta(spec_before, await spec_counters(client)))
        rss_after = await rss_mib(client, pid)
    preemptions = None if preempted_after is None else int(preempted_after - (preempted_before or 0.0))
    return Run(outcomes, elapsed, rss, rss_after, gauges, preemptions, spec, int(model_card["max_model_len"]),
               "/metrics" if pid is None else "/proc")


# ---- checks and report -------------------------------------------------------------------


def finish_problem(outcome: Outcome, max_model_len: int) -> str | None:
    """Why a finished request's finish_reason disagrees with its usage, or None."""
    reason, tokens, prompt = outcome.finish_reason, outcome.completion_tokens, outcome.prompt_tokens
    if tokens is None or prompt is None:
        return "no usage in the stream"
    hit_length = tokens == outcome.plan.max_tokens or prompt + tokens >= max_model_len
    if reason == "length" and not hit_length:
        return f"length after {tokens} of max_tokens={outcome.plan.max_tokens} (prompt {prompt})"
    if reason == "stop" and not 1 <= tokens <= outcome.plan.max_tokens:
        return f"stop after {tokens} tokens with max_tokens={outcome.plan.max_tokens}"
    if reason not in ("length", "stop"):
        return f"finish_reason {reason!r}"
    return None


def rss_halves(samples: list[tuple[float, float]], duration: float) -> tuple[float | None, float | None]:
    """Peak RSS (MiB) of the first and of the second half of the load window."""
    first = [v for t, v in samples if t < duration / 2]
    second = [v for t, v in samples if t >= duration / 2]
    return (max(first) if first else None), (max(second) if second else None)


def _check(ok: bool, detail: str) -> dict[str, Any]:
    return {"ok": ok, "detail": detail}


def checks(run: Run, summary: dict[str, Any], args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    growth = summary["rss_growth_mib"]
    problems = summary["finish_reason_problems"]
    return {
        "no_5xx": _check(summary["server_errors"] == 0, f"{summary['server_errors']} server errors"),
        "no_errors": _check(summary["errors"] == 0, f"{summary['errors']} failed requests"),
        "finish_reasons": _check(not problems, f"{len(problems)} inconsistent" if problems else "all consistent"),
        "kv_blocks_free": _check(all(v == 0 for v in run.gauges.values()), json.dumps(run.gauges)),
        "rss_flat": _check(growth is not None and growth <= args.max_rss_growth_mb,
                           f"growth {growth} MiB (limit {args.max_rss_growth_mb})"),
        "served": _check(summary["completed"] > 0, f"{summary['completed']} completed"),
    }


def summarize(run: Run, args: argparse.Namespace) -> dict[str, Any]:
    outcomes = run.outcomes
    failed = [o for o in outcomes if o.error]
    completed = [o for o in outcomes if not o.error and not o.cancelled]
    problems = [(o, p) for o in completed if (p := finish_problem(o, run.max_model_len))]
    ttfts = [o.ttft * 1000 for o in outcomes if o.ttft is not None]
    first, second = rss_halves(run.rss, args.duration)
    ends = [(o.started_at + (o.latency or 0.0), (o.prompt_tokens or 0) + (o.completion_tokens or 0)) for o in completed]
    filled_at, rss_filled = rss_once_filled([*run.rss, (run.elapsed, run.rss_after)], ends, run.kv_tokens)
    tokens = sum(o.completion_tokens or 0 for o in completed)
    summary: dict[str, Any] = {
        "clients": args.clients, "duration_s": args.duration, "elapsed_s": round(run.elapsed, 2),
        "requests": len(outcomes),
        "completed": len(completed), "cancelled": sum(o.cancelled for o in outcomes), "errors": len(failed),
        "server_errors": sum(o.server_error for o in outcomes),
        "non_speculative": sum(not o.plan.body["speculative"] for o in outcomes),
        "finish_reasons": dict(Counter(str(o.finish_reason) for o in completed)),
        "requests_per_s": round(len(completed) / run.elapsed, 2),
        "output_tokens_per_s": round(tokens / run.elapsed, 1),
        "ttft_ms": {"p50": round(percentile(ttfts, 50), 1), "p99": round(percentile(ttfts, 99), 1)},
        "rss_first_half_mib": first, "rss_second_half_mib": second,
        "rss_growth_mib": None if first is None or second is None else round(second - first, 1),
        "rss_after_mib": run.rss_after, "rss_source": run.rss_source, "kv_pool_tokens": run.kv_tokens,
        "kv_filled_at_s": None if filled_at is None else round(filled_at, 1), "rss_kv_filled_mib": rss_filled,
        "preemptions": run.preemptions, "spec_decode": run.spec_decode, "kv_after": run.gauges,
        "error_samples": [f"{n}x {e}" for e, n in Counter(o.error for o in failed).most_common(5)],
        "finish_reason_problems": [f"{o.plan.route}: {p}" for o, p in problems[:5]],
        "timeline": timeline(run, args.duration / args.windows, args.windows),
    }
    summary["checks"] = checks(run, summary, args)
    summary["ok"] = all(c["ok"] for c in summary["checks"].values())
    return summary


def timeline(run: Run, window: float, count: int) -> list[dict[str, Any]]:
    """Per window of the load: requests started, their p99 latency and TTFT, peak RSS (a
    soak shows drift here: latency or memory that climbs window after window)."""
    rows = []
    for k in range(count):
        lo, hi = k * window, (k + 1) * window
        done = [o for o in run.outcomes if lo <= o.started_at < hi and not o.error and not o.cancelled]
        rss = [mib for t, mib in run.rss if lo <= t < hi]
        rows.append({"start_s": round(lo), "requests": len(done),
                     "p99_latency_s": round(percentile([o.latency or 0.0 for o in done], 99), 2),
                     "p99_ttft_ms": round(percentile([1000 * (o.ttft or 0.0) for o in done], 99), 1),
                     "rss_peak_mib": max(rss) if rss else None})
    return rows


def report_table(summary: dict[str, Any]) -> str:
    rows: list[list[Any]] = [
        ["clients / duration / elapsed (s)",
         f"{summary['clients']} / {summary['duration_s']} / {summary['elapsed_s']}"],
        ["requests (completed / cancelled / failed)",
         f"{summary['requests']} ({summary['completed']} / {summary['cancelled']} / {summary['errors']})"],
        ["non-speculative requests", summary["non_speculative"]],
        ["finish reasons", ", ".join(f"{k} {v}" for k, v in sorted(summary["finish_reasons"].items()))],
        ["requests/s, output tokens/s", f"{summary['requests_per_s']}, {summary['output_tokens_per_s']}"],
        ["TTFT p50 / p99 (ms)", f"{summary['ttft_ms']['p50']} / {summary['ttft_ms']['p99']}"],
        ["RSS first / second half peak (MiB)",
         f"{_mib(summary['rss_first_half_mib'])} / {_mib(summary['rss_second_half_mib'])}"],
        ["RSS growth (MiB), after the run", f"{summary['rss_growth_mib']}, {_mib(summary['rss_after_mib'])}"],
        ["RSS once the KV cache was filled (MiB; at s)", f"{_mib(summary['rss_kv_filled_mib'])}; "
                                                          f"{summary['kv_filled_at_s']}"],
        ["preemptions", summary["preemptions"]],
        ["draft acceptance rate", _ratio(summary["spec_decode"].get("acceptance_rate"))],
    ]
    rows += [[f"check {name}", ("PASS " if c["ok"] else "FAIL ") + c["detail"]]
             for name, c in summary["checks"].items()]
    return markdown_table(["load test", "value"], rows)


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


# ---- a server of our own -----------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was healthy")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"the server was not healthy within {timeout:.0f} s")


def serve_command(args: argparse.Namespace, port: int) -> list[str]:
    command = [sys.executable, "-m", "specdec.cli", "serve", args.start_server, "--port", str(port)]
    if args.speculative_config:
        command += ["--speculative-config", args.speculative_config]
    return command + shlex.split(args.server_args)


@contextlib.contextmanager
def own_server(args: argparse.Namespace) -> Iterator[tuple[str, int, int | None]]:
    """`specdec serve` in a subprocess: (base url, pid, KV pool tokens); SIGTERM on the way out."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with contextlib.ExitStack() as stack:
        # The stack closes the log file after the server has stopped.
        log = stack.enter_context(open(args.server_log, "w+b") if args.server_log  # noqa: SIM115
                                  else tempfile.TemporaryFile())  # noqa: SIM115
        proc = subprocess.Popen(serve_command(args, port), stdout=log, stderr=subprocess.STDOUT)
        stack.callback(_stop, proc)
        try:
            _wait_healthy(url, proc, args.startup_timeout)
        except RuntimeError:
            log.seek(0)
            sys.stderr.write(log.read()[-4000:].decode(errors="replace"))
            raise
        started = os.pread(log.fileno(), os.fstat(log.fileno()).st_size, 0)  # no seek: the server writes at its offset
        yield url, proc.pid, kv_pool_tokens(started.decode(errors="replace"))


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)  # the server drains, then exits
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# ---- main --------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="a running server (unless --start-server)")
    parser.add_argument("--start-server", nargs="?", const=DEFAULT_MODEL, default=None, metavar="MODEL",
                        help=f"start `specdec serve MODEL` (default {DEFAULT_MODEL}) for the run")
    parser.add_argument("--speculative-config", default=None, help="with --start-server: the server's JSON config")
    parser.add_argument("--server-args", default="", help="with --start-server: more `specdec serve` arguments")
    parser.add_argument("--server-log", default=None, help="with --start-server: write the server's log here")
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds during which requests start")
    parser.add_argument("--cancel-fraction", type=float, default=0.2, help="share closed mid-stream")
    parser.add_argument("--no-spec-fraction", type=float, default=0.25, help='share sent with "speculative": false')
    parser.add_argument("--chat-fraction", type=float, default=0.5, help="share sent to /v1/chat/completions")
    parser.add_argument("--min-prompt-words", type=int, default=4)
    parser.add_argument("--max-prompt-words", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=128, help="max_tokens is uniform in [1, this]")
    parser.add_argument("--max-rss-growth-mb", type=float, default=64.0)
    parser.add_argument("--windows", type=int, default=6, help="the timeline's windows over the load")
    parser.add_argument("--rss-interval", type=float, default=0.5, help="seconds between RSS samples")
    parser.add_argument("--settle-timeout", type=float, default=30.0, help="wait this long for KV to drain")
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request HTTP timeout")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-json", default=None, help="also write the JSON summary here")
    args = parser.parse_args(argv)
    check_local(args.base_url)
    if args.clients < 1 or args.duration <= 0 or not 1 <= args.min_prompt_words <= args.max_prompt_words:
        parser.error("need --clients >= 1, --duration > 0 and 1 <= --min-prompt-words <= --max-prompt-words")
    for name in ("cancel_fraction", "no_spec_fraction", "chat_fraction"):
        if not 0.0 <= getattr(args, name) <= 1.0:
            parser.error(f"--{name.replace('_', '-')} must be in [0, 1]")
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    with contextlib.ExitStack() as stack:
        base_url, pid, kv_tokens = args.base_url, None, None
        if args.start_server:
            base_url, pid, kv_tokens = stack.enter_context(own_server(args))
        result = asyncio.run(load(base_url, pid, args))
        result.kv_tokens = kv_tokens
    return summarize(result, args)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    summary = run(args)
    print(json.dumps(summary, indent=2))
    print(report_table(summary))
    print(markdown_table(["from s", "requests", "p99 latency s", "p99 TTFT ms", "RSS peak MiB"],
                         [list(row.values()) for row in summary["timeline"]]))
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
