"""The KV block pool keeps its invariants under any sequence of operations."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.block_manager import BlockManager
from specdec.request import Request
from specdec.sampling_params import SamplingParams

BLOCK = 4
NUM_BLOCKS = 12


def new_request(i: int, tokens: list[int]) -> Request:
    return Request(f"r{i}", tokens, SamplingParams(), None, 64, set())


def check_invariants(bm: BlockManager, live: list[Request]) -> None:
    refs = [0] * bm.num_blocks
    for request in live:
        assert len(set(request.block_table)) == len(request.block_table)  # no block twice in one table
        for block_id in request.block_table:
            refs[block_id] += 1
    assert [b.ref_count for b in bm.blocks] == refs
    free = set(bm.free_blocks)
    assert free == {i for i, r in enumerate(refs) if r == 0}
    assert bm.num_free_blocks == len(free)
    for block_hash, block_id in bm.cached.items():
        assert bm.blocks[block_id].hash == block_hash


operation = st.tuples(st.sampled_from(["add", "grow", "truncate", "free", "commit"]),
                      st.integers(0, 7), st.integers(1, 20))


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(operation, max_size=60), caching=st.booleans(),
       prefixes=st.lists(st.integers(0, 3), min_size=8, max_size=8))
def test_random_operations_keep_invariants(ops: list[tuple[str, int, int]], caching: bool,
                                           prefixes: list[int]) -> None:
    bm = BlockManager(NUM_BLOCKS, BLOCK, caching)
    live: dict[int, Request] = {}
    for op, i, n in ops:
        request = live.get(i)
        if op == "add" and request is None:
            # Prompts share prefixes so the prefix cache is exercised.
            request = new_request(i, [prefixes[i]] * 6 + list(range(i, i + n)))
            bm.match_prefix(request)
            todo = request.num_tokens - request.num_computed_tokens
            if bm.can_allocate(request, todo):
                bm.allocate(request, todo)
                request.num_computed_tokens = request.num_tokens
                live[i] = request
            else:
                bm.free(request)
        elif request is not None and op == "grow" and bm.can_allocate(request, n):
            bm.allocate(request, n)  # lookahead slots, as a verify step reserves
        elif request is not None and op == "truncate":
            keep = max(request.num_computed_tokens - n, 0)
            request.num_computed_tokens = keep
            bm.truncate(request, keep)
        elif request is not None and op == "commit":
            bm.cache_blocks(request)
        elif request is not None and op == "free":
            bm.free(live.pop(i))
        check_invariants(bm, list(live.values()))
    for request in live.values():
        bm.free(request)
    assert bm.num_free_blocks == NUM_BLOCKS


def test_double_free_is_caught() -> None:
    bm = BlockManager(4, BLOCK, False)
    request = new_request(0, [1, 2, 3])
    bm.allocate(request, 3)
    table = list(request.block_table)
    bm.free(request)
    request.block_table = table
    try:
        bm.free(request)
    except RuntimeError as error:
        assert "double free" in str(error)
    else:
        raise AssertionError("double free not detected")


def computed_and_cached(bm: BlockManager, tokens: list[int]) -> Request:
    """A request whose tokens are all in the KV cache, its full blocks in the prefix cache."""
    request = new_request(0, tokens)
    bm.allocate(request, len(tokens))
    request.num_computed_tokens = len(tokens)
    bm.cache_blocks(request)
    return request


def test_prefix_blocks_are_shared_and_survive_their_owner() -> None:
    bm = BlockManager(8, BLOCK, True)
    first = computed_and_cached(bm, list(range(10)))
    second = new_request(1, list(range(9)) + [99])
    bm.match_prefix(second)
    assert second.num_computed_tokens == 8 and second.block_table == first.block_table[:2]
    assert bm.blocks[first.block_table[0]].ref_count == 2
    bm.free(first)
    third = new_request(2, list(range(9)) + [77])
    bm.match_prefix(third)
    assert third.num_computed_tokens == 8  # still cached after its first owner left
    assert (bm.num_prefix_queries, bm.num_prefix_hits) == (20, 16)  # two lookups of 10 tokens, 8 found each


def test_forget_cached_drops_entries_not_kept() -> None:
    bm = BlockManager(8, BLOCK, True)
    bm.free(computed_and_cached(bm, list(range(10))))
    bm.forget_cached(keep=set())
    again = new_request(1, list(range(10)))
    bm.match_prefix(again)
    assert again.num_computed_tokens == 0 and not bm.cached and bm.num_free_blocks == 8
