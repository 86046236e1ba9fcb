"""Elastic pools over one byte budget: the same decisions as fixed pools when the budget
is no limit, pages follow live data, other pools' cached pages are reclaimed emptiest
first, floors stay mapped, unmaps wait for the step that last used a page."""

from __future__ import annotations

import dataclasses
import random

import pytest
from block_groups import deepseek_mtp_like, full_only, gpt_oss_like, group, kimi_dspark_like

from pagedkv.blocks import KVCacheManager
from pagedkv.blocks.elastic import ElasticPool
from pagedkv.blocks.pages import MapOp, PageLedger, PoolRange, UnmapOp
from pagedkv.errors import OutOfBlocksError
from pagedkv.kvspec import Full, blocks_per_request, step_blocks

KIB = 1024


def for_len(groups, max_model_len=64, max_batched_tokens=64):
    """The groups as a plan for ``max_model_len`` would report them (their floors)."""
    return [dataclasses.replace(
        g, blocks_per_request=max(1, blocks_per_request(g.retention, max_model_len, g.block_size))
        if g.is_recurrent else blocks_per_request(g.retention, max_model_len, g.block_size),
        step_blocks=step_blocks(g.retention, max_batched_tokens, g.block_size)) for g in groups]


def _drive(m, ops, rng_seed):
    """Random admissions, chunked prefills, decodes, preemptions and frees; returns
    every decision and hit, in order."""
    rng = random.Random(rng_seed)
    out = []
    running, waiting = [], []
    bases = [[rng.randrange(6) for _ in range(60)] for _ in range(3)]
    for i in range(ops):
        r = rng.random()
        if r < 0.25 or not (running or waiting):
            base = bases[rng.randrange(3)]
            prompt = base[:rng.randrange(1, 48)] + [rng.randrange(6) for _ in range(rng.randrange(4))]
            m.add_request(i, prompt, max_new_tokens=rng.randrange(12))
            waiting.append(i)
        elif r < 0.45 and waiting:
            rid = waiting[0]
            hit = m.find_cached_prefix(rid)
            n = min(m.num_tokens(rid) - hit, rng.randrange(1, 40))
            ok = m.allocate(rid, n)
            out.append(("admit", rid, hit, ok))
            if ok:
                waiting.pop(0)
                running.append(rid)
                done = m.num_computed(rid) + n >= m.num_tokens(rid)
                m.commit(rid, n, [rng.randrange(6)] if done else [])
        elif r < 0.85 and running:
            rid = rng.choice(running)
            todo = m.num_tokens(rid) - m.num_computed(rid)
            n = max(1, min(todo, rng.randrange(1, 20)))
            ok = m.allocate(rid, n)
            out.append(("step", rid, ok))
            if ok:
                done = m.num_computed(rid) + n >= m.num_tokens(rid)
                m.commit(rid, n, [rng.randrange(6)] if done else [])
        elif r < 0.9 and running:
            rid = running.pop()
            m.preempt(rid)
            waiting.append(rid)
        else:
            pool = running or waiting
            rid = pool.pop(rng.randrange(len(pool)))
            m.free(rid)
        m.drain_copy_ops()
    met = m.metrics()
    out.append(("end", met.prefix_hits, met.prefix_queries, met.evictions, met.preemptions))
    return out


@pytest.mark.parametrize("groups", [full_only(num_blocks=24), gpt_oss_like(num_blocks=30),
                                    kimi_dspark_like(num_blocks=30, slots=5),
                                    deepseek_mtp_like(num_blocks=30)],
                         ids=["full", "window", "kimi", "mtp"])
@pytest.mark.parametrize("seed", [1, 2])
def test_with_room_for_everything_elastic_pools_decide_as_fixed_pools(groups, seed):
    groups = for_len(groups)
    fixed = KVCacheManager(groups, max_model_len=64, max_batched_tokens=64, checked=True)
    # each pool's ceiling is its fixed size and the budget holds every ceiling at once
    elastic = KVCacheManager(groups, max_model_len=64, max_batched_tokens=64, checked=True,
                             budget_bytes=1 << 30, page_bytes=32 * KIB,
                             ceilings={g.id: g.num_blocks for g in groups})
    assert [p.usable for p in elastic.pools] == [p.usable for p in fixed.pools]
    a, b = _drive(fixed, 300, seed), _drive(elastic, 300, seed)
    assert a == b
    assert a[-1][3] > 0  # the pools were small enough to evict: the LRU agreed too


@pytest.mark.parametrize("budget", [None, 18 * 32 * KIB, 1 << 30],
                         ids=["fixed", "tight-budget", "ample-budget"])
@pytest.mark.parametrize("ngroups", [1, 2])
def test_the_decode_fast_path_decides_as_the_general_path(budget, ngroups):
    # _grow (every group full attention in a pool of its own, nothing pending) against the
    # general allocation path forced on the same calls: same decisions, hits, evictions,
    # block tables and page ops, also when the budget runs short and the fast path yields
    groups = for_len([group(0, Full(), 4, 24), group(1, Full(), 8, 16)][:ngroups])
    if ngroups == 1 and budget is not None and budget < 1 << 30:
        budget = 10 * 32 * KIB  # one group's floor: as tight as two groups' at 18 pages
    kw = {} if budget is None else {"budget_bytes": budget, "page_bytes": 32 * KIB}
    fast, general = (KVCacheManager(groups, max_model_len=64, max_batched_tokens=64,
                                    checked=True, **kw) for _ in range(2))
    assert fast._full_only
    general._full_only = False
    page_ops = ([], [])
    for m, log in zip((fast, general), page_ops):
        drain = m.drain_copy_ops

        def drain_both(m=m, log=log, drain=drain):
            log.extend(m.drain_page_ops())
            log.append(sorted(((rid, tuple(map(tuple, m.block_tables(rid))))
                               for rid in m.requests), key=repr))
            return drain()

        m.drain_copy_ops = drain_both
    a, b = _drive(fast, 300, 3), _drive(general, 300, 3)
    assert a == b
    a, b = _decode_heavy(fast, 4), _decode_heavy(general, 4)
    assert a == b
    assert page_ops[0] == page_ops[1]
    assert a[-1][1] > 0 or budget == 1 << 30  # cached blocks were evicted for new ones
    assert sum(1 for d in a if d[0] == "decode" and not d[2]) > 0 or budget in (None, 1 << 30)


def _decode_heavy(m, seed):
    """Up to 6 requests sharing prefixes, decoding one token per step (the fast path's
    case) until they reach 56 tokens, fail to get a block, or stop at random."""
    rng = random.Random(seed)
    out, running = [], []
    base = [rng.randrange(6) for _ in range(40)]
    for i in range(400):
        if len(running) < 6 and rng.random() < 0.3:
            m.add_request(("d", i), base[:rng.randrange(4, 40)] + [rng.randrange(6)])
            hit = m.find_cached_prefix(("d", i))
            n = m.num_tokens(("d", i)) - hit
            ok = m.allocate(("d", i), n)
            out.append(("admit", i, hit, ok))
            if ok:
                m.commit(("d", i), n, [rng.randrange(6)])
                running.append(("d", i))
            else:
                m.free(("d", i))
        for rid in list(running):
            ok = m.allocate(rid, 1)
            out.append(("decode", rid, ok, [list(t) for t in m.block_tables(rid)]))
            if ok:
                m.commit(rid, 1, [rng.randrange(6)])
            if not ok or m.num_tokens(rid) > 56 or rng.random() < 0.05:
                running.remove(rid)
                m.free(rid)
        m.drain_copy_ops()
    out.append(("end", m.metrics().evictions))
    return out


def two_pools(budget_pages, floor_len=8):
    """Two full-attention groups of 16 KiB blocks (4 tokens of 4 KiB) over 32 KiB pages:
    floors of ``floor_len`` tokens each."""
    groups = [group(0, Full(), 4, 1, max_model_len=floor_len),
              group(1, Full(), 4, 1, max_model_len=floor_len)]
    return KVCacheManager(groups, max_model_len=64, max_batched_tokens=64,
                          checked=True, sweep_every=1, budget_bytes=budget_pages * 32 * KIB,
                          page_bytes=32 * KIB)


def test_blocks_fill_the_lowest_ids_and_mapped_bytes_follow_live_data():
    m = two_pools(10)  # floors: 2 blocks = 1 page each
    assert m.mapped_bytes() == m.floor_bytes() == 2 * 32 * KIB
    m.add_request("a", list(range(24)))  # 6 blocks of pool 0: ids 0..5 on pages 0..2
    m.find_cached_prefix("a")
    assert m.allocate("a", 24)
    assert m.block_tables("a")[0] == [0, 1, 2, 3, 4, 5]
    assert m.mapped_bytes() == (3 + 3) * 32 * KIB  # each pool: pages 0..2 (0 is its floor)
    m.commit("a", 24, [9])
    m.free("a")
    assert m.reset_prefix_cache()
    assert m.mapped_bytes() == m.floor_bytes()  # everything went back but the floors


def test_a_pool_short_of_bytes_takes_the_emptiest_cached_pages_of_another():
    # pools of 4 blocks per page; budget 5 pages; each pool's floor is page 0
    ledger = PageLedger([PoolRange(0, 8, 40, 4), PoolRange(1, 8, 40, 4)], 5 * 32, 32)
    a = ElasticPool(40, 0, None, False, ledger, 4)
    b = ElasticPool(40, 1, None, False, ledger, 4)
    a.peers = b.peers = (a, b)
    a.cache_for(0)
    b.cache_for(1)
    held = b.allocate(11, 1)  # ids 0..10: pages 0 (floor), 1 and 2 (3 blocks)
    assert held == list(range(11)) and ledger.free_bytes() == 1 * 32  # a0, b0, b1, b2 held
    for blk in held:  # all cached, then released: evictable, still holding data
        assert b.cache(1, blk, 1000 + blk)
    b.release(held[4:], 1)  # pages 1 (ids 4..7) and 2 (ids 8..10) hold only cached blocks
    x = a.allocate(12, 0)  # page 0 (floor), page 1 takes the last free page, then...
    assert x == list(range(12))
    # ...the third page was taken from b: its emptiest cached-only page (page 2: 3 blocks)
    assert sorted(b.evictable) == [4, 5, 6, 7] and b.evictions == 3
    assert ledger.mapped_bytes() == ledger.budget_bytes and b.epoch == 3
    assert not any(ledger.holds_data(1, blk) for blk in (8, 9, 10))
    with pytest.raises(OutOfBlocksError):  # b's live page 0 and a's pages are not b's to give
        a.allocate(5, 0)
    ledger.check()


def test_an_unmap_waits_for_the_step_that_last_used_the_page():
    groups = [group(0, Full(), 4, 1, max_model_len=8)]
    m = KVCacheManager(groups, max_model_len=64, max_batched_tokens=64, checked=True,
                       sweep_every=1, budget_bytes=8 * 32 * KIB, page_bytes=32 * KIB,
                       sync_steps=False, enable_caching=False)
    m.add_request("a", list(range(16)))  # 4 blocks: pages 0 (floor) and 1
    m.find_cached_prefix("a")
    assert m.allocate("a", 16)
    assert m.drain_page_ops() == [MapOp(0, 0), MapOp(0, 1)]
    m.drain_copy_ops()  # step 0 launched: it reads pages 0 and 1
    m.commit("a", 16, [5])
    m.free("a")
    assert m.mapped_bytes() == 2 * 32 * KIB  # page 1 is empty but step 0 may still read it
    assert m.drain_page_ops() == []
    m.step_finished(0)
    assert m.mapped_bytes() == m.floor_bytes() == 32 * KIB
    assert m.drain_page_ops() == [UnmapOp(0, 1, 0)]


def test_a_request_of_max_model_len_always_fits_in_the_floors():
    m = two_pools(4, floor_len=16)  # floors of 4 blocks = 2 pages each: the whole budget
    m.add_request("x", list(range(15)))
    m.find_cached_prefix("x")
    assert m.allocate("x", 15)
    m.commit("x", 15, [1])
    assert m.mapped_bytes() == m.floor_bytes() == m.ledger.budget_bytes


def test_an_engine_that_reports_steps_itself_keeps_the_manager_out_of_them():
    groups = [group(0, Full(), 4, 1, max_model_len=8)]
    m = KVCacheManager(groups, max_model_len=64, max_batched_tokens=64, checked=True,
                       sweep_every=1, budget_bytes=8 * 32 * KIB, page_bytes=32 * KIB,
                       own_steps=False, stock_pages=3, enable_caching=False)
    assert m.ledger.stock_wanted() == 3
    m.add_request("a", list(range(16)))
    m.find_cached_prefix("a")
    assert m.allocate("a", 16)
    assert m.drain_page_ops() == [MapOp(0, 0), MapOp(0, 1)]  # page 1 reaches the device
    m.drain_copy_ops()
    assert m.ledger.launched == -1  # PhysicalMemory launches and finishes steps
    m.ledger.step_launched(0)
    m.commit("a", 16, [5])
    m.free("a")
    assert m.mapped_bytes() == 2 * 32 * KIB  # waits for step 0, which nobody finished
    m.ledger.step_finished(0)
    assert m.mapped_bytes() == m.floor_bytes()
