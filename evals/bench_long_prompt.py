"""A long prompt arriving among decoding streams: the streams' inter-token gaps and the
long prompt's time to first token, with prefill pacing at each target (0 = off).

    python evals/bench_long_prompt.py --targets 0,250 --long-tokens 4000 --streams 4

Runs the engine in-process (no HTTP), alternating targets round by round so machine
noise hits them alike.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from specdec.evals.common import markdown_table
from specdec.llm import LLM
from specdec.sampling_params import SamplingParams

FILLER = "The quick brown fox jumps over the lazy dog while the committee reviews the budget. "


def measure(llm: LLM, long_tokens: int, streams: int) -> dict[str, float]:
    engine = llm.engine
    tokenizer = engine.tokenizer
    params = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
    for i in range(streams):
        engine.add_request(f"stream-{i}", tokenizer.encode(f"Story {i}: tell me a long story."), params)
    while any(not r.is_decoding for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # every stream past its prefill
    long_ids = (tokenizer.encode(FILLER) * (long_tokens // 10 + 1))[:long_tokens]
    engine.add_request("long", long_ids, SamplingParams(temperature=0.0, max_tokens=1))
    start = last = time.perf_counter()
    gaps: list[float] = []
    ttft = 0.0
    while not ttft:
        outputs = engine.step()
        now = time.perf_counter()
        if any(o.request_id.startswith("stream-") for o in outputs):
            gaps.append(now - last)
            last = now
        if any(o.request_id == "long" for o in outputs):
            ttft = now - start
    for i in range(streams):
        engine.abort_request(f"stream-{i}")
    return {"max_gap_s": max(gaps), "p50_gap_s": statistics.median(gaps), "long_ttft_s": ttft,
            "steps": float(len(gaps))}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--targets", default="0,250", help="prefill_step_target_ms values to compare")
    parser.add_argument("--long-tokens", type=int, default=4000)
    parser.add_argument("--streams", type=int, default=4, help="requests decoding while the long prompt arrives")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = parser.parse_args(argv)
    targets = [float(t) for t in args.targets.split(",")]
    engines = {t: LLM(args.model, max_model_len=args.long_tokens + 512, prefill_step_target_ms=t,
                      max_num_batched_tokens=args.max_num_batched_tokens) for t in targets}
    results: dict[float, list[dict[str, float]]] = {t: [] for t in targets}
    for _ in range(args.rounds):
        for target, llm in engines.items():
            results[target].append(measure(llm, args.long_tokens, args.streams))
    rows: list[list[Any]] = []
    for target, runs in results.items():
        rows.append([f"{target:g}", max(r["max_gap_s"] for r in runs), statistics.fmean(r["p50_gap_s"] for r in runs),
                     statistics.fmean(r["long_ttft_s"] for r in runs), statistics.fmean(r["steps"] for r in runs)])
    print(markdown_table(["prefill_step_target_ms", "max gap s", "median gap s", "long TTFT s", "steps"], rows))
    print(json.dumps({f"{t:g}": runs for t, runs in results.items()}))


if __name__ == "__main__":
    main()
