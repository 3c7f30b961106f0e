"""Shared pieces of the benchmark scripts: prompt sets, timing, tables."""
from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

PROMPTS_DIR = Path(__file__).parent / "prompts"
# The input-grounded tasks: summarise this text, extract from this text, rewrite
# this code (code completion is not: its answer is not in the prompt).
INPUT_GROUNDED = ("summarization", "rag", "code:rewrite")
# Every category the latency benchmarks run by default, input-grounded first.
ALL_CATEGORIES = (*INPUT_GROUNDED, "code:complete", "qa", "math_reasoning", "translation", "mt_bench")
# Workloads whose repetition spans requests (an edit loop printing its answer again, one
# extraction template over many inputs, JSON tool calls): they measure drafters that share
# a cache across requests (suffix decoding), so they are meant to run in sequence through
# one engine, as `specdec eval acceptance` runs them. Not in ALL_CATEGORIES: the latency
# benchmarks send first turns only, and greedy_outputs dumps stay comparable.
CROSS_REQUEST = ("edit_loop", "template_extraction", "tool_call")


def load_prompts(category: str, limit: int) -> list[str]:
    """First-turn user messages of one category's prompt file; "code:rewrite" keeps the
    prompts of that file whose subcategory is "rewrite"."""
    name, _, subcategory = category.partition(":")
    path = PROMPTS_DIR / f"{name}.jsonl"
    items = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if subcategory:
        items = [item for item in items if item.get("subcategory") == subcategory]
    return [item["turns"][0] for item in items if "turns" in item][:limit]


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def markdown_table(headers: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else 0.0
