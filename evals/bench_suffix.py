"""The suffix drafter's costs with a full cross-request cache: microseconds per propose
step, milliseconds per finished request (CPU time) (its output indexed into the cache), and the
cache's memory.

    python evals/bench_suffix.py --num-requests 10000 --tokens-per-request 200

Synthetic token streams, built to be hard on the index: Zipf-distributed tokens (common
n-grams recur thousands of times, so lookups hit the walk limit) mixed with spans of a few
dozen shared templates (so that drafts find long matches and propose full trees). The
decoding requests follow a template too; each step they commit the drafted tokens the
true continuation agrees with plus one, as a verify step would. Memory is measured twice:
tracemalloc's peak of Python allocations while filling the cache, and the RSS growth.
No model runs: this is the drafter alone.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

from specdec.config import SpeculativeConfig
from specdec.drafters.base import Drafter, DraftRequest
from specdec.drafters.ngram import NgramDrafter
from specdec.drafters.suffix import SuffixDrafter
from specdec.evals.common import markdown_table
from specdec.sampling_params import SamplingParams

VOCAB = 49152  # SmolLM2's
NUM_TEMPLATES = 40
TEMPLATE_TOKENS = 30


class Corpus:
    """Seeded synthetic requests: each a prompt tail and an output of template spans and noise."""

    def __init__(self, seed: int, noise_seed: int) -> None:
        self.rng = random.Random(seed)
        weights = [1.0 / (rank + 1) for rank in range(VOCAB)]  # Zipf, s = 1
        self.cumulative = list(_accumulate(weights))
        self.templates = [self.noise(TEMPLATE_TOKENS) for _ in range(NUM_TEMPLATES)]
        self.rng = random.Random(noise_seed)  # the same templates, other noise

    def noise(self, count: int) -> list[int]:
        return self.rng.choices(range(VOCAB), cum_weights=self.cumulative, k=count)

    def request(self, num_tokens: int) -> list[int]:
        tokens: list[int] = []
        while len(tokens) < num_tokens:
            tokens += self.rng.choice(self.templates) if self.rng.random() < 0.5 else self.noise(TEMPLATE_TOKENS)
        return tokens[:num_tokens]


def _accumulate(values: list[float]) -> list[float]:
    total, out = 0.0, []
    for value in values:
        total += value
        out.append(total)
    return out


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * 4096


def fill_cache(drafter: SuffixDrafter, corpus: Corpus, num_requests: int, tokens_per_request: int,
               prompt_tokens: int) -> None:
    """Run num_requests requests through propose (after the prefill, then at the end) and free them."""
    params = SamplingParams(temperature=0.0)
    for i in range(num_requests):
        prompt, output = corpus.noise(prompt_tokens), corpus.request(tokens_per_request)
        drafter.propose([DraftRequest(f"fill-{i}", [*prompt, output[0]], 1, 1, params)])
        drafter.propose([DraftRequest(f"fill-{i}", [*prompt, *output], 1, 1, params)])
        drafter.free(f"fill-{i}")


def decode_steps(drafter: Drafter, corpus: Corpus, num_requests: int, tokens_per_request: int,
                 num_draft_tokens: int, max_depth: int) -> dict[str, float]:
    """Decode requests one step at a time: the propose CPU time per step (us), committed
    tokens per step, and the CPU time of each request's free (ms; its cache insertion)."""
    params = SamplingParams(temperature=0.0)
    step_us: list[float] = []
    free_ms: list[float] = []
    committed: list[int] = []
    for i in range(num_requests):
        prompt, truth = corpus.noise(16), corpus.request(tokens_per_request)
        length = 1
        while length < len(truth):
            request = DraftRequest(f"decode-{i}", [*prompt, *truth[:length]], num_draft_tokens, max_depth, params)
            start = time.process_time()  # CPU time: the machine may be shared
            tree = drafter.propose([request])[0]
            step_us.append(1e6 * (time.process_time() - start))
            accepted = _accepted(tree.token_ids, tree.parents, truth[length:])
            committed.append(accepted + 1)
            length += accepted + 1
        start = time.process_time()
        drafter.free(f"decode-{i}")
        free_ms.append(1e3 * (time.process_time() - start))
    step_us.sort()
    return {"propose_us_median": statistics.median(step_us), "propose_us_p99": step_us[int(0.99 * len(step_us))],
            "propose_us_mean": statistics.fmean(step_us), "tokens_per_step": statistics.fmean(committed),
            "free_ms_median": statistics.median(free_ms)}


def _accepted(tokens: list[int], parents: list[int], truth: list[int]) -> int:
    """Drafts a greedy verify would accept: the deepest tree path that agrees with the truth."""
    node, depth = 0, 0
    while depth < len(truth):
        child = next((i for i in range(1, len(tokens)) if parents[i] == node and tokens[i] == truth[depth]), None)
        if child is None:
            break
        node, depth = child, depth + 1
    return depth


def measure(args: argparse.Namespace) -> dict[str, Any]:
    spec = SpeculativeConfig.from_dict({"method": "suffix", "num_speculative_tokens": args.max_depth,
                                        "suffix_cache_max_requests": args.num_requests,
                                        "suffix_cache_max_tokens": args.num_requests * (args.tokens_per_request + 32),
                                        "suffix_cache_ttl_s": 1e9})
    assert spec is not None
    suffix = SuffixDrafter(spec)
    rss_before = rss_bytes()
    fill_cache(suffix, Corpus(args.seed, args.seed), args.num_requests, args.tokens_per_request, 24)
    rss_growth = rss_bytes() - rss_before
    traced = SuffixDrafter(spec)  # a second fill, traced: tracemalloc slows every allocation
    tracemalloc.start()
    fill_cache(traced, Corpus(args.seed, args.seed), args.num_requests, args.tokens_per_request, 24)
    held, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del traced
    assert suffix.cache is not None and suffix.cache.index is not None
    report: dict[str, Any] = {
        "cached_requests": suffix.cache.num_requests, "cached_tokens": suffix.cache.num_tokens,
        "cache_array_mb": suffix.cache.index.nbytes() / 2**20, "tracemalloc_held_mb": held / 2**20,
        "tracemalloc_peak_mb": peak / 2**20, "rss_growth_mb": rss_growth / 2**20,
    }
    makers: dict[str, Callable[[], Drafter]] = {
        "suffix (full cache)": lambda: suffix,
        "suffix (own context only)": lambda: SuffixDrafter(SpeculativeConfig("suffix", suffix_cross_request=False)),
        "ngram": lambda: NgramDrafter(2, 5),
    }
    report["steps"] = {name: decode_steps(make(), Corpus(args.seed, args.seed + 1), args.decode_requests,
                                          args.tokens_per_request, args.num_draft_tokens, args.max_depth)
                       for name, make in makers.items()}
    return report


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=10_000, help="requests in the cache")
    parser.add_argument("--tokens-per-request", type=int, default=200)
    parser.add_argument("--decode-requests", type=int, default=20, help="requests decoded against the full cache")
    parser.add_argument("--num-draft-tokens", type=int, default=8, help="tree nodes per step")
    parser.add_argument("--max-depth", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    report = measure(args)
    columns = ["propose_us_median", "propose_us_p99", "propose_us_mean", "tokens_per_step", "free_ms_median"]
    print(markdown_table(["drafter", "propose us (median)", "p99", "mean", "tokens/step", "free ms (median)"],
                         [[name, *(steps[c] for c in columns)] for name, steps in report["steps"].items()]))
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
