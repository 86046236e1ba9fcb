"""Differential test of the page ledger's fast paths against its general ones.

The same random use / release / launch / finish / drain sequence drives three ledgers over
the same pools (blocks that divide a page, a page-sized block, blocks that straddle, a slot
spanning pages):

- *fast*: as shipped -- releases only move counts, emptied pages settle later, pools whose
  blocks never straddle take the one-page arithmetic;
- *settled*: every release is followed by a query, so emptied pages settle at once (what
  the ledger did before settling was deferred);
- *general*: the one-page arithmetic switched off, every block through the range loops.

After every call all three must give the same answers: errors, bytes held / free /
pending, which blocks lie on held pages, the stock wanted, and each drain's ops (the same
unmaps then the same maps; the order within one kind is not part of the contract).
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedkv.blocks.pages import MapOp, PageLedger, PoolRange
from pagedkv.errors import OutOfBlocksError

PAGE = 8
POOLS = [PoolRange(0, block_bytes=2, ceiling_blocks=24, floor_blocks=3),  # 4 per page
         PoolRange(1, block_bytes=8, ceiling_blocks=6),  # one page each
         PoolRange(2, block_bytes=3, ceiling_blocks=10, floor_blocks=1),  # straddle
         PoolRange(3, block_bytes=20, ceiling_blocks=3)]  # 3 or 4 pages each


def make(kind: str, budget_pages: int) -> PageLedger:
    led = PageLedger(POOLS, budget_bytes=budget_pages * PAGE, page_bytes=PAGE, stock_pages=2)
    if kind == "general":
        for p in led._pools.values():  # the fast path's switch: range loops for every pool
            p.per_page = 0
    return led


def observe(led: PageLedger) -> tuple:
    mapped = tuple(tuple(led.is_mapped(p.pool_id, b) for b in range(p.ceiling_blocks))
                   for p in POOLS)
    return (led.mapped_bytes(), led.free_bytes(), led.pending_bytes(), led.stock_wanted(),
            tuple(led.mapped_bytes(p.pool_id) for p in POOLS), mapped)


def drained(led: PageLedger) -> tuple:
    ops = led.drain()
    kinds = [isinstance(op, MapOp) for op in ops]
    assert kinds == sorted(kinds), f"a map before an unmap: {ops}"
    return tuple(sorted(ops, key=lambda op: (isinstance(op, MapOp), tuple(op))))


call = st.one_of(
    st.tuples(st.just("use"), st.integers(0, 3), st.lists(st.integers(0, 23), min_size=1,
                                                          max_size=5, unique=True)),
    st.tuples(st.just("release"), st.integers(0, 3), st.integers(1, 5), st.randoms()),
    # the free list's way: the blocks released last come back first (pending pages revive)
    st.tuples(st.just("reuse"), st.integers(0, 3), st.integers(1, 3)),
    st.tuples(st.just("launch")),
    st.tuples(st.just("finish"), st.integers(0, 3)),
    st.tuples(st.just("drain")),
    st.tuples(st.just("look")),
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(calls=st.lists(call, min_size=10, max_size=60), budget=st.integers(4, 20))
def test_fast_paths_answer_like_the_general_ones(calls, budget):
    leds = {k: make(k, budget) for k in ("fast", "settled", "general")}
    used: dict[int, set[int]] = {p.pool_id: set() for p in POOLS}
    freed: dict[int, list[int]] = {p.pool_id: [] for p in POOLS}  # released, newest last
    launched = finished = -1
    for c in calls:
        if c[0] in ("use", "reuse"):
            pool = c[1]
            if c[0] == "use":
                blocks = [b % POOLS[pool].ceiling_blocks for b in c[2]]
            else:
                blocks = freed[pool][-c[2]:][::-1]
            blocks = [b for b in dict.fromkeys(blocks) if b not in used[pool]]
            if not blocks:
                continue
            outcome = set()
            for led in leds.values():
                try:
                    led.use(pool, blocks)
                    outcome.add("ok")
                except OutOfBlocksError:
                    outcome.add("short")
            assert len(outcome) == 1, f"use {pool} {blocks}: {outcome}"
            if outcome == {"ok"}:
                used[pool].update(blocks)
        elif c[0] == "release":
            busy = [p for p, u in used.items() if u]
            if not busy:
                continue
            pool = busy[c[1] % len(busy)]
            blocks = c[3].sample(sorted(used[pool]), min(c[2], len(used[pool])))
            for kind, led in leds.items():
                led.release(pool, blocks)
                if kind == "settled":
                    led.free_bytes()  # any query settles the emptied pages
            used[pool].difference_update(blocks)
            freed[pool] = [b for b in freed[pool] if b not in blocks] + blocks
        elif c[0] == "launch":
            launched += 1
            for led in leds.values():
                led.step_launched(launched)
        elif c[0] == "finish":
            finished = min(launched, finished + 1 + c[1])
            for led in leds.values():
                led.step_finished(finished)
        elif c[0] == "drain":
            ops = {drained(led) for led in leds.values()}
            assert len(ops) == 1, ops
        else:
            seen = {observe(led) for led in leds.values()}
            assert len(seen) == 1, seen
        for led in leds.values():
            led.check()
    seen = {observe(led) for led in leds.values()}
    assert len(seen) == 1, seen
    ops = {drained(led) for led in leds.values()}
    assert len(ops) == 1, ops
