"""KV cache manager: one block table (global KV) and one slot (private state) per request.

Global KV (compressed entries + index keys of every KV source) lives in blocks of one chunk each,
prefix-cached by chained chunk hash. Private state (window rings, ratio-2 open-group rows, Engram
token history) lives in a slot, never cached or shared. Data in, data out: methods take token ids
and counts and return block ids, slots, or None when memory is short (and then change nothing).

Prefix hits and bounded replay (model_spec.md §11.4), block size c, replay length r:

    tokens   0 ........................ usable ........ hit ............ N
    blocks   [ hit blocks, reused with refcount+1       ][ new blocks      ]
    compute                             [ replay:       ][ normal          ]
                                          private state   global + private
                                          only, global
                                          writes suppressed

    hit = whole cached chunks (c-aligned), usable = hit - r (0 when that is not > 0)

The replayed chunks' global KV is never rewritten, so every hit block is reused even though the
last r hit tokens are recomputed.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from flashpd.engine.block_pool import BlockPool
from flashpd.engine.events import KVCacheEvent
from flashpd.engine.hashing import next_chunk_hash, root_hash, usable_prefix_tokens


@dataclass(frozen=True)
class PrefixHit:
    hit_tokens: int  # whole cached chunks, in tokens
    usable_tokens: int  # tokens that need no recompute: hit - replay, or 0
    block_ids: tuple[int, ...]  # one per hit chunk
    block_hashes: tuple[str, ...]  # their chunk hashes (to check the hit is still current)

    @property
    def replay_tokens(self) -> int:
        return self.hit_tokens - self.usable_tokens


NO_HIT = PrefixHit(hit_tokens=0, usable_tokens=0, block_ids=(), block_hashes=())


@dataclass(frozen=True)
class Allocation:
    request_id: str
    slot: int
    block_ids: tuple[int, ...]  # the whole block table
    num_hit_blocks: int  # block_ids[:num_hit_blocks] came from the prefix cache
    start_token: int  # first token to compute (= the hit's usable tokens)


@dataclass
class _Held:
    block_ids: list[int]
    slot: int | None  # None once a finished prefill releases its slot but keeps its blocks
    chunk_hashes: list[str]  # hashes of this request's committed full chunks, in order


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        num_slots: int,
        chunk_tokens: int = 128,
        *,
        namespace: str,
        replay_tokens: int | None = None,
    ) -> None:
        if num_slots <= 0 or chunk_tokens <= 0:
            raise ValueError(f"num_slots and chunk_tokens must be > 0, got {num_slots}, {chunk_tokens}")
        # The real model's window (the replay) is one chunk long: 128 tokens.
        self.replay_tokens = chunk_tokens if replay_tokens is None else replay_tokens
        if self.replay_tokens < 0:
            raise ValueError(f"replay_tokens must be >= 0, got {replay_tokens}")
        self.chunk_tokens = chunk_tokens
        self.num_slots = num_slots
        self.namespace = namespace
        self._pool = BlockPool(num_blocks)
        self._free_slots = list(range(num_slots))  # min-heap: the lowest free slot first
        self._held: dict[str, _Held] = {}
        self._root_hash = root_hash(namespace)

    @property
    def num_blocks(self) -> int:
        return self._pool.num_blocks

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.chunk_tokens)

    # ---- prefix lookup --------------------------------------------------------------------

    def lookup(self, token_ids: Sequence[int]) -> PrefixHit:
        """The longest cached run of whole chunks at the start of `token_ids`; no side effects."""
        block_ids, hashes = [], []
        parent = self._root_hash
        c = self.chunk_tokens
        for begin in range(0, len(token_ids) - c + 1, c):
            parent = next_chunk_hash(parent, token_ids[begin : begin + c])
            block_id = self._pool.cached_block(parent)
            if block_id is None:
                break
            block_ids.append(block_id)
            hashes.append(parent)
        hit_tokens = len(block_ids) * c
        usable = usable_prefix_tokens(hit_tokens, c, self.replay_tokens)
        return PrefixHit(hit_tokens, usable, tuple(block_ids), tuple(hashes))

    # ---- allocation -----------------------------------------------------------------------

    def allocate(
        self, request_id: str, token_ids: Sequence[int], num_new_tokens: int, hit: PrefixHit | None = None
    ) -> Allocation | None:
        """Blocks for tokens [0, usable + num_new_tokens) plus a slot, or None (no change).

        `hit` must come from `lookup(token_ids)` with no other manager call in between.
        """
        if request_id in self._held:
            raise ValueError(f"request {request_id!r} already holds KV")
        hit = NO_HIT if hit is None else hit
        end_token = hit.usable_tokens + num_new_tokens
        if num_new_tokens < 0 or end_token > len(token_ids) or hit.hit_tokens > len(token_ids):
            raise ValueError(
                f"request {request_id!r}: {num_new_tokens} new tokens after {hit.usable_tokens} "
                f"usable (hit {hit.hit_tokens}) do not fit in {len(token_ids)} tokens"
            )
        self._check_hit_current(hit)
        num_hit_blocks = len(hit.block_ids)
        num_new_blocks = max(self.blocks_for_tokens(end_token) - num_hit_blocks, 0)
        # Hit blocks sitting in the evictable LRU are reused, so they cannot also be evicted.
        num_evictable_hits = sum(1 for b in hit.block_ids if self._pool.refcount(b) == 0)
        if not self._free_slots or num_new_blocks > self._pool.num_allocatable - num_evictable_hits:
            return None
        self._pool.touch(hit.block_ids)
        new_block_ids = self._pool.allocate(num_new_blocks)
        assert new_block_ids is not None  # capacity was checked above
        slot = heapq.heappop(self._free_slots)
        block_ids = list(hit.block_ids) + new_block_ids
        self._held[request_id] = _Held(block_ids, slot, list(hit.block_hashes))
        return Allocation(request_id, slot, tuple(block_ids), num_hit_blocks, hit.usable_tokens)

    def grow(self, request_id: str, total_tokens: int) -> list[int] | None:
        """Extend the block table to hold `total_tokens`; the new block ids, or None (no change)."""
        held = self._get(request_id)
        num_missing = self.blocks_for_tokens(total_tokens) - len(held.block_ids)
        if num_missing <= 0:
            return []
        new_block_ids = self._pool.allocate(num_missing)
        if new_block_ids is None:
            return None
        held.block_ids.extend(new_block_ids)
        return new_block_ids

    def shrink(self, request_id: str, total_tokens: int) -> list[int]:
        """Release trailing blocks beyond those `total_tokens` need (a rejected speculative
        draft's); never a block that holds a committed (hashed) chunk. Returns the ids."""
        held = self._get(request_id)
        keep = max(self.blocks_for_tokens(total_tokens), len(held.chunk_hashes))
        extra = held.block_ids[keep:]
        if extra:
            del held.block_ids[keep:]
            self._pool.release(extra[::-1])
        return extra

    def commit(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> list[str]:
        """Cache every full chunk whose global KV is now computed; returns the hashes stored."""
        held = self._get(request_id)
        if num_computed_tokens > min(len(token_ids), len(held.block_ids) * self.chunk_tokens):
            raise ValueError(
                f"request {request_id!r}: {num_computed_tokens} computed tokens exceed its "
                f"{len(token_ids)} tokens or {len(held.block_ids)} blocks"
            )
        c = self.chunk_tokens
        first_chunk = len(held.chunk_hashes)
        parent = held.chunk_hashes[-1] if held.chunk_hashes else self._root_hash
        for chunk_index in range(first_chunk, num_computed_tokens // c):
            parent = next_chunk_hash(parent, token_ids[chunk_index * c : (chunk_index + 1) * c])
            held.chunk_hashes.append(parent)
        new_chunks = range(first_chunk, len(held.chunk_hashes))
        return self._pool.store([(held.block_ids[i], held.chunk_hashes[i]) for i in new_chunks])

    def free(self, request_id: str) -> None:
        """Drop the request's blocks (last chunk first, so a prefix's tail is evicted before its
        head) and its slot."""
        held = self._held.pop(request_id, None)
        if held is None:
            raise KeyError(f"request {request_id!r} holds no KV")
        self._pool.release(held.block_ids[::-1])
        if held.slot is not None:
            heapq.heappush(self._free_slots, held.slot)

    def release_slot(self, request_id: str) -> None:
        """Free only the slot; the blocks stay (a finished prefill whose KV is still being sent)."""
        held = self._get(request_id)
        if held.slot is None:
            raise ValueError(f"request {request_id!r} already released its slot")
        heapq.heappush(self._free_slots, held.slot)
        held.slot = None

    def reset(self) -> None:
        """Drop the whole prefix cache (AllCleared); blocks in use stay with their owners."""
        self._pool.clear_cache()

    def drain_events(self) -> list[KVCacheEvent]:
        return self._pool.drain_events()

    def drain_snapshot(self) -> list[KVCacheEvent]:
        """Every cached chunk as events (AllCleared + BlockStored), in place of pending events."""
        return self._pool.drain_snapshot()

    # ---- views ----------------------------------------------------------------------------

    def holds(self, request_id: str) -> bool:
        return request_id in self._held

    def block_table(self, request_id: str) -> list[int]:
        return list(self._get(request_id).block_ids)

    def slot(self, request_id: str) -> int:
        slot = self._get(request_id).slot
        if slot is None:
            raise ValueError(f"request {request_id!r} released its slot")
        return slot

    def usage(self) -> dict[str, int]:
        return {
            "blocks_total": self._pool.num_blocks,
            "blocks_free": self._pool.num_free,
            "blocks_cached": self._pool.num_cached,
            "blocks_used": self._pool.num_referenced,
            "slots_total": self.num_slots,
            "slots_free": len(self._free_slots),
            "slots_used": self.num_slots - len(self._free_slots),
            "requests": len(self._held),
        }

    def check_consistency(self) -> None:
        """Raise RuntimeError unless refcounts equal table references and slots are disjoint."""
        self._pool.check_consistency()
        references = [0] * self._pool.num_blocks
        for held in self._held.values():
            for block_id in held.block_ids:
                references[block_id] += 1
        actual = [self._pool.refcount(b) for b in range(self._pool.num_blocks)]
        if references != actual:
            raise RuntimeError("block refcounts differ from the block tables that hold them")
        held_slots = [h.slot for h in self._held.values() if h.slot is not None]
        all_slots = sorted(held_slots + self._free_slots)
        if all_slots != list(range(self.num_slots)):
            raise RuntimeError(f"slots leaked or doubly owned: {all_slots}")

    # ---- helpers --------------------------------------------------------------------------

    def _get(self, request_id: str) -> _Held:
        held = self._held.get(request_id)
        if held is None:
            raise KeyError(f"request {request_id!r} holds no KV")
        return held

    def _check_hit_current(self, hit: PrefixHit) -> None:
        if len(hit.block_ids) != len(hit.block_hashes) or hit.hit_tokens != len(hit.block_ids) * self.chunk_tokens:
            raise ValueError(f"malformed prefix hit: {hit}")
        for block_id, block_hash in zip(hit.block_ids, hit.block_hashes, strict=True):
            if self._pool.block_hash(block_id) != block_hash:
                raise ValueError(f"stale prefix hit: block {block_id} no longer holds {block_hash}")
