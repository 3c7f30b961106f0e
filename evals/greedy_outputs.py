"""Greedy outputs of several speculative configs over every evals/prompts category, as
JSON, and the comparison of two such files: the check that a change left outputs alone.

    python evals/greedy_outputs.py dump before.json     # in the old worktree
    python evals/greedy_outputs.py dump after.json      # in the new one
    python evals/greedy_outputs.py compare before.json after.json

Prompts run batched through one engine per config (chat template, temperature 0).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from specdec.evals.common import ALL_CATEGORIES, load_prompts
from specdec.llm import LLM
from specdec.model_registry import DEFAULT_MODEL
from specdec.sampling_params import SamplingParams

# Every prompt file: the latency categories and the conversation ones.
CATEGORIES = (*ALL_CATEGORIES, "edit_loop", "template_extraction", "tool_call")

WEIGHTS = Path(__file__).resolve().parents[1] / "drafters" / "weights"
CONFIGS: dict[str, dict[str, Any] | str | None] = {
    "plain": None,
    "default": "auto",  # the engine's default speculation (adaptive hybrid drafting with the shipped heads)
    "ngram": {"method": "ngram", "num_speculative_tokens": 5},
    "suffix": {"method": "suffix", "num_speculative_tokens": 8, "num_tree_nodes": 8},
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 4, "model": str(WEIGHTS / "smollm2-135m-draft")},
    "draft_tree": {"method": "draft_model", "num_speculative_tokens": 4, "num_tree_nodes": 6,
                   "model": str(WEIGHTS / "smollm2-135m-draft")},
    "medusa": {"method": "medusa", "num_speculative_tokens": 4, "model": str(WEIGHTS / "smollm2-135m-medusa")},
    "medusa_rec_tree6": {"method": "medusa", "num_speculative_tokens": 6, "num_tree_nodes": 6,
                         "model": str(WEIGHTS / "smollm2-135m-medusa-recurrent")},
    "ngram_adaptive": {"method": "ngram", "num_speculative_tokens": 5, "adaptive": True},
    "eagle3_tree16": {"method": "eagle3", "num_speculative_tokens": 6, "num_tree_nodes": 16,
                      "model": str(WEIGHTS / "smollm2-135m-eagle3")},
    "default_eagle3": {"method": "hybrid", "num_speculative_tokens": 16, "num_tree_nodes": 16, "adaptive": True,
                       "model": str(WEIGHTS / "smollm2-135m-eagle3")},
}


def dump(path: Path, model: str, max_tokens: int, configs: list[str]) -> None:
    prompts = [(c, p) for c in CATEGORIES for p in load_prompts(c, 1000)]
    outputs: dict[str, list[list[int]]] = {}
    for name in configs:
        start = time.perf_counter()
        llm = LLM(model, speculative_config=CONFIGS[name])
        results = llm.chat([[{"role": "user", "content": p}] for _, p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=max_tokens))
        outputs[name] = [list(r.outputs[0].token_ids) for r in results]
        print(f"{name}: {len(prompts)} prompts in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    path.write_text(json.dumps({"categories": [c for c, _ in prompts], "outputs": outputs}))


def compare(before: Path, after: Path) -> bool:
    old, new = json.loads(before.read_text()), json.loads(after.read_text())
    same_everywhere = True
    for name, outputs in old["outputs"].items():
        if name not in new["outputs"]:
            continue
        same = sum(a == b for a, b in zip(outputs, new["outputs"][name], strict=True))
        same_everywhere &= same == len(outputs)
        print(f"{name}: {same}/{len(outputs)} identical")
    return same_everywhere


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    dump_cmd = sub.add_parser("dump")
    dump_cmd.add_argument("output", type=Path)
    dump_cmd.add_argument("--model", default=DEFAULT_MODEL)
    dump_cmd.add_argument("--max-tokens", type=int, default=48)
    dump_cmd.add_argument("--configs", default=",".join(CONFIGS), help=f"a comma list of {', '.join(CONFIGS)}")
    compare_cmd = sub.add_parser("compare")
    compare_cmd.add_argument("before", type=Path)
    compare_cmd.add_argument("after", type=Path)
    args = parser.parse_args(argv)
    if args.command == "dump":
        unknown = [c for c in args.configs.split(",") if c not in CONFIGS]
        if unknown:
            parser.error(f"unknown configs {unknown}; known: {', '.join(CONFIGS)}")
        dump(args.output, args.model, args.max_tokens, args.configs.split(","))
        return 0
    return 0 if compare(args.before, args.after) else 1


if __name__ == "__main__":
    sys.exit(main())
