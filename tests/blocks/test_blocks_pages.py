"""Page ledger: geometry, floors, budget, delayed unmap, the manager's queries.

Tiny pages (4 or 8 bytes) keep the arithmetic checkable by hand; expected values are
written out, never computed by the ledger.
"""

from __future__ import annotations

import pytest

from pagedkv.blocks.pages import PAGE_BYTES, MapOp, PageLedger, PoolRange, UnmapOp
from pagedkv.errors import CacheCorruptedError, InvalidArgumentError, OutOfBlocksError


def ledger(budget_pages=8, stock=2, floor=0):
    # pool 0: 3-byte blocks on 4-byte pages (blocks straddle); pool 1: 10-byte slots (3 pages)
    return PageLedger(
        [PoolRange(0, block_bytes=3, ceiling_blocks=10, floor_blocks=floor),
         PoolRange(1, block_bytes=10, ceiling_blocks=4)],
        budget_bytes=budget_pages * 4, page_bytes=4, stock_pages=stock)


def test_geometry_straddling_blocks_and_multi_page_slots():
    led = ledger()
    # pool 0: 30 bytes -> 8 pages; block 1 = bytes 3..5 -> pages 0 and 1
    assert led.num_pages(0) == 8 and led.num_pages(1) == 10
    assert list(led.pages_of(0, 0)) == [0]
    assert list(led.pages_of(0, 1)) == [0, 1]
    assert list(led.pages_of(0, 9)) == [6, 7]
    assert list(led.blocks_on_page(0, 1)) == [1, 2]  # bytes 4..7
    assert list(led.blocks_on_page(0, 7)) == [9]  # bytes 28..31, the range ends at 30
    # pool 1: slot 1 = bytes 10..19 -> pages 2, 3, 4
    assert list(led.pages_of(1, 1)) == [2, 3, 4]
    assert PAGE_BYTES == 2 * 1024 * 1024


def test_floor_pages_are_mapped_at_start_and_never_unmapped():
    led = ledger(floor=3)  # blocks 0..2 = bytes 0..8 -> pages 0, 1, 2
    assert led.drain() == [MapOp(0, 0), MapOp(0, 1), MapOp(0, 2)]
    assert led.mapped_bytes() == led.floor_bytes() == 12
    assert all(led.is_mapped(0, b) for b in (0, 1, 2, 3)) and not led.is_mapped(0, 4)
    led.use(0, [0, 1, 2])
    assert led.drain() == []
    led.step_launched(0)
    led.release(0, [0, 1, 2])
    led.step_finished(0)
    assert led.drain() == [] and led.mapped_bytes() == 12
    led.check()


def test_floors_over_budget_are_refused():
    with pytest.raises(InvalidArgumentError, match="floors need 3 pages"):
        ledger(budget_pages=2, floor=3)


def test_use_maps_once_and_budget_is_all_or_nothing():
    led = ledger(budget_pages=4)
    assert led.bytes_to_use(1, [0]) == 12  # a slot spans pages 0..2
    led.use(1, [0])
    assert led.drain() == [MapOp(1, 0), MapOp(1, 1), MapOp(1, 2)]
    assert led.free_bytes() == 4
    assert led.bytes_to_use(0, [0]) == 4 and led.bytes_to_use(0, [0, 1]) == 8
    with pytest.raises(OutOfBlocksError, match="2 new pages"):
        led.use(0, [0, 1])
    assert led.drain() == [] and led.mapped_bytes() == 12 and not led.holds_data(0, 0)
    led.use(0, [0])
    assert led.bytes_to_use(0, [0]) == 0  # already on a held page (and holding data)
    assert led.free_bytes() == 0 and led.drain() == [MapOp(0, 0)]
    led.check()


def test_unmap_waits_for_the_step_in_flight():
    led = ledger()
    led.use(0, [4])  # bytes 12..14 -> page 3
    led.drain()
    led.step_launched(7)
    led.release(0, [4])
    assert led.drain() == []
    assert led.pending_bytes() == 4 and led.mapped_bytes() == 4 and led.free_bytes() == 28
    assert led.is_mapped(0, 4)  # still held: reusable for free
    led.step_launched(8)
    led.step_finished(6)
    assert led.drain() == [] and led.pending_bytes() == 4
    led.step_finished(7)
    assert led.pending_bytes() == 0 and led.mapped_bytes() == 0  # bytes free at once
    assert led.drain() == [UnmapOp(0, 3, 7)]
    led.check()


def test_release_with_nothing_in_flight_unmaps_at_the_next_drain():
    led = ledger()
    led.use(0, [4])
    led.drain()
    led.release(0, [4])
    assert led.mapped_bytes() == 0
    assert led.drain() == [UnmapOp(0, 3, -1)]


def test_reusing_a_pending_page_cancels_its_unmap():
    led = ledger()
    led.use(0, [4, 5])  # page 3 (block 4) and pages 3, 4 (block 5: bytes 15..17)
    led.drain()
    led.step_launched(0)
    led.release(0, [4, 5])
    assert led.pending_bytes() == 8
    led.use(0, [4])
    assert led.pending_bytes() == 4  # page 4 still waits, page 3 revived
    led.step_finished(0)
    assert led.drain() == [UnmapOp(0, 4, 0)]
    assert led.is_mapped(0, 4) and not led.is_mapped(0, 5)
    led.check()


def test_a_page_emptied_before_its_map_was_applied_needs_no_op():
    led = ledger()
    led.step_launched(0)
    led.use(1, [3])
    led.release(1, [3])
    assert led.drain() == [] and led.mapped_bytes() == 0


def test_reusing_a_page_whose_unmap_is_not_drained_cancels_the_unmap():
    led = ledger()
    led.use(0, [4])
    led.drain()
    led.step_launched(0)
    led.release(0, [4])
    led.step_finished(0)
    assert led.free_bytes() == 32
    led.use(0, [4])
    assert led.free_bytes() == 28
    assert led.drain() == []  # the page never left the device
    led.check()


def test_page_moves_between_pools_within_a_full_budget():
    led = ledger(budget_pages=3)
    led.use(1, [0])  # pages 0..2 of pool 1: the whole budget
    led.drain()
    with pytest.raises(OutOfBlocksError):
        led.use(0, [0])
    led.step_launched(0)
    led.release(1, [0])
    assert led.free_bytes() == 0  # still pending
    with pytest.raises(OutOfBlocksError):
        led.use(0, [0])
    led.step_finished(0)
    led.use(0, [0])
    assert led.drain() == [UnmapOp(1, 0, 0), UnmapOp(1, 1, 0), UnmapOp(1, 2, 0), MapOp(0, 0)]


def test_bytes_freed_by_evicting_counts_only_pages_left_empty():
    led = ledger(floor=1)  # page 0 is floor
    led.use(0, [0, 1, 2, 3, 6])  # pages 0 | 0,1 | 1,2 | 2 | 4,5
    assert led.bytes_freed_by(0, [6]) == 8  # pages 4 and 5
    assert led.bytes_freed_by(0, [3]) == 0  # page 2 also holds block 2
    assert led.bytes_freed_by(0, [2, 3]) == 4  # page 2 (page 1 keeps block 1)
    assert led.bytes_freed_by(0, [0, 1]) == 0  # page 0 is floor, page 1 keeps block 2
    assert led.bytes_freed_by(0, [7, 8]) == 0  # hold no data
    assert led.bytes_freed_by(0, [6, 6]) == 8


def test_emptiest_and_fullest_open_pages():
    led = ledger()
    led.use(0, [1, 2, 3, 6])  # page 0: {1}; 1: {1, 2}; 2: {2, 3}; 4: {6}; 5: {6}
    assert led.emptiest_pages(0, 3) == [(0, 1), (4, 1), (5, 1)]
    assert led.emptiest_pages(0, 10) == [(0, 1), (4, 1), (5, 1), (1, 2), (2, 2)]
    # held pages with room: 0 (blocks 0, 1; 1 used), 4 (5, 6; 1 used), 5 (6, 7; 1 used);
    # pages 1 and 2 are full (2 of 2)
    assert led.fullest_open_pages(0, 5) == [(0, 1), (4, 1), (5, 1)]
    led.use(0, [7])
    assert led.fullest_open_pages(0, 1) == [(0, 1)]


def test_stock_wanted_never_exceeds_the_free_bytes():
    led = ledger(budget_pages=4, stock=2)
    assert led.stock_wanted() == 2
    led.use(1, [0])
    assert led.stock_wanted() == 1
    with pytest.raises(OutOfBlocksError):
        led.use(0, [9])  # bytes 27..29 -> pages 6, 7: 2 pages, 1 left
    assert led.stock_wanted() == 1
    led.use(0, [8])  # bytes 24..26 -> page 6
    assert led.stock_wanted() == 0


def test_errors_name_the_offending_values():
    led = ledger()
    with pytest.raises(InvalidArgumentError, match="no pool 5"):
        led.use(5, [0])
    with pytest.raises(InvalidArgumentError, match="block 10 outside 0..9"):
        led.use(0, [10])
    with pytest.raises(InvalidArgumentError, match="page 8 outside"):
        led.blocks_on_page(0, 8)
    led.use(0, [2])
    with pytest.raises(CacheCorruptedError, match="block 2 used twice"):
        led.use(0, [2])
    with pytest.raises(CacheCorruptedError, match="block 3 released but not in use"):
        led.release(0, [3])
    led.step_launched(3)
    with pytest.raises(InvalidArgumentError, match="step 3 launched after step 3"):
        led.step_launched(3)
    with pytest.raises(InvalidArgumentError, match="step 4 finished"):
        led.step_finished(4)
    with pytest.raises(InvalidArgumentError, match="given twice"):
        PageLedger([PoolRange(0, 1, 1), PoolRange(0, 1, 1)], budget_bytes=8)
    with pytest.raises(InvalidArgumentError, match="floor_blocks 3 outside"):
        PageLedger([PoolRange(0, 1, 2, floor_blocks=3)], budget_bytes=8)


def test_check_catches_a_corrupted_count():
    led = ledger()
    led.use(0, [4])
    led._pools[0].count[3] = 0  # simulate a lost update
    with pytest.raises(CacheCorruptedError, match="drifted"):
        led.check()


def test_a_block_freed_and_taken_again_before_any_query_leaves_no_trace():
    led = ledger()
    led.use(0, [4, 6])  # pages 3 and 4 (block 6: bytes 18..20 -> pages 4, 5)
    assert led.drain() == [MapOp(0, 3), MapOp(0, 4), MapOp(0, 5)]
    led.step_launched(0)
    led.release(0, [4, 6])
    led.check()  # emptied pages wait, still mapped, for the next query to settle them
    led.try_use_one(0, 4)  # page 3 again: pages 4 and 5 stay empty
    led.check()
    assert led.pending_bytes() == 8 and led.mapped_bytes() == 12
    led.step_finished(0)
    assert led.drain() == [UnmapOp(0, 4, 0), UnmapOp(0, 5, 0)]
    assert led.mapped_bytes() == 4 and led.is_mapped(0, 4) and not led.is_mapped(0, 6)
    led.check()


def test_check_catches_an_emptied_page_nobody_will_settle():
    led = ledger()
    led.use(0, [4])
    led.drain()
    led.release(0, [4])
    led._pools[0].emptied.clear()  # simulate a lost note: page 3 would stay mapped forever
    with pytest.raises(CacheCorruptedError, match="mapped, empty and not to be settled"):
        led.check()
