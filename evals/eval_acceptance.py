"""Acceptance-rate evaluation of speculative decoding: `specdec eval acceptance`.

For one target model and a list of speculative configs, every prompt of the chosen
categories is generated twice per config and temperature: plain and speculative, on
the same `LLM` instance (same weights, same kernels), alternating which goes first so
that machine noise hits both equally. Conversations run one at a time (batch size 1, as
in Spec-Bench); multi-turn items send turn 1, append the model's own answer, then send
turn 2. Reported per config x temperature x category:

- acceptance rate (accepted / drafted), mean accepted length tau (tokens committed per
  verify step, bonus/recovered token included), acceptance per draft position;
- tokens/s (output tokens / wall time of the generate calls, prefill included) and the
  speedup over plain decoding measured in the same run;
- at temperature 0, how many conversations differ from plain decoding (must be 0).

Spec counters are deltas of `llm.get_metrics()` around each generation, so the
per-category numbers plus the warm-up add up exactly to the engine's own totals.
`--hf-baselines` also times Hugging Face transformers on the same prompts (greedy,
prompt lookup, assisted generation) against our plain decoding, interleaved per prompt.

    specdec eval acceptance --configs ngram-k3 ngram-k5 --temperatures 0 --num-prompts 3
    python evals/eval_acceptance.py --configs '{"method": "ngram", "num_speculative_tokens": 4}'
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # heavy imports stay inside functions so that building the CLI is cheap
    from specdec.llm import LLM
    from specdec.sampling_params import SamplingParams

EVALS_DIR = Path(__file__).resolve().parent
PROMPTS_DIR = EVALS_DIR / "prompts"
DEFAULT_DRAFT = "smollm2-135m-draft"  # a name resolve_draft_dir finds in drafters/weights
DEFAULT_MEDUSA = "smollm2-135m-medusa"  # heads shipped in drafters/weights
PRESETS: dict[str, dict[str, Any]] = {
    "ngram-k3": {"method": "ngram", "num_speculative_tokens": 3},
    "ngram-k5": {"method": "ngram", "num_speculative_tokens": 5},
    "draft-k3": {"method": "draft_model", "num_speculative_tokens": 3},
    "draft-k5": {"method": "draft_model", "num_speculative_tokens": 5},
    "medusa": {"method": "medusa", "num_speculative_tokens": 4},
}
# Counters that add up across generations (the rest of get_metrics() are gauges or ratios).
ADDITIVE = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_prompt_tokens",
            "num_generation_tokens", "num_steps")
PER_POS = "num_accepted_tokens_per_pos"

Counters = dict[str, Any]  # ADDITIVE ints + PER_POS list
Template = Callable[[list[dict[str, str]]], list[int]]
Generate = Callable[[list[int]], tuple[list[int], str]]
MakeLLM = Callable[..., "LLM"]


@dataclass
class Run:
    """One conversation generated one way (plain, speculative, or an HF baseline)."""

    token_ids: list[list[int]]  # one list per assistant turn
    texts: list[str]
    seconds: float
    counters: Counters | None = None  # engine counter deltas; None for HF

    @property
    def num_tokens(self) -> int:
        return sum(len(ids) for ids in self.token_ids)


@dataclass
class PromptResult:
    config: str
    temperature: float
    category: str
    prompt_id: str
    spec: Run
    plain: Run


@dataclass
class HFResult:
    category: str
    prompt_id: str
    runs: dict[str, Run] = field(default_factory=dict)  # method -> run


# ---- arguments ---------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from specdec.model_registry import DEFAULT_MODEL

    parser.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    parser.add_argument("--configs", nargs="+", default=["ngram-k3", "ngram-k5"],
                        help=f"presets ({', '.join(PRESETS)}) or speculative_config JSON; "
                             'a "name" key in the JSON labels it')
    parser.add_argument("--prompts", nargs="+", default=None,
                        help="categories (files in evals/prompts) or .jsonl paths; default: all")
    parser.add_argument("--num-prompts", type=int, default=None, help="first N prompts per category")
    parser.add_argument("--temperatures", nargs="+", type=float, default=[0.0])
    parser.add_argument("--max-tokens", type=int, default=128, help="per assistant turn")
    parser.add_argument("--draft-model", default=None,
                        help=f"draft dir/name for draft_model configs without one (default {DEFAULT_DRAFT}) "
                             "and for HF assisted generation")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=0, help="engine seed; prompt i samples with seed+i")
    parser.add_argument("--warmup", type=int, default=1, help="warm-up conversations per config (not reported)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--hf-baselines", action="store_true",
                        help="also time HF transformers greedy / prompt lookup / assisted generation")
    parser.add_argument("--hf-num-tokens", type=int, default=5,
                        help="prompt_lookup_num_tokens and num_assistant_tokens for the HF baselines")
    parser.add_argument("--out", type=Path, default=None, help="report dir (default evals/results/<timestamp>)")
    parser.add_argument("--resume", action="store_true",
                        help="reuse the finished prompts recorded in --out/prompts.jsonl by an earlier run")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eval_acceptance", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return parser


def parse_configs(specs: list[str], draft_model: str | None) -> dict[str, dict[str, Any]]:
    """Label -> speculative_config, from preset names or JSON strings."""
    configs: dict[str, dict[str, Any]] = {}
    for spec in specs:
        if spec in PRESETS:
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


def _shipped_weights(name: str) -> Path:
    import importlib.util

    spec = importlib.util.find_spec("specdec.drafters")  # located, not imported
    assert spec is not None and spec.origin is not None
    return Path(spec.origin).parent / "weights" / name


def _default_label(config: dict[str, Any]) -> str:
    return f"{config.get('method')}-k{config.get('num_speculative_tokens', 5)}"


def load_prompts(sources: list[str] | None, num_prompts: int | None) -> dict[str, list[dict[str, Any]]]:
    """Category -> prompt items (each with "id" and "turns"), in file order."""
    paths = [_prompt_path(s) for s in sources] if sources else sorted(PROMPTS_DIR.glob("*.jsonl"))
    prompts: dict[str, list[dict[str, Any]]] = {}
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


# ---- counters ----------------------------------------------------------------------------


def zero_counters() -> Counters:
    return {**{key: 0 for key in ADDITIVE}, PER_POS: []}


def counter_delta(after: dict[str, Any], before: dict[str, Any]) -> Counters:
    delta: Counters = {key: after[key] - before[key] for key in ADDITIVE}
    delta[PER_POS] = [a - b for a, b in zip(after[PER_POS], before[PER_POS])]
    return delta


def add_counters(a: Counters, b: Counters) -> Counters:
    total: Counters = {key: a[key] + b[key] for key in ADDITIVE}
    width = max(len(a[PER_POS]), len(b[PER_POS]))
    total[PER_POS] = [_at(a[PER_POS], i) + _at(b[PER_POS], i) for i in range(width)]
    return total


def _at(values: list[int], index: int) -> int:
    return values[index] if index < len(values) else 0


def sum_counters(items: Iterable[Counters]) -> Counters:
    total = zero_counters()
    for item in items:
        total = add_counters(total, item)
    return total


def spec_rates(counters: Counters) -> dict[str, Any]:
    """Acceptance rate, tau and per-position acceptance, with the engine's own formulas."""
    drafts = max(counters["num_drafts"], 1)
    return {
        "acceptance_rate": counters["num_accepted_tokens"] / max(counters["num_draft_tokens"], 1),
        "mean_accepted_length": 1.0 + counters["num_accepted_tokens"] / drafts,
        "acceptance_per_pos": [n / drafts for n in counters[PER_POS]],
    }


# ---- generation --------------------------------------------------------------------------


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

    before = llm.get_metrics()
    run = converse(turns, llm.apply_chat_template, generate)
    run.counters = counter_delta(llm.get_metrics(), before)
    return run


def sampling_params(temperature: float, max_tokens: int, seed: int) -> SamplingParams:
    from specdec.sampling_params import SamplingParams

    # Seeded so that plain and speculative runs of one prompt draw from the same stream.
    return SamplingParams(temperature=temperature, max_tokens=max_tokens,
                          seed=None if temperature == 0 else seed)


def warm_up(llm: LLM, prompts: dict[str, list[dict[str, Any]]], count: int) -> Counters:
    """First calls pay one-off costs (allocations, lazy init); keep them out of the timings."""
    first = next(iter(prompts.values()))[0]["turns"][:1]
    params = sampling_params(0.0, 8, 0)
    runs = [engine_run(llm, first, params, speculative) for _ in range(count) for speculative in (False, True)]
    return sum_counters(r.counters for r in runs if r.counters)


Key = tuple[str, float, str, str]  # config label, temperature, category, prompt id


def plan(label: str, prompts: dict[str, list[dict[str, Any]]],
         temperatures: list[float]) -> list[tuple[Key, int, dict[str, Any]]]:
    """Every (key, index in category, item) one config generates, in run order."""
    return [((label, t, category, item["id"]), index, item)
            for t in temperatures for category, items in prompts.items() for index, item in enumerate(items)]


def evaluate_config(llm: LLM | None, label: str, prompts: dict[str, list[dict[str, Any]]],
                    args: argparse.Namespace, bar: Any, journal: Journal) -> list[PromptResult]:
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
    # Alternate who goes first, so drift in machine load favours neither.
    for speculative in ((False, True) if plain_first else (True, False)):
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
                self.done[_key(record)] = (record["setup"], _from_record(record))
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
            record = {**_prompt_record(result), "setup": self.setups[result.config]}
            with self.path.open("a") as fh:
                fh.write(json.dumps(record) + "\n")


def _key(record: dict[str, Any]) -> Key:
    return record["config"], record["temperature"], record["category"], record["id"]


def _from_record(record: dict[str, Any]) -> PromptResult:
    return PromptResult(*_key(record), spec=Run(**record["spec"]), plain=Run(**record["plain"]))


# ---- summaries ---------------------------------------------------------------------------


def summarise(results: list[PromptResult]) -> dict[str, Any]:
    """Every number of one (config, temperature, category) cell."""
    spec = sum_counters(r.spec.counters for r in results if r.spec.counters)
    plain = sum_counters(r.plain.counters for r in results if r.plain.counters)
    summary: dict[str, Any] = {"num_prompts": len(results), **{k: spec[k] for k in ADDITIVE}, PER_POS: spec[PER_POS]}
    summary.update(spec_rates(spec))
    summary.update(_throughput("spec", [r.spec for r in results]))
    summary.update(_throughput("plain", [r.plain for r in results]))
    summary["plain_num_steps"] = plain["num_steps"]
    # Output tokens per target forward pass (prefill steps included): what speculation buys
    # before the cost of a wider verify pass, counting steps where no draft was found.
    summary["spec_tokens_per_step"] = spec["num_generation_tokens"] / max(spec["num_steps"], 1)
    summary["plain_tokens_per_step"] = plain["num_generation_tokens"] / max(plain["num_steps"], 1)
    summary["speedup"] = summary["spec_tokens_per_s"] / max(summary["plain_tokens_per_s"], 1e-9)
    greedy = all(r.temperature == 0 for r in results)
    summary["mismatches"] = sum(r.spec.token_ids != r.plain.token_ids for r in results) if greedy else None
    return summary


def _throughput(prefix: str, runs: list[Run]) -> dict[str, float]:
    tokens = sum(r.num_tokens for r in runs)
    seconds = sum(r.seconds for r in runs)
    return {f"{prefix}_tokens": tokens, f"{prefix}_seconds": seconds,
            f"{prefix}_tokens_per_s": tokens / max(seconds, 1e-9)}


def summary_rows(results: list[PromptResult]) -> list[dict[str, Any]]:
    """One row per (config, temperature, category), each group closed by an "all" row."""
    cells: dict[tuple[str, float], dict[str, list[PromptResult]]] = {}
    for r in results:
        cells.setdefault((r.config, r.temperature), {}).setdefault(r.category, []).append(r)
    rows = []
    for (config, temperature), by_category in cells.items():
        everything = [r for group in by_category.values() for r in group]
        for category, group in [*by_category.items(), ("all", everything)]:
            rows.append({"config": config, "temperature": temperature, "category": category, **summarise(group)})
    return rows


# ---- Hugging Face baselines --------------------------------------------------------------


def load_hf_models(model_dir: Path, draft: str | None, dtype: Any) -> tuple[Any, Any]:
    """The target, and the assistant (None without a draft) with the target's embeddings
    filled in when its checkpoint leaves them out (as our distilled drafts do)."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    if not draft:
        return target, None
    from specdec.drafters.draft_model import resolve_draft_dir

    loaded: Any = AutoModelForCausalLM.from_pretrained(
        str(resolve_draft_dir(draft)), dtype=dtype, output_loading_info=True)
    assistant, info = loaded
    if any("embed_tokens" in key or "lm_head" in key for key in info["missing_keys"]):
        assistant.set_input_embeddings(target.get_input_embeddings())
        assistant.tie_weights()
    return target, assistant.eval()


def hf_generators(llm: LLM, target: Any, assistant: Any, max_tokens: int, num_tokens: int) -> dict[str, Generate]:
    """Method name -> generate function, ours first (the reference), all greedy."""
    from specdec.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    tokenizer = llm.get_tokenizer()
    eos = sorted(llm.engine.eos_token_ids)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    config = {"max_new_tokens": max_tokens, "do_sample": False, "eos_token_id": eos, "pad_token_id": pad}

    def ours(prompt: list[int]) -> tuple[list[int], str]:
        ids = list(llm.generate([prompt], params, use_speculation=False)[0].outputs[0].token_ids)
        # Decoded like the HF runs (the engine's incremental detokenizer holds back a trailing
        # partial UTF-8 sequence), so that equal tokens give equal second-turn prompts.
        return ids, tokenizer.decode(ids, skip_special_tokens=True)

    methods: dict[str, Generate] = {"specdec-plain": ours,
                                    "hf-greedy": _hf_generate(target, tokenizer, config),
                                    "hf-prompt-lookup": _hf_generate(target, tokenizer, config,
                                                                     prompt_lookup_num_tokens=num_tokens)}
    if assistant is not None:
        methods["hf-assisted"] = _hf_generate(target, tokenizer, config, assistant_model=assistant,
                                              num_assistant_tokens=num_tokens,
                                              num_assistant_tokens_schedule="constant")
    return methods


def _hf_generate(model: Any, tokenizer: Any, config: dict[str, Any], **extra: Any) -> Generate:
    import torch
    from transformers import GenerationConfig

    assistant = extra.pop("assistant_model", None)
    generation_config = GenerationConfig(**config, **extra)

    def generate(prompt: list[int]) -> tuple[list[int], str]:
        input_ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                 generation_config=generation_config, assistant_model=assistant)
        ids = out[0, len(prompt):].tolist()
        return ids, tokenizer.decode(ids, skip_special_tokens=True)

    return generate


def run_hf_baselines(llm: LLM, prompts: dict[str, list[dict[str, Any]]], args: argparse.Namespace,
                     bar: Any) -> list[HFResult]:
    import torch

    dtype = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
             "fp16": torch.float16}.get(args.dtype, torch.float32)  # the engine's names for its dtypes
    target, assistant = load_hf_models(llm.model_dir, args.draft_model, dtype)
    methods = hf_generators(llm, target, assistant, args.max_tokens, args.hf_num_tokens)
    names = list(methods)
    first = next(iter(prompts.values()))[0]["turns"][:1]
    for _ in range(args.warmup):  # one-off costs out of the timings, as for the engine runs
        for name in names:
            converse(first, llm.apply_chat_template, methods[name])
    results, turn = [], 0
    for category, items in prompts.items():
        for item in items:
            runs: dict[str, Run] = {}
            shift = turn % len(names)  # rotate the order per prompt, as for plain vs speculative
            for name in names[shift:] + names[:shift]:
                runs[name] = converse(item["turns"], llm.apply_chat_template, methods[name])
                bar.update(1)
            turn += 1
            results.append(HFResult(category, item["id"], {name: runs[name] for name in names}))
    return results


def hf_rows(results: list[HFResult]) -> list[dict[str, Any]]:
    """Per (method, category) and "all": tokens/s, speedup over our plain decoding, mismatches."""
    groups: dict[str, list[HFResult]] = {}
    for r in results:
        groups.setdefault(r.category, []).append(r)
    groups["all"] = list(results)
    rows = []
    for category, group in groups.items():
        reference = _throughput("", [r.runs["specdec-plain"] for r in group])["_tokens_per_s"]
        for method in group[0].runs:
            stats = _throughput("", [r.runs[method] for r in group])
            rows.append({"method": method, "category": category, "num_prompts": len(group),
                         "tokens": stats["_tokens"], "seconds": stats["_seconds"],
                         "tokens_per_s": stats["_tokens_per_s"],
                         "speedup_vs_specdec_plain": stats["_tokens_per_s"] / max(reference, 1e-9),
                         "mismatches_vs_specdec_plain": sum(
                             r.runs[method].token_ids != r.runs["specdec-plain"].token_ids for r in group)})
    return rows


# ---- the whole evaluation ----------------------------------------------------------------


def default_llm(model: str, speculative_config: dict[str, Any] | None, args: argparse.Namespace) -> LLM:
    from specdec.llm import LLM

    return LLM(model, speculative_config=speculative_config, max_model_len=args.max_model_len,
               dtype=args.dtype, seed=args.seed)


def evaluate(args: argparse.Namespace, make_llm: MakeLLM | None = None) -> dict[str, Any]:
    """Run everything; return the report (every number) as a JSON-able dict."""
    from tqdm import tqdm

    make_llm = make_llm or default_llm
    configs = parse_configs(args.configs, args.draft_model)
    prompts = load_prompts(args.prompts, args.num_prompts)
    num_prompts = sum(len(items) for items in prompts.values())
    hf_methods = (4 if args.draft_model else 3) if args.hf_baselines else 0
    total = (2 * len(configs) * len(args.temperatures) + hf_methods) * num_prompts
    bar = tqdm(total=total, desc="eval acceptance", unit="gen")
    journal = Journal(args.out / "prompts.jsonl" if args.out else None, args.resume)
    results: list[PromptResult] = []
    config_info: dict[str, Any] = {}
    llm = None
    for label, config in configs.items():
        bar.set_postfix_str(label)
        journal.set_setup(label, {"model": args.model, "speculative_config": config, "max_tokens": args.max_tokens,
                                  "dtype": args.dtype, "seed": args.seed})
        pending = [key for key, _, _ in plan(label, prompts, args.temperatures) if journal.get(key) is None]
        llm = None  # free the previous engine (weights + KV cache) before building the next
        llm = make_llm(args.model, config, args) if pending else None
        warmup = warm_up(llm, prompts, args.warmup) if llm and args.warmup else zero_counters()
        results += evaluate_config(llm, label, prompts, args, bar, journal)
        config_info[label] = {"speculative_config": config, "warmup_counters": warmup,
                              "engine_totals": _engine_totals(llm) if llm else None,
                              "num_resumed_prompts": len(plan(label, prompts, args.temperatures)) - len(pending)}
    hf: list[HFResult] = []
    if args.hf_baselines:
        llm = llm or make_llm(args.model, None, args)  # a plain engine when everything was resumed
        hf = run_hf_baselines(llm, prompts, args, bar)
    bar.close()
    return build_report(args, configs, config_info, results, hf, llm)


def _engine_totals(llm: LLM) -> dict[str, Any]:
    metrics = llm.get_metrics()
    return {**{key: metrics[key] for key in ADDITIVE}, PER_POS: list(metrics[PER_POS])}


def build_report(args: argparse.Namespace, configs: dict[str, Any], config_info: dict[str, Any],
                 results: list[PromptResult], hf: list[HFResult], llm: LLM | None) -> dict[str, Any]:
    import torch

    meta = {"model": args.model, "model_dir": str(llm.model_dir) if llm else None,
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"), "max_tokens": args.max_tokens,
            "temperatures": args.temperatures, "num_prompts_per_category": args.num_prompts,
            "dtype": args.dtype, "seed": args.seed, "warmup": args.warmup, "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "machine": platform.platform(),
            "configs": list(configs)}
    return {
        "meta": meta,
        "configs": config_info,
        "results": summary_rows(results),
        "prompts": [_prompt_record(r) for r in results],
        "hf_baselines": {"num_tokens": args.hf_num_tokens, "draft_model": args.draft_model,
                         "results": hf_rows(hf) if hf else [],
                         "prompts": [{"category": r.category, "id": r.prompt_id,
                                      "runs": {m: asdict(run) for m, run in r.runs.items()}} for r in hf]},
    }


def _prompt_record(r: PromptResult) -> dict[str, Any]:
    return {"config": r.config, "temperature": r.temperature, "category": r.category, "id": r.prompt_id,
            "spec": asdict(r.spec), "plain": asdict(r.plain)}


# ---- reports -----------------------------------------------------------------------------


def write_reports(report: dict[str, Any], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "results.json", out / "report.md"]
    paths[0].write_text(json.dumps(report, indent=1) + "\n")
    paths[1].write_text(markdown(report))
    return paths + write_plots(report, out)


def markdown(report: dict[str, Any]) -> str:
    meta = report["meta"]
    setup = (f"{meta['timestamp']} · max_tokens {meta['max_tokens']} per turn · "
             f"{meta['num_prompts_per_category'] or 'all'} prompts per category · {meta['dtype']} · "
             f"torch {meta['torch']}, {meta['torch_threads']} threads · batch size 1")
    lines = [f"# Acceptance-rate evaluation: {meta['model']}", "", setup, ""]
    for temperature in meta["temperatures"]:
        rows = [r for r in report["results"] if r["temperature"] == temperature]
        lines += [f"## Temperature {temperature:g}", "", *markdown_table(rows), ""]
    if report["hf_baselines"]["results"]:
        note = ("Speedup is tokens/s over our plain decoding of the same prompts, interleaved per prompt. "
                f"Prompt lookup / assistant tokens: {report['hf_baselines']['num_tokens']}.")
        lines += ["## Hugging Face transformers baselines (greedy)", "", note, "",
                  *hf_table(report["hf_baselines"]["results"]), ""]
    return "\n".join(lines)


def markdown_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [("| config | category | prompts | drafts | acc. rate | τ | acceptance per position | "
              "spec tok/s | plain tok/s | speedup | ≠ plain |"),
             "|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        per_pos = " / ".join(f"{p:.2f}" for p in r["acceptance_per_pos"])
        mismatches = "–" if r["mismatches"] is None else str(r["mismatches"])
        category = f"**{r['category']}**" if r["category"] == "all" else r["category"]
        lines.append(f"| {r['config']} | {category} | {r['num_prompts']} | {r['num_drafts']} | "
                     f"{r['acceptance_rate']:.3f} | {r['mean_accepted_length']:.2f} | {per_pos} | "
                     f"{r['spec_tokens_per_s']:.1f} | {r['plain_tokens_per_s']:.1f} | {r['speedup']:.2f}× | "
                     f"{mismatches} |")
    return lines


def hf_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| method | category | prompts | tokens | tok/s | speedup vs specdec plain | ≠ specdec plain |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['category']} | {r['num_prompts']} | {r['tokens']} | "
                     f"{r['tokens_per_s']:.1f} | {r['speedup_vs_specdec_plain']:.2f}× | "
                     f"{r['mismatches_vs_specdec_plain']} |")
    return lines


def write_plots(report: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    paths = []
    for temperature in report["meta"]["temperatures"]:
        rows = [r for r in report["results"] if r["temperature"] == temperature]
        paths.append(plot_acceptance_curves(rows, out / f"acceptance_curves_T{temperature:g}.png", temperature))
        paths.append(plot_speedups(rows, out / f"speedup_T{temperature:g}.png", temperature))
    if report["hf_baselines"]["results"]:
        paths.append(plot_hf(report["hf_baselines"]["results"], out / "hf_baselines.png"))
    return paths


def plot_acceptance_curves(rows: list[dict[str, Any]], path: Path, temperature: float) -> Path:
    """One panel per category, one line per config: P(draft position i accepted)."""
    import matplotlib.pyplot as plt

    categories = _ordered(r["category"] for r in rows)
    cols = min(4, len(categories))
    nrows = -(-len(categories) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(3.2 * cols, 2.8 * nrows), squeeze=False, sharey=True)
    for ax, category in zip(axes.flat, categories):
        for r in (r for r in rows if r["category"] == category):
            positions = range(1, len(r["acceptance_per_pos"]) + 1)
            ax.plot(positions, r["acceptance_per_pos"], marker="o", label=r["config"])
        ax.set_title(category)
        ax.set_xticks(range(1, 1 + max((len(r["acceptance_per_pos"]) for r in rows), default=1)))
        ax.set_xlabel("draft position")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(categories):]:
        ax.axis("off")
    axes[0][0].set_ylabel("acceptance")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"Per-position acceptance, temperature {temperature:g}")
    return _save(fig, path)


def plot_speedups(rows: list[dict[str, Any]], path: Path, temperature: float) -> Path:
    """Grouped bars: categories on x, one bar per config; 1.0 = plain decoding."""
    configs = _ordered(r["config"] for r in rows)
    values = {(r["config"], r["category"]): r["speedup"] for r in rows}
    return _bars(configs, _ordered(r["category"] for r in rows), values, path,
                 f"Speedup over plain decoding, temperature {temperature:g}")


def plot_hf(rows: list[dict[str, Any]], path: Path) -> Path:
    methods = _ordered(r["method"] for r in rows)
    values = {(r["method"], r["category"]): r["speedup_vs_specdec_plain"] for r in rows}
    return _bars(methods, _ordered(r["category"] for r in rows), values, path,
                 "HF transformers vs specdec plain decoding (greedy)")


def _bars(series: list[str], categories: list[str], values: dict[tuple[str, str], float],
          path: Path, title: str) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(categories) * max(1, len(series)) ** 0.5), 3.6))
    width = 0.8 / max(len(series), 1)
    for i, name in enumerate(series):
        xs = [c + (i - (len(series) - 1) / 2) * width for c in range(len(categories))]
        ax.bar(xs, [values.get((name, cat), 0.0) for cat in categories], width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(categories)), categories, rotation=20)
    ax.set_ylabel("speedup (×)")
    ax.set_title(title)
    ax.legend(fontsize=7)
    return _save(fig, path)


def _ordered(values: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(values))


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---- entry point -------------------------------------------------------------------------


def main(args: argparse.Namespace | list[str] | None = None) -> dict[str, Any]:
    if not isinstance(args, argparse.Namespace):
        args = build_parser().parse_args(args)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    args.out = args.out or Path("evals/results") / time.strftime("%Y%m%d-%H%M%S")
    report = evaluate(args)
    paths = write_reports(report, args.out)
    for temperature in args.temperatures:  # the headline: every config over all categories
        rows = [r for r in report["results"] if r["category"] == "all" and r["temperature"] == temperature]
        print(f"temperature {temperature:g}", *markdown_table(rows), sep="\n")
    print(f"reports: {', '.join(str(p) for p in paths)}")
    return report


if __name__ == "__main__":
    main()
