"""Backings on ordinary tensors (CPU): map, write, read, move a page between pools, delayed
unmap, the stock, per-layer views over block-major pools, and the ledger driven end to end.

The same behaviour runs on CUDA virtual memory in test_memory_vmm.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from pagedkv.blocks.pages import MapOp, PageLedger, PoolRange, UnmapOp  # noqa: E402
from pagedkv.errors import CacheCorruptedError, InvalidArgumentError  # noqa: E402
from pagedkv.memory.backing import POISON, TensorBacking  # noqa: E402
from pagedkv.memory.physical import PhysicalMemory  # noqa: E402
from pagedkv.memory.steps import ManualSteps  # noqa: E402
from pagedkv.memory.views import layer_view  # noqa: E402

PAGE = 64
POOLS = [PoolRange(0, block_bytes=48, ceiling_blocks=8, floor_blocks=1),  # 384 B: 6 pages
         PoolRange(1, block_bytes=160, ceiling_blocks=3)]  # a slot spans 2.5 pages: 8 pages


def page_bytes(backing, pool, page):
    return backing.tensor(pool)[page * PAGE:(page + 1) * PAGE]


def test_map_write_read_and_unmapped_pages_read_poison():
    b = TensorBacking(POOLS, page_bytes=PAGE)
    t = b.tensor(0)
    assert t.dtype == torch.uint8 and t.numel() == 6 * PAGE
    assert bool((t == POISON).all())
    b.map(0, 2)
    data = torch.randint(0, 255, (PAGE,), dtype=torch.uint8)
    page_bytes(b, 0, 2).copy_(data)
    assert torch.equal(b.tensor(0)[2 * PAGE:3 * PAGE], data)
    assert b.is_mapped(0, 2) and not b.is_mapped(0, 3) and b.physical_pages == 1
    b.unmap(0, 2)
    assert bool((page_bytes(b, 0, 2) == POISON).all())
    assert b.stats["maps"] == 1 and b.stats["unmaps"] == 1 and b.stock == 1


def test_a_page_moved_to_another_pool_keeps_its_bytes():
    b = TensorBacking(POOLS, page_bytes=PAGE)
    b.set_stock(2)
    b.map(0, 1)
    data = torch.randint(0, 255, (PAGE,), dtype=torch.uint8)
    page_bytes(b, 0, 1).copy_(data)
    b.unmap(0, 1)
    b.map(1, 5)  # takes the page unmapped last
    assert torch.equal(page_bytes(b, 1, 5), data)
    assert b.physical_pages == 2 and b.stats["created_in_map"] == 0


def test_stock_is_created_between_steps_not_in_a_map():
    b = TensorBacking(POOLS, page_bytes=PAGE)
    b.map(0, 0)
    assert b.stats["created_in_map"] == 1
    b.set_stock(3)
    assert b.stock == 3 and b.stats["created"] == 4
    b.map(0, 1)
    b.map(0, 2)
    assert b.stats["created_in_map"] == 1 and b.stock == 1
    b.set_stock(0)
    assert b.stock == 0 and b.stats["released"] == 1 and b.physical_pages == 3


def test_unmap_before_its_step_finished_is_refused():
    steps = ManualSteps()
    b = TensorBacking(POOLS, page_bytes=PAGE, steps=steps)
    b.apply([MapOp(0, 3)])
    steps.record(0)
    with pytest.raises(CacheCorruptedError, match="before step 0 finished"):
        b.apply([UnmapOp(0, 3, 0)])
    assert b.is_mapped(0, 3)
    steps.complete(0)
    b.apply([UnmapOp(0, 3, 0)])
    assert not b.is_mapped(0, 3)


def test_bad_ops_are_refused():
    b = TensorBacking(POOLS, page_bytes=PAGE)
    with pytest.raises(InvalidArgumentError, match="page 6 outside 0..5"):
        b.map(0, 6)
    with pytest.raises(InvalidArgumentError, match="no pool 7"):
        b.map(7, 0)
    b.map(0, 0)
    with pytest.raises(CacheCorruptedError, match="mapped twice"):
        b.map(0, 0)
    with pytest.raises(CacheCorruptedError, match="not mapped"):
        b.unmap(0, 1)


def test_layer_view_of_a_block_major_pool():
    b = TensorBacking(POOLS, page_bytes=PAGE)
    for pg in range(6):
        b.map(0, pg)
    pool = b.tensor(0)
    # block of 48 bytes: layer A = 4x2 bf16 (16 B) at 0, layer B = 3 float32 (12 B) at 32
    a = layer_view(pool, 48, 0, (4, 2), torch.bfloat16)
    c = layer_view(pool, 48, 32, (3,), torch.float32)
    assert a.shape == (8, 4, 2) and c.shape == (8, 3)
    va = torch.randn(4, 2).to(torch.bfloat16)
    vc = torch.randn(3)
    a[5] = va
    c[6] = vc
    assert torch.equal(pool[5 * 48:5 * 48 + 16], va.contiguous().view(torch.uint8).flatten())
    assert torch.equal(pool[6 * 48 + 32:6 * 48 + 44], vc.view(torch.uint8))
    with pytest.raises(InvalidArgumentError, match="does not fit"):
        layer_view(pool, 48, 40, (3,), torch.float32)


def test_ledger_and_backing_between_steps():
    led = PageLedger(POOLS, budget_bytes=6 * PAGE, page_bytes=PAGE, stock_pages=2)
    steps = ManualSteps()
    mem = PhysicalMemory(led, TensorBacking(POOLS, page_bytes=PAGE, steps=steps))
    b = mem.backing
    assert b.mapped_pages() == {(0, 0)}  # the floor (block 0: bytes 0..47)
    assert b.stock == 2
    led.use(1, [1])  # bytes 160..319: pages 2, 3, 4
    mem.between_steps()
    assert b.mapped_pages() == {(0, 0), (1, 2), (1, 3), (1, 4)}
    assert b.physical_pages <= 6  # 4 mapped + stock capped by the free bytes
    slot = b.tensor(1)[160:320]
    slot.copy_(torch.arange(160, dtype=torch.uint8))
    mem.launched(0)  # step 0 reads slot 1
    led.release(1, [1])
    mem.between_steps()
    assert b.is_mapped(1, 3)  # step 0 may still read it
    assert torch.equal(b.tensor(1)[160:320], torch.arange(160, dtype=torch.uint8))
    steps.complete(0)
    ops = mem.between_steps()
    assert ops == [UnmapOp(1, 2, 0), UnmapOp(1, 3, 0), UnmapOp(1, 4, 0)]
    assert b.mapped_pages() == {(0, 0)} and b.stock == 2 and b.physical_pages == 3
    # release the floor block too: still mapped
    led.use(0, [0])
    led.release(0, [0])
    mem.between_steps()
    assert b.mapped_pages() == {(0, 0)}


def test_ledger_and_backing_must_agree_and_steps_go_forward():
    led = PageLedger(POOLS, budget_bytes=6 * PAGE, page_bytes=PAGE)
    with pytest.raises(InvalidArgumentError, match="pages of 64 bytes, backing pages of 32"):
        PhysicalMemory(led, TensorBacking(POOLS, page_bytes=32))
    other = [POOLS[0], PoolRange(1, block_bytes=80, ceiling_blocks=3)]
    with pytest.raises(InvalidArgumentError, match=r"pools \[1\] differ"):
        PhysicalMemory(led, TensorBacking(other, page_bytes=PAGE))
    steps = ManualSteps()
    steps.record(3)
    with pytest.raises(InvalidArgumentError, match="step 3 recorded after step 3"):
        steps.record(3)
    with pytest.raises(InvalidArgumentError, match="step 4 completed"):
        steps.complete(4)
    assert not steps.wait(3)
    steps.complete(3)
    assert steps.wait(3) and steps.finished() == 3


def test_split_around_the_launch_keeps_only_maps_before_it():
    led = PageLedger(POOLS, budget_bytes=6 * PAGE, page_bytes=PAGE, stock_pages=1)
    steps = ManualSteps()
    mem = PhysicalMemory(led, TensorBacking(POOLS, page_bytes=PAGE, steps=steps))
    b = mem.backing
    led.use(0, [3, 4])  # bytes 144..239: pages 2, 3
    mem.before_launch()
    mem.after_launch(0)
    led.release(0, [3, 4])
    steps.complete(0)
    led.use(0, [7])  # bytes 336..383: page 5
    ops = mem.before_launch()
    assert ops == [UnmapOp(0, 2, 0), UnmapOp(0, 3, 0), MapOp(0, 5)]
    assert b.mapped_pages() == {(0, 0), (0, 2), (0, 3), (0, 5)}  # the map came from stock
    assert b.physical_pages <= 6
    mem.after_launch(1)
    assert b.mapped_pages() == {(0, 0), (0, 5)} and b.stock == 1
    # with an empty stock, as many unmaps as maps need go first
    led2 = PageLedger(POOLS, budget_bytes=3 * PAGE, page_bytes=PAGE, stock_pages=0)
    mem2 = PhysicalMemory(led2, TensorBacking(POOLS, page_bytes=PAGE, steps=ManualSteps(True)))
    led2.use(0, [3, 4])  # pages 2, 3: with the floor's page 0, the whole budget
    mem2.before_launch()
    mem2.after_launch(0)
    led2.release(0, [3, 4])
    assert led2.free_bytes() == 0 and led2.pending_bytes() == 2 * PAGE
    led2.step_finished(0)  # what the next poll would learn
    led2.use(0, [6, 7])  # bytes 288..383: pages 4, 5
    assert mem2.before_launch() == [UnmapOp(0, 2, 0), UnmapOp(0, 3, 0), MapOp(0, 4),
                                    MapOp(0, 5)]
    # pages 0, 2, 3 were created in their maps (no stock); 4 and 5 reuse 2 and 3
    assert mem2.backing.physical_pages == 3 and mem2.backing.stats["created_in_map"] == 3
    assert mem2.backing.mapped_pages() == {(0, 0), (0, 4), (0, 5)}


def test_pages_mapped_ahead_serve_the_ledger_s_map_and_count_as_stock():
    b = TensorBacking(POOLS, page_bytes=PAGE)
    b.set_stock(3)
    assert b.map_ahead(0, 4) and b.ahead_pages() == {(0, 4)}
    assert not b.map_ahead(0, 4)  # already there
    assert b.mapped_pages() == set() and b.stock == 2 and b.physical_pages == 3
    b.set_stock(3)  # ahead pages are stock: nothing created
    assert b.stock == 2 and b.stats["created"] == 3
    data = torch.randint(0, 255, (PAGE,), dtype=torch.uint8)
    b.map(0, 4)  # the ledger's map: no attach, no stock taken
    page_bytes(b, 0, 4).copy_(data)
    assert b.mapped_pages() == {(0, 4)} and b.ahead == 0 and b.stock == 2
    assert b.stats["ahead_hits"] == 1 and b.stats["maps"] == 1
    assert torch.equal(page_bytes(b, 0, 4), data)
    # an empty stock: a map elsewhere takes a page mapped ahead back instead of creating one
    assert b.map_ahead(1, 0) and b.map_ahead(1, 1) and b.stock == 0
    b.map(0, 5)
    assert b.stats["created_in_map"] == 0 and b.stats["ahead_dropped"] == 1
    assert b.ahead == 1 and b.physical_pages == 3  # nothing created since set_stock(3)
    assert bool((page_bytes(b, 1, 0) == POISON).all() or (page_bytes(b, 1, 1) == POISON).all())
    b.set_stock(0)  # fewer pages wanted than mapped ahead: those go first
    assert b.ahead == 0 and b.stock == 0 and b.physical_pages == 2
    with pytest.raises(InvalidArgumentError, match="outside"):
        b.map_ahead(0, 6)


def test_map_ahead_moves_a_lowest_id_pool_s_maps_off_the_critical_path():
    """Blocks taken lowest id first (as ElasticPool takes them), one per page: after the
    first step every map before a launch was mapped ahead, and physical pages stay within
    the budget."""
    pools = [PoolRange(0, block_bytes=PAGE, ceiling_blocks=12, floor_blocks=1)]
    led = PageLedger(pools, budget_bytes=8 * PAGE, page_bytes=PAGE, stock_pages=3)
    steps = ManualSteps(True)
    mem = PhysicalMemory(led, TensorBacking(pools, page_bytes=PAGE, steps=steps), ahead=2)
    b = mem.backing
    created_at_start = b.stats["created_in_map"]  # the floor's page, before any stock
    mem.before_launch()
    mem.after_launch(0)
    assert b.ahead_pages() == {(0, 1), (0, 2)} and b.stock == 1
    used = [0]
    for step in range(1, 6):
        nxt = max(used) + 1
        led.use(0, [nxt])
        used.append(nxt)
        before = b.stats["ahead_maps"]
        ops = mem.before_launch()
        assert ops == [MapOp(0, nxt)]
        assert b.stats["ahead_maps"] == before  # no driver call before the launch
        mem.after_launch(step)
        assert b.physical_pages <= 8
    assert b.stats["ahead_hits"] == 5 and b.stats["created_in_map"] == created_at_start
    assert b.mapped_pages() == {(0, pg) for pg in used}
    # the budget fills up: the stock shrinks and the pages mapped ahead go with it
    led.use(0, [6, 7])
    mem.before_launch()
    mem.after_launch(6)
    assert led.free_bytes() == 0 and b.ahead == 0 and b.physical_pages == 8
    # freed low pages become the lowest unmapped ones: the guess follows them
    led.release(0, [1, 2])
    mem.before_launch()
    mem.after_launch(7)  # step 7 is done (synchronous steps): pages 1, 2 unmapped
    mem.before_launch()
    mem.after_launch(8)
    assert b.ahead_pages() == {(0, 1), (0, 2)}
    with pytest.raises(InvalidArgumentError, match="ahead"):
        PhysicalMemory(led, b, ahead=-1)
