"""KV cache dtypes on the default model: memory, greedy agreement with fp32 KV, and τ.

For each --kv-cache-dtype: KV bytes per token (and tokens per GiB); plain greedy output
compared with the fp32-KV output (identical outputs, common prefix, first divergences);
teacher-forced top-1 agreement (the next greedy token after every prefix of the fp32
output, so one early divergence does not hide the rest); and ngram k=5 speculation on
the same prompts (τ, acceptance rate, and whether it is token-identical to plain greedy
with that KV dtype). Free-running prompts run as one batch in an engine without prefix
caching, so plain and speculative runs prefill alike (with fp8, a prompt tail computed
from cached blocks instead of in the prefill can round differently and change the
output); the teacher-forced steps run one by one in a second engine with prefix caching.

    python evals/bench_kv_dtype.py --categories summarization,rag,code,qa,math_reasoning,translation,mt_bench \
        --num-prompts 2 --max-tokens 96
"""
from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from specdec.evals.common import load_prompts, markdown_table, timed
from specdec.llm import LLM
from specdec.model_registry import DEFAULT_MODEL
from specdec.model_runner import KVCache
from specdec.sampling_params import SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
HEADERS = ["KV dtype", "bytes/token", "tokens/GiB", "vs fp32", "identical outputs", "common prefix",
           "first divergences", "top-1 agreement (forced)", "τ ngram k=5", "acc. rate", "spec = plain",
           "plain tok/s"]


def run_dtype(args: argparse.Namespace, kv_dtype: str, texts: list[str],
              reference: list[list[int]] | None) -> dict[str, Any]:
    engine_args: dict[str, Any] = dict(kv_cache_dtype=kv_dtype, max_model_len=args.max_model_len,
                                       kv_cache_memory=args.kv_cache_memory)
    llm = LLM(args.model, speculative_config=NGRAM, **engine_args)
    prompts: list[str | list[int]] = [llm.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    result = free_running(llm, prompts, args.max_tokens)
    mc = llm.engine.model_config
    result.update(dtype=kv_dtype, bytes_per_token=KVCache.bytes_per_block(
        mc.num_layers, 1, mc.num_kv_heads, mc.head_dim, llm.engine.config.kv_cache_torch_dtype))
    del llm
    forced_llm = LLM(args.model, enable_prefix_caching=True, **engine_args)
    result["forced"] = teacher_forced_hits(forced_llm, prompts, reference or result["plain"])
    return result


def free_running(llm: LLM, prompts: list[str | list[int]], max_tokens: int) -> dict[str, Any]:
    """Plain greedy outputs (and their speed), then ngram speculation on the same prompts."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    plain, seconds = timed(lambda: llm.generate(prompts, params, use_speculation=False))
    plain_ids = [o.outputs[0].token_ids for o in plain]
    spec = llm.generate(prompts, params)
    metrics = llm.get_metrics()
    return {"plain": plain_ids, "tok_s": sum(map(len, plain_ids)) / seconds,
            "spec_equal": sum(o.outputs[0].token_ids == p for o, p in zip(spec, plain_ids)),
            "tau": metrics["mean_accepted_length"], "acceptance_rate": metrics["acceptance_rate"]}


def teacher_forced_hits(llm: LLM, prompts: list[str | list[int]], reference: list[list[int]]) -> list[bool]:
    """Whether the greedy next token after prompt + reference[:i] is reference[i], for every i."""
    params = SamplingParams(temperature=0.0, max_tokens=1)
    hits = []
    for prompt, ref in zip(prompts, reference):
        assert isinstance(prompt, list)
        for i, want in enumerate(ref):
            out = llm.generate([prompt + ref[:i]], params, use_speculation=False)[0]
            hits.append(out.outputs[0].token_ids == [want])
    return hits


def common_prefix(a: list[int], b: list[int]) -> int:
    """Tokens before the first divergence."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def table_row(result: dict[str, Any], reference: dict[str, Any]) -> list[Any]:
    pairs = list(zip(result["plain"], reference["plain"]))
    prefixes = [common_prefix(got, want) for got, want in pairs]
    identical = sum(got == want for got, want in pairs)
    diverged = sorted(p for p, (got, want) in zip(prefixes, pairs) if got != want)
    n, per_token = len(pairs), result["bytes_per_token"]
    return [result["dtype"], per_token, f"{(1 << 30) // per_token:,}",
            f"{reference['bytes_per_token'] / per_token:.2f}×", f"{identical}/{n}",
            f"{100 * sum(prefixes) / max(sum(len(w) for _, w in pairs), 1):.0f}%",
            ", ".join(map(str, diverged)) or "–", f"{100 * sum(result['forced']) / len(result['forced']):.1f}%",
            result["tau"], f"{result['acceptance_rate']:.3f}",
            f"{result['spec_equal']}/{n}", result["tok_s"]]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--kv-cache-dtypes", type=lambda s: s.split(","), default=["fp32", "fp16", "bf16", "fp8"],
                        help="the first one is the reference")
    parser.add_argument("--categories", type=lambda s: s.split(","),
                        default=["summarization", "rag", "code", "qa", "math_reasoning", "translation", "mt_bench"])
    parser.add_argument("--num-prompts", type=int, default=2, help="per category")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--kv-cache-memory", type=int, default=256 << 20, help="bytes, per engine")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    texts = [p for category in args.categories for p in load_prompts(category, args.num_prompts)]
    results: list[dict[str, Any]] = []
    for kv_dtype in args.kv_cache_dtypes:
        results.append(run_dtype(args, kv_dtype, texts, results[0]["plain"] if results else None))
        print(f"{kv_dtype}: done", file=sys.stderr)
    print(f"{len(texts)} prompts ({', '.join(args.categories)}; {args.num_prompts} each), greedy, "
          f"max_tokens {args.max_tokens}; agreement is with {results[0]['dtype']} KV\n")
    print(markdown_table(HEADERS, [table_row(r, results[0]) for r in results]))


if __name__ == "__main__":
    main()
