import pytest

from flashpd.engine.events import AllCleared, BlockRemoved, BlockStored
from flashpd.engine.hashing import chunk_hashes
from flashpd.engine.kv_cache_manager import NO_HIT, KVCacheManager

NS = "tiny|"
C = 4  # chunk tokens in these tests; replay defaults to one chunk


def manager(num_blocks: int = 8, num_slots: int = 4, **kwargs) -> KVCacheManager:
    return KVCacheManager(num_blocks, num_slots, C, namespace=NS, **kwargs)


def prefill(kv: KVCacheManager, request_id: str, tokens: list[int]) -> tuple[int, ...]:
    """Allocate with whatever hit there is, compute everything, commit; the block table."""
    hit = kv.lookup(tokens)
    allocation = kv.allocate(request_id, tokens, len(tokens) - hit.usable_tokens, hit)
    assert allocation is not None
    kv.commit(request_id, tokens, len(tokens))
    return allocation.block_ids


def test_allocate_gives_lowest_blocks_and_slot():
    kv = manager()
    allocation = kv.allocate("a", list(range(10)), 10)
    assert allocation.block_ids == (0, 1, 2)
    assert allocation.slot == 0
    assert allocation.start_token == 0 and allocation.num_hit_blocks == 0
    assert kv.allocate("b", list(range(3)), 3).block_ids == (3,)
    assert kv.slot("b") == 1
    assert kv.block_table("a") == [0, 1, 2]


def test_allocate_returns_none_without_change_when_blocks_or_slots_are_short():
    kv = manager(num_blocks=3, num_slots=1)
    assert kv.allocate("a", list(range(16)), 16) is None  # 4 blocks > 3
    assert kv.usage()["blocks_free"] == 3 and not kv.holds("a")
    assert kv.allocate("a", list(range(4)), 4) is not None
    assert kv.allocate("b", list(range(4)), 4) is None  # no slot left
    assert kv.usage() == {
        "blocks_total": 3,
        "blocks_free": 2,
        "blocks_cached": 0,
        "blocks_used": 1,
        "slots_total": 1,
        "slots_free": 0,
        "slots_used": 1,
        "requests": 1,
    }


def test_commit_caches_only_full_computed_chunks():
    kv = manager()
    tokens = list(range(10))
    kv.allocate("a", tokens, 10)
    assert kv.commit("a", tokens, 3) == []
    assert kv.commit("a", tokens, 9) == chunk_hashes(tokens, NS, C)  # chunks 0 and 1
    assert kv.commit("a", tokens, 10) == []  # chunk 2 is partial
    assert kv.drain_events() == [BlockStored(tuple(chunk_hashes(tokens, NS, C)))]
    with pytest.raises(ValueError):
        kv.commit("a", tokens, 13)  # beyond its 3 blocks


def test_lookup_counts_whole_chunks_and_has_no_side_effects():
    kv = manager()
    prefill(kv, "a", list(range(10)))
    before = kv.usage()
    hit = kv.lookup(list(range(10)) + [77])
    assert (hit.hit_tokens, hit.usable_tokens, hit.block_ids) == (8, 4, (0, 1))
    assert hit.replay_tokens == 4
    assert kv.usage() == before
    assert kv.lookup([0, 1, 2, 99, 4, 5, 6, 7]).hit_tokens == 0  # chunk 0 differs
    assert kv.lookup([0, 1, 2]) == NO_HIT  # no full chunk


def test_hit_blocks_are_reused_with_refcount_and_new_blocks_follow():
    kv = manager()
    prefill(kv, "a", list(range(10)))  # blocks 0, 1, 2; chunks 0 and 1 cached
    tokens_b = list(range(8)) + [50, 51, 52, 53, 54]
    hit = kv.lookup(tokens_b)
    allocation = kv.allocate("b", tokens_b, len(tokens_b) - hit.usable_tokens, hit)
    assert allocation.block_ids == (0, 1, 3, 4)
    assert allocation.num_hit_blocks == 2 and allocation.start_token == 4
    kv.free("a")
    # Blocks 0 and 1 are still owned by b; block 2 (uncached) went back to the free list.
    assert kv.usage()["blocks_used"] == 4 and kv.usage()["blocks_cached"] == 0
    kv.check_consistency()


def test_a_one_chunk_hit_has_no_credit_but_its_block_is_reused():
    kv = manager()
    prefill(kv, "a", list(range(6)))  # chunk 0 cached in block 0
    hit = kv.lookup(list(range(6)))
    assert (hit.hit_tokens, hit.usable_tokens, hit.block_ids) == (4, 0, (0,))
    allocation = kv.allocate("b", list(range(6)), 6, hit)
    assert allocation.block_ids == (0, 2)
    assert allocation.start_token == 0


def test_free_releases_the_tail_first_so_it_is_evicted_first():
    kv = manager(num_blocks=4)
    prefill(kv, "a", list(range(16)))  # blocks 0..3, all 4 chunks cached
    kv.free("a")
    kv.drain_events()
    hashes = chunk_hashes(list(range(16)), NS, C)
    assert kv.allocate("b", [9] * 8, 8).block_ids == (3, 2)
    assert kv.drain_events() == [BlockRemoved((hashes[3], hashes[2]))]
    hit = kv.lookup(list(range(16)))
    assert hit.block_ids == (0, 1)  # the head of the prefix survived


def test_evictable_hit_blocks_are_not_counted_as_room_for_the_same_request():
    kv = manager(num_blocks=2)
    prefill(kv, "a", list(range(4)))  # block 0 cached
    kv.free("a")
    tokens = list(range(4)) + [8, 9, 10, 11, 12]
    hit = kv.lookup(tokens)
    assert hit.block_ids == (0,)
    # Needs block 0 (hit) + 2 new blocks; only block 1 is free, block 0 cannot be evicted for it.
    assert kv.allocate("b", tokens, len(tokens) - hit.usable_tokens, hit) is None
    assert kv.lookup(tokens) == hit
    kv.check_consistency()


def test_stale_hit_is_rejected():
    kv = manager(num_blocks=2)
    prefill(kv, "a", list(range(4)))
    kv.free("a")
    hit = kv.lookup(list(range(4)))
    kv.allocate("x", [5] * 8, 8)  # evicts block 0
    with pytest.raises(ValueError, match="stale"):
        kv.allocate("b", list(range(4)), 4, hit)


def test_grow_adds_blocks_as_decode_proceeds():
    kv = manager(num_blocks=3)
    kv.allocate("a", list(range(4)), 4)
    assert kv.grow("a", 4) == []
    assert kv.grow("a", 5) == [1]
    assert kv.grow("a", 12) == [2]
    assert kv.grow("a", 13) is None
    assert kv.block_table("a") == [0, 1, 2]


def test_duplicate_chunk_from_a_concurrent_request_is_not_cached_twice():
    kv = manager()
    tokens = list(range(8))
    kv.allocate("a", tokens, 8)
    kv.allocate("b", tokens, 8)  # both miss: nothing committed yet
    assert kv.commit("a", tokens, 8) == chunk_hashes(tokens, NS, C)
    assert kv.commit("b", tokens, 8) == []
    kv.free("a")
    kv.free("b")
    assert kv.usage()["blocks_cached"] == 2 and kv.usage()["blocks_free"] == 6
    assert kv.lookup(tokens).block_ids == (0, 1)


def test_free_returns_the_slot_and_release_slot_keeps_blocks():
    kv = manager(num_slots=2)
    kv.allocate("a", list(range(4)), 4)
    kv.allocate("b", list(range(4)), 4)
    kv.release_slot("a")
    assert kv.usage()["slots_free"] == 1 and kv.block_table("a") == [0]
    with pytest.raises(ValueError):
        kv.slot("a")
    assert kv.allocate("c", [1], 1).slot == 0
    kv.free("a")
    assert kv.usage()["slots_free"] == 0
    with pytest.raises(KeyError):
        kv.free("a")


def test_reset_drops_the_prefix_cache():
    kv = manager()
    prefill(kv, "a", list(range(8)))
    prefill(kv, "b", [7] * 4)
    kv.free("a")
    kv.drain_events()
    kv.reset()
    assert kv.drain_events() == [AllCleared()]
    assert kv.lookup(list(range(8))) == NO_HIT
    assert kv.lookup([7] * 4) == NO_HIT
    assert kv.usage()["blocks_cached"] == 0 and kv.usage()["blocks_used"] == 1
    kv.free("b")
    assert kv.usage()["blocks_free"] == 8


def test_allocate_checks_its_arguments():
    kv = manager()
    with pytest.raises(ValueError):
        kv.allocate("a", [1, 2], 3)
    kv.allocate("a", [1, 2], 2)
    with pytest.raises(ValueError):
        kv.allocate("a", [1, 2], 2)
    with pytest.raises(KeyError):
        kv.grow("nobody", 3)


def test_real_sizes_credit_whole_chunks_minus_the_128_token_replay():
    kv = KVCacheManager(8, 2, namespace=NS)  # 128-token chunks, 128-token replay
    prompt = list(range(300))
    prefill(kv, "a", prompt)  # chunks 0 and 1 cached, the 44-token tail is not
    kv.free("a")
    hit = kv.lookup(prompt + [1, 2, 3])
    assert (hit.hit_tokens, hit.usable_tokens, hit.block_ids) == (256, 128, (0, 1))
    assert kv.lookup(prompt[:255]).hit_tokens == 128
    assert kv.lookup(prompt[:255]).usable_tokens == 0


def test_shrink_releases_blocks_a_rejected_draft_was_given():
    kv = manager(num_blocks=8)
    tokens = list(range(10))
    kv.allocate("a", tokens, 10)
    kv.commit("a", tokens, 10)  # chunks 0, 1 hashed (8 tokens)
    assert kv.grow("a", 10 + 5) == [3]  # a verify of 5 drafts past 12 tokens: one more block
    free = kv.usage()["blocks_free"]
    assert kv.shrink("a", 11) == [3]  # one draft accepted + the target's token: 11 known
    assert kv.block_table("a") == [0, 1, 2] and kv.usage()["blocks_free"] == free + 1
    assert kv.shrink("a", 1) == [2]  # never a block of a hashed chunk
    assert kv.block_table("a") == [0, 1]
    kv.check_consistency()
