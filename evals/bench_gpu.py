"""Our own GPU benchmark: plain decoding against the memory roofline, the verify cost per
row count, the oracle ceiling, transformers side by side and, where the default model's
GGUF is on the machine, every drafter per evals/prompts category.

    python evals/bench_gpu.py --shape 8b --out docs/bench_gpu_h100.md docs/bench_gpu_h100.json
    python evals/bench_gpu.py --shape tiny --device cpu --no-compile --out /tmp/b.json   # a quick check

Random-weight checkpoints of real shapes are made on the device (evals/gpu_checkpoint.py:
Llama-3.1-8B, Llama-3.2-1B, SmolLM2-135M, or a tiny one), prompts are token ids, nothing is
downloaded. Sections:

- plain: decode tokens per second at batch 1 and 16 (greedy, EOS ignored; (N-1) tokens over
  the time of N tokens less that of 1, so prefill is left out), the roofline (weight bytes a
  step reads, over the measured copy bandwidth: a device-to-device copy, bytes read plus
  written), each figure's fraction of it, and the time to first token of a long prompt;
- verify: one request's forward (with its logits) over T = 1..64 query rows, each captured
  as its own CUDA graph on a GPU, wall time relative to T = 1;
- oracle: bench_oracle's always-right drafter at each depth, tokens per second against plain
  (its verify steps replay the deepest depth's graph shape);
- transformers: eager, and static cache + `torch.compile` (`--no-compile`: static cache
  eager), batch 1, the same shape and random weights;
- drafters (when the default model's GGUF is here): tok/s, τ (tokens per verify step) and
  token identity with plain, per category, batch 1, first turns;
- idle (`--profile`, CUDA): the GPU's idle time per decode step from torch.profiler.

Every figure is measured, none needs a GPU to run: on the CPU (`--device cpu`, torch attention)
the same tables come out, meaningful as a check of the benchmark only.
"""
from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from specdec.config import DEFAULT_HEADS, default_speculative_config
from specdec.evals.bench_oracle import OracleDrafter
from specdec.evals.common import ALL_CATEGORIES, load_prompts, markdown_table
from specdec.evals.gpu_checkpoint import SHAPES, random_weights, write_checkpoint
from specdec.llm import LLM
from specdec.model_registry import DEFAULT_MODEL, KNOWN_MODELS, gguf_cache_dir
from specdec.model_runner import StepInputs, upload
from specdec.sampling_params import SamplingParams

VERIFY_ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 17, 24, 32, 48, 64)
DRAFTERS: dict[str, dict[str, Any] | None] = {  # what `drafters` times on the default model
    "plain": None,
    "ngram k=5": {"method": "ngram", "num_speculative_tokens": 5},
    "suffix, 16-node trees": {"method": "suffix", "num_speculative_tokens": 8, "num_tree_nodes": 16},
    "recurrent heads, 16-node tree": {"method": "medusa", "model": DEFAULT_HEADS, "num_speculative_tokens": 5,
                                      "num_tree_nodes": 16},
    "hybrid, 16-node tree": {"method": "hybrid", "model": DEFAULT_HEADS, "num_speculative_tokens": 16,
                             "num_tree_nodes": 16},
    "draft model k=5": {"method": "draft_model", "model": "smollm2-135m-draft", "num_speculative_tokens": 5},
    "Medusa-1 heads, tree": {"method": "medusa", "model": "smollm2-135m-medusa", "num_speculative_tokens": 4,
                             "num_tree_nodes": 16},
}
DRAFTER_MAX_MODEL_LEN = 4096  # evals/prompts' long inputs (summarization, rag) fit


class Rig:
    """What every section shares: the device, dtype, sizes and the engines' options."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.device = torch.device(args.device)
        self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        small = args.shape == "tiny"
        self.max_tokens = args.max_tokens or (16 if small else 128)
        self.prompt_len = 16 if small else 128
        self.long_prompt = 256 if small else 1024
        self.max_model_len = self.long_prompt + 2 * self.max_tokens + 64
        self.kv_bytes = args.kv_cache_memory or (1 << 24 if small else 4 << 30)
        self.compile = args.compile
        self.repeats = 3 if small else 20
        self.vocab = SHAPES[args.shape]["vocab_size"]

    def options(self, **more: Any) -> dict[str, Any]:
        """LLM keywords: the rig's, overridden by `more`."""
        return {"device": self.device.type, "dtype": self.dtype, "max_model_len": self.max_model_len,
                "kv_cache_memory": self.kv_bytes, "enable_prefix_caching": False,
                "attention_backend": "torch" if self.device.type == "cpu" else "auto", **more}

    def prompts(self, count: int, length: int, seed: int = 0) -> list[list[int]]:
        gen = torch.Generator().manual_seed(seed)
        return torch.randint(3, min(self.vocab, 1000), (count, length), generator=gen).tolist()

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def wall(self, fn: Callable[[], object], repeats: int = 1) -> float:
        """Seconds per call of fn, the device waited for."""
        self.sync()
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        self.sync()
        return (time.perf_counter() - start) / repeats


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def free() -> None:
    """Return what dropped engines held (call after the last reference went: one engine
    at a time on the device)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- plain decoding against the roofline ----------------------------------------------------------------------


def copy_bandwidth(rig: Rig) -> float:
    """Bytes per second of a device-to-device copy, read and written bytes both counted."""
    size = (1 << 30) if rig.device.type == "cuda" else (64 << 20)
    src = torch.empty(size, dtype=torch.uint8, device=rig.device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = rig.wall(lambda: dst.copy_(src), rig.repeats)
    return 2 * size / seconds


def weight_bytes(llm: LLM) -> int:
    """Bytes a decode step reads: every parameter once, but an untied embedding table (a
    step reads its few rows only)."""
    model = llm.engine.model
    seen, total = set(), 0
    embed = model.embed_tokens
    tied = embed.data_ptr() == model.lm_head_weight.data_ptr()
    for tensor in model.parameters():
        ptr = tensor.data_ptr()
        if ptr in seen or (ptr == embed.data_ptr() and not tied):
            continue
        seen.add(ptr)
        total += tensor.numel() * tensor.element_size()
    return total


def decode_rate(rig: Rig, llm: LLM, batch: int, use_speculation: bool = False) -> float:
    """Decode tokens per second of `batch` requests: N tokens' time less 1 token's."""
    prompts = rig.prompts(batch, rig.prompt_len, seed=batch)
    run = lambda n: llm.generate(prompts, greedy(n), use_speculation=use_speculation)  # noqa: E731
    run(rig.max_tokens)  # warm up
    one = min(rig.wall(lambda: run(1)) for _ in range(2))
    full = min(rig.wall(lambda: run(rig.max_tokens)) for _ in range(2))
    return batch * (rig.max_tokens - 1) / max(full - one, 1e-9)


def plain_section(rig: Rig, llm: LLM, bandwidth: float) -> dict[str, Any]:
    read = weight_bytes(llm)
    rows = []
    for batch in (1, 16):
        rate = decode_rate(rig, llm, batch)
        roofline = batch * bandwidth / read  # every step reads the weights once
        rows.append({"batch": batch, "tok_s": rate, "ms_per_step": 1000 * batch / rate, "roofline_tok_s": roofline,
                     "fraction_of_roofline": rate / roofline})
    prompt = rig.prompts(1, rig.long_prompt, seed=7)
    llm.generate(prompt, greedy(1))
    ttft = min(rig.wall(lambda: llm.generate(prompt, greedy(1))) for _ in range(2))
    return {"weight_bytes": read, "rows": rows, "ttft_prompt_tokens": rig.long_prompt, "ttft_ms": 1000 * ttft}


# ---- verify cost per row count -------------------------------------------------------------------------------


def verify_section(rig: Rig, llm: LLM) -> list[dict[str, Any]]:
    """One request's forward and logits over T rows after a 64-token context, on the engine's
    eager executor and KV cache (its blocks are free between requests), a CUDA graph per T
    on a GPU."""
    pool = torch.cuda.graph_pool_handle() if rig.device.type == "cuda" else None
    seconds = {rows: time_rows(rig, llm, rows, pool) for rows in VERIFY_ROWS}
    return [{"rows": rows, "ms": 1000 * s, "relative": s / seconds[1]} for rows, s in seconds.items()]


@torch.inference_mode()
def time_rows(rig: Rig, llm: LLM, rows: int, pool: Any) -> float:
    engine = llm.engine
    executor = getattr(engine.runner.executor, "eager", engine.runner.executor)  # CudaGraphs' eager one
    kv, block, total = engine.runner.kv_cache.layers, engine.config.block_size, 64 + rows
    positions = list(range(64, total))
    inputs = StepInputs([5] * rows, positions, list(positions), [rows], [total], [list(range(-(-total // block)))],
                        [rows], None, list(range(rows)))
    ids, pos, meta, _ = upload(inputs, rig.device)
    forward: Callable[[], object] = lambda: engine.model.compute_logits(executor.forward(ids, pos, kv, meta))  # noqa: E731
    if pool is not None:
        from specdec.cuda_graphs import capture_graph

        forward = capture_graph(forward, pool, rig.device).graph.replay  # type: ignore[arg-type]
    forward()
    return min(rig.wall(forward, rig.repeats) for _ in range(2))


# ---- the oracle's ceiling --------------------------------------------------------------------------------------


def oracle_section(rig: Rig, model_dir: Path, depths: list[int]) -> list[dict[str, Any]]:
    """Plain against bench_oracle's OracleDrafter at each depth, batch 1, one engine."""
    with random_weights(model_dir):
        llm = LLM(str(model_dir), max_num_seqs=1,
                  **rig.options(speculative_config={"method": "ngram", "num_speculative_tokens": max(depths)}))
    oracle = OracleDrafter()
    llm.engine.drafter = oracle
    prompt = rig.prompts(1, rig.prompt_len, seed=3)[0]
    params = greedy(rig.max_tokens)
    run = lambda spec: llm.generate([prompt], params, use_speculation=spec)[0].outputs[0].token_ids  # noqa: E731
    expected = list(run(False))
    oracle.expected = prompt + expected
    plain = min(rig.wall(lambda: run(False)) for _ in range(2))
    rows = [{"depth": 0, "tok_s": rig.max_tokens / plain, "speedup": 1.0, "identical": True}]
    for depth in depths:
        oracle.depth = depth
        run(True)
        same = list(run(True)) == expected
        seconds = min(rig.wall(lambda: run(True)) for _ in range(2))
        rows.append({"depth": depth, "tok_s": rig.max_tokens / seconds, "speedup": plain / seconds,
                     "identical": same})
    return rows


# ---- transformers side by side ---------------------------------------------------------------------------------


def transformers_section(rig: Rig, model_dir: Path) -> list[dict[str, Any]]:
    """transformers' greedy decoding of the same shape and kind of weights (its own random
    init), batch 1: eager with its dynamic cache, then a static cache, compiled
    (`torch.compile(forward, mode="reduce-overhead")`, transformers' recipe) unless not."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(model_dir))
    with torch.device(rig.device):
        try:
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=rig.dtype)
        except TypeError:  # transformers before `dtype` replaced `torch_dtype`
            model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=rig.dtype)
    model.to(device=rig.device, dtype=rig.dtype).eval()  # where a version ignored the device context
    # Newer transformers compile a static cache's forward by themselves: told not to, so
    # that "eager" is eager and the compiled forward is the one compiled here.
    eager = {"disable_compile": True} if hasattr(transformers.GenerationConfig(), "disable_compile") else {}
    ids = torch.tensor(rig.prompts(1, rig.prompt_len, seed=5), device=rig.device)
    rows = []

    def rate(**options: Any) -> float:
        def run(n: int) -> object:
            with torch.inference_mode():
                return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                                      **options)
        run(rig.max_tokens)
        run(rig.max_tokens)  # warm up (twice: a compiled forward captures its graphs on a later call)
        one = min(rig.wall(lambda: run(1)) for _ in range(2))
        full = min(rig.wall(lambda: run(rig.max_tokens)) for _ in range(2))
        return (rig.max_tokens - 1) / max(full - one, 1e-9)

    rows.append({"engine": "transformers, eager", "tok_s": rate(**eager)})
    name = "transformers, static cache"
    if rig.compile:
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
        name += " + torch.compile"
    rows.append({"engine": name, "tok_s": rate(cache_implementation="static", **eager)})
    return rows


# ---- every drafter on the default model -------------------------------------------------------------------------


def default_gguf() -> Path | None:
    path = gguf_cache_dir(DEFAULT_MODEL) / KNOWN_MODELS[DEFAULT_MODEL].gguf_file
    return path if path.is_file() else None


def default_drafters(device: torch.device) -> dict[str, dict[str, Any] | None]:
    """DRAFTERS and the default speculation (with the default model's heads)."""
    default = default_speculative_config(DEFAULT_MODEL, device)
    return {**DRAFTERS, "default (adaptive hybrid)": asdict(default) if default else None}


def drafters_section(rig: Rig, model: str, configs: dict[str, dict[str, Any] | None], categories: list[str],
                     num_prompts: int, max_tokens: int) -> list[dict[str, Any]]:
    """Each drafter's tok/s, τ and identity with plain (configs: name -> speculative config,
    "plain" first) on `model`, per category (first turns, batch 1, in sequence through one
    engine per drafter)."""
    prompts = {category: load_prompts(category, num_prompts) for category in categories}
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    plain: dict[str, list[list[int]]] = {}
    rows: list[dict[str, Any]] = []
    for name, spec in configs.items():
        llm = LLM(model, **rig.options(speculative_config=spec, max_num_seqs=4, max_model_len=DRAFTER_MAX_MODEL_LEN))
        llm.chat([[{"role": "user", "content": "Say hello."}]], params)  # warm up
        for category, texts in prompts.items():
            before, outputs, seconds = llm.get_metrics(), [], 0.0
            for text in texts:
                start = time.perf_counter()
                out = llm.chat([[{"role": "user", "content": text}]], params)[0].outputs[0]
                seconds += time.perf_counter() - start
                outputs.append(list(out.token_ids))
            after = llm.get_metrics()
            drafts = after["num_drafts"] - before["num_drafts"]
            accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
            reference = plain.setdefault(category, outputs)
            rows.append({"drafter": name, "category": category, "tok_s": sum(map(len, outputs)) / seconds,
                         "tau": 1 + accepted / drafts if drafts else None,
                         "identical": sum(a == b for a, b in zip(outputs, reference)), "prompts": len(texts)})
        del llm
        free()
    for row in rows:
        base = next(r["tok_s"] for r in rows if r["drafter"] == "plain" and r["category"] == row["category"])
        row["x_plain"] = row["tok_s"] / base
    return rows


# ---- GPU idle time per step ---------------------------------------------------------------------------------


def idle_section(rig: Rig, llm: LLM) -> dict[str, Any]:
    """Batch-1 decoding under torch.profiler: the GPU's idle time between its kernels and
    copies (the union of their intervals against the span they cover) over one request, its
    short prefill included, per decode step."""
    from torch.profiler import ProfilerActivity, profile

    prompt = rig.prompts(1, rig.prompt_len, seed=11)
    llm.generate(prompt, greedy(rig.max_tokens))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompt, greedy(rig.max_tokens))
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start)
    busy, end = 0.0, float("-inf")
    for first, last in spans:  # merged: overlapping kernels count once
        busy += max(0.0, last - max(first, end))
        end = max(end, last)
    window = spans[-1][1] - spans[0][0] if spans else 0.0
    steps = rig.max_tokens
    return {"steps": steps, "gpu_busy_ms_per_step": busy / 1000 / steps,
            "gpu_idle_ms_per_step": (window - busy) / 1000 / steps}


# ---- the run and its report --------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    rig = Rig(args)
    report: dict[str, Any] = {"device": device_name(rig.device), "shape": args.shape, "dims": SHAPES[args.shape],
                              "dtype": str(rig.dtype).removeprefix("torch."), "max_tokens": rig.max_tokens}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_checkpoint(Path(tmp) / args.shape, args.shape, rig.max_model_len)
        report["copy_bandwidth_gb_s"] = copy_bandwidth(rig) / 1e9
        with random_weights(model_dir):
            llm = LLM(str(model_dir), max_num_seqs=16, **rig.options(speculative_config=None))
        report["plain"] = plain_section(rig, llm, report["copy_bandwidth_gb_s"] * 1e9)
        report["verify"] = verify_section(rig, llm)
        report["idle"] = (idle_section(rig, llm) if args.profile and rig.device.type == "cuda"
                          else {"skipped": "needs --profile on CUDA"})
        del llm
        free()
        report["oracle"] = oracle_section(rig, model_dir, args.depths)
        free()
        report["transformers"] = transformers_section(rig, model_dir)
        free()
    gguf = default_gguf()
    if args.drafters and gguf is not None:
        report["drafters"] = drafters_section(rig, str(gguf), default_drafters(rig.device), args.categories,
                                              args.num_prompts, args.drafter_tokens)
    else:
        report["drafters"] = {"skipped": "--no-drafters" if not args.drafters else
                              f"the default model's GGUF is not here (`specdec models pull {DEFAULT_MODEL}`)"}
    return report


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    return f"CPU, torch {torch.__version__}"


def markdown(report: dict[str, Any]) -> str:
    plain = report["plain"]
    parts = [f"# bench_gpu: {report['shape']} shape ({report['dtype']}) on {report['device']}",
             f"Copy bandwidth {report['copy_bandwidth_gb_s']:.1f} GB/s; a step reads "
             f"{plain['weight_bytes'] / 1e6:.1f} MB of weights; {report['max_tokens']} tokens a run.",
             "## Plain decoding", markdown_table(
                 ["batch", "tok/s", "ms a step", "roofline tok/s", "of roofline"],
                 [[r["batch"], r["tok_s"], r["ms_per_step"], r["roofline_tok_s"], f"{r['fraction_of_roofline']:.2f}"]
                  for r in plain["rows"]]),
             f"Time to first token, {plain['ttft_prompt_tokens']}-token prompt: {plain['ttft_ms']:.2f} ms.",
             "## Verify cost per row count", markdown_table(
                 ["rows", "ms", "x 1 row"], [[r["rows"], r["ms"], f"{r['relative']:.3f}"] for r in report["verify"]]),
             "## Oracle ceiling (always-right drafter, batch 1)", markdown_table(
                 ["depth", "tok/s", "x plain", "identical"],
                 [[r["depth"] or "plain", r["tok_s"], f"{r['speedup']:.2f}", r["identical"]]
                  for r in report["oracle"]]),
             "## transformers (batch 1)", markdown_table(
                 ["engine", "tok/s"], [[r["engine"], r["tok_s"]] for r in report["transformers"]]),
             "## Drafters on the default model (batch 1)"]
    drafters = report["drafters"]
    parts.append(f"Skipped: {drafters['skipped']}." if isinstance(drafters, dict) else markdown_table(
        ["drafter", "category", "tok/s", "x plain", "τ", "identical to plain"],
        [[r["drafter"], r["category"], r["tok_s"], f"{r['x_plain']:.2f}", "—" if r["tau"] is None else r["tau"],
          f"{r['identical']}/{r['prompts']}"] for r in drafters]))
    idle = report["idle"]
    parts += ["## GPU idle time per decode step (torch.profiler, batch 1)",
              f"Skipped: {idle['skipped']}." if "skipped" in idle else
              f"{idle['gpu_idle_ms_per_step']:.3f} ms idle, {idle['gpu_busy_ms_per_step']:.3f} ms busy a step "
              f"({idle['steps']} steps)."]
    return "\n\n".join(parts) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--max-tokens", type=int, default=0, help="tokens a run decodes (0: 128, tiny shape 16)")
    parser.add_argument("--kv-cache-memory", type=int, default=0, help="bytes of KV cache per engine "
                                                                       "(0: 4 GiB, tiny shape 16 MiB)")
    parser.add_argument("--depths", type=lambda s: [int(d) for d in s.split(",")], default=[1, 3, 7])
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="transformers' static cache "
                                                                                   "runs eagerly")
    parser.add_argument("--no-drafters", dest="drafters", action="store_false")
    parser.add_argument("--categories", type=lambda s: s.split(","), default=list(ALL_CATEGORIES))
    parser.add_argument("--num-prompts", type=int, default=2, help="prompts per category for the drafters")
    parser.add_argument("--drafter-tokens", type=int, default=96, help="max tokens per drafter prompt")
    parser.add_argument("--profile", action="store_true", help="GPU idle time per step from torch.profiler")
    parser.add_argument("--out", type=Path, nargs="*", default=[], help="report files: .json or .md each")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA GPU")
    if any(p.suffix not in (".json", ".md") for p in args.out):
        parser.error("--out paths must end in .json or .md")
    if not args.depths or min(args.depths) < 1 or max(args.depths) > 16:
        parser.error("--depths must be integers in [1, 16]")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    report = run(args)
    text = markdown(report)
    print(text)
    for path in args.out:
        path.write_text(json.dumps(report, indent=2) + "\n" if path.suffix == ".json" else text)
    return report


if __name__ == "__main__":
    main()
