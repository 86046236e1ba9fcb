"""What other pools' cached pages could give back, as the elastic fit check asks it.

``KVCacheManager._spare_bytes`` used to walk every cached block of a pool through the page
ledger on each allocation that needed a costly pool's reclaim: quadratic with blocks of
one token and long contexts (fuzz/simulate.py seed 723762, minimax-m1 at block size 1: 63
s, 70% of it there). The ledger now counts idle (cached free) blocks per page. These tests
hold the new answer to the walk it replaced, on random ledgers and random manager runs,
and check that one fit check no longer does work per cached block.
"""

from __future__ import annotations

import random
import sys

import pytest
from block_groups import _layer, group

from pagedkv.blocks import KVCacheManager
from pagedkv.blocks.pages import PageLedger, PoolRange
from pagedkv.errors import CacheCorruptedError
from pagedkv.kvspec import Attention, AttentionKV, Full, LayerSpec, Recurrent, SlidingWindow

KIB = 1024


def walked_spare_bytes(m, q, k, revived):
    """The fit check's spare bytes as computed before the idle counts (the reference): q's
    cached blocks, less ``revived`` and the ``k`` oldest, less those on the pages of q's
    ``k`` lowest plain ids, through :meth:`PageLedger.bytes_freed_by` block by block."""
    ledger = m.ledger
    pid = q.pool_id
    gone = set(revived)
    rest = [b for b in q.evictable if b not in gone]
    if k:
        del rest[:k]
        kept = {pg for b in q._lowest_ids(k) for pg in ledger.pages_of(pid, b)}
        rest = [b for b in rest if kept.isdisjoint(ledger.pages_of(pid, b))]
    return ledger.bytes_freed_by(pid, rest) if rest else 0


# ---- the ledger: idle counts against a walk over the idle blocks --------------------------

@pytest.mark.parametrize("block_bytes", [8, 16, 24, 40, 64, 96, 200],
                         ids=lambda bb: f"bb{bb}")  # pages of 64 bytes: 8 a page .. 3+ pages a block
def test_idle_bytes_freed_equals_bytes_freed_by_of_the_idle_blocks_it_leaves(block_bytes):
    rng = random.Random(block_bytes)
    nonzero = 0
    for case in range(40):
        ceiling = rng.randrange(4, 60)
        floor = rng.randrange(0, ceiling // 3 + 1)
        other = PoolRange(1, 32, 10, 0)  # a second pool: its counts must stay its own
        ledger = PageLedger([PoolRange(0, block_bytes, ceiling, floor), other], 1 << 20, 64)
        used, idle = set(), set()
        for _ in range(rng.randrange(1, 8)):  # uses, idles, takes back, releases
            free = [b for b in range(ceiling) if b not in used]
            new = rng.sample(free, rng.randrange(0, len(free) + 1))
            ledger.use(0, new)
            used |= set(new)
            marked = rng.sample(sorted(used), rng.randrange(0, len(used) + 1))
            ledger.set_idle(0, marked)
            idle |= set(marked)
            back = rng.sample(sorted(used), rng.randrange(0, len(used) // 3 + 1))
            ledger.clear_idle(0, back)  # not all of them idle: those stay as they are
            idle -= set(back)
            gone = rng.sample(sorted(used), rng.randrange(0, len(used) // 3 + 1))
            ledger.release(0, gone)  # idle ones among them: no longer idle either
            used -= set(gone)
            idle -= set(gone)
            ledger.use(1, [case % 10])
            ledger.set_idle(1, [case % 10])
            ledger.release(1, [case % 10])
            ledger.check()
            assert [b for b in range(ceiling) if ledger.is_idle(0, b)] == sorted(idle)
        unused = [b for b in range(ceiling) if b not in used]
        kept = rng.sample(sorted(used), rng.randrange(0, len(used) // 2 + 1))
        landing = rng.sample(unused, rng.randrange(0, min(4, len(unused)) + 1))
        near = {pg for b in landing for pg in ledger.pages_of(0, b)}
        walk = [b for b in sorted(idle)
                if b not in kept and near.isdisjoint(ledger.pages_of(0, b))]
        want = ledger.bytes_freed_by(0, walk)
        assert ledger.idle_bytes_freed(0, kept, landing) == want, (case, kept, landing)
        assert ledger.idle_bytes_freed(0) == ledger.bytes_freed_by(0, sorted(idle))
        nonzero += want > 0
    assert nonzero >= 5  # the cases freed pages, not only nothing


def test_a_block_marked_idle_must_hold_data():
    ledger = PageLedger([PoolRange(0, 16, 8, 0)], 1 << 10, 64)
    ledger.use(0, [1])
    with pytest.raises(CacheCorruptedError, match="holds no data"):
        ledger.set_idle(0, [2])
    ledger.set_idle(0, [1])
    ledger.set_idle(0, [1])  # once more: still counted once
    assert ledger.idle_bytes_freed(0) == ledger.bytes_freed_by(0, [1]) == 64
    ledger.clear_idle(0, [1])
    assert ledger.idle_bytes_freed(0) == 0 and not ledger.is_idle(0, 1)
    ledger.check()


# ---- the manager: every fit check's answer against the walk -------------------------------

def _big_beside_small(heads):
    """Blocks of 4 tokens of 8 layers (128 KiB: 4 pages of 32 KiB) beside blocks of one
    token of ``heads`` KV heads (4 KiB: 8 a page; 1.5 KiB: they straddle pages); floors
    of 16 tokens, a budget of 60 pages."""
    def make(**kw):
        small = LayerSpec("s", AttentionKV(heads, 128), Full(), Attention(), "target", 0)
        groups = [group(0, Full(), 4, 1, max_model_len=16,
                        layers=tuple(_layer(f"f{i}", Full()) for i in range(8))),
                  group(1, Full(), 1, 1, max_model_len=16, layers=(small,))]
        return KVCacheManager(groups, budget_bytes=60 * 32 * KIB, page_bytes=32 * KIB,
                              max_model_len=64, max_batched_tokens=64, **kw)
    return make


def _mixed(**kw):
    # full + window + recurrent (checkpoints) + MTP over 32 pages (floors 27): as the
    # stateful test's elastic manager
    lim = {"max_model_len": 64, "max_batched_tokens": 64}
    groups = [group(0, Full(), 4, 1, **lim), group(1, SlidingWindow(8), 4, 1, **lim),
              group(2, Recurrent(2), 4, 1, **lim),
              group(3, Full(), 4, 1, offset=1, models=("mtp",), **lim,
                    layers=(_layer("mtp.0", Full(), model="mtp", offset=1),))]
    return KVCacheManager(groups, budget_bytes=32 * 32 * KIB, page_bytes=32 * KIB,
                          recurrent_checkpoint_every=1, **lim, **kw)


def _one_token_blocks(**kw):
    # the fuzz seed's shape: blocks of one token (4 KiB, 8 a page) beside recurrent state
    # slots of 8 pages each, the budget a few pages past the floors
    rec = Recurrent(3)
    lim = {"max_model_len": 48, "max_batched_tokens": 64}
    groups = [group(0, Full(), 1, 1, **lim),
              group(1, rec, 1, 1, layers=tuple(_layer(f"r{i}", rec) for i in range(256)), **lim)]
    return KVCacheManager(groups, budget_bytes=(6 + 8 + 20) * 32 * KIB, page_bytes=32 * KIB,
                          recurrent_checkpoint_every=3, **lim, **kw)


def _run(m, seed, ops=300):
    """Random admissions (shared prefixes: hits), chunked prefills, decodes until each
    request's length, preemptions and frees: cached blocks pile up in every pool."""
    rng = random.Random(seed)
    running, waiting, length = [], [], {}
    bases = [[rng.randrange(5) for _ in range(40)] for _ in range(3)]

    def step(rid, n):
        done = m.num_computed(rid) + n >= m.num_tokens(rid)
        m.commit(rid, n, [rng.randrange(5)] if done else [])
        if m.num_tokens(rid) >= length[rid]:
            running.remove(rid)
            m.free(rid)

    for i in range(ops):
        r = rng.random()
        if r < 0.3 or not (running or waiting):
            rid = (seed, i)
            prompt = bases[rng.randrange(3)][:rng.randrange(1, 36)] + [rng.randrange(5)]
            length[rid] = len(prompt) + rng.randrange(1, 12)
            m.add_request(rid, prompt, max_new_tokens=length[rid] - len(prompt))
            waiting.append(rid)
        elif r < 0.55 and waiting:
            rid = waiting[0]
            hit = m.find_cached_prefix(rid)
            n = min(m.num_tokens(rid) - hit, rng.randrange(1, 30))
            if m.allocate(rid, n):
                waiting.pop(0)
                running.append(rid)
                step(rid, n)
        elif r < 0.95 and running:
            rid = rng.choice(running)
            n = max(1, min(m.num_tokens(rid) - m.num_computed(rid), rng.randrange(1, 12)))
            if m.allocate(rid, n):
                step(rid, n)
        elif running:
            rid = running.pop()
            m.preempt(rid)
            waiting.append(rid)
        m.drain_copy_ops()


@pytest.mark.parametrize(("make", "frees"), [
    (_big_beside_small(8), True), (_big_beside_small(3), True), (_one_token_blocks, True),
    (_mixed, False)], ids=["one-token-blocks", "straddling", "state-slots", "mixed"])
def test_the_fit_checks_spare_bytes_are_the_walks(make, frees):
    m = make(checked=True, sweep_every=16)
    seen = []
    spare = m._spare_bytes

    def both(q, k, revived):
        got = spare(q, k, revived)
        want = walked_spare_bytes(m, q, k, revived)
        assert got == want, (q.pool_id, k, list(revived), got, want)
        seen.append((k, len(revived), got))
        return got

    m._spare_bytes = both
    for seed in range(4):
        _run(m, seed)
    m.check_invariants()
    assert len(seen) >= 10  # the fit checks got that far
    assert any(k for k, _, _ in seen)  # with new blocks of the pool asked
    # and found pages to reclaim (the mixed pools' pages rarely are: its other checks)
    assert any(got for _, _, got in seen) or not frees


# ---- one fit check: no work per cached block ---------------------------------------------

def _fit_check_calls(cached):
    """Python-level calls (functions and builtins) made by the fit checks of one admission
    that a costly pool fails, with ``cached`` + 1 cached blocks in the other pool, each on a
    page that also holds a live block (so they free nothing)."""
    rec = Recurrent(1000)
    lim = {"max_model_len": 1024, "max_batched_tokens": 64}
    groups = [group(0, Full(), 1, 1, **lim),  # blocks of 4 KiB, 2 a page
              group(1, rec, 1, 1, layers=tuple(_layer(f"r{i}", rec) for i in range(64)),
                    **lim)]  # state slots of 64 KiB: 8 pages
    page = 8 * KIB
    m = KVCacheManager(groups, budget_bytes=(512 + 8 + 10) * page, page_bytes=page,
                       recurrent_checkpoint_every=0, checked=False, **lim)
    for rid in ("live", "old"):
        m.add_request(rid, [len(rid)], max_new_tokens=1000)
        m.find_cached_prefix(rid)
        assert m.allocate(rid, 1)
        m.commit(rid, 1, [0])
    for i in range(cached):  # a block each per step: their blocks alternate on the pages
        for rid in ("live", "old"):
            assert m.allocate(rid, 1)
            m.commit(rid, 1, [i])
        m.drain_copy_ops()
    m.free("old")  # its blocks stay cached, each beside one of "live"
    while m.ledger.free_bytes() >= 8 * page:  # "live" alone, until a slot no longer fits
        assert m.allocate("live", 1)
        m.commit("live", 1, [0])
        m.drain_copy_ops()
    assert len(m.pools[0].evictable) == cached + 1
    counts, spares = [], []
    fits, spare = m._elastic_fits, m._spare_bytes

    def counted(*args):
        n = 0

        def profile(frame, event, arg):
            nonlocal n
            n += event in ("call", "c_call")

        sys.setprofile(profile)
        try:
            return fits(*args)
        finally:
            sys.setprofile(None)
            counts.append(n)

    def spare_seen(q, k, revived):
        spares.append(spare(q, k, revived))
        return spares[-1]

    m._elastic_fits, m._spare_bytes = counted, spare_seen
    m.add_request("new", [7, 7, 7, 7])
    m.find_cached_prefix("new")
    assert not m.allocate("new", 4)  # its state slot needs 8 pages: 7 free, none to reclaim
    assert spares and not any(spares)  # the fit checks asked the cached pool, which had none
    return counts


def test_one_fit_check_does_no_work_per_cached_block_of_another_pool():
    small, large = _fit_check_calls(100), _fit_check_calls(300)
    # the walk made 14 calls per cached block: 1,492 and 4,292 per fit check before, 115 now
    assert small == large


def test_checked_mode_catches_a_cached_block_the_ledger_thinks_busy():
    m = _big_beside_small(8)(checked=True, sweep_every=1)
    m.add_request("a", list(range(16)))
    m.find_cached_prefix("a")
    assert m.allocate("a", 16)
    m.commit("a", 16, [1])
    m.free("a")
    pool = m.pools[1]
    b = next(iter(pool.evictable))
    assert m.ledger.is_idle(pool.pool_id, b)
    m.ledger.clear_idle(pool.pool_id, [b])  # as if an LRU change had not been reported
    with pytest.raises(CacheCorruptedError, match="cached free"):
        m.check_invariants()


def test_a_pool_alone_on_its_budget_does_not_report_idle_blocks():
    # nobody else could reclaim its pages: the ledger is never asked, so not told either
    # (the single-pool decode loop keeps its cost); two pools report theirs
    alone = KVCacheManager([group(0, Full(), 4, 1, max_model_len=16)], checked=True,
                           sweep_every=1, budget_bytes=20 * 32 * KIB, page_bytes=32 * KIB,
                           max_model_len=64, max_batched_tokens=64)
    pair = _big_beside_small(8)(checked=True, sweep_every=1)
    for m in (alone, pair):
        m.add_request("a", list(range(16)))
        m.find_cached_prefix("a")
        assert m.allocate("a", 16)
        m.commit("a", 16, [1])
        m.free("a")
        m.check_invariants()
    (pool,) = alone.pools
    assert pool.evictable and not pool.report_idle and not alone.ledger.shared
    assert not any(alone.ledger.is_idle(pool.pool_id, b) for b in pool.evictable)
    assert all(p.report_idle for p in pair.pools) and pair.ledger.shared
    assert all(pair.ledger.is_idle(p.pool_id, b) for p in pair.pools for b in p.evictable)
