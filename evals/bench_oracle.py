"""The most speculation can give on this machine: an oracle drafter that always guesses
the plain greedy continuation, per evals/prompts category, timed as the acceptance report
times it (whole conversations in sequence through one engine, prefill included).

Every oracle guess is right, so a step that verifies a chain of k guesses commits k + 1
tokens. What is left between that and k + 1 times plain speed is what a verify row costs
against a 1-token forward, and the prefill, which speculation does not touch. A category
whose ceiling here is under a target cannot reach it with any drafter, on this machine and
the same backends:

    .venv/bin/python evals/bench_oracle.py --depths 1,2,4,8,16 --num-prompts 4

Per conversation: a plain run (whose outputs the oracle then guesses), its prefills alone
(each turn's prompt with max_tokens=1), one oracle run per depth, and a second plain run;
plain time is the mean of the two. Every run starts from the prefix cache the
conversation found, as in the acceptance report. A row's "≠ plain" counts oracle runs
whose tokens differ from the plain run's (a broken exactness contract; expected 0).
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdec.drafters.base import Drafter, DraftRequest
from specdec.evals.acceptance_run import converse, load_prompts
from specdec.evals.common import markdown_table
from specdec.llm import LLM
from specdec.model_registry import DEFAULT_MODEL
from specdec.sampling_params import SamplingParams
from specdec.spec.tree import DraftTree


class OracleDrafter(Drafter):
    """Drafts the next `depth` tokens of `expected`, the sequence (prompt + plain output)
    the request is known to produce; the root alone once the request leaves it."""

    def __init__(self) -> None:
        self.expected: list[int] = []
        self.depth = 0
        self.num_misses = 0  # proposals for a request that had left `expected`

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        return [self._chain(r) for r in requests]

    def _chain(self, request: DraftRequest) -> DraftTree:
        known = len(request.token_ids)
        if self.expected[:known] != request.token_ids:
            self.num_misses += 1
            return DraftTree.chain([request.token_ids[-1]])
        depth = min(self.depth, request.num_draft_tokens, request.max_depth)
        return DraftTree.chain(request.token_ids[-1:] + self.expected[known:known + depth])


@dataclass
class Conversation:
    """One prompt item's turns as the plain run produced them."""

    prompts: list[list[int]] = field(default_factory=list)  # each turn's prompt token ids
    outputs: list[list[int]] = field(default_factory=list)  # each turn's plain output token ids

    @property
    def num_tokens(self) -> int:
        return sum(len(o) for o in self.outputs)


def run_plain(llm: LLM, turns: list[str], params: SamplingParams) -> tuple[Conversation, float]:
    """The conversation decoded plainly, and the seconds its generate calls took."""
    conversation = Conversation()

    def generate(prompt: list[int]) -> tuple[list[int], str]:
        out = llm.generate([prompt], params, use_speculation=False)[0].outputs[0]
        conversation.prompts.append(prompt)
        return list(out.token_ids), out.text

    run = converse(turns, llm.apply_chat_template, generate)
    conversation.outputs = run.token_ids
    return conversation, run.seconds


def replay(llm: LLM, conversation: Conversation, params: SamplingParams,
           oracle: OracleDrafter | None) -> tuple[list[list[int]], float]:
    """The conversation's prompts generated again, plainly or (oracle given) with the
    oracle expecting each turn's plain output; their outputs and seconds."""
    outputs, seconds = [], 0.0
    for prompt, expected in zip(conversation.prompts, conversation.outputs):
        if oracle is not None:
            oracle.expected = prompt + expected
        start = time.perf_counter()
        out = llm.generate([prompt], params, use_speculation=oracle is not None)[0].outputs[0]
        seconds += time.perf_counter() - start
        outputs.append(list(out.token_ids))
    return outputs, seconds


def prefill_seconds(llm: LLM, conversation: Conversation) -> float:
    """Seconds the conversation's prefills take: each turn's prompt with max_tokens=1, its
    earlier turns' answers first put in the prefix cache untimed, as decoding them had."""
    first = SamplingParams(temperature=0.0, max_tokens=1)
    seconds = 0.0
    for prompt, output in zip(conversation.prompts, conversation.outputs):
        start = time.perf_counter()
        llm.generate([prompt], first, use_speculation=False)
        seconds += time.perf_counter() - start
        llm.generate([prompt + output], first, use_speculation=False)
    return seconds


def measure(llm: LLM, oracle: OracleDrafter, turns: list[str], depths: list[int],
            max_tokens: int) -> dict[str, Any]:
    """Seconds of one conversation: plain (mean of two runs), prefill only, and the oracle
    at each depth; with its token count and the oracle runs that differed from plain."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    blocks = llm.engine.block_manager
    cached_before = set(blocks.cached)
    blocks.forget_cached(cached_before)
    conversation, plain = run_plain(llm, turns, params)
    blocks.forget_cached(cached_before)
    prefill = prefill_seconds(llm, conversation)
    oracle_seconds, differ = {}, 0
    for depth in depths:
        oracle.depth = depth
        blocks.forget_cached(cached_before)
        outputs, oracle_seconds[depth] = replay(llm, conversation, params, oracle)
        differ += outputs != conversation.outputs
    blocks.forget_cached(cached_before)
    _, plain_again = replay(llm, conversation, params, None)
    return {"tokens": conversation.num_tokens, "turns": len(turns), "plain": (plain + plain_again) / 2,
            "prefill": prefill, "oracle": oracle_seconds, "differ": differ}


def summarize(category: str, rows: list[dict[str, Any]], depths: list[int]) -> dict[str, Any]:
    """A category's sums: its plain seconds, prefill share, and speed-up per depth."""
    plain = sum(r["plain"] for r in rows)
    prefill = sum(r["prefill"] for r in rows)
    speedups = {d: plain / max(sum(r["oracle"][d] for r in rows), 1e-9) for d in depths}
    best = max(depths, key=lambda d: speedups[d])
    return {"category": category, "conversations": len(rows), "tokens": sum(r["tokens"] for r in rows),
            "plain_s": plain, "prefill_share": prefill / max(plain, 1e-9), "speedup": speedups,
            "best_depth": best, "best_speedup": speedups[best], "differ": sum(r["differ"] for r in rows)}


def build_llm(model: str, max_depth: int, max_model_len: int) -> tuple[LLM, OracleDrafter]:
    """An engine granting every step `max_depth` draft tokens (a fixed policy), whose
    drafter is the oracle: the engine's drafter is swapped after it is built, since no
    speculative_config names an oracle (no user should ask for one)."""
    llm = LLM(model, max_model_len=max_model_len,
              speculative_config={"method": "ngram", "num_speculative_tokens": max_depth})
    oracle = OracleDrafter()
    llm.engine.drafter = oracle
    return llm, oracle


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--categories", type=lambda s: s.split(","), default=None,
                        help="evals/prompts files (default: all)")
    parser.add_argument("--num-prompts", type=int, default=4, help="conversations per category")
    parser.add_argument("--depths", type=lambda s: [int(d) for d in s.split(",")], default=[1, 2, 4, 8, 16],
                        help="oracle chain lengths to time")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    if not args.depths or min(args.depths) < 1:
        parser.error("--depths must be positive integers")
    llm, oracle = build_llm(args.model, max(args.depths), args.max_model_len)
    measure(llm, oracle, ["Say hello."], [1], 4)  # warm up: kernel builds, first allocations
    prompts = load_prompts(args.categories, args.num_prompts)
    per_category = {cat: [measure(llm, oracle, item["turns"], args.depths, args.max_tokens) for item in items]
                    for cat, items in prompts.items()}
    summaries = [summarize(cat, rows, args.depths) for cat, rows in per_category.items()]
    summaries.append(summarize("all", [r for rows in per_category.values() for r in rows], args.depths))
    print(markdown_table(["category", "conversations", "tokens", "plain s", "prefill share",
                          *(f"k={d}" for d in args.depths), "≠ plain"],
                         [[s["category"], s["conversations"], s["tokens"], s["plain_s"], f"{s['prefill_share']:.0%}",
                           *(f"{s['speedup'][d]:.2f}×" for d in args.depths), s["differ"]] for s in summaries]))
    print(f"\noracle proposals for a request off its expected tokens: {oracle.num_misses}")
    if args.json is not None:
        args.json.write_text(json.dumps(summaries, indent=2) + "\n")
    return summaries


if __name__ == "__main__":
    main()
