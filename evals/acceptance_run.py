"""The engine side of `specdec eval acceptance`: configs and prompts in, one `PromptResult`
per (config, temperature, prompt) out, each prompt generated plain and speculative on the
same `LLM`, with the engine's own counters around every generation, and a journal that
lets a killed run resume.

Requests run in sequence through one engine per config, as a server would see them: every
conversation turn is one request, in file order, category after category, so drafters
with state shared across requests (suffix decoding's cache) draft later prompts from
earlier answers. The warm-up asks a prompt of its own, so no measured prompt was answered
before it is measured. Plain runs never reach the drafter, so only the speculative runs
feed such a cache. With several temperatures, every prompt comes again at each one, and
a cache has seen its earlier answers: compare cross-request drafters one temperature at a
time. A resumed run skips finished prompts, so a cache misses their answers.
"""
from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdec.metrics import EngineMetrics

if TYPE_CHECKING:  # heavy imports stay inside functions so that building the CLI is cheap
    from specdec.llm import LLM
    from specdec.sampling_params import SamplingParams

PROMPTS_DIR = Path(__file__).resolve().parent / "prompts"
DEFAULT_DRAFT = "smollm2-135m-draft"  # a name resolve_draft_dir finds in drafters/weights
DEFAULT_MEDUSA = "smollm2-135m-medusa"  # heads shipped in drafters/weights
PRESETS: dict[str, dict[str, Any]] = {
    "ngram-k3": {"method": "ngram", "num_speculative_tokens": 3},
    "ngram-k5": {"method": "ngram", "num_speculative_tokens": 5},
    "draft-k3": {"method": "draft_model", "num_speculative_tokens": 3},
    "draft-k5": {"method": "draft_model", "num_speculative_tokens": 5},
    "medusa": {"method": "medusa", "num_speculative_tokens": 4},
    "suffix-k5": {"method": "suffix", "num_speculative_tokens": 5},
    "suffix-tree": {"method": "suffix", "num_speculative_tokens": 8, "num_tree_nodes": 12},
}
# The warm-up's conversation: none of the measured prompts, which a cross-request drafter
# would otherwise have seen answered before they are measured.
WARM_UP_TURNS = ["Name three colours of the rainbow."]

Prompts = dict[str, list[dict[str, Any]]]  # category -> items with "id" and "turns"
Template = Callable[[list[dict[str, str]]], list[int]]
Generate = Callable[[list[int]], tuple[list[int], str]]
MakeLLM = Callable[..., "LLM"]
Key = tuple[str, float, str, str]  # config label, temperature, category, prompt id


@dataclass
class Run:
    """One conversation generated one way (plain, speculative, or an HF baseline)."""

    token_ids: list[list[int]]  # one list per assistant turn
    texts: list[str]
    seconds: float
    counters: EngineMetrics | None = None  # what the engine counted during it; None for HF

    @property
    def num_tokens(self) -> int:
        return sum(len(ids) for ids in self.token_ids)

    def to_record(self) -> dict[str, Any]:
        return {"token_ids": self.token_ids, "texts": self.texts, "seconds": self.seconds,
                "counters": None if self.counters is None else self.counters.counters()}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Run:
        counters = record.get("counters")
        return cls(record["token_ids"], record["texts"], record["seconds"],
                   None if counters is None else EngineMetrics.from_dict(counters))


@dataclass
class PromptResult:
    config: str
    temperature: float
    category: str
    prompt_id: str
    spec: Run
    plain: Run

    @property
    def key(self) -> Key:
        return self.config, self.temperature, self.category, self.prompt_id

    def to_record(self) -> dict[str, Any]:
        return {"config": self.config, "temperature": self.temperature, "category": self.category,
                "id": self.prompt_id, "spec": self.spec.to_record(), "plain": self.plain.to_record()}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> PromptResult:
        return cls(*record_key(record), spec=Run.from_record(record["spec"]), plain=Run.from_record(record["plain"]))


def record_key(record: dict[str, Any]) -> Key:
    return record["config"], record["temperature"], record["category"], record["id"]


# ---- configs and prompts -----------------------------------------------------------------


def parse_configs(specs: list[str], draft_model: str | None, model: str) -> dict[str, dict[str, Any]]:
    """Label -> speculative_config, from preset names ("default": what the engine runs when
    given none, for `model` on the CPU) or JSON strings."""
    configs: dict[str, dict[str, Any]] = {}
    for spec in specs:
        if spec == "default":
            label, config = spec, default_config(model)
        elif spec in PRESETS:
            label, config = spec, dict(PRESETS[spec])
        else:
            config = json.loads(spec)
            label = config.pop("name", None) or _default_label(config)
        if config.get("method") == "draft_model" and not config.get("model"):
            config["model"] = draft_model or DEFAULT_DRAFT
        if config.get("method") == "medusa" and not config.get("model"):
            config["model"] = str(_shipped_weights(DEFAULT_MEDUSA))
        if label in configs:
            raise ValueError(f"two configs are labelled {label!r}; add a \"name\" to the JSON")
        configs[label] = config
    return configs


def default_config(model: str) -> dict[str, Any]:
    """The engine's default speculative_config for `model` on the CPU, as the keys that
    differ from SpeculativeConfig's defaults."""
    import dataclasses

    import torch

    from specdec.config import SpeculativeConfig, default_speculative_config

    config = default_speculative_config(model, torch.device("cpu"))
    assert config is not None
    defaults = SpeculativeConfig(method=config.method)
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
            if f.name == "method" or getattr(config, f.name) != getattr(defaults, f.name)}


def _shipped_weights(name: str) -> Path:
    import importlib.util

    spec = importlib.util.find_spec("specdec.drafters")  # located, not imported
    assert spec is not None and spec.origin is not None
    return Path(spec.origin).parent / "weights" / name


def _default_label(config: dict[str, Any]) -> str:
    return f"{config.get('method')}-k{config.get('num_speculative_tokens', 5)}"


def load_prompts(sources: list[str] | None, num_prompts: int | None) -> Prompts:
    """Category -> prompt items (each with "id" and "turns"), in file order."""
    paths = [_prompt_path(s) for s in sources] if sources else sorted(PROMPTS_DIR.glob("*.jsonl"))
    prompts: Prompts = {}
    for path in paths:
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                item = json.loads(line)
                _check_item(item, path)
                prompts.setdefault(item.get("category", path.stem), []).append(item)
    return {cat: items[:num_prompts] for cat, items in prompts.items()}


def _prompt_path(source: str) -> Path:
    path = Path(source) if source.endswith(".jsonl") else PROMPTS_DIR / f"{source}.jsonl"
    if not path.is_file():
        known = ", ".join(p.stem for p in sorted(PROMPTS_DIR.glob("*.jsonl")))
        raise FileNotFoundError(f"no prompt file {path}; known categories: {known}")
    return path


def _check_item(item: dict[str, Any], path: Path) -> None:
    turns = item.get("turns")
    if "id" not in item or not turns or not all(isinstance(t, str) and t for t in turns):
        raise ValueError(f"{path}: every line needs an 'id' and non-empty string 'turns': {item}")


# ---- generation --------------------------------------------------------------------------


def default_llm(model: str, speculative_config: dict[str, Any] | None, args: argparse.Namespace) -> LLM:
    from specdec.llm import LLM

    return LLM(model, speculative_config=speculative_config, max_model_len=args.max_model_len,
               dtype=args.dtype, seed=args.seed, quantization=args.quantization)


def engine_counters(llm: LLM) -> EngineMetrics:
    return EngineMetrics.from_dict(llm.get_metrics())


def converse(turns: list[str], template: Template, generate: Generate) -> Run:
    """Send the user turns one by one, each after the model's answer to the previous one.

    Only the generate calls are timed: applying the chat template is the same for every
    method and is not decoding work.
    """
    messages: list[dict[str, str]] = []
    token_ids, texts, seconds = [], [], 0.0
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        prompt = template(messages)
        start = time.perf_counter()
        ids, text = generate(prompt)
        seconds += time.perf_counter() - start
        messages.append({"role": "assistant", "content": text})
        token_ids.append(ids)
        texts.append(text)
    return Run(token_ids, texts, seconds)


def engine_run(llm: LLM, turns: list[str], params: SamplingParams, speculative: bool) -> Run:
    def generate(prompt: list[int]) -> tuple[list[int], str]:
        out = llm.generate([prompt], params, use_speculation=speculative)[0].outputs[0]
        return list(out.token_ids), out.text

    before = engine_counters(llm)
    run = converse(turns, llm.apply_chat_template, generate)
    run.counters = engine_counters(llm) - before
    return run


def sampling_params(temperature: float, max_tokens: int, seed: int) -> SamplingParams:
    from specdec.sampling_params import SamplingParams

    # Seeded so that plain and speculative runs of one prompt draw from the same stream.
    return SamplingParams(temperature=temperature, max_tokens=max_tokens,
                          seed=None if temperature == 0 else seed)


def warm_up(llm: LLM, count: int) -> EngineMetrics:
    """First calls pay one-off costs (allocations, lazy init); keep them out of the timings."""
    params = sampling_params(0.0, 8, 0)
    runs = [engine_run(llm, WARM_UP_TURNS, params, speculative) for _ in range(count) for speculative in (False, True)]
    return sum((r.counters for r in runs if r.counters), EngineMetrics())


def plan(label: str, prompts: Prompts, temperatures: list[float]) -> list[tuple[Key, int, dict[str, Any]]]:
    """Every (key, index in category, item) one config generates, in run order."""
    return [((label, t, category, item["id"]), index, item)
            for t in temperatures for category, items in prompts.items() for index, item in enumerate(items)]


def evaluate_config(llm: LLM | None, label: str, prompts: Prompts, args: argparse.Namespace, bar: Any,
                    journal: Journal) -> list[PromptResult]:
    results = []
    for turn, (key, index, item) in enumerate(plan(label, prompts, args.temperatures)):
        result = journal.get(key)
        if result is None:
            assert llm is not None, "an engine is built whenever a prompt is pending"
            params = sampling_params(key[1], args.max_tokens, args.seed + index)
            result = run_prompt(llm, key, item["turns"], params, plain_first=turn % 2 == 0, bar=bar)
            journal.add(result)
        else:
            bar.update(2)
        results.append(result)
    return results


def run_prompt(llm: LLM, key: Key, turns: list[str], params: SamplingParams, plain_first: bool,
               bar: Any) -> PromptResult:
    runs: dict[bool, Run] = {}
    # Both runs find the prefix cache as the first found it (what earlier prompts left, as
    # in a server): the second must not reuse the first's prefill of the same prompt.
    blocks = llm.engine.block_manager
    cached_before = set(blocks.cached)
    # Alternate who goes first, so drift in machine load favours neither.
    for speculative in ((False, True) if plain_first else (True, False)):
        blocks.forget_cached(cached_before)
        runs[speculative] = engine_run(llm, turns, params, speculative)
        bar.update(1)
    return PromptResult(*key, spec=runs[True], plain=runs[False])


class Journal:
    """prompts.jsonl in the report dir, one line per finished prompt: a run that is killed
    keeps its work, and `--resume` continues it (reusing only records of the same setup)."""

    def __init__(self, path: Path | None, resume: bool) -> None:
        self.path = path
        self.setups: dict[str, dict[str, Any]] = {}
        self.done: dict[Key, tuple[dict[str, Any], PromptResult]] = {}
        if path is not None and resume and path.is_file():
            for line in path.read_text().splitlines():
                record = json.loads(line)
                self.done[record_key(record)] = (record["setup"], PromptResult.from_record(record))
        elif path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("")

    def set_setup(self, label: str, setup: dict[str, Any]) -> None:
        self.setups[label] = setup

    def get(self, key: Key) -> PromptResult | None:
        setup, result = self.done.get(key, (None, None))
        return result if setup == self.setups[key[0]] else None

    def add(self, result: PromptResult) -> None:
        if self.path is not None:
            record = {**result.to_record(), "setup": self.setups[result.config]}
            with self.path.open("a") as fh:
                fh.write(json.dumps(record) + "\n")
