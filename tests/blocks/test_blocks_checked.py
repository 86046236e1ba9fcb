"""Checked mode: a subclass; incremental checks catch what a call touched, the periodic
(or requested) full sweep catches the rest; a corrupted manager refuses every call."""

from __future__ import annotations

import pytest
from block_groups import full_only

from pagedkv.blocks import CheckedKVCacheManager, KVCacheManager
from pagedkv.errors import CacheCorruptedError, InvalidArgumentError


def run_one(m, rid, n=8):
    m.add_request(rid, list(range(100, 100 + n)))
    hit = m.find_cached_prefix(rid)
    assert m.allocate(rid, n - hit)
    m.commit(rid, n - hit, [7])


def test_checked_builds_the_subclass_and_unchecked_the_plain_manager():
    assert type(KVCacheManager(full_only(), checked=True)) is CheckedKVCacheManager
    assert type(KVCacheManager(full_only(), checked=False)) is KVCacheManager
    with pytest.raises(InvalidArgumentError, match="sweep_every"):
        KVCacheManager(full_only(), checked=True, sweep_every=0)


def test_a_call_that_touches_a_corrupted_block_is_caught_without_a_sweep():
    m = KVCacheManager(full_only(), checked=True, sweep_every=10**9, max_batched_tokens=64)
    run_one(m, "a")
    last = m.block_tables("a")[0][-1]
    m.pools[0].ref[last] = 0  # the request still holds it: a use after free in waiting
    with pytest.raises(CacheCorruptedError, match="blocks belong to their group"):
        m.allocate("a", 1)  # 9 tokens: a new block; the table's old tail is checked
    with pytest.raises(CacheCorruptedError, match="refuses"):
        m.num_tokens("a")


def test_an_untouched_corruption_waits_for_the_periodic_sweep():
    m = KVCacheManager(full_only(), checked=True, sweep_every=10**9, max_batched_tokens=64)
    run_one(m, "a")
    first = m.block_tables("a")[0][0]
    m.pools[0].ref[first] += 1  # a reference nobody owns, on a block no call touches
    run_one(m, "b", 4)  # b hits a's first block: touched, ref 3 with 2 owners...
    m.free("b")
    # ...which only counting owners reveals: the full sweep does
    with pytest.raises(CacheCorruptedError, match="reference counts equal owners"):
        m.check_invariants()
    with pytest.raises(CacheCorruptedError, match="refuses"):
        m.free("a")


def test_the_sweep_runs_every_n_calls_on_its_own():
    m = KVCacheManager(full_only(), checked=True, sweep_every=4, max_batched_tokens=64)
    m.add_request("a", list(range(8)))  # call 1
    m.find_cached_prefix("a")  # call 2
    m.allocate("a", 8)  # call 3
    m.pools[0].ref[m.block_tables("a")[0][0]] += 1
    with pytest.raises(CacheCorruptedError, match="reference counts equal owners"):
        m.commit("a", 8, [1])  # call 4: the sweep


def test_the_next_call_that_moves_blocks_of_a_pool_with_broken_counters_is_caught():
    m = KVCacheManager(full_only(), checked=True, sweep_every=10**9, max_batched_tokens=64)
    run_one(m, "a")
    m.pools[0].free.pop()  # a free block vanishes
    m.add_request("b", [1, 2, 3])  # moves no block: counters are not looked at
    m.find_cached_prefix("b")
    with pytest.raises(CacheCorruptedError, match="free \\+ used = total"):
        m.allocate("b", 3)
