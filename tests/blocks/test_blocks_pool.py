"""BlockPool: O(1) allocate/free, reference counts, null block, LRU of cached blocks."""

from __future__ import annotations

import pytest

from pagedkv.blocks.events import EventLog
from pagedkv.blocks.pool import NULL_BLOCK, BlockPool
from pagedkv.errors import CacheCorruptedError, InvalidArgumentError, OutOfBlocksError


def test_null_block_is_never_handed_out():
    pool = BlockPool(5)
    assert pool.usable == 4
    got = pool.allocate(4, 0) if pool.cache_for(0) is not None else []
    assert NULL_BLOCK not in got and sorted(got) == [1, 2, 3, 4]
    with pytest.raises(OutOfBlocksError):
        pool.allocate(1, 0)


def test_pool_without_null_block_uses_every_page():
    pool = BlockPool(3, reserve_null=False)
    pool.cache_for(0)
    assert pool.usable == 3
    assert sorted(pool.allocate(3, 0)) == [0, 1, 2]


def test_too_small_pool_is_refused():
    with pytest.raises(InvalidArgumentError):
        BlockPool(1)
    with pytest.raises(InvalidArgumentError):
        BlockPool(0, reserve_null=False)


def test_release_without_hash_returns_block_to_plain_free_list():
    pool = BlockPool(4)
    pool.cache_for(0)
    a, b = pool.allocate(2, 0)
    pool.release([a, b], 0)
    assert pool.num_free() == 3 and not pool.evictable
    assert pool.used[0] == 0


def test_cached_blocks_are_evicted_least_recently_used_first():
    log = EventLog(True)
    pool = BlockPool(4, events=log)
    pool.cache_for(7)
    blocks = pool.allocate(3, 7)
    for h, b in zip((11, 22, 33), blocks):
        assert pool.cache(7, b, h)
    pool.release([blocks[1], blocks[0], blocks[2]], 7)  # LRU order: 22, 11, 33
    assert pool.num_free() == 3
    first = pool.allocate(1, 7)
    assert first == [blocks[1]] and 22 not in pool.caches[7]
    pool.touch([blocks[0]], 7)  # a hit on 11 pulls it out of the LRU
    second = pool.allocate(1, 7)
    assert second == [blocks[2]] and set(pool.caches[7]) == {11}
    removed = [e for e in log.drain() if e.kind == "removed"]
    assert [e.block_hashes for e in removed] == [(22,), (33,)]
    assert [e.seq for e in removed] == sorted(e.seq for e in removed)


def test_duplicate_hash_keeps_the_first_block():
    pool = BlockPool(4)
    pool.cache_for(0)
    a, b = pool.allocate(2, 0)
    assert pool.cache(0, a, 5)
    assert not pool.cache(0, b, 5)
    pool.release([b], 0)
    assert b in pool.free  # private block goes to the plain free list


def test_double_release_is_detected():
    pool = BlockPool(3)
    pool.cache_for(0)
    (a,) = pool.allocate(1, 0)
    pool.release([a], 0)
    with pytest.raises(CacheCorruptedError):
        pool.release([a], 0)


def test_shared_block_survives_until_last_owner_releases():
    pool = BlockPool(3)
    pool.cache_for(0)
    (a,) = pool.allocate(1, 0)
    pool.cache(0, a, 9)
    pool.touch([a], 0)
    assert pool.ref[a] == 2 and pool.used[0] == 1
    pool.release([a], 0)
    assert pool.ref[a] == 1 and a not in pool.evictable
    pool.release([a], 0)
    assert a in pool.evictable and pool.used[0] == 0


def test_clear_cache_makes_cached_free_blocks_plain_and_emits_cleared():
    log = EventLog(True)
    pool = BlockPool(3, events=log)
    pool.cache_for(2)
    (a,) = pool.allocate(1, 2)
    pool.cache(2, a, 1)
    pool.release([a], 2)
    pool.clear_cache()
    assert a in pool.free and not pool.evictable and not pool.caches[2]
    assert [e.kind for e in log.drain()] == ["cleared"]
