"""The verify cost curve: what a target forward over 1 + k query tokens costs, per linear backend.

Speculation pays only if verifying 1 + k tokens costs little more than decoding one. This
measures, for one request through the engine's own paged-KV path (ModelRunner.execute:
metadata, forward, LM head on every query row), the forward time for several query
lengths at several context lengths, with every linear backend of
kernels/linear.py. It also times each projection of the model alone
(micro-benchmark) and checks batch invariance: whether the logits of a verify forward
over q tokens equal, bit for bit, those of q one-token decode steps (what lossless greedy
speculation relies on).

Backends are packed once and swapped in turn on one model, so every (context, query
length) point is measured alternately across backends and machine noise hits them alike;
each number is the median over --repeats rounds of the mean of a few calls. Besides the
backends of kernels/linear.py (q8_0, q4_0 and q4_1 quantize the fp32 weights at load),
"gguf" runs the model's own GGUF blocks (quantization="gguf"; --no-gguf to skip) and
"gguf-int8" the same blocks with int8 activations (quantized_activations="int8", lossy;
--no-int8 to skip), and a summary gives each backend's 1-token, 1+5 and 1+8-token verify
forwards and their ratios. `--backends ""` times those two alone.

    SPECDEC_HOME=/tmp/sdhome python evals/bench_kernels.py --threads 2 --json /tmp/kernels.json

Check `uptime` first: with 2 OpenMP threads on 2 cores while another job holds a core,
every parallel region waits for a descheduled thread (measured: a 1-token fp32 forward
took 340 ms instead of 71 ms at 1 thread); on a shared box compare with --threads 1.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from specdec.allocator import keep_freed_memory
from specdec.config import EngineConfig
from specdec.executor import choose_executor
from specdec.kernels.attention import AttentionBackend, make_attention_backend
from specdec.kernels.linear import LinearBackend, available_linear_backends, get_linear_backend
from specdec.kernels.linear_gguf import GgufLinear
from specdec.model_registry import DEFAULT_MODEL, resolve_model
from specdec.model_runner import KVCache, ModelRunner
from specdec.models import LlamaForCausalLM, load_model
from specdec.models.linear import PackedWeights, install_linears, pack_linears
from specdec.models.llama import LlamaDecoderLayer
from specdec.request import Request
from specdec.sampling_params import SamplingParams
from specdec.scheduler import ScheduledRequest
from specdec.spec.tree import DraftTree

BLOCK_SIZE = 16


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--backends", default=None, type=lambda s: [b for b in s.split(",") if b],
                        help="comma-separated; default: every backend available here")
    parser.add_argument("--attention-backends", default=["auto"], type=lambda s: s.split(","),
                        help="engine attention_backend values to time side by side (auto, cpp, torch)")
    parser.add_argument("--query-lens", default=[1, 2, 4, 6, 8, 9, 16, 32], type=_ints)
    parser.add_argument("--context-lens", default=[128, 512, 1024], type=_ints)
    parser.add_argument("--micro-rows", default=[1, 2, 4, 8, 9, 16, 32], type=_ints)
    parser.add_argument("--repeats", type=int, default=5, help="alternating rounds; the median is reported")
    parser.add_argument("--min-time", type=float, default=0.05, help="seconds of calls per sample (at least 1)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gguf", action=argparse.BooleanOptionalAction, default=True,
                        help="also time the model's own GGUF blocks (backend 'gguf')")
    parser.add_argument("--int8", action=argparse.BooleanOptionalAction, default=True,
                        help="and those blocks with int8 activations (backend 'gguf-int8')")
    parser.add_argument("--skip-micro", action="store_true")
    parser.add_argument("--skip-model", action="store_true")
    parser.add_argument("--skip-invariance", action="store_true", help="and the accuracy check")
    parser.add_argument("--json", type=Path, default=None, help="also write every number here")


def markdown_table(headers: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(str(v) for v in row) + " |" for row in rows])


# ---- timing ------------------------------------------------------------------------------

def _calls_per_sample(fn: Callable[[], Any], min_time: float) -> int:
    fn()  # warm-up (first-call allocations, oneDNN primitive creation)
    start = time.perf_counter()
    fn()
    once = time.perf_counter() - start
    return max(1, int(min_time / max(once, 1e-6)))


Point = tuple[Callable[[], None], Callable[[], Any]]  # (setup, the call to time)


def time_interleaved(points: dict[Any, Point], repeats: int, min_time: float) -> dict[Any, dict[str, float]]:
    """Seconds per call at every point: `repeats` rounds, each visiting every point once
    (a sample = the mean of a few calls), so a burst of load from other jobs spreads over
    all points instead of inflating a few. Returns the median and min over rounds."""
    calls = {}
    for key, (setup, fn) in points.items():
        setup()
        calls[key] = _calls_per_sample(fn, min_time)
    samples: dict[Any, list[float]] = {key: [] for key in points}
    for _ in range(repeats):
        for key, (setup, fn) in points.items():
            setup()
            start = time.perf_counter()
            for _ in range(calls[key]):
                fn()
            samples[key].append((time.perf_counter() - start) / calls[key])
    return {key: {"median": statistics.median(v), "min": min(v)} for key, v in samples.items()}


# ---- one request through the engine's ModelRunner ---------------------------------------

class VerifyRig:
    """A ModelRunner and a fake request whose KV cache holds `context` tokens; a step
    runs 1 known token + (q - 1) draft tokens, as a verify step of k = q - 1 drafts does."""

    def __init__(self, model: LlamaForCausalLM, max_tokens: int) -> None:
        mc = model.config
        self.model = model
        num_blocks = -(-max_tokens // BLOCK_SIZE) + 1
        config = EngineConfig(model="bench", block_size=BLOCK_SIZE, max_model_len=max_tokens)
        kv = KVCache(mc.num_layers, num_blocks, BLOCK_SIZE, mc.num_kv_heads, mc.head_dim,
                     torch.float32, torch.device("cpu"))
        gen = torch.Generator().manual_seed(0)
        for layer in kv.layers:  # plausible cache contents (timings don't care)
            layer.k.normal_(generator=gen)
            layer.v.normal_(generator=gen)
        self.runner = ModelRunner(choose_executor(model, kv.layers), config, kv, torch.device("cpu"))
        self.tokens = torch.randint(3, mc.vocab_size, (max_tokens,), generator=gen).tolist()
        self.block_table = list(range(num_blocks))

    def batch(self, context: int, num_query: int) -> tuple[list[ScheduledRequest], list[DraftTree]]:
        """One decoding request after `context` cached tokens, verifying a chain of
        num_query - 1 drafts."""
        request = Request("bench", self.tokens[: context + 1], SamplingParams(temperature=0.0), None,
                          1, set())
        request.num_computed_tokens = context
        request.block_table = self.block_table
        chain = DraftTree.chain(self.tokens[context : context + num_query])
        return [ScheduledRequest(request, 1, chain.num_drafts, chain.max_depth)], [chain]

    def step(self, context: int, num_query: int) -> torch.Tensor:  # [num_query, V] logits
        return self.runner.execute(*self.batch(context, num_query)).logits

    def use(self, packing: PackedWeights, attention: AttentionBackend[Any] | None = None) -> None:
        """Install a packing (and an attention backend), and the executor an engine built
        on them would choose (the C++ layer loop or the Python layers)."""
        install_linears(self.model, packing)
        if attention is not None:
            self.model.attention_backend = attention
        self.runner.executor = choose_executor(self.model, self.runner.kv_cache.layers)


def bench_model(rig: VerifyRig, packed: dict[str, PackedWeights], args: argparse.Namespace
                ) -> tuple[dict[str, Any], dict[str, Any]]:
    """ms per forward: (medians, mins), each backend -> context -> query length."""
    attention_backends = {name: make_attention_backend(name, "cpu") for name in args.attention_backends}

    def install(p: PackedWeights, attention: str) -> Callable[[], None]:
        return lambda: rig.use(p, attention_backends[attention])

    def step(context: int, q: int) -> Callable[[], Tensor]:
        return lambda: rig.step(context, q)

    points: dict[Any, Point] = {}
    for context in args.context_lens:
        for q in args.query_lens:
            for name, p in packed.items():
                for attention in args.attention_backends:
                    label = name if len(args.attention_backends) == 1 else f"{name}, attention {attention}"
                    points[(label, context, q)] = (install(p, attention), step(context, q))
    medians: dict[str, Any] = {}
    mins: dict[str, Any] = {}
    for (name, context, q), t in time_interleaved(points, args.repeats, args.min_time).items():
        medians.setdefault(name, {}).setdefault(str(context), {})[str(q)] = t["median"] * 1e3
        mins.setdefault(name, {}).setdefault(str(context), {})[str(q)] = t["min"] * 1e3
    return medians, mins


def check_invariance(rig: VerifyRig, packed: dict[str, PackedWeights], context: int,
                     num_query: int) -> dict[str, Any]:
    """Verify-forward logits over num_query tokens vs num_query one-token decode steps."""
    out: dict[str, Any] = {}
    for name, p in packed.items():
        rig.use(p)
        decode = torch.cat([rig.step(context + i, 1) for i in range(num_query)])
        verify = rig.step(context, num_query)
        diff = (verify - decode).abs().max().item()
        out[name] = {"max_abs_diff": diff, "bitwise_equal": diff == 0.0,
                     "argmax_equal": bool((verify.argmax(-1) == decode.argmax(-1)).all())}
    return out


def check_accuracy(rig: VerifyRig, packed: dict[str, PackedWeights], model_dir: Path,
                   max_tokens: int) -> dict[str, Any]:
    """Logits of a real text prompt (prefill) per backend against fp32's."""
    from transformers import AutoTokenizer

    text = json.loads((Path(__file__).parent / "prompts" / "summarization.jsonl").read_text().splitlines()[0])
    ids = AutoTokenizer.from_pretrained(str(model_dir)).encode(text["turns"][0])[: max_tokens - 1]
    # Every prompt row gets logits: the prompt's tail goes in as "drafts" after its first token.
    request = Request("accuracy", ids[:1], SamplingParams(temperature=0.0), None, 1, set())
    request.block_table = rig.block_table
    chain = DraftTree.chain(ids)
    batch = [ScheduledRequest(request, 1, chain.num_drafts, chain.max_depth)]
    logits = {}
    for name, p in packed.items():
        rig.use(p)
        logits[name] = rig.runner.execute(batch, [chain]).logits
    ref = logits.get("fp32", next(iter(logits.values())))
    return {name: {"rel_err": float((got - ref).norm() / ref.norm()),
                   "top1_agree": float((got.argmax(-1) == ref.argmax(-1)).float().mean()),
                   "num_tokens": len(ids)}
            for name, got in logits.items()}


# ---- one projection alone --------------------------------------------------------------

def model_shapes(model: LlamaForCausalLM) -> dict[str, tuple[int, int]]:
    """Projection -> (in, out) of the model's actual weights."""
    return {name: (int(w.shape[1]), int(w.shape[0])) for name, w in _weights(model).items()}


def _weights(model: LlamaForCausalLM) -> dict[str, Tensor]:  # projection -> fp32 [out, in]
    layer = model.layers[0]
    assert isinstance(layer, LlamaDecoderLayer)
    return {"qkv": layer.qkv_proj.weight, "o": layer.o_proj.weight, "gate_up": layer.gate_up_proj.weight,
            "down": layer.down_proj.weight, "lm_head": model.lm_head_weight}


def bench_micro(model: LlamaForCausalLM, backends: list[str], args: argparse.Namespace,
                gguf_model: LlamaForCausalLM | None) -> dict[str, Any]:
    def call(backend: LinearBackend, packed: Any, x: Tensor) -> Callable[[], Tensor]:
        return lambda: backend.apply(x, packed)

    def nothing() -> None:
        pass

    results: dict[str, Any] = {}
    gguf_weights = _weights(gguf_model) if gguf_model is not None else {}
    for proj, weight in _weights(model).items():
        impls = {name: get_linear_backend(name) for name in backends}
        packed = {name: impl.prepare(weight) for name, impl in impls.items()}
        if proj in gguf_weights:
            for name, gguf in _gguf_backends(args).items():
                impls[name] = gguf
                packed[name] = gguf.prepare(gguf_weights[proj])
        points: dict[Any, Point] = {}
        for m in args.micro_rows:
            x = torch.randn(m, weight.shape[1])
            for name in impls:
                points[(name, m)] = (nothing, call(impls[name], packed[name], x))
        for (name, m), t in time_interleaved(points, args.repeats, args.min_time / 4).items():
            results.setdefault(proj, {}).setdefault(name, {})[str(m)] = t["median"] * 1e6
        _progress(f"micro {proj} done")
    return results


# ---- report ------------------------------------------------------------------------------

def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def model_tables(results: dict[str, Any], args: argparse.Namespace) -> str:
    parts = []
    fp32_decode = results.get("fp32", {})
    for context in args.context_lens:
        c = str(context)
        headers = ["backend"] + [f"q={q}" for q in args.query_lens] + ["1-token vs fp32"]
        rows = []
        for name, by_context in results.items():
            times = by_context[c]
            one = times[str(args.query_lens[0])]
            cells = [f"{times[str(q)]:.1f} ({times[str(q)] / one:.2f}x)" for q in args.query_lens]
            vs = f"{one / fp32_decode[c][str(args.query_lens[0])]:.2f}x" if fp32_decode else "-"
            rows.append([name, *cells, vs])
        parts.append(f"### context {context}: ms per forward (ratio to the {args.query_lens[0]}-token forward)\n\n"
                     + markdown_table(headers, rows))
    return "\n\n".join(parts)


def micro_tables(results: dict[str, Any], shapes: dict[str, tuple[int, int]], args: argparse.Namespace) -> str:
    parts = []
    for proj, by_backend in results.items():
        k, n = shapes[proj]
        headers = ["backend"] + [f"M={m}" for m in args.micro_rows]
        rows = []
        for name, times in by_backend.items():
            one = times[str(args.micro_rows[0])]
            rows.append([name] + [f"{times[str(m)]:.0f} ({times[str(m)] / one:.2f}x)" for m in args.micro_rows])
        parts.append(f"### {proj} {k}x{n} (in x out): µs per call (ratio to M={args.micro_rows[0]})\n\n"
                     + markdown_table(headers, rows))
    return "\n\n".join(parts)


def verify_ratio_table(results: dict[str, Any]) -> str:
    """Per backend and context: the 1-token forward and the 1+5 and 1+8-token verifies."""
    rows = []
    for name, by_context in results.items():
        for context, times in by_context.items():
            one, five, eight = (times.get(str(q)) for q in (1, 6, 9))
            if one is None:
                continue
            cells = [f"{t:.2f}" if t is not None else "-" for t in (one, five, eight)]
            ratios = [f"{t / one:.2f}x" if t is not None else "-" for t in (five, eight)]
            rows.append([name, context, *cells, *ratios])
    return ("### verify cost: ms per forward of 1 token, 1 + 5 and 1 + 8 (median)\n\n"
            + markdown_table(["backend", "context", "1", "1+5", "1+8", "(1+5) / 1", "(1+8) / 1"], rows))


def gguf_model(args: argparse.Namespace, max_positions: int) -> LlamaForCausalLM | None:
    """The model on its own GGUF blocks, if asked for and it has a GGUF."""
    if not args.gguf:
        return None
    try:
        path = resolve_model(args.model, gguf=True)
    except (ValueError, FileNotFoundError) as error:
        _progress(f"no GGUF blocks to time: {error}")
        return None
    if path.suffix != ".gguf":
        _progress(f"{args.model} has no GGUF file: no 'gguf' backend")
        return None
    return load_model(path, max_positions=max_positions, quantization="gguf")


def _gguf_backends(args: argparse.Namespace) -> dict[str, GgufLinear]:
    """The GGUF blocks' backends to time: float32 activations, and int8 unless --no-int8."""
    return {"gguf": GgufLinear(), **({"gguf-int8": GgufLinear("int8")} if args.int8 else {})}


def invariance_table(results: dict[str, Any], context: int, num_query: int) -> str:
    rows = [[name, f"{r['max_abs_diff']:.2e}", r["bitwise_equal"], r["argmax_equal"]]
            for name, r in results.items()]
    return (f"### batch invariance: verify forward of {num_query} tokens vs {num_query} decode steps "
            f"(context {context})\n\n"
            + markdown_table(["backend", "max |Δlogit|", "bitwise equal", "argmax equal"], rows))


def accuracy_table(results: dict[str, Any]) -> str:
    num_tokens = next(iter(results.values()))["num_tokens"]
    rows = [[name, f"{r['rel_err']:.2e}", f"{100 * r['top1_agree']:.1f}%"] for name, r in results.items()]
    return (f"### accuracy: logits of a {num_tokens}-token text prompt against fp32's\n\n"
            + markdown_table(["backend", "relative error", "top-1 agreement"], rows))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    keep_freed_memory()  # as the engine does: otherwise bigger steps also pay page faults
    backends = available_linear_backends() if args.backends is None else args.backends
    model_dir = resolve_model(args.model)
    max_positions = max(args.context_lens) + max(args.query_lens) + 1
    model = load_model(model_dir, max_positions=max_positions)
    blocks_model = gguf_model(args, max_positions)
    report: dict[str, Any] = {
        "model": args.model, "backends": backends, "threads": args.threads, "repeats": args.repeats,
        "torch": torch.__version__, "loadavg_before": os.getloadavg(),
    }
    title = (f"# verify cost curve: {args.model}, {args.threads} thread(s), torch {torch.__version__}, "
             f"load average {os.getloadavg()[0]:.2f} at start")
    sections = [title]
    with torch.inference_mode():
        if not args.skip_micro:
            shapes = model_shapes(model)
            report["micro_us"] = bench_micro(model, backends, args, blocks_model)
            report["shapes"] = shapes
            sections.append("## one projection alone\n\n" + micro_tables(report["micro_us"], shapes, args))
        if not (args.skip_model and args.skip_invariance):
            packed = {name: pack_linears(model, get_linear_backend(name)) for name in backends}
            if blocks_model is not None:  # same module names: its packing installs on `model`
                packed.update({name: pack_linears(blocks_model, gguf) for name, gguf in _gguf_backends(args).items()})
            rig = VerifyRig(model, max(args.context_lens) + max(args.query_lens) + 1)
            if not args.skip_invariance:
                context, q = args.context_lens[0], 9
                report["invariance"] = check_invariance(rig, packed, context, q)
                sections.append(invariance_table(report["invariance"], context, q))
                report["accuracy"] = check_accuracy(rig, packed, model_dir, len(rig.tokens))
                sections.append(accuracy_table(report["accuracy"]))
            if not args.skip_model:
                report["model_ms"], report["model_ms_min"] = bench_model(rig, packed, args)
                sections.append(verify_ratio_table(report["model_ms"]))
                sections.append("## target forward through the paged KV path (ModelRunner.execute), median\n\n"
                                + model_tables(report["model_ms"], args))
                sections.append("## the same, min over rounds (the machine's best case)\n\n"
                                + model_tables(report["model_ms_min"], args))
    report["loadavg_after"] = os.getloadavg()
    sections.append(f"load average at the end: {os.getloadavg()[0]:.2f}")
    print("\n\n".join(sections))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
