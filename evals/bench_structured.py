"""JSON-schema extraction on the default model: constrained plain decoding against
speculation with grammar-forced drafts, side by side in one process.

    python evals/bench_structured.py --rounds 3 --methods ngram,draft_model

Each round runs every method over all prompts (batch 1, greedy), in alternating order, so
machine noise hits them alike. A drafter's cross-request cache (suffix decoding) starts
each round empty: it may draft from earlier prompts of the round, not from the same
prompt's answer in an earlier round. Reported: tokens/s per method, its speedup over
constrained plain decoding, steps per output token, and whether every output is
token-identical to plain's and valid for its schema.
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
from typing import Any

from specdec.evals.bench_latency import PRESETS
from specdec.evals.common import markdown_table, timed
from specdec.llm import LLM
from specdec.model_registry import DEFAULT_MODEL
from specdec.outputs import RequestOutput
from specdec.sampling_params import SamplingParams, StructuredOutputsParams


def _object(properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


STRING, INTEGER = {"type": "string"}, {"type": "integer"}
# (instruction with its input text, schema): the kind of extraction a user sends.
TASKS: list[tuple[str, dict[str, Any]]] = [
    ("Extract the person: Maria Lopez is a 34 year old civil engineer who lives in Madrid, Spain.",
     _object({"name": STRING, "age": INTEGER, "occupation": STRING, "city": STRING, "country": STRING})),
    ("Extract the order: Order #A-2291 was placed by John Carter on 2024-03-12 for 3 units of the "
     "Blue Widget at $19.99 each, shipped to 14 Elm Street, Springfield.",
     _object({"order_id": STRING, "customer": STRING, "date": STRING, "product": STRING,
              "quantity": INTEGER, "unit_price": {"type": "number"}, "address": STRING})),
    ("Extract the meeting: The quarterly budget review with Priya Shah and Tom Becker is on Friday "
     "at 3 pm in room 4B; bring the Q3 spending report.",
     _object({"title": STRING, "attendees": {"type": "array", "items": STRING}, "day": STRING,
              "time": STRING, "room": STRING, "bring": STRING})),
    ("Extract the book: 'The Silent River' by Elena Novak, published by Harbor Press in 2019, "
     "312 pages, genre: literary fiction.",
     _object({"title": STRING, "author": STRING, "publisher": STRING, "year": INTEGER, "pages": INTEGER,
              "genre": STRING})),
    ("Extract the support ticket: Customer Ana Silva (ana.silva@example.com) reports that the mobile "
     "app crashes on login since version 5.2.1; priority high.",
     _object({"customer": STRING, "email": STRING, "problem": STRING, "version": STRING,
              "priority": {"enum": ["low", "medium", "high"]}})),
    ("Extract the flight: Flight LH 454 from Frankfurt (FRA) to San Francisco (SFO) departs at 13:40 "
     "from gate B22 and arrives at 16:05 local time.",
     _object({"flight": STRING, "from_city": STRING, "from_code": STRING, "to_city": STRING,
              "to_code": STRING, "departs": STRING, "gate": STRING, "arrives": STRING})),
]


def run(llm: LLM, max_tokens: int) -> tuple[list[list[int]], list[str], float, int]:
    """(token ids, texts, seconds, engine steps) over every task, one request at a time."""
    ids, texts, seconds = [], [], 0.0
    steps_before = llm.get_metrics()["num_steps"]
    if llm.engine.drafter is not None:  # no round drafts from an earlier round's answers to the same prompts
        llm.engine.drafter.forget_cached()
    for prompt, schema in TASKS:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                structured_outputs=StructuredOutputsParams(json=schema))
        out, took = timed(functools.partial(_chat, llm, prompt, params))
        seconds += took
        ids.append(list(out.outputs[0].token_ids))
        texts.append(out.outputs[0].text)
    return ids, texts, seconds, llm.get_metrics()["num_steps"] - steps_before


def _chat(llm: LLM, prompt: str, params: SamplingParams) -> RequestOutput:
    return llm.chat([{"role": "user", "content": prompt}], params)[0]


def _valid(text: str, schema: dict[str, Any]) -> bool:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return isinstance(value, dict) and set(value) == set(schema["properties"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--methods", default="ngram,draft_model", help=f"speculative presets of {sorted(PRESETS)}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=160)
    args = parser.parse_args()
    names = ["plain", *args.methods.split(",")]
    engines = {name: LLM(args.model, speculative_config=PRESETS[name]) for name in names}
    for llm in engines.values():  # compile kernels and grammars before timing
        run(llm, 8)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    results: dict[str, tuple[list[list[int]], list[str], int]] = {}
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else reversed(names):
            ids, texts, took, steps = run(engines[name], args.max_tokens)
            seconds[name].append(took)
            results[name] = (ids, texts, steps)
    plain_ids, plain_texts, _ = results["plain"]
    num_tokens = sum(len(t) for t in plain_ids)
    plain_rate = num_tokens / statistics.median(seconds["plain"])
    rows = []
    for name in names:
        ids, texts, steps = results[name]
        rate = sum(len(t) for t in ids) / statistics.median(seconds[name])
        valid = sum(_valid(t, schema) for t, (_, schema) in zip(texts, TASKS))
        rows.append([name, rate, rate / plain_rate, steps / sum(len(t) for t in ids), ids == plain_ids,
                     f"{valid}/{len(TASKS)}"])
    print(f"{len(TASKS)} extraction prompts, {num_tokens} output tokens, median of {args.rounds} rounds")
    print(markdown_table(["method", "tok/s", "vs plain", "steps/token", "identical to plain", "valid JSON"], rows))
    for text in plain_texts:
        print(text)


if __name__ == "__main__":
    main()
