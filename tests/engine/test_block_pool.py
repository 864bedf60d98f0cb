import pytest

from flashpd.engine.block_pool import BlockPool
from flashpd.engine.events import AllCleared, BlockRemoved, BlockStored


def counts(pool: BlockPool) -> tuple[int, int, int]:
    return pool.num_free, pool.num_cached, pool.num_referenced


def test_allocates_lowest_ids_first():
    pool = BlockPool(6)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) == [3, 4]
    assert counts(pool) == (1, 0, 5)


def test_released_uncached_blocks_join_the_back_of_the_free_list():
    pool = BlockPool(6)
    assert pool.allocate(3) == [0, 1, 2]
    pool.release([1])
    assert pool.allocate(4) == [3, 4, 5, 1]


def test_allocate_returns_none_and_changes_nothing_when_short():
    pool = BlockPool(4)
    pool.allocate(3)
    assert pool.allocate(2) is None
    assert counts(pool) == (1, 0, 3)
    assert pool.allocate(1) == [3]


def test_cached_blocks_become_evictable_and_free_blocks_go_first():
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    assert pool.store([(0, "h0"), (1, "h1")]) == ["h0", "h1"]
    pool.release([0, 1])
    assert counts(pool) == (2, 2, 0)
    assert pool.allocate(2) == [2, 3]  # free blocks before any eviction
    assert pool.cached_block("h0") == 0
    assert pool.drain_events() == [BlockStored(("h0", "h1"))]


def test_eviction_takes_the_least_recently_released_first():
    pool = BlockPool(4)
    pool.allocate(4)
    pool.store([(0, "h0"), (1, "h1"), (2, "h2"), (3, "h3")])
    pool.release([2])
    pool.release([0, 3])
    pool.release([1])
    pool.drain_events()
    assert pool.allocate(3) == [2, 0, 3]
    assert pool.drain_events() == [BlockRemoved(("h2", "h0", "h3"))]
    assert pool.cached_block("h0") is None
    assert pool.cached_block("h1") == 1
    assert counts(pool) == (0, 1, 3)


def test_touch_takes_a_cached_block_out_of_the_lru():
    pool = BlockPool(2)
    pool.allocate(2)
    pool.store([(0, "h0"), (1, "h1")])
    pool.release([0, 1])
    pool.touch([0])
    assert pool.refcount(0) == 1
    assert pool.allocate(2) is None
    assert pool.allocate(1) == [1]
    pool.touch([0])
    assert pool.refcount(0) == 2


def test_touch_of_a_free_uncached_block_is_an_error():
    pool = BlockPool(2)
    with pytest.raises(ValueError):
        pool.touch([0])


def test_shared_block_returns_to_the_lru_only_after_its_last_owner():
    pool = BlockPool(2)
    pool.allocate(1)
    pool.store([(0, "h0")])
    pool.touch([0])
    pool.release([0])
    assert counts(pool) == (1, 0, 1)
    pool.release([0])
    assert counts(pool) == (1, 1, 0)


def test_storing_an_already_cached_hash_keeps_the_first_block():
    pool = BlockPool(3)
    pool.allocate(2)
    assert pool.store([(0, "h")]) == ["h"]
    assert pool.store([(1, "h")]) == []
    assert pool.block_hash(1) is None
    pool.release([1])
    assert counts(pool) == (2, 0, 1)  # the duplicate went back to the free list
    assert pool.drain_events() == [BlockStored(("h",))]


def test_store_needs_an_owner_and_an_uncached_block():
    pool = BlockPool(2)
    with pytest.raises(ValueError):
        pool.store([(0, "h")])
    pool.allocate(1)
    pool.store([(0, "h")])
    with pytest.raises(ValueError):
        pool.store([(0, "other")])


def test_clear_cache_frees_evictable_blocks_and_unhashes_referenced_ones():
    pool = BlockPool(3)
    pool.allocate(3)
    pool.store([(0, "h0"), (1, "h1"), (2, "h2")])
    pool.release([2, 0])
    pool.drain_events()
    pool.clear_cache()
    assert pool.drain_events() == [AllCleared()]
    assert counts(pool) == (2, 0, 1)
    assert pool.block_hash(1) is None and pool.cached_block("h1") is None
    pool.release([1])
    assert pool.allocate(3) == [2, 0, 1]
    pool.check_consistency()


def test_release_beyond_refcount_and_bad_ids_raise():
    pool = BlockPool(2)
    with pytest.raises(ValueError):
        pool.release([0])
    with pytest.raises(ValueError):
        pool.refcount(2)
    with pytest.raises(ValueError):
        BlockPool(0)


def test_consistency_check_catches_corruption():
    pool = BlockPool(3)
    pool.allocate(1)
    pool.check_consistency()
    pool._free.append(0)  # corrupt on purpose: block 0 is referenced
    with pytest.raises(RuntimeError):
        pool.check_consistency()


def test_snapshot_lists_every_cached_hash_and_replaces_pending_events():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    pool.store([(blocks[0], "h0"), (blocks[1], "h1")])
    pool.release(blocks)  # cached blocks stay listed once unreferenced
    assert pool.drain_snapshot() == [AllCleared(), BlockStored(("h0", "h1"))]
    assert pool.drain_events() == []
    pool.clear_cache()
    assert pool.drain_snapshot() == [AllCleared()]
