"""What speculation costs a step when it drafts nothing: the default engine's steps that
verified no draft node against plain decoding's steps, on the same prompts.

    python evals/bench_step_cost.py --categories qa,mt_bench --num-prompts 10 --max-tokens 96

Both engines decode each prompt once (greedy, batch 1), alternating prompt by prompt in one
process so machine noise hits them alike. Every step is timed whole (`LLMEngine.step`) and
in its forward (the executor's run); a default step is "idle" when no request in it had a
draft node verified. Reported: the median step of each kind, the idle default step over the
plain one (the promise: at most 1.01), and the microseconds each spends outside the
forward (scheduling, drafting, verifying, committing).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from specdec.evals.common import load_prompts, markdown_table
from specdec.llm import LLM
from specdec.model_registry import DEFAULT_MODEL
from specdec.sampling_params import SamplingParams


@dataclass
class Steps:
    """Per decode step (one request, one token known): seconds whole and in the forward."""

    idle: list[tuple[float, float]] = field(default_factory=list)  # no draft node verified
    drafted: list[tuple[float, float]] = field(default_factory=list)


def instrument(llm: LLM, steps: Steps) -> None:
    """Time every decode step of `llm`'s engine into `steps`."""
    engine = llm.engine
    runner, step = engine.runner, engine.step
    forward = {"seconds": 0.0, "rows": 0, "decode": False}
    run = runner.execute

    def timed_run(batch: Any, trees: Any, feed: Any = None) -> Any:
        start = time.perf_counter()
        output = run(batch, trees, feed)
        forward["seconds"] = time.perf_counter() - start
        forward["rows"] = sum(tree.num_drafts for tree in trees)
        forward["decode"] = all(item.num_new_tokens == 1 for item in batch)
        return output

    def timed_step() -> Any:
        forward.update(seconds=0.0, rows=0, decode=False)
        start = time.perf_counter()
        outputs = step()
        seconds = time.perf_counter() - start
        if forward["decode"]:
            (steps.drafted if forward["rows"] else steps.idle).append((seconds, float(forward["seconds"])))
        return outputs

    runner.execute = timed_run  # type: ignore[method-assign]
    engine.step = timed_step  # type: ignore[method-assign]


def summary(name: str, samples: list[tuple[float, float]]) -> list[Any]:
    if not samples:
        return [name, 0, None, None]
    whole = statistics.median(s for s, _ in samples)
    outside = statistics.mean(s - f for s, f in samples)
    return [name, len(samples), whole * 1e3, outside * 1e6]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--categories", default="qa,mt_bench", type=lambda s: s.split(","))
    parser.add_argument("--num-prompts", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args(argv)
    engines = {"plain": LLM(args.model, speculative_config=None), "default": LLM(args.model)}
    steps = {name: Steps() for name in engines}
    for name, llm in engines.items():
        instrument(llm, steps[name])
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    prompts = [p for category in args.categories for p in load_prompts(category, args.num_prompts)]
    for prompt in prompts:  # each prompt once per engine, the engines alternating
        for llm in engines.values():
            llm.chat([[{"role": "user", "content": prompt}]], params, use_tqdm=False)
    rows = [summary("plain", steps["plain"].idle), summary("default, nothing drafted", steps["default"].idle),
            summary("default, drafted", steps["default"].drafted)]
    plain_ms, idle_ms = rows[0][2], rows[1][2]
    ratio = idle_ms / plain_ms if plain_ms and idle_ms else None
    print(markdown_table(["steps", "count", "median ms", "mean µs outside the forward"], rows))
    print(f"idle default step / plain step: {ratio:.3f}" if ratio else "no idle steps")
    result = {"rows": rows, "idle_over_plain": ratio}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
