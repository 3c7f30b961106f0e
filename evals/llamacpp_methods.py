"""What specdec runs in the llama.cpp comparison (evals/bench_llamacpp.py): its methods
and variants, the engines for them, and the chat prompts both engines get."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specdec.evals.bench_latency import PRESETS
from specdec.evals.common import INPUT_GROUNDED, load_prompts
from specdec.llm import LLM

METHODS: dict[str, dict[str, Any] | str | None] = {
    "plain": None,
    "default": "auto",  # what the engine runs when given no speculative_config
    "ngram": {"method": "ngram", "num_speculative_tokens": 5},
    "suffix": {"method": "suffix", "num_speculative_tokens": 8, "num_tree_nodes": 12, "adaptive": True},
    "medusa-rec-tree6": PRESETS["medusa-rec-tree6"],
}
DEFAULT_METHODS = "plain,default,ngram,suffix,medusa-rec-tree6,plain@none"
GROUPS = {"input-grounded": INPUT_GROUNDED,
          "other": ("mt_bench", "qa", "math_reasoning", "code:complete", "translation")}
KV_CACHE_MEMORY = 1 << 28  # per batch-1 engine: five engines live at once
LLAMACPP = "llama.cpp"


@dataclass(frozen=True)
class Prompt:
    category: str
    group: str
    ids: list[int]


def chat_prompts(llm: LLM, num_prompts: int) -> list[Prompt]:
    """num_prompts first turns of every category, grouped, as chat token ids."""
    return [Prompt(category, group, llm.apply_chat_template([{"role": "user", "content": text}]))
            for group, categories in GROUPS.items() for category in categories
            for text in load_prompts(category, num_prompts)]


# "name@variant": how specdec runs the file (quantization, quantized_activations).
VARIANTS = {"gguf": ("gguf", "float32"), "none": ("none", "float32"), "int8": ("gguf", "int8")}
VARIANT_LABELS = {"gguf": "", "none": " (dequantized)", "int8": " (int8 activations)"}


def parse_method(method: str) -> tuple[str, dict[str, Any] | str | None, tuple[str, str]]:
    """"name", "name@none" or "name@int8" -> (label, speculative config, (quantization,
    quantized_activations))."""
    name, at, variant = method.partition("@")
    variant = variant if at else "gguf"
    if name not in METHODS or variant not in VARIANTS:
        raise SystemExit(f"unknown method {method!r}: one of {', '.join(METHODS)}, optionally with "
                         f"@{' | @'.join(v for v in VARIANTS if v != 'gguf')}")
    return f"specdec {name}{VARIANT_LABELS[variant]}", METHODS[name], VARIANTS[variant]


def build_engines(model: Path, args: argparse.Namespace) -> dict[str, LLM]:
    engines = {}
    for method in args.methods:
        label, speculative, (quantization, activations) = parse_method(method)
        engines[label] = LLM(str(model), quantization=quantization, quantized_activations=activations,
                             speculative_config=speculative, max_model_len=args.max_model_len,
                             kv_cache_memory=KV_CACHE_MEMORY)
    torch.set_num_threads(args.threads)  # an engine build may set its own
    return engines

def dash(value: Any) -> Any:
    return "-" if value is None else value



def load() -> float:
    return os.getloadavg()[0]
