"""Where the time of bench_latency's concurrency workload goes, and the bound that sets on
the batching gain.

The same requests as `bench_latency.py --concurrency` (round-robin over the categories,
EOS ignored) are served at level 1 and at level N, with timers on the C++ kernels' entry
points (the default CPU backends: linears, attention, RMSNorm, K/V store). Prefill is a
max_tokens=1 pass over the same requests; decode is the full run minus that. The bound is
the level-N ratio if attention and every overhead at level N cost nothing, leaving only
prefill and the decode linears, which on a CPU are FMA work:

    .venv/bin/python evals/profile_step.py --concurrency 16 --max-tokens 96
"""
from __future__ import annotations

import argparse
import contextlib
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

from specdec.evals.bench_latency import serve_in_waves, workload
from specdec.evals.common import ALL_CATEGORIES, markdown_table
from specdec.kernels import attention_cpu, linear_cpu, rms_norm_cpu, store_kv_cpu
from specdec.llm import LLM
from specdec.model_registry import DEFAULT_MODEL
from specdec.sampling_params import SamplingParams

KERNELS: dict[str, tuple[ModuleType, str]] = {
    "linears": (linear_cpu, "linear_fp16"),
    "attention": (attention_cpu, "paged_attention_cpu"),
    "rms_norm": (rms_norm_cpu, "rms_norm_cpu"),
    "store_kv": (store_kv_cpu, "store_kv_cpu"),
}


@contextlib.contextmanager
def kernel_timers() -> Iterator[dict[str, float]]:
    """Seconds spent in each kernel entry point while the block runs."""
    seconds: dict[str, float] = defaultdict(float)
    originals = {name: getattr(module, attr) for name, (module, attr) in KERNELS.items()}
    for name, (module, attr) in KERNELS.items():
        setattr(module, attr, _timed(originals[name], name, seconds))
    try:
        yield seconds
    finally:
        for name, (module, attr) in KERNELS.items():
            setattr(module, attr, originals[name])


def _timed(fn: Callable[..., Any], name: str, seconds: dict[str, float]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds[name] += time.perf_counter() - start
    return run


def serve(llm: LLM, prompts: list[list[int]], max_tokens: int, level: int) -> dict[str, float]:
    """Wall seconds and per-kernel seconds of the workload served `level` at a time."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    with kernel_timers() as seconds:
        start = time.perf_counter()
        serve_in_waves(llm, prompts, params, level)
        wall = time.perf_counter() - start
    return {"wall": wall, **seconds}


def profile_level(llm: LLM, prompts: list[list[int]], max_tokens: int, level: int) -> dict[str, float]:
    prefill = serve(llm, prompts, 1, level)
    full = serve(llm, prompts, max_tokens, level)
    steps = -(-len(prompts) // level) * (max_tokens - 1)  # decode steps: waves x tokens after the first
    row = {"level": level, "wall": full["wall"], "prefill": prefill["wall"], "steps": steps}
    for name in ["wall", *KERNELS]:
        row[f"decode_{name}_ms"] = 1e3 * (full.get(name, 0.0) - prefill.get(name, 0.0)) / steps
    return row


def main() -> list[dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--categories", default=",".join(ALL_CATEGORIES), type=lambda s: s.split(","))
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--max-model-len", type=int, default=2048)
    args = parser.parse_args()
    llm = LLM(args.model, max_model_len=args.max_model_len, enable_prefix_caching=False)
    prompts = workload(args, llm, args.concurrency)
    serve(llm, prompts[:2], 4, 2)  # warm up: kernel builds, first-call allocations
    rows = [profile_level(llm, prompts, args.max_tokens, level) for level in (1, args.concurrency)]
    print(markdown_table(["in flight", "wall s", "prefill s", "decode steps", "decode ms/step", "linears",
                          "attention", "RMSNorm", "K/V store"],
                         [[r["level"], r["wall"], r["prefill"], r["steps"], r["decode_wall_ms"],
                           *(r[f"decode_{name}_ms"] for name in KERNELS)] for r in rows]))
    one, many = rows
    floor = many["prefill"] + many["steps"] * many["decode_linears_ms"] / 1e3
    print(f"\nlevel {many['level']} / level 1: {one['wall'] / many['wall']:.2f}x measured; "
          f"at most {one['wall'] / floor:.2f}x if attention and all overhead at level {many['level']} were free")
    return rows


if __name__ == "__main__":
    main()
