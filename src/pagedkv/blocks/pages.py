"""Physical pages under the pools: which 2 MiB pages are mapped, within one byte budget.

Each pool owns a contiguous *virtual* byte range sized for its ceiling. Block (or state
slot) ``b`` of a pool occupies bytes ``[b * block_bytes, (b + 1) * block_bytes)`` of that
range, all of its layers together (block-major), so a block lies on one page, straddles
two, or -- a recurrent state slot -- spans many. Physical memory is mapped page by page
only where blocks hold data, and every pool draws from one budget (bytes of pages held).

The block manager tells the ledger which blocks hold data (:meth:`PageLedger.use`: a block
allocated or kept in the prefix cache) and which no longer do (:meth:`PageLedger.release`:
freed uncached, or evicted). A page is mapped when its first block is used; when its last
block is released it is *pending*: still mapped and still charged, reusable for free, and
unmapped only once every step launched before it emptied is known finished (the GPU may
still be reading it; ``cuMemUnmap`` does not wait for queued work). The engine reports steps
with :meth:`step_launched` / :meth:`step_finished` and, between steps, applies the
:class:`UnmapOp` and :class:`MapOp` that :meth:`drain` returns. A finished step frees its
pending pages' bytes at once; their unmaps come first in the next drain, so the device
never holds more than the budget and the unmapped physical pages can serve the maps (a
block used again before that drain cancels its page's unmap instead). Pages covering each pool's floor blocks are mapped at
the start and never unmapped. The backing keeps :meth:`stock_wanted` pages pre-created so a
map never waits for creation; those come out of the free bytes, never on top of the budget.

A release only moves counts: a page left empty is noted on a per-pool list and its fate
(pending, dropped, unmap) is decided by :meth:`_settle` on the ledger's next call other than
``use`` / ``try_use_one`` / ``release`` -- by then the manager has often used the page again
(a free list hands freed blocks straight back to admissions and decode steps), and such a
page never touches the op queues. Every answer is the one settling at once would give; only the order of ops
of one kind within a drain may differ.

When several pools share the budget (:attr:`PageLedger.shared`), the pools also mark which
blocks holding data are *idle* (:meth:`PageLedger.set_idle`: cached free blocks, which they
may evict at any time; :meth:`~PageLedger.clear_idle` when one is taken back; a release
clears the mark too). The ledger counts them per page, so
:meth:`~PageLedger.idle_bytes_freed` -- what evicting them would give back to another
pool -- costs O(pages) in C, not a Python loop over every idle block.

Standard library only; the ledger holds no memory, it only decides. Cost: O(pages a block
touches) per block used or released (integer arithmetic and a count when no block
straddles a page); the queries over pages are O(pages of the pool).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import compress, repeat
from operator import add, eq, floordiv, mod, mul
from typing import NamedTuple

from pagedkv.blocks.ids import BlockId, PoolId
from pagedkv.errors import CacheCorruptedError, InvalidArgumentError, OutOfBlocksError

PAGE_BYTES = 2 << 20  # the CUDA virtual-memory allocation granularity on current GPUs
NO_STEP = -1  # "no step launched yet" / "no step used the page"

_UNMAPPED, _MAPPED, _PENDING = 0, 1, 2


@dataclass(frozen=True)
class PoolRange:
    """One pool's virtual byte range: blocks ``0 .. ceiling_blocks - 1`` of ``block_bytes``
    each (the stride between consecutive blocks, padding included). The pages covering
    blocks ``0 .. floor_blocks - 1`` stay mapped for the ledger's whole life."""

    pool_id: PoolId
    block_bytes: int
    ceiling_blocks: int
    floor_blocks: int = 0


class MapOp(NamedTuple):
    """Back page ``page`` of pool ``pool_id`` -- bytes ``[page * page_bytes, (page + 1) *
    page_bytes)`` of its virtual range -- with a physical page, before the next step."""

    pool_id: PoolId
    page: int


class UnmapOp(NamedTuple):
    """Unmap page ``page`` of pool ``pool_id`` and return its physical page to the stock.
    Emitted only once step ``after_step`` (the last launched while the page held data;
    ``NO_STEP`` if none) has finished; the backing may check its own event again."""

    pool_id: PoolId
    page: int
    after_step: int


PageOp = MapOp | UnmapOp

# build ops from tuples in C (no Python-level ``__new__`` frame per op)
_new_map = partial(tuple.__new__, MapOp)
_new_unmap = partial(tuple.__new__, UnmapOp)


def virtual_pages(spec: PoolRange, page_bytes: int) -> int:
    """Pages of the pool's virtual range: its ceiling's bytes, rounded up to whole pages."""
    return -(-spec.ceiling_blocks * spec.block_bytes // page_bytes)


class _PoolPages:
    """Per-pool state: page states, blocks in use per page, which blocks hold data."""

    __slots__ = ("spec", "num_pages", "floor_pages", "state", "count", "held", "block_used",
                 "span", "index", "bb", "ceiling", "per_page", "emptied", "idle", "idle_count")

    def __init__(self, spec: PoolRange, page_bytes: int, index: int = 0) -> None:
        self.spec = spec
        self.index = index  # page keys of the op queues: page * number of pools + index
        self.bb = spec.block_bytes
        self.ceiling = spec.ceiling_blocks
        self.num_pages = virtual_pages(spec, page_bytes)
        self.floor_pages = (
            ((spec.floor_blocks * spec.block_bytes - 1) // page_bytes + 1)
            if spec.floor_blocks else 0
        )
        self.state = bytearray(self.num_pages)
        self.count = [0] * self.num_pages  # blocks holding data that overlap the page
        self.held = 0  # pages mapped or pending (charged to the budget)
        self.block_used = bytearray(spec.ceiling_blocks)
        self.idle = bytearray(spec.ceiling_blocks)  # holds data that its owner may release
        self.idle_count = [0] * self.num_pages  # idle blocks that overlap the page (<= count)
        self.span = (spec.block_bytes + page_bytes - 2) // page_bytes + 1  # most pages a block touches
        # blocks per page when none straddles a page (page of block b: b // per_page), else 0
        self.per_page = page_bytes // spec.block_bytes if page_bytes % spec.block_bytes == 0 else 0
        # non-floor pages whose count fell to 0 since the last settle (may repeat, may have
        # been used again since): still in their old state until PageLedger._settle
        self.emptied: list[int] = []


class PageLedger:
    """Decides which physical pages back the pools; see the module docstring.

    ``budget_bytes`` bounds the bytes of pages held (mapped, queued to map, or pending
    unmap) over all pools; the floors must fit in it. ``stock_pages`` is how many spare
    pages the backing should keep created (capped by the free bytes).
    """

    def __init__(self, pools: Sequence[PoolRange], budget_bytes: int,
                 page_bytes: int = PAGE_BYTES, stock_pages: int = 4) -> None:
        if not isinstance(page_bytes, int) or page_bytes <= 0:
            raise InvalidArgumentError(f"page_bytes must be a positive int, got {page_bytes!r}")
        if not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise InvalidArgumentError(f"budget_bytes must be an int >= 0, got {budget_bytes!r}")
        if not isinstance(stock_pages, int) or stock_pages < 0:
            raise InvalidArgumentError(f"stock_pages must be an int >= 0, got {stock_pages!r}")
        self.page_bytes = page_bytes
        self.budget_pages = budget_bytes // page_bytes
        self.stock_pages = stock_pages
        self._pools: dict[PoolId, _PoolPages] = {}
        for spec in pools:
            if spec.pool_id in self._pools:
                raise InvalidArgumentError(f"pool {spec.pool_id} given twice")
            if spec.block_bytes <= 0 or spec.ceiling_blocks <= 0:
                raise InvalidArgumentError(
                    f"pool {spec.pool_id}: block_bytes and ceiling_blocks must be positive, "
                    f"got {spec.block_bytes} and {spec.ceiling_blocks}"
                )
            if not 0 <= spec.floor_blocks <= spec.ceiling_blocks:
                raise InvalidArgumentError(
                    f"pool {spec.pool_id}: floor_blocks {spec.floor_blocks} outside "
                    f"0..{spec.ceiling_blocks} (the ceiling)"
                )
            self._pools[spec.pool_id] = _PoolPages(spec, page_bytes, len(self._pools))
        floor = sum(p.floor_pages for p in self._pools.values())
        if floor > self.budget_pages:
            raise InvalidArgumentError(
                f"the pools' floors need {floor} pages of {page_bytes} bytes "
                f"({floor * page_bytes} bytes), over the budget of {budget_bytes} bytes"
            )
        self._held = 0
        # pools that could take pages from each other: only then is what a pool's idle
        # blocks would free ever asked (its own allocations reuse them without asking)
        self.shared = len(self._pools) > 1
        # page queues keyed by one int per page (page * number of pools + pool index), in
        # insertion order: no tuple or op object per page until ``drain``
        self._npools = len(self._pools)
        self._pool_ids = tuple(self._pools)
        self._maps: dict[int, None] = {}  # queued maps
        # page -> the step it waits for; the steps never decrease in insertion order (an
        # entry is always added with the newest launched step)
        self._pending: dict[int, int] = {}
        self._unmaps: dict[int, int] = {}  # page -> its UnmapOp's after_step, next drain
        self.launched = NO_STEP  # last step handed to the device
        self.finished = NO_STEP  # every step up to this one has finished
        self._dirty = False  # some pool's ``emptied`` list may be non-empty
        for p in self._pools.values():
            for page in range(p.floor_pages):
                p.state[page] = _MAPPED
                self._maps[page * self._npools + p.index] = None
            p.held = p.floor_pages
            self._held += p.floor_pages

    # ---- accounting -------------------------------------------------------------------

    @property
    def budget_bytes(self) -> int:
        return self.budget_pages * self.page_bytes

    def mapped_bytes(self, pool_id: PoolId | None = None) -> int:
        """Bytes of pages held (mapped, queued to map, or pending unmap), of one pool or all."""
        if self._dirty:
            self._settle()
        held = self._held if pool_id is None else self._pool(pool_id).held
        return held * self.page_bytes

    def free_bytes(self) -> int:
        """Budget bytes no page holds: what :meth:`use` can still map now."""
        if self._dirty:
            self._settle()
        return (self.budget_pages - self._held) * self.page_bytes

    def pending_bytes(self) -> int:
        """Bytes of empty pages still charged, waiting for the step in flight to finish."""
        if self._dirty:
            self._settle()
        return len(self._pending) * self.page_bytes

    def floor_bytes(self, pool_id: PoolId | None = None) -> int:
        pools = self._pools.values() if pool_id is None else (self._pool(pool_id),)
        return sum(p.floor_pages for p in pools) * self.page_bytes

    def pool_range(self, pool_id: PoolId) -> PoolRange:
        return self._pool(pool_id).spec

    def num_pages(self, pool_id: PoolId) -> int:
        """Pages of the pool's virtual range (its ceiling)."""
        return self._pool(pool_id).num_pages

    def stock_wanted(self) -> int:
        """Spare physical pages the backing should hold created now (within the budget)."""
        if self._dirty:
            self._settle()
        return min(self.stock_pages, self.budget_pages - self._held)

    # ---- blocks -----------------------------------------------------------------------

    def pages_of(self, pool_id: PoolId, block: BlockId) -> range:
        """Pages block ``block`` of the pool overlaps."""
        p = self._pool(pool_id)
        self._check_block(p, block)
        return self._pages(p, block)

    def blocks_on_page(self, pool_id: PoolId, page: int) -> range:
        """Blocks of the pool that overlap page ``page`` (all of them lose their bytes if
        it is unmapped)."""
        p = self._pool(pool_id)
        if not 0 <= page < p.num_pages:
            raise InvalidArgumentError(
                f"pool {pool_id}: page {page} outside 0..{p.num_pages - 1}")
        bb, pb = p.spec.block_bytes, self.page_bytes
        return range(page * pb // bb, min(p.spec.ceiling_blocks, -(-(page + 1) * pb // bb)))

    def is_mapped(self, pool_id: PoolId, block: BlockId) -> bool:
        """Whether every page of the block is held (using it then costs no bytes)."""
        if self._dirty:
            self._settle()
        state = self._pool(pool_id).state
        return all(state[pg] != _UNMAPPED for pg in self.pages_of(pool_id, block))

    def holds_data(self, pool_id: PoolId, block: BlockId) -> bool:
        p = self._pool(pool_id)
        self._check_block(p, block)
        return bool(p.block_used[block])

    def bytes_to_use(self, pool_id: PoolId, blocks: Iterable[BlockId]) -> int:
        """Bytes :meth:`use` of these blocks would newly map (0: they fit on held pages)."""
        if self._dirty:
            self._settle()
        new = self._new_pages(self._pool(pool_id), blocks)
        return len(new) * self.page_bytes if new else 0

    def use(self, pool_id: PoolId, blocks: Iterable[BlockId]) -> None:
        """These blocks now hold data: map their pages (revive pending ones). All or
        nothing: raises :class:`OutOfBlocksError` if the budget cannot hold the new pages."""
        if type(blocks) is not list and not isinstance(blocks, (tuple, range)):
            blocks = list(blocks)
        if len(blocks) == 1:  # a decode step's block: the one-block path
            if not self.try_use_one(pool_id, blocks[0]):  # (settled by try_use_one)
                new = self._new_pages(self._pool(pool_id), blocks) or ()
                raise OutOfBlocksError(
                    f"pool {pool_id}: 1 block needs {len(new)} new pages of "
                    f"{self.page_bytes} bytes, {self.budget_pages - self._held} left in the "
                    f"budget of {self.budget_bytes} bytes")
            return
        p = self._pools.get(pool_id) or self._pool(pool_id)
        room = self.budget_pages - self._held
        if len(blocks) * p.span > room and self._dirty:  # could be short: exact counts first
            self._settle()
            room = self.budget_pages - self._held
        # count the new pages only when the budget could fall short of the worst case
        new = self._new_pages(p, blocks) if len(blocks) * p.span > room else None
        if new and len(new) > room:
            raise OutOfBlocksError(
                f"pool {pool_id}: {len(blocks)} blocks need {len(new)} new pages of "
                f"{self.page_bytes} bytes, {self.budget_pages - self._held} left in the "
                f"budget of {self.budget_bytes} bytes"
            )
        if new is None and blocks and (min(blocks) < 0 or max(blocks) >= p.ceiling):
            for b in blocks:  # ids not checked by the count: name the first bad one
                self._check_block(p, b)
        self._use_checked(p, pool_id, blocks)

    def _use_checked(self, p: _PoolPages, pool_id: PoolId, blocks: Sequence[BlockId]) -> None:
        """:meth:`use` once the ids and the budget are checked."""
        bb, pb = p.bb, self.page_bytes
        used, count, state = p.block_used, p.count, p.state
        n, idx = self._npools, p.index
        maps, pending, unmaps = self._maps, self._pending, self._unmaps
        mapped = 0
        k = p.per_page
        try:
            if k:  # no block straddles a page: one page per block, no range
                for b in blocks:
                    if used[b]:
                        raise CacheCorruptedError(f"pool {pool_id}: block {b} used twice")
                    used[b] = 1
                    pg = b // k
                    c = count[pg]
                    count[pg] = c + 1
                    if c or state[pg] == _MAPPED:  # holds data, a floor page, or emptied
                        continue
                    key = pg * n + idx
                    if state[pg] == _PENDING:
                        del pending[key]
                    else:
                        if unmaps.pop(key, None) is None:
                            maps[key] = None
                        mapped += 1
                    state[pg] = _MAPPED
                return
            for b in blocks:
                if used[b]:
                    raise CacheCorruptedError(f"pool {pool_id}: block {b} used twice")
                used[b] = 1
                lo = b * bb // pb
                hi = ((b + 1) * bb - 1) // pb
                for pg in (lo,) if lo == hi else range(lo, hi + 1):
                    c = count[pg]
                    count[pg] = c + 1
                    if c or state[pg] == _MAPPED:  # holds data, a floor page, or emptied
                        continue
                    key = pg * n + idx
                    if state[pg] == _PENDING:
                        del pending[key]
                    else:
                        # an unmap not yet drained is cancelled: the page never left the device
                        if unmaps.pop(key, None) is None:
                            maps[key] = None
                        mapped += 1
                    state[pg] = _MAPPED
        finally:
            p.held += mapped
            self._held += mapped

    def try_use_one(self, pool_id: PoolId, block: BlockId) -> bool:
        """:meth:`use` of one block, False instead of :class:`OutOfBlocksError` (nothing
        changed) when the budget cannot hold its new pages: a decode step's allocation."""
        p = self._pools.get(pool_id) or self._pool(pool_id)
        if p.span > self.budget_pages - self._held:  # could be short: count its new pages
            if self._dirty:
                self._settle()
            new = self._new_pages(p, (block,))
            if new and len(new) > self.budget_pages - self._held:
                return False
        b = block
        if not 0 <= b < p.ceiling:
            self._check_block(p, b)
        k = p.per_page
        if k:
            lo = b // k
        else:
            pb = self.page_bytes
            lo = b * p.bb // pb
            if lo != ((b + 1) * p.bb - 1) // pb:  # straddles pages: the general loop
                self._use_checked(p, pool_id, (b,))
                return True
        used = p.block_used
        if used[b]:
            raise CacheCorruptedError(f"pool {pool_id}: block {b} used twice")
        used[b] = 1
        count = p.count
        c = count[lo]
        count[lo] = c + 1
        if c:  # the page holds data: the decode step's usual case
            return True
        state = p.state
        if state[lo] == _MAPPED:  # a floor page, or emptied since the last settle
            return True
        key = lo * self._npools + p.index
        if state[lo] == _PENDING:
            del self._pending[key]
        else:
            if self._unmaps.pop(key, None) is None:
                self._maps[key] = None
            p.held += 1
            self._held += 1
        state[lo] = _MAPPED
        return True

    def release(self, pool_id: PoolId, blocks: Iterable[BlockId]) -> None:
        """These blocks hold no data any more (nor are idle); pages left empty become
        pending (or, if their map was never applied, are dropped at once). Only counts move
        here: the pages' fate is settled on the next call that could observe it."""
        p = self._pools.get(pool_id) or self._pool(pool_id)
        used, count, floor, ceiling = p.block_used, p.count, p.floor_pages, p.ceiling
        idle, idle_count = p.idle, p.idle_count
        emptied = p.emptied
        self._dirty = True
        k = p.per_page
        if k:  # no block straddles a page
            for b in blocks:
                if not (0 <= b < ceiling and used[b]):
                    self._bad_release(p, b)
                used[b] = 0
                pg = b // k
                if idle[b]:  # an evicted cached block
                    idle[b] = 0
                    idle_count[pg] -= 1
                c = count[pg] - 1
                count[pg] = c
                if not c and pg >= floor:
                    emptied.append(pg)
            return
        bb, pb = p.bb, self.page_bytes
        for b in blocks:
            if not (0 <= b < ceiling and used[b]):
                self._bad_release(p, b)
            used[b] = 0
            was_idle = idle[b]
            idle[b] = 0
            for pg in range(b * bb // pb, ((b + 1) * bb - 1) // pb + 1):
                if was_idle:
                    idle_count[pg] -= 1
                c = count[pg] - 1
                count[pg] = c
                if not c and pg >= floor:
                    emptied.append(pg)

    def _bad_release(self, p: _PoolPages, b: int) -> None:
        self._check_block(p, b)
        raise CacheCorruptedError(f"pool {p.spec.pool_id}: block {b} released but not in use")

    def _settle(self) -> None:
        """Decide the fate of the pages releases left empty, as if decided at each release
        (``launched`` and ``finished`` cannot have changed since: every step call settles
        first). A page used again since is skipped; so is a repeat."""
        self._dirty = False
        n = self._npools
        maps, pending, unmaps = self._maps, self._pending, self._unmaps
        launched = self.launched
        in_flight = launched > self.finished
        for p in self._pools.values():
            emptied = p.emptied
            if not emptied:
                continue
            p.emptied = []
            count, state, idx = p.count, p.state, p.index
            dropped = 0
            for pg in emptied:
                if count[pg] or state[pg] != _MAPPED:
                    continue
                key = pg * n + idx
                if maps.pop(key, 0) is None:  # never reached the device
                    state[pg] = _UNMAPPED
                    dropped += 1
                elif in_flight:  # the step in flight may read it: unmap after it
                    state[pg] = _PENDING
                    pending[key] = launched
                else:  # nothing in flight can read it
                    state[pg] = _UNMAPPED
                    dropped += 1
                    unmaps[key] = launched
            p.held -= dropped
            self._held -= dropped

    def bytes_freed_by(self, pool_id: PoolId, blocks: Iterable[BlockId]) -> int:
        """Bytes that would leave the budget (after the step in flight) if these blocks --
        say cached ones the manager could evict -- were released."""
        p = self._pool(pool_id)
        if self._dirty:
            self._settle()
        hits: dict[int, int] = {}
        for b in set(blocks):
            if not self.holds_data(pool_id, b):
                continue
            for pg in self.pages_of(pool_id, b):
                hits[pg] = hits.get(pg, 0) + 1
        freed = sum(1 for pg, n in hits.items() if n == p.count[pg] and pg >= p.floor_pages)
        return freed * self.page_bytes

    # ---- idle blocks ------------------------------------------------------------------

    def set_idle(self, pool_id: PoolId, blocks: Iterable[BlockId]) -> None:
        """These blocks, which hold data, are idle: their owner may release them at any
        time (cached free blocks it can evict). Counted per page for
        :meth:`idle_bytes_freed`; a block already idle stays counted once."""
        self._mark_idle(self._pools.get(pool_id) or self._pool(pool_id), blocks, 1)

    def clear_idle(self, pool_id: PoolId, blocks: Iterable[BlockId]) -> None:
        """These blocks are no longer idle (taken back into use, still holding data); a
        block that was not idle is left as is. (:meth:`release` clears the mark itself.)"""
        self._mark_idle(self._pools.get(pool_id) or self._pool(pool_id), blocks, 0)

    def clear_idle_one(self, pool_id: PoolId, block: BlockId) -> None:
        """:meth:`clear_idle` of one block, inline: the LRU's oldest block taken for new
        data, one call per block when the budget is short."""
        p = self._pools.get(pool_id) or self._pool(pool_id)
        if not 0 <= block < p.ceiling:
            self._check_block(p, block)
        idle = p.idle
        if idle[block]:
            idle[block] = 0
            k = p.per_page
            if k:
                p.idle_count[block // k] -= 1
            else:
                for pg in self._pages(p, block):
                    p.idle_count[pg] -= 1

    def is_idle(self, pool_id: PoolId, block: BlockId) -> bool:
        p = self._pool(pool_id)
        self._check_block(p, block)
        return bool(p.idle[block])

    def idle_bytes_freed(self, pool_id: PoolId, kept: Iterable[BlockId] = (),
                         landing: Iterable[BlockId] = ()) -> int:
        """:meth:`bytes_freed_by` of the pool's idle blocks, less those in ``kept`` and less
        every idle block that overlaps a page of a block in ``landing`` (blocks about to
        be used: their pages stay held, with whatever lies on them), without walking the
        idle blocks: O(pages of the pool) in C, plus the pages ``kept`` and ``landing``
        touch. A page is freed when it is past the floor, holds data, and every block on
        it holding data is idle (``idle_count == count``: exactly the pages whose blocks
        would all be released) and none of them stays."""
        p = self._pool(pool_id)
        count, idle_count, floor = p.count, p.idle_count, p.floor_pages
        counts = count[floor:]
        # pages where every block holding data is idle; a page holding none matches too
        whole = sum(map(eq, idle_count[floor:], counts)) - counts.count(0)
        if not whole:
            return 0
        idle = p.idle
        kept = list(kept)
        stay = self._pages_under(p, list(compress(kept, map(idle.__getitem__, kept))))
        landing_pages = self._pages_under(p, landing)
        if landing_pages:
            stay |= landing_pages
            bb, pb, ceiling = p.bb, self.page_bytes, p.ceiling
            for pg in landing_pages:
                # an idle block on the page stays; only its first and last blocks can
                # reach other pages (the ones between lie on this page alone)
                first = pg * pb // bb
                last = min(ceiling, -(-(pg + 1) * pb // bb)) - 1
                for b in (first, last):
                    if idle[b]:
                        stay.update(self._pages(p, b))
        lost = sum(1 for pg in stay
                   if pg >= floor and count[pg] and idle_count[pg] == count[pg])
        return (whole - lost) * self.page_bytes

    def emptiest_pages(self, pool_id: PoolId, n: int) -> list[tuple[int, int]]:
        """Up to ``n`` (page, blocks holding data) of the pool's unmappable pages that hold
        data, fewest blocks first: where evicting frees a page soonest."""
        p = self._pool(pool_id)
        if self._dirty:
            self._settle()
        count = p.count
        found = heapq.nsmallest(
            n, ((count[pg], pg) for pg in range(p.floor_pages, p.num_pages) if count[pg]))
        return [(pg, c) for c, pg in found]

    def fullest_open_pages(self, pool_id: PoolId, n: int) -> list[tuple[int, int]]:
        """Up to ``n`` (page, blocks holding data) of held pages with room for another
        block, fullest first: where placing a new block packs pages tightest."""
        p = self._pool(pool_id)
        if self._dirty:
            self._settle()
        count, state = p.count, p.state
        room = [(pg, count[pg]) for pg in range(p.num_pages)
                if state[pg] != _UNMAPPED and count[pg] < len(self.blocks_on_page(pool_id, pg))]
        return heapq.nlargest(n, room, key=lambda t: (t[1], -t[0]))

    def lowest_unmapped_pages(self, pool_id: PoolId, n: int) -> list[int]:
        """The pool's ``n`` (or fewer) lowest pages that are neither held nor queued to
        map: where its next maps land when new blocks take the lowest free ids, as
        :class:`~pagedkv.blocks.elastic.ElasticPool` does (every block of an unmapped page
        is free, so the lowest free id on an unmapped page is on the lowest one). The
        backing can map them ahead, off the step's critical path."""
        p = self._pool(pool_id)
        if self._dirty:
            self._settle()
        state, out, pg = p.state, [], p.floor_pages
        while len(out) < n:
            pg = state.find(_UNMAPPED, pg)
            if pg < 0:
                break
            out.append(pg)
            pg += 1
        return out

    # ---- steps and ops ----------------------------------------------------------------

    def step_launched(self, step: int) -> None:
        """Step ``step`` (increasing ids) was handed to the device: pages emptied from now
        on wait for it."""
        if step <= self.launched:
            raise InvalidArgumentError(f"step {step} launched after step {self.launched}")
        if self._dirty:  # pages emptied so far wait for the steps launched so far
            self._settle()
        self.launched = step

    def step_finished(self, step: int) -> None:
        """Every step up to ``step`` has finished on the device."""
        if step > self.launched:
            raise InvalidArgumentError(
                f"step {step} finished but the last launched is {self.launched}")
        if step <= self.finished:
            return
        self.finished = step
        pending = self._pending
        if pending:
            unmaps = self._unmaps
            if next(reversed(pending.values())) <= step:  # the usual case: every one
                done = list(pending)
                unmaps.update(pending)
                pending.clear()
            else:
                done = []
                for key, s in pending.items():  # steps increase: stop at the first later
                    if s > step:
                        break
                    done.append(key)
                for key in done:
                    unmaps[key] = pending.pop(key)
            n = self._npools
            if n == 1:
                p = self._pools[self._pool_ids[0]]
                state = p.state
                for pg in done:
                    state[pg] = _UNMAPPED
                p.held -= len(done)
            else:
                pools, ids = self._pools, self._pool_ids
                for key in done:
                    pg, i = divmod(key, n)
                    p = pools[ids[i]]
                    p.state[pg] = _UNMAPPED
                    p.held -= 1
            self._held -= len(done)
        # pages emptied since the last settle: released while ``launched`` was in flight,
        # they go where the pending pages above went (straight to an unmap if that step is
        # finished now), after them, as if they had been pending since their release
        if self._dirty:
            self._settle()

    def drain(self) -> list[PageOp]:
        """The ops to apply now, between steps, in order: unmaps (their step finished;
        their bytes are already free in the ledger), then maps."""
        if self._dirty:
            self._settle()
        unmaps, maps = self._unmaps, self._maps
        if not (unmaps or maps):
            return []
        n = self._npools
        if n == 1:
            pid = self._pool_ids[0]
            out: list[PageOp] = list(map(_new_unmap, zip(repeat(pid), unmaps, unmaps.values())))
            out += map(_new_map, zip(repeat(pid), maps))
        else:
            get = self._pool_ids.__getitem__
            out = list(map(_new_unmap, zip(map(get, map(mod, unmaps, repeat(n))),
                                           map(floordiv, unmaps, repeat(n)), unmaps.values())))
            out += map(_new_map, zip(map(get, map(mod, maps, repeat(n))),
                                     map(floordiv, maps, repeat(n))))
        unmaps.clear()
        maps.clear()
        return out

    # ---- checked mode -----------------------------------------------------------------

    def check(self) -> None:
        """Full sweep of the invariants; raises :class:`CacheCorruptedError`."""
        bad: list[str] = []
        held = 0
        for pid, p in self._pools.items():
            count = [0] * p.num_pages
            idle = [0] * p.num_pages
            for b in range(p.spec.ceiling_blocks):
                if p.block_used[b]:
                    for pg in self.pages_of(pid, b):
                        count[pg] += 1
                        idle[pg] += p.idle[b]
                        if p.state[pg] != _MAPPED:
                            bad.append(f"pool {pid}: block {b} holds data on unmapped page {pg}")
                elif p.idle[b]:
                    bad.append(f"pool {pid}: block {b} idle but holds no data")
            if count != p.count:
                bad.append(f"pool {pid}: page counts drifted")
            if idle != p.idle_count:
                bad.append(f"pool {pid}: idle block counts drifted")
            emptied = set(p.emptied)
            if emptied and not self._dirty:
                bad.append(f"pool {pid}: pages {sorted(emptied)[:5]} emptied but not marked")
            for pg in range(p.num_pages):
                s = p.state[pg]
                if pg < p.floor_pages and s != _MAPPED:
                    bad.append(f"pool {pid}: floor page {pg} not mapped")
                if s == _MAPPED and not count[pg] and pg >= p.floor_pages and pg not in emptied:
                    bad.append(f"pool {pid}: page {pg} mapped, empty and not to be settled")
                key = pg * self._npools + p.index
                if (s == _PENDING) != (key in self._pending):
                    bad.append(f"pool {pid}: page {pg} pending state disagrees")
                if s == _PENDING and count[pg]:
                    bad.append(f"pool {pid}: pending page {pg} holds {count[pg]} blocks")
                if key in self._maps and s != _MAPPED:
                    bad.append(f"pool {pid}: page {pg} queued to map but not held")
                if key in self._unmaps and (s != _UNMAPPED or count[pg]):
                    bad.append(f"pool {pid}: page {pg} queued to unmap but held")
            n = sum(1 for s in p.state if s != _UNMAPPED)
            if n != p.held:
                bad.append(f"pool {pid}: holds {n} pages, counted {p.held}")
            held += n
        if held != self._held or held > self.budget_pages:
            bad.append(f"{held} pages held (counted {self._held}), budget {self.budget_pages}")
        if any(step > self.launched for step in self._pending.values()):
            bad.append("a pending page waits for a step never launched")
        if bad:
            raise CacheCorruptedError("page ledger: " + "; ".join(bad[:5]))

    # ---- helpers ----------------------------------------------------------------------

    def _pool(self, pool_id: PoolId) -> _PoolPages:
        p = self._pools.get(pool_id)
        if p is None:
            raise InvalidArgumentError(
                f"no pool {pool_id} in the page ledger (pools: {sorted(self._pools)})")
        return p

    def _mark_idle(self, p: _PoolPages, blocks: Iterable[BlockId], value: int) -> None:
        """Set these blocks' idle flags to ``value`` (1 or 0) and move the page counts of
        those whose flag changes, the page arithmetic inline (a request's cached blocks as
        it finishes: thousands at block size 1). Only a block holding data can be idle."""
        used, idle, idle_count, ceiling = p.block_used, p.idle, p.idle_count, p.ceiling
        k, bb, pb = p.per_page, p.bb, self.page_bytes
        step = 1 if value else -1
        for b in blocks:
            if not (0 <= b < ceiling and (used[b] or not value)):
                self._check_block(p, b)
                raise CacheCorruptedError(
                    f"pool {p.spec.pool_id}: block {b} idle but holds no data")
            if idle[b] == value:
                continue
            idle[b] = value
            if k:
                idle_count[b // k] += step
                continue
            lo = b * bb // pb
            hi = ((b + 1) * bb - 1) // pb
            idle_count[lo] += step
            while hi > lo:  # the block reaches further pages
                idle_count[hi] += step
                hi -= 1

    def _pages(self, p: _PoolPages, block: int) -> range:
        """Pages block ``block`` of ``p`` overlaps (:meth:`pages_of` without the checks; the
        one place of that arithmetic outside the loops that inline it for speed)."""
        bb, pb = p.bb, self.page_bytes
        return range(block * bb // pb, ((block + 1) * bb - 1) // pb + 1)

    def _pages_under(self, p: _PoolPages, blocks: Iterable[int]) -> set[int]:
        """Every page these blocks overlap; in C (``map``) unless a block can span more than
        two pages: the queries over thousands of blocks of an allocation stay cheap."""
        k = p.per_page
        if k:
            return set(map(floordiv, blocks, repeat(k)))
        bb, pb = p.bb, self.page_bytes
        if p.span > 2:
            return {pg for b in blocks for pg in range(b * bb // pb, ((b + 1) * bb - 1) // pb + 1)}
        starts = list(map(mul, blocks, repeat(bb)))  # a block's first and last byte's pages
        pages = set(map(floordiv, starts, repeat(pb)))
        pages.update(map(floordiv, map(add, starts, repeat(bb - 1)), repeat(pb)))
        return pages

    @staticmethod
    def _check_block(p: _PoolPages, block: int) -> None:
        if not 0 <= block < p.spec.ceiling_blocks:
            raise InvalidArgumentError(
                f"pool {p.spec.pool_id}: block {block} outside 0..{p.spec.ceiling_blocks - 1}")

    def _new_pages(self, p: _PoolPages, blocks: Iterable[BlockId]) -> set[int] | None:
        """Unmapped pages under these blocks (None: none)."""
        bb, pb, ceiling = p.spec.block_bytes, self.page_bytes, p.spec.ceiling_blocks
        state = p.state
        new: set[int] | None = None
        for b in blocks:
            if not 0 <= b < ceiling:
                self._check_block(p, b)
            for pg in range(b * bb // pb, ((b + 1) * bb - 1) // pb + 1):
                if state[pg] == _UNMAPPED:
                    if new is None:
                        new = set()
                    new.add(pg)
        return new
