"""Stateful property test of the page ledger against a model of the device.

Random use / release / launch / finish / drain sequences over pools of every shape (blocks
smaller than a page that straddle, blocks larger than a page, a page-aligned pool). The
drained ops are applied to a model device that remembers, per page, the last launched step
during which the page held data. Invariants after every rule: the ledger's full sweep;
device pages never exceed the budget; a map only of an unmapped page and an unmap only of a
mapped one; no unmap before the last step that used the page finished; after a drain, every
block holding data lies on device-mapped pages. At the end, after releasing everything and
letting the steps finish, the device holds exactly the floor pages.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedkv.blocks.pages import MapOp, PageLedger, PoolRange, UnmapOp
from pagedkv.errors import OutOfBlocksError

PAGE = 8


class PagesMachine(RuleBasedStateMachine):
    @initialize(
        shapes=st.lists(
            st.tuples(st.integers(1, 20), st.integers(1, 12), st.integers(0, 3)),
            min_size=1, max_size=3),
        spare=st.integers(0, 6), stock=st.integers(0, 3))
    def setup(self, shapes, spare, stock):
        pools = [PoolRange(i, block_bytes=bb, ceiling_blocks=n, floor_blocks=min(f, n))
                 for i, (bb, n, f) in enumerate(shapes)]
        self.floor = {}
        for p in pools:
            last = (p.floor_blocks * p.block_bytes - 1) // PAGE if p.floor_blocks else -1
            self.floor[p.pool_id] = set(range(last + 1))
        self.budget = sum(len(f) for f in self.floor.values()) + spare
        self.pools = pools
        self.led = PageLedger(pools, budget_bytes=self.budget * PAGE + PAGE - 1,
                              page_bytes=PAGE, stock_pages=stock)
        self.device: set[tuple[int, int]] = set()  # mapped (pool, page)
        self.last_use: dict[tuple[int, int], int] = {}  # page -> last launched step using it
        self.used: dict[int, set[int]] = {p.pool_id: set() for p in pools}
        self.launched = -1
        self.finished = -1
        self._apply(self.led.drain())

    # ---- model -------------------------------------------------------------------------

    def _pages(self, pool, block):
        bb = self.pools[pool].block_bytes
        return range(block * bb // PAGE, ((block + 1) * bb - 1) // PAGE + 1)

    def _apply(self, ops):
        for op in ops:
            key = (op.pool_id, op.page)
            if isinstance(op, MapOp):
                assert key not in self.device, f"map of mapped page {key}"
                self.device.add(key)
            else:
                assert isinstance(op, UnmapOp)
                assert key in self.device, f"unmap of unmapped page {key}"
                assert key not in {(p, pg) for p, f in self.floor.items() for pg in f}
                assert self.last_use.get(key, -1) <= self.finished, (
                    f"page {key} unmapped while step {self.last_use[key]} may run "
                    f"(finished {self.finished})")
                assert op.after_step <= self.finished
                self.device.discard(key)
            assert len(self.device) <= self.budget

    # ---- rules -------------------------------------------------------------------------

    @rule(data=st.data())
    def use(self, data):
        pool = data.draw(st.integers(0, len(self.pools) - 1))
        free = [b for b in range(self.pools[pool].ceiling_blocks) if b not in self.used[pool]]
        if not free:
            return
        blocks = data.draw(st.lists(st.sampled_from(free), min_size=1, max_size=4, unique=True))
        # pages already holding data or floor pages never cost bytes
        busy = {pg for b in self.used[pool] for pg in self._pages(pool, b)} | self.floor[pool]
        most = len({pg for b in blocks for pg in self._pages(pool, b)} - busy)
        assert self.led.bytes_to_use(pool, blocks) <= most * PAGE
        fits = self.led.bytes_to_use(pool, blocks) <= self.led.free_bytes()
        before = self.led.mapped_bytes()
        try:
            self.led.use(pool, blocks)
        except OutOfBlocksError:
            assert not fits
            assert self.led.mapped_bytes() == before
            return
        assert fits
        self.used[pool].update(blocks)

    @precondition(lambda self: any(self.used.values()))
    @rule(data=st.data())
    def release(self, data):
        pool = data.draw(st.sampled_from([p for p, u in self.used.items() if u]))
        blocks = data.draw(st.lists(st.sampled_from(sorted(self.used[pool])),
                                    min_size=1, max_size=4, unique=True))
        self.led.release(pool, blocks)
        self.used[pool].difference_update(blocks)

    @rule()
    def launch(self):
        self.launched += 1
        self.led.step_launched(self.launched)
        # the step reads every page that holds data now
        for pool, blocks in self.used.items():
            for b in blocks:
                for pg in self._pages(pool, b):
                    self.last_use[(pool, pg)] = self.launched

    @precondition(lambda self: self.finished < self.launched)
    @rule(data=st.data())
    def finish(self, data):
        self.finished = data.draw(st.integers(self.finished + 1, self.launched))
        self.led.step_finished(self.finished)

    @rule()
    def drain(self):
        self._apply(self.led.drain())
        for pool, blocks in self.used.items():
            for b in blocks:
                for pg in self._pages(pool, b):
                    assert (pool, pg) in self.device, f"block {b} of pool {pool} on unmapped {pg}"

    # ---- invariants --------------------------------------------------------------------

    @invariant()
    def sweep(self):
        if not hasattr(self, "led"):
            return
        self.led.check()
        assert self.led.mapped_bytes() <= self.budget * PAGE
        assert 0 <= self.led.stock_wanted() <= self.led.free_bytes() // PAGE
        for pool, blocks in self.used.items():
            for b in blocks:
                assert self.led.is_mapped(pool, b) and self.led.holds_data(pool, b)

    def teardown(self):
        if not hasattr(self, "led"):
            return
        for pool, blocks in self.used.items():
            if blocks:
                self.led.release(pool, sorted(blocks))
        self.finished = self.launched
        self.led.step_finished(self.launched)
        self._apply(self.led.drain())
        floors = {(p, pg) for p, f in self.floor.items() for pg in f}
        assert self.device == floors
        assert self.led.mapped_bytes() == self.led.floor_bytes() == len(floors) * PAGE
        self.led.check()


TestPages = PagesMachine.TestCase
TestPages.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                              suppress_health_check=[HealthCheck.too_slow])
