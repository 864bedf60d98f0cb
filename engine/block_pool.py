"""Block pool: ids, refcounts and the prefix cache of one worker's global-KV blocks.

A block is storage for one chunk of global KV across all KV-source groups. Every block is in
exactly one of three states:

    free       refcount 0, no hash      in `_free` (FIFO: lowest ids first initially, released
                                        blocks join the back)
    cached     refcount 0, has a hash   in `_evictable` (LRU: the front is the least recently
                                        released, evicted first)
    referenced refcount > 0             owned by one or more requests; may also have a hash

    num_free + num_cached + num_referenced == num_blocks

Allocation takes free blocks first and evicts cached ones only when the free list runs dry, so
the prefix cache keeps everything until memory is actually needed. Cached blocks are immutable:
only full chunks get a hash, and nobody writes into a full chunk again.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence

from flashpd.engine.events import AllCleared, BlockRemoved, BlockStored, KVCacheEvent


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._refcounts = [0] * num_blocks
        self._hash_of_block: dict[int, str] = {}
        self._block_of_hash: dict[str, int] = {}
        self._events: list[KVCacheEvent] = []

    # ---- counters -------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Unreferenced cached blocks (evictable)."""
        return len(self._evictable)

    @property
    def num_referenced(self) -> int:
        return self.num_blocks - self.num_free - self.num_cached

    @property
    def num_allocatable(self) -> int:
        return self.num_free + self.num_cached

    # ---- queries --------------------------------------------------------------------------

    def cached_block(self, block_hash: str) -> int | None:
        return self._block_of_hash.get(block_hash)

    def block_hash(self, block_id: int) -> str | None:
        self._check_id(block_id)
        return self._hash_of_block.get(block_id)

    def refcount(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._refcounts[block_id]

    # ---- mutations ------------------------------------------------------------------------

    def allocate(self, num_blocks: int) -> list[int] | None:
        """`num_blocks` blocks with refcount 1, or None (and no change) when too few are left."""
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > self.num_allocatable:
            return None
        block_ids = []
        evicted_hashes = []
        for _ in range(num_blocks):
            if self._free:
                block_id = self._free.popleft()
            else:
                block_id, _ = self._evictable.popitem(last=False)
                evicted_hashes.append(self._uncache(block_id))
            self._refcounts[block_id] = 1
            block_ids.append(block_id)
        if evicted_hashes:
            self._events.append(BlockRemoved(tuple(evicted_hashes)))
        return block_ids

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take one more reference on cached or referenced blocks (a prefix hit reusing them)."""
        for block_id in block_ids:
            self._check_id(block_id)
            if self._refcounts[block_id] == 0:
                if block_id not in self._evictable:
                    raise ValueError(f"block {block_id} is free and uncached: nothing to reuse")
                del self._evictable[block_id]
            self._refcounts[block_id] += 1

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference each, in the given order (which sets the eviction order)."""
        for block_id in block_ids:
            self._check_id(block_id)
            if self._refcounts[block_id] <= 0:
                raise ValueError(f"block {block_id} released more often than referenced")
            self._refcounts[block_id] -= 1
            if self._refcounts[block_id] > 0:
                continue
            if block_id in self._hash_of_block:
                self._evictable[block_id] = None
            else:
                self._free.append(block_id)

    def store(self, blocks_and_hashes: Sequence[tuple[int, str]]) -> list[str]:
        """Mark referenced blocks as cached under their chunk hashes; emit one BlockStored.

        A hash that is already cached in another block (two requests computed the same chunk
        at once) is skipped: that block stays uncached and returns to the free list later.
        Returns the hashes actually stored.
        """
        stored = []
        for block_id, block_hash in blocks_and_hashes:
            self._check_id(block_id)
            if self._refcounts[block_id] == 0:
                raise ValueError(f"block {block_id} is not referenced; only owners may store it")
            if block_id in self._hash_of_block:
                raise ValueError(f"block {block_id} is already cached")
            if block_hash in self._block_of_hash:
                continue
            self._hash_of_block[block_id] = block_hash
            self._block_of_hash[block_hash] = block_id
            stored.append(block_hash)
        if stored:
            self._events.append(BlockStored(tuple(stored)))
        return stored

    def clear_cache(self) -> None:
        """Forget every hash: cached blocks become free (in LRU order), referenced ones stay."""
        for block_id in self._evictable:
            self._free.append(block_id)
        self._evictable.clear()
        self._hash_of_block.clear()
        self._block_of_hash.clear()
        self._events.append(AllCleared())

    def drain_events(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events

    def drain_snapshot(self) -> list[KVCacheEvent]:
        """The whole cache state as events (AllCleared, then BlockStored of every cached hash),
        replacing the pending events: for a subscriber that lost what it was told."""
        self._events = []
        hashes = tuple(self._block_of_hash)
        return [AllCleared()] + ([BlockStored(hashes)] if hashes else [])

    # ---- checks ---------------------------------------------------------------------------

    def check_consistency(self) -> None:
        """Raise RuntimeError when the three block states stop partitioning the pool."""
        free, evictable = set(self._free), set(self._evictable)
        referenced = {b for b in range(self.num_blocks) if self._refcounts[b] > 0}
        problems = []
        if len(free) != len(self._free):
            problems.append("a block is twice in the free list")
        if free & evictable or free & referenced or evictable & referenced:
            problems.append("a block is in two states")
        if len(free) + len(evictable) + len(referenced) != self.num_blocks:
            problems.append("a block is in no state")
        if any(count < 0 for count in self._refcounts):
            problems.append("negative refcount")
        if free & set(self._hash_of_block) or not evictable <= set(self._hash_of_block):
            problems.append("free blocks must be uncached and evictable blocks cached")
        if {b: h for h, b in self._block_of_hash.items()} != self._hash_of_block:
            problems.append("hash maps disagree")
        if problems:
            raise RuntimeError("block pool inconsistent: " + "; ".join(problems))

    # ---- helpers --------------------------------------------------------------------------

    def _uncache(self, block_id: int) -> str:
        block_hash = self._hash_of_block.pop(block_id)
        del self._block_of_hash[block_hash]
        return block_hash

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} out of range [0, {self.num_blocks})")
