"""Stateful property test: the page ledger driving a tensor backing, bytes and all.

Random use (then write a fresh byte into every byte of the block) / release / launch /
complete / between-steps (or before-launch + after-launch, with 0-2 pages per pool mapped
ahead) sequences over a straddling pool and a multi-page slot pool.
Invariants: every block holding data reads back exactly what was written to it, however
its pages moved; physical pages (mapped + stock) never exceed the budget; the backing's
mapped pages are the ledger's held pages after each between-steps; the backing never
unmaps a page before its step finished (it raises if asked to). At the end everything is
released and only the floors stay mapped.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

torch = pytest.importorskip("torch")

from pagedkv.blocks.pages import PageLedger, PoolRange  # noqa: E402
from pagedkv.errors import OutOfBlocksError  # noqa: E402
from pagedkv.memory.backing import TensorBacking  # noqa: E402
from pagedkv.memory.physical import PhysicalMemory  # noqa: E402
from pagedkv.memory.steps import ManualSteps  # noqa: E402

PAGE = 16


class BytesMachine(RuleBasedStateMachine):
    @initialize(budget=st.integers(3, 10), stock=st.integers(0, 3), floor=st.integers(0, 2),
                ahead=st.integers(0, 2))
    def setup(self, budget, stock, floor, ahead):
        self.pools = [PoolRange(0, block_bytes=12, ceiling_blocks=10, floor_blocks=floor),
                      PoolRange(1, block_bytes=40, ceiling_blocks=3)]
        self.budget = budget
        self.steps = ManualSteps()
        self.led = PageLedger(self.pools, budget_bytes=budget * PAGE, page_bytes=PAGE,
                              stock_pages=stock)
        self.mem = PhysicalMemory(self.led, TensorBacking(self.pools, PAGE, steps=self.steps),
                                  ahead=ahead)
        self.data: dict[tuple[int, int], int] = {}  # (pool, block) -> byte written
        self.unwritten: set[tuple[int, int]] = set()  # used, not yet mapped and written
        self.step = -1
        self.value = 0

    def _bytes(self, pool, block):
        bb = self.pools[pool].block_bytes
        return self.mem.backing.tensor(pool)[block * bb:(block + 1) * bb]

    @rule(pool=st.integers(0, 1), data=st.data())
    def use(self, pool, data):
        free = [b for b in range(self.pools[pool].ceiling_blocks)
                if (pool, b) not in self.data and (pool, b) not in self.unwritten]
        if not free:
            return
        blocks = data.draw(st.lists(st.sampled_from(free), min_size=1, max_size=3, unique=True))
        try:
            self.led.use(pool, blocks)
        except OutOfBlocksError:
            return
        self.unwritten.update((pool, b) for b in blocks)

    @precondition(lambda self: self.data)
    @rule(data=st.data())
    def release(self, data):
        key = data.draw(st.sampled_from(sorted(self.data)))
        self.led.release(key[0], [key[1]])
        del self.data[key]

    @rule()
    def between_steps(self):
        self.mem.between_steps()
        self._write()

    @rule()
    def launch_split(self):
        """Maps before the launch, deferred unmaps and the stock after it."""
        self.mem.before_launch()
        self._write()
        assert self.mem.backing.physical_pages <= self.budget
        self.step += 1
        self.mem.after_launch(self.step)

    def _write(self):
        for pool, block in sorted(self.unwritten):
            self.value = (self.value + 37) % 251
            self._bytes(pool, block).fill_(self.value)
            self.data[(pool, block)] = self.value
        self.unwritten.clear()
        mapped = self.mem.backing.mapped_pages()
        for pool, block in self.data:
            assert all((pool, pg) in mapped for pg in self.led.pages_of(pool, block))

    @rule()
    def launch(self):
        self.step += 1
        self.mem.launched(self.step)

    @precondition(lambda self: self.steps.finished() < self.step)
    @rule(data=st.data())
    def complete(self, data):
        self.steps.complete(data.draw(st.integers(self.steps.finished() + 1, self.step)))

    @invariant()
    def bytes_survive(self):
        if not hasattr(self, "mem"):
            return
        backing = self.mem.backing
        assert backing.physical_pages <= self.budget
        # pages mapped ahead are the ledger's unmapped ones: no block holding data is on one
        assert not backing.ahead_pages() & backing.mapped_pages()
        for (pool, block), v in self.data.items():
            assert not any((pool, pg) in backing.ahead_pages() for pg in self.led.pages_of(pool, block))
            assert bool((self._bytes(pool, block) == v).all()), f"block {block} of pool {pool}"

    def teardown(self):
        if not hasattr(self, "mem"):
            return
        for pool, block in list(self.data) + list(self.unwritten):
            self.led.release(pool, [block])
        if self.step >= 0:
            self.steps.complete(self.step)
        self.mem.between_steps()
        assert self.led.mapped_bytes() == self.led.floor_bytes()
        assert len(self.mem.backing.mapped_pages()) * PAGE == self.led.floor_bytes()


TestBytes = BytesMachine.TestCase
TestBytes.settings = settings(max_examples=40, stateful_step_count=30, deadline=None,
                              suppress_health_check=[HealthCheck.too_slow])
