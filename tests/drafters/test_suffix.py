"""Suffix decoding's pieces: the n-gram index against a brute-force search, the cache's
bounds (requests, tokens, TTL) and isolation, the tree's frequencies and order, the config."""
from __future__ import annotations

import random
from typing import Any

import pytest

from specdec.config import SpeculativeConfig
from specdec.drafters.base import DraftRequest
from specdec.drafters.suffix import SuffixDrafter
from specdec.drafters.suffix_cache import SuffixCache
from specdec.drafters.suffix_index import LEVELS, MAX_WALK, SEPARATOR, SuffixIndex
from specdec.drafters.suffix_tree import build_draft
from specdec.sampling_params import SamplingParams


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def suffix_spec(**keys: Any) -> SpeculativeConfig:
    spec = SpeculativeConfig.from_dict({"method": "suffix", **keys})
    assert spec is not None
    return spec


def ask(drafter: SuffixDrafter, request_id: str, token_ids: list[int], budget: int = 8, depth: int = 8) -> Any:
    return drafter.draft(DraftRequest(request_id, token_ids, budget, depth, SamplingParams())).scored


def match_length(text: list[int], position: int, context: list[int], cap: int) -> int:
    length = 0
    while (length < min(cap, len(context), position) and text[position - 1 - length] != SEPARATOR
           and text[position - 1 - length] == context[-1 - length]):
        length += 1
    return length


def brute_force(text: list[int], context: list[int], cap: int) -> tuple[int, set[int]]:
    """The longest match (>= min level) of the context's suffix before any position of
    `text` that has a token, and the positions with it."""
    lengths = {p: match_length(text, p, context, cap) for p in range(len(text)) if text[p] != SEPARATOR}
    best = max(lengths.values(), default=0)
    return (best, {p for p, n in lengths.items() if n == best}) if best >= LEVELS[0] else (0, set())


def index_best(found: list[tuple[int, int]]) -> tuple[int, set[int]]:
    best = max((n for _, n in found), default=0)
    return best, {p for p, n in found if n == best}


# ---- the index ------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(20))
def test_index_finds_the_longest_matches(seed: int) -> None:
    rng = random.Random(seed)
    text = [rng.randrange(4) for _ in range(rng.randint(10, 60))]  # few symbols: many matches
    index = SuffixIndex()
    for cut in range(1, len(text) + 1):  # incrementally, as a request grows
        index.extend(text[index.end:cut])
        context = text[:cut]
        found = index.matches(context, max_match=12)
        assert all(n == match_length(text, p, context, 12) for p, n in found)
        assert [p for p, _ in found] == sorted((p for p, _ in found), reverse=True)  # newest first
        # An occurrence is followed by a token: never the context's own end.
        assert all(p < cut for p, _ in found)
        expected = brute_force(text[:cut], context, 12)
        assert index_best(found) == expected


def test_a_walk_visits_at_most_max_walk_occurrences() -> None:
    index = SuffixIndex()
    index.extend([5, 6] * (MAX_WALK * 3))
    found = index.matches([5, 6], max_match=2)
    assert len(found) == MAX_WALK and found[0] == (index.end - 2, 2)  # the newest occurrence first


@pytest.mark.parametrize("seed", range(6))
def test_the_ring_sees_exactly_the_live_entries(seed: int) -> None:
    """Entries added past the token bound evict the oldest; lookups see every live entry's
    text and nothing else, across the ring's wrap."""
    rng = random.Random(seed)
    cache = SuffixCache(max_requests=50, max_tokens=60, ttl_s=1e9)
    live: list[list[int]] = []
    for _ in range(40):
        entry = [rng.randrange(5) for _ in range(rng.randint(1, 25))]
        cache.add(entry)
        live.append(entry)
        while sum(len(e) + 1 for e in live) - 1 > 60:
            live.pop(0)
        assert cache.num_requests == len(live)
        text = [t for e in live for t in (*e, SEPARATOR)][:-1]
        assert cache.index is not None
        assert cache.index.read(0, cache.index.end) == text
        context = [rng.randrange(5) for _ in range(6)]
        expected = brute_force(text, context, 8)
        found = [(p - cache.index.floor, n) for p, n in cache.matches(context, 8)]  # as offsets into text
        if len(found) < MAX_WALK:  # else the walk stopped before the oldest occurrences
            assert index_best(found) == expected
        assert all(n == match_length(text, p, context, 8) for p, n in found)


def test_continuations_stop_at_the_entry_end() -> None:
    cache = SuffixCache(max_requests=4, max_tokens=100, ttl_s=1e9)
    cache.add([1, 2, 3, 4])
    cache.add([1, 2, 9])
    found = dict(cache.matches([1, 2], 4))
    assert sorted(cache.continuation(p, 5) for p in found) == [[3, 4], [9]]


def occurrences(text: list[int], context: list[int], cap: int) -> tuple[int, list[int], int]:
    """brute_force's longest match and its positions, newest first, and how many positions
    match at least the shortest level (more than MAX_WALK: the walk may stop before some)."""
    best, positions = brute_force(text, context, cap)
    lengths = [match_length(text, p, context, cap) for p in range(len(text)) if text[p] != SEPARATOR]
    return best, sorted(positions, reverse=True), sum(n >= LEVELS[0] for n in lengths)


def continuation_of(text: list[int], position: int, depth: int) -> list[int]:
    out = text[position: position + depth]
    return out[: out.index(SEPARATOR)] if SEPARATOR in out else out


@pytest.mark.parametrize("seed", range(12))
def test_a_lookup_finds_the_own_and_cached_occurrences_of_the_longest_match(seed: int) -> None:
    """One native call against brute force: the longest match over the request's own tokens
    and a ring that wraps and evicts, own occurrences first, then the cache's, newest first,
    with continuations that stop at the entry's end."""
    rng = random.Random(seed)
    symbols, cap, factor = rng.choice([3, 5, 8]), rng.choice([4, 12]), rng.choice([0.5, 1.0, 2.0])
    cache = SuffixCache(max_requests=6, max_tokens=rng.choice([40, 90]), ttl_s=1e9)
    live: list[list[int]] = []
    for _ in range(rng.randint(3, 15)):
        live.append([rng.randrange(symbols) for _ in range(rng.randint(1, 30))])
        cache.add(live[-1])
    assert cache.index is not None
    ring = cache.index.read(0, cache.index.end)
    floor = cache.index.floor
    own_text = [rng.randrange(symbols) for _ in range(rng.randint(2, 40))]
    own = SuffixIndex()
    for cut in range(2, len(own_text) + 1):
        own.extend(own_text[own.end:cut])
        context = own_text[:cut]
        found = own.lookup(cache.index, cap, max_depth=6, spec_factor=factor)
        own_best, own_positions, own_count = occurrences(own_text[:cut], context, cap)
        ring_best, ring_positions, ring_count = occurrences(ring, context, cap)
        if own_count >= MAX_WALK or ring_count >= MAX_WALK:  # the walk may stop before the oldest
            assert found.match_length <= max(own_best, ring_best)
            continue
        best = max(own_best, ring_best)
        expected = ([(0, p) for p in own_positions] if own_best == best else []) + \
                   ([(1, p + floor) for p in ring_positions] if ring_best == best else [])
        assert found.match_length == best
        assert list(zip(found.stores, found.positions)) == (expected if best else [])
        depth = min(6, max(1, int(factor * best)))
        texts = (own_text[:cut], ring)
        assert found.continuations == [continuation_of(texts[store], p - floor * store, depth)
                                       for store, p in expected]


def test_a_growing_request_index_keeps_finding_its_matches() -> None:
    """The own index's head tables double as it grows, re-indexing every token."""
    rng = random.Random(7)
    text = [rng.randrange(40) for _ in range(3000)]
    index = SuffixIndex()
    buckets = {index.num_buckets}
    for cut in range(50, len(text) + 1, 37):
        index.extend(text[index.end:cut])
        buckets.add(index.num_buckets)
        found = index.matches(text[:cut], 16)
        best, positions, count = occurrences(text[:cut], text[:cut], 16)
        assert all(n == match_length(text, p, text[:cut], 16) for p, n in found)
        if count < MAX_WALK:
            assert index_best(found) == (best, set(positions))
    assert len(buckets) > 2 and index.num_buckets >= len(text)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="capacity"):
        SuffixIndex(capacity=0)
    with pytest.raises(ValueError, match="starts at 0"):
        SuffixIndex(start=5)
    index = SuffixIndex()
    with pytest.raises(ValueError, match="extend: bad argument"):
        index.extend([1 << 40])
    with pytest.raises(OverflowError):
        index.extend([1, 1 << 40])
    with pytest.raises(ValueError, match="lookup: bad argument"):
        index.lookup(None, 8, -1, 1.0)
    assert index.end == 0 and index.continuation(0, 4) == [] and index.read(-5, 5) == []


# ---- the cache's bounds -----------------------------------------------------------------


def test_cache_evicts_oldest_first_by_requests_tokens_and_age() -> None:
    clock = Clock()
    cache = SuffixCache(max_requests=3, max_tokens=1000, ttl_s=10.0, clock=clock)
    for i in range(5):
        clock.now = float(i)
        cache.add([100 + i, 7, 8, 9])
    assert cache.num_requests == 3  # requests 0 and 1 evicted
    assert {cache.continuation(p, 1)[0] for p, _ in cache.matches([100 + 2, 7], 2)} == {8}
    assert cache.matches([100, 7], 2) == [] and cache.matches([101, 7], 2) == []
    clock.now = 13.5  # requests 2 (t=2) and 3 (t=3) are older than 10 s
    assert cache.num_requests == 1
    assert cache.matches([102, 7], 2) == [] and cache.matches([103, 7], 2) == []
    assert len(cache.matches([104, 7], 2)) == 1
    clock.now = 100.0
    assert cache.num_requests == 0 and cache.matches([104, 7], 2) == []


def test_evicted_text_is_wiped_and_memory_is_bounded() -> None:
    cache = SuffixCache(max_requests=1000, max_tokens=500, ttl_s=1e9)
    secret = [999_999] * 30
    cache.add(secret)
    rng = random.Random(0)
    for _ in range(200):
        cache.add([rng.randrange(50) for _ in range(rng.randint(1, 40))])
    index = cache.index
    assert index is not None
    assert 999_999 not in index.slots()  # evicted, then overwritten or wiped
    assert cache.num_tokens <= 500
    assert len(index.slots()) == 500  # the ring's arrays stop growing at its capacity
    assert index.nbytes() == 500 * (4 + 4 * len(LEVELS)) + 4 * len(LEVELS) * index.num_buckets


def test_an_entry_longer_than_the_cache_keeps_its_end() -> None:
    cache = SuffixCache(max_requests=10, max_tokens=20, ttl_s=1e9)
    cache.add(list(range(100, 150)))
    assert cache.index is not None and cache.index.read(0, cache.index.end) == list(range(131, 150))


# ---- the tree -----------------------------------------------------------------------------


def test_tree_counts_frequencies_in_priority_order() -> None:
    continuations = [[1, 2, 3], [1, 2, 4], [1, 2, 3], [5, 6], [1, 7]]
    draft = build_draft(0, continuations, num_draft_tokens=10, min_prob=0.0)
    tree = draft.tree
    assert tree.token_ids == [0, 1, 2, 3, 5, 7, 6, 4]  # ties: shallower first, then by parent
    assert draft.probs == [1.0, 0.8, 0.6, 0.4, 0.2, 0.2, 0.2, 0.2]
    assert tree.parents == [-1, 0, 1, 2, 0, 1, 4, 2]
    for budget in range(8):  # any budget: the first nodes, a tree of its own
        pruned = build_draft(0, continuations, budget, 0.0)
        assert pruned.tree.num_drafts == budget
        assert pruned.tree.token_ids == tree.token_ids[: budget + 1]
        assert pruned.tree.parents == tree.parents[: budget + 1]


def test_tree_drops_improbable_nodes() -> None:
    continuations = [[1, 2, 3], [1, 2, 4], [1, 2, 3], [5, 6], [1, 7]]
    draft = build_draft(0, continuations, num_draft_tokens=10, min_prob=0.3)
    assert draft.tree.token_ids == [0, 1, 2, 3] and min(draft.probs) >= 0.3
    assert build_draft(0, [], 10, 0.0).tree.num_drafts == 0


# ---- the drafter --------------------------------------------------------------------------


def test_depth_follows_the_match_length() -> None:
    prompt = [50, 51, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70]
    for factor, context, depth in ((1.0, [3, 50, 51], 2), (2.0, [3, 50, 51], 4), (3.0, [3, 50, 51], 6),
                                   (1.0, prompt[:6], 6), (0.5, prompt[:6], 3)):
        drafter = SuffixDrafter(suffix_spec(suffix_spec_factor=factor))
        draft = ask(drafter, "r", [*prompt, 1, *context], budget=16, depth=16)
        assert draft.tree.max_depth == depth and draft.tree.is_chain
        assert draft.tree.token_ids[1:] == prompt[prompt.index(context[-1]) + 1:][:depth]
        assert ask(drafter, "r", [*prompt, 1, *context], budget=3, depth=2).tree.num_drafts <= 2


def test_cross_request_sharing_and_isolation() -> None:
    output = [40, 41, 42, 43, 44, 45, 46, 47]
    prompt = [7, 8, 9]
    for cross_request, max_requests in ((True, 10), (False, 10), (True, 0)):
        drafter = SuffixDrafter(suffix_spec(suffix_cross_request=cross_request,
                                            suffix_cache_max_requests=max_requests))
        ask(drafter, "first", [*prompt, output[0]])
        ask(drafter, "first", [*prompt, *output])
        drafter.free("first")
        draft = ask(drafter, "second", [1, 2, *prompt, output[0]])
        shared = cross_request and max_requests > 0
        assert draft.tree.token_ids[1:] == (output[1:5] if shared else [])  # as deep as the 4-token match
        assert (drafter.cache is not None) == shared


def test_free_caches_the_prompt_tail_and_output_once() -> None:
    drafter = SuffixDrafter(suffix_spec(suffix_max_depth=4))
    prompt, output = list(range(100, 110)), list(range(200, 220))
    ask(drafter, "a", [*prompt, output[0]])  # first seen right after the prefill
    ask(drafter, "a", [*prompt, *output])
    drafter.free("a")
    drafter.free("a")  # a second free (finish after abort) adds nothing
    assert drafter.cache is not None and drafter.cache.index is not None
    assert drafter.cache.num_requests == 1
    assert drafter.cache.index.read(0, drafter.cache.index.end) == [*prompt[-4:], *output]
    assert drafter.contexts == {}


def test_a_shorter_history_rebuilds_the_request_index() -> None:
    drafter = SuffixDrafter(suffix_spec(suffix_cross_request=False))
    ask(drafter, "r", [1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3])
    draft = ask(drafter, "r", [5, 6, 7, 5, 6])
    assert draft.tree.token_ids == [6, 7, 5]  # from the new history only


def test_factory_builds_the_suffix_drafter() -> None:
    from specdec.drafters.factory import build_drafter

    context: Any = type("Context", (), {"spec": suffix_spec()})()
    assert isinstance(build_drafter(context), SuffixDrafter)


# ---- the config ---------------------------------------------------------------------------


@pytest.mark.parametrize("key, value", [
    ("suffix_cache_max_requests", -1), ("suffix_cache_max_requests", True), ("suffix_cache_max_tokens", 1),
    ("suffix_cache_max_tokens", 1.5), ("suffix_cache_ttl_s", 0), ("suffix_cache_ttl_s", "600"),
    ("suffix_cross_request", 1), ("suffix_max_depth", 1), ("suffix_max_depth", 65), ("suffix_spec_factor", 0),
    ("suffix_min_prob", 1.5), ("suffix_min_prob", -0.1),
])
def test_bad_suffix_keys_are_named(key: str, value: Any) -> None:
    with pytest.raises(ValueError, match=key):
        SpeculativeConfig.from_dict({"method": "suffix", key: value})


def test_suffix_keys_are_refused_for_other_methods() -> None:
    with pytest.raises(ValueError, match=r"\['suffix_min_prob'\] apply to methods 'suffix' and 'hybrid' only"):
        SpeculativeConfig.from_dict({"method": "ngram", "suffix_min_prob": 0.5})
    assert suffix_spec(suffix_cache_max_requests=0, suffix_cross_request=False, suffix_min_prob=0) is not None


def test_positions_past_two_to_the_32_still_match() -> None:
    """A ring's heads are stored modulo 2**32: a long-lived cache crosses that boundary."""
    cache = SuffixCache(max_requests=10, max_tokens=100, ttl_s=1e9)
    cache.index = SuffixIndex(capacity=100, start=(1 << 32) - 24)  # as if that many tokens had passed through
    cache.add([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    cache.add([20, 21, 1, 2, 3, 4, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41])
    assert cache.index.end > 1 << 32
    found = cache.matches([0, 1, 2, 3, 4], 8)
    assert sorted(cache.continuation(p, 2) for p, _ in found) == [[5, 6], [30, 31]]


def test_bench_suffix_reports_costs_and_the_cache_helps(capsys: pytest.CaptureFixture[str]) -> None:
    from specdec.evals import bench_suffix

    report = bench_suffix.main(["--num-requests", "60", "--tokens-per-request", "80", "--decode-requests", "3"])
    assert report["cached_requests"] == 60 and report["cache_array_mb"] > 0
    steps = report["steps"]
    assert steps["suffix (full cache)"]["tokens_per_step"] > steps["suffix (own context only)"]["tokens_per_step"]
    assert all(s["propose_us_median"] > 0 for s in steps.values())
    assert "| suffix (full cache) |" in capsys.readouterr().out


def test_without_a_compiler_the_default_is_plain_and_suffix_drafting_fails_at_start(monkeypatch: Any) -> None:
    """The index is C++: where it cannot be built, the default speculation turns into plain
    decoding (one warning) and an explicit suffix drafter fails when the engine is built,
    naming the cause, rather than failing every request's draft."""
    import torch

    from specdec.config import default_speculative_config
    from specdec.drafters import suffix_index
    from specdec.kernels import cpu_build
    from specdec.model_registry import DEFAULT_MODEL

    assert default_speculative_config(DEFAULT_MODEL, torch.device("cpu")) is not None
    real_builds = cpu_build.builds
    monkeypatch.setattr(cpu_build, "builds",
                        lambda name, fallback: name != "suffix_index" and real_builds(name, fallback))
    assert default_speculative_config(DEFAULT_MODEL, torch.device("cpu")) is None

    def no_compiler(name: str) -> Any:
        raise cpu_build.KernelBuildError(f"cannot build {name}: [Errno 2] No such file or directory: 'g++'")

    monkeypatch.setattr(cpu_build, "load", no_compiler)
    suffix_index._native.cache_clear()
    try:
        with pytest.raises(cpu_build.KernelBuildError, match="g\\+\\+"):
            SuffixDrafter(SpeculativeConfig(method="suffix", num_speculative_tokens=4))
    finally:
        suffix_index._native.cache_clear()
