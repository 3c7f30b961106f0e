"""Large grammars arriving among decoding streams: the streams' largest inter-token gap
while four requests with a huge `guided_choice` list arrive, and what those requests get.

    python evals/bench_grammar_stall.py --choices 100000 --streams 4

Runs the server's engine front (AsyncEngine, the path an HTTP request takes after parsing)
in-process on the default model, one case after another in one sitting:

- `limits`: the default limits; a list over max_guided_choices is refused before any work.
- `worker`: the size limits raised so the grammars really compile, on the compiler's
  worker threads, within max_grammar_compile_s.
- `engine-thread`: the control, the limits raised and the grammars compiled on the
  engine thread itself (what the server did before compiling ahead of admission).

Each case uses choice lists of its own, so no case finds another's grammar in the cache.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from specdec.async_engine import AsyncEngine
from specdec.evals.common import markdown_table
from specdec.llm import LLM
from specdec.sampling_params import SamplingParams, StructuredOutputsParams
from specdec.structured_output import GrammarLimits

CASES = ("limits", "worker", "engine-thread")


@dataclass
class Result:
    gaps: list[float] = field(default_factory=list)  # seconds between a stream's outputs while grammars are in flight
    outcomes: list[str] = field(default_factory=list)  # per grammar request: "ok" or its error
    grammar_seconds: list[float] = field(default_factory=list)  # arrival to answer (error or last token)


async def decode(stream: Any, result: Result, window: dict[str, float]) -> None:
    last = time.perf_counter()
    async for _ in stream:
        now = time.perf_counter()
        if window["start"] <= now and (window["end"] == 0 or last <= window["end"]):
            result.gaps.append(now - last)
        last = now


async def constrained(engine: AsyncEngine, request_id: str, choices: list[str], result: Result) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8,
                            structured_outputs=StructuredOutputsParams(choice=choices))
    start = time.perf_counter()
    try:
        async for _ in await engine.generate(request_id, "Pick one item:", params):
            pass
        result.outcomes.append("ok")
    except ValueError as error:
        result.outcomes.append(str(error))
    result.grammar_seconds.append(time.perf_counter() - start)


async def run_case(llm: LLM, case: str, args: argparse.Namespace) -> Result:
    grammars = llm.engine.grammars
    raised = GrammarLimits(compile_s=args.compile_s, max_choices=2 * args.choices, max_bytes=1 << 26)
    grammars.limits = GrammarLimits(compile_s=args.compile_s) if case == "limits" else raised
    engine = AsyncEngine(llm.engine)
    if case == "engine-thread":
        async def nothing_ahead(params: SamplingParams) -> None:  # the engine thread compiles on add
            return None
        engine.engine.compile_grammar = nothing_ahead  # type: ignore[method-assign]
    result, window = Result(), {"start": float("inf"), "end": 0.0}
    params = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)
    streams = [await engine.generate(f"{case}-s{i}", f"Story {i}: tell me a long story.", params)
               for i in range(args.streams)]
    decoders = [asyncio.create_task(decode(s, result, window)) for s in streams]
    lists = [[f"{case} list {j} item {k}" for k in range(args.choices)] for j in range(args.grammars)]
    await asyncio.sleep(args.warmup_s)  # every stream past its prefill
    window["start"] = time.perf_counter()
    await asyncio.gather(*(constrained(engine, f"{case}-g{j}", choices, result) for j, choices in enumerate(lists)))
    window["end"] = time.perf_counter()
    await asyncio.sleep(0.2)
    for stream in streams:
        stream.abort()
    await asyncio.gather(*decoders)
    await engine.shutdown(drain=False)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {CASES}")
    parser.add_argument("--choices", type=int, default=100_000, help="items of each guided_choice list")
    parser.add_argument("--grammars", type=int, default=4, help="grammar requests arriving together")
    parser.add_argument("--streams", type=int, default=4, help="requests decoding meanwhile")
    parser.add_argument("--compile-s", type=float, default=10.0, help="max_grammar_compile_s")
    parser.add_argument("--warmup-s", type=float, default=1.0)
    args = parser.parse_args(argv)
    llm = LLM(args.model)
    rows, raw = [], {}
    for case in args.cases.split(","):
        result = asyncio.run(run_case(llm, case, args))
        raw[case] = {"max_gap_s": max(result.gaps, default=0.0), "outcomes": result.outcomes,
                     "grammar_seconds": result.grammar_seconds}
        outcomes = sorted(set(o if o == "ok" else o.split(":", 1)[1].strip()[:60] for o in result.outcomes))
        rows.append([case, max(result.gaps, default=0.0), statistics.median(result.gaps) if result.gaps else 0.0,
                     len(result.gaps), max(result.grammar_seconds), "; ".join(outcomes)])
    print(markdown_table(["case", "max gap s", "median gap s", "outputs", "slowest grammar answer s",
                          "grammar outcomes"], rows))
    print(json.dumps(raw))


if __name__ == "__main__":
    main()
