"""The paged KV block pool: allocation, freeing, rollback and prefix caching."""
from __future__ import annotations

from collections import OrderedDict

from specdec.request import Request


class Block:
    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None  # set once the block holds a full, committed prefix block


class BlockManager:
    """Blocks are shared by reference count; freed blocks keep their hash until reused,
    so a later request with the same prefix can take them back (LRU eviction)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_blocks: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # hash -> block id
        # Tokens looked up in the prefix cache, and found there (vLLM's prefix_cache_queries/hits).
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_slots: int) -> int:
        return (num_slots + self.block_size - 1) // self.block_size

    def can_allocate(self, request: Request, num_new_tokens: int) -> bool:
        slots = request.num_computed_tokens + num_new_tokens
        return self.blocks_needed(slots) - len(request.block_table) <= self.num_free_blocks

    def allocate(self, request: Request, num_new_tokens: int) -> None:
        """Grow the block table to hold num_computed_tokens + num_new_tokens slots."""
        slots = request.num_computed_tokens + num_new_tokens
        while len(request.block_table) < self.blocks_needed(slots):
            request.block_table.append(self._take_free().block_id)

    def truncate(self, request: Request, num_slots: int) -> None:
        """Roll back: release blocks past the first num_slots slots."""
        keep = self.blocks_needed(num_slots)
        while len(request.block_table) > keep:
            self._release(request.block_table.pop())

    def free(self, request: Request) -> None:
        # Release in reverse so a request's tail is evicted before its shareable head.
        for block_id in reversed(request.block_table):
            self._release(block_id)
        request.block_table = []

    def match_prefix(self, request: Request) -> None:
        """Take cached blocks for the longest hashed prefix of a request starting fresh."""
        if not self.enable_prefix_caching or request.block_table:
            return
        # At least one token must run through the model to produce logits.
        limit = (request.num_tokens - 1) // self.block_size
        for i in range(limit):
            block_id = self.cached.get(self._block_hash(request, i))
            if block_id is None:
                break
            self._ref(block_id)
            request.block_table.append(block_id)
        request.num_computed_tokens = len(request.block_table) * self.block_size
        request.num_cached_tokens = request.num_computed_tokens
        self.num_prefix_queries += request.num_tokens
        self.num_prefix_hits += request.num_cached_tokens

    def cache_blocks(self, request: Request) -> None:
        """Register hashes for full blocks whose tokens are all computed and committed."""
        if not self.enable_prefix_caching:
            return
        for i in range(request.num_computed_tokens // self.block_size):
            block_hash = self._block_hash(request, i)
            block = self.blocks[request.block_table[i]]
            if block.hash is None and block_hash not in self.cached:
                block.hash = block_hash
                self.cached[block_hash] = block.block_id

    def forget_cached(self, keep: set[int]) -> None:
        """Drop every prefix-cache entry whose hash is not in `keep` (vLLM's reset_prefix_cache,
        partial); a freed block among them is reused first, as uncached blocks are."""
        for block_hash in [h for h in self.cached if h not in keep]:
            block = self.blocks[self.cached.pop(block_hash)]
            block.hash = None
            if block.ref_count == 0:
                self.free_blocks.move_to_end(block.block_id, last=False)

    def _block_hash(self, request: Request, index: int) -> int:
        """Hash of block `index` chained with every block before it (memoised on the request)."""
        hashes = request.block_hashes
        while len(hashes) <= index:
            start = len(hashes) * self.block_size
            parent = hashes[-1] if hashes else None
            hashes.append(hash((parent, tuple(request.all_token_ids[start : start + self.block_size]))))
        return hashes[index]

    def _take_free(self) -> Block:
        block_id, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict its cached contents
            del self.cached[block.hash]
            block.hash = None
        block.ref_count = 1
        return block

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_blocks[block_id]
        block.ref_count += 1

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise RuntimeError(f"double free of KV block {block_id}")
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_blocks[block_id] = None
            if block.hash is None:
                self.free_blocks.move_to_end(block_id, last=False)  # reuse uncached blocks first
