"""A pool whose capacity is elastic: block ids up to a ceiling, bytes from a shared budget.

Same interface and reference counting as :class:`BlockPool`; what changes is where a new
block comes from. Every block that holds data (referenced, or free but cached) is "in
use" in the :class:`~pagedkv.blocks.pages.PageLedger`, which maps the 2 MiB physical
pages under it and charges them to the rank's one budget. A new block is, in order:

1. the lowest plain free id whose pages are already mapped (no new bytes), else the lowest
   one whose pages the budget can still map -- low ids first keep data packed on few
   pages, so pages at the top empty out and go back to the budget;
2. this pool's least recently used cached block (the fixed pool's rule), when the budget
   is spent;
3. a plain free id after :meth:`ElasticPool.reclaim` evicted other pools' cached blocks
   from their emptiest pages (pages holding only cached blocks, fewest first).

A block leaves the ledger when it goes back to the plain free list or is evicted for good;
evicted-and-reused blocks stay in use (their pages never unmap in between). When pools share
the ledger, it also knows which blocks are cached free (idle: every change to ``evictable``
tells it), so that what evicting them would give another pool is a count per page, not a
walk over the LRU; a pool alone skips that bookkeeping (nobody asks).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

from pagedkv.blocks.events import EventLog
from pagedkv.blocks.ids import BlockId, GroupId, PoolId
from pagedkv.blocks.pages import PageLedger
from pagedkv.blocks.pool import BlockPool
from pagedkv.errors import CacheCorruptedError, OutOfBlocksError


class ElasticPool(BlockPool):
    """``num_blocks`` is the ceiling; ``floor`` blocks are always mapped (the ledger's)."""

    __slots__ = ("ledger", "fresh", "block_bytes", "floor", "peers", "protected", "lean",
                 "worst_bytes", "report_idle")

    def __init__(self, num_blocks: int, pool_id: PoolId, events: EventLog | None,
                 reserve_null: bool, ledger: PageLedger, floor: int) -> None:
        super().__init__(num_blocks, pool_id, events, reserve_null)
        self.ledger = ledger
        self.block_bytes = ledger.pool_range(pool_id).block_bytes
        page = ledger.page_bytes
        self.worst_bytes = ((self.block_bytes + page - 1) // page + 1) * page  # one block, alone
        self.floor = floor
        # plain free ids: a min-heap of ids handed out before, plus every id >= fresh
        self.free = []
        self.fresh = self.first
        self.peers: tuple[ElasticPool, ...] = ()  # pools sharing the budget (set by the manager)
        self.protected = False  # an allocation in progress needs this pool's blocks
        self.lean = False  # the budget is short: reuse own cached blocks before new pages
        self.report_idle = ledger.shared  # tell the ledger which blocks are cached free

    # --- counts ------------------------------------------------------------------------
    def num_plain_free(self) -> int:
        return len(self.free) + self.num_blocks - self.fresh

    def free_blocks(self) -> list[int]:
        return sorted(self.free) + list(range(self.fresh, self.num_blocks))

    def _lowest(self) -> int:
        """The lowest plain free id (-1: none)."""
        if self.free:
            return self.free[0]
        return self.fresh if self.fresh < self.num_blocks else -1

    def _lowest_ids(self, n: int) -> list[int]:
        """The ``n`` (or fewer) lowest plain free ids, in the order allocate takes them."""
        out = heapq.nsmallest(n, self.free)
        out += range(self.fresh, min(self.num_blocks, self.fresh + n - len(out)))
        return sorted(out)[:n]

    def num_free(self) -> int:
        """Blocks an allocation can surely take now without evicting other pools: cached
        free ones, plain free ones on mapped pages, and what the free budget maps (counted
        pessimistically, every block on pages of its own)."""
        plain = self.num_plain_free()
        if not plain:
            return len(self.evictable)
        affordable = self.ledger.free_bytes() // self.worst_bytes
        b = self._lowest()
        if self.ledger.bytes_to_use(self.pool_id, (b,)) == 0:
            affordable += 1
        return len(self.evictable) + min(plain, affordable)

    def cost_of(self, n: int) -> int:
        """Bytes the next ``n`` plain free blocks would newly map."""
        if n <= 0:
            return 0
        return self.ledger.bytes_to_use(self.pool_id, self._lowest_ids(n))

    def reclaimable_bytes(self) -> int:
        """Bytes evicting all of this pool's cached free blocks would give back."""
        if not self.evictable:
            return 0
        return self.ledger.bytes_freed_by(self.pool_id, self.evictable)

    # --- taking and giving back ----------------------------------------------------------
    def _pop_plain(self) -> int:
        if self.free:
            return heapq.heappop(self.free)
        b = self.fresh
        self.fresh += 1
        return b

    def _push_plain(self, b: int) -> None:
        """``b`` holds no data any more: back to the plain free ids, out of the ledger."""
        self.ledger.release(self.pool_id, (b,))
        heapq.heappush(self.free, b)

    def touch(self, blocks: list[BlockId], group_id: GroupId) -> None:
        """A prefix hit: cached free blocks among ``blocks`` leave the LRU, no longer idle
        (the ledger is asked only when some did: hit blocks are mostly shared, still held)."""
        cached = len(self.evictable)
        super().touch(blocks, group_id)
        if self.report_idle and len(self.evictable) != cached:
            self.ledger.clear_idle(self.pool_id, blocks)

    def _take_one(self) -> int:
        ledger = self.ledger
        pid = self.pool_id
        b = self._lowest()
        if b >= 0:
            cost = ledger.bytes_to_use(pid, (b,))
            if cost == 0 or (cost <= ledger.free_bytes() and not (self.lean and self.evictable)):
                self._pop_plain()
                ledger.use(pid, (b,))
                return b
        if self.evictable:  # (still idle in the ledger: allocate tells it, all at once)
            return self._evict_oldest()  # stays in use: its pages hold the new data
        if b >= 0 and self.reclaim(ledger.bytes_to_use(pid, (b,))):
            self._pop_plain()
            ledger.use(pid, (b,))
            return b
        raise OutOfBlocksError(
            f"pool {pid}: no free block within its ceiling of {self.num_blocks} and "
            f"{ledger.free_bytes()} bytes left in the budget"
        )

    def reclaim(self, want_bytes: int) -> bool:
        """Evict other pools' cached blocks, emptiest pages first, until ``want_bytes`` are
        free in the budget (True) or nothing more can go (False)."""
        ledger = self.ledger
        for peer in self.peers:
            if ledger.free_bytes() >= want_bytes:
                break
            if peer is self or peer.protected or not peer.evictable:  # busy or empty
                continue
            peer.evict_emptiest(want_bytes)
        return ledger.free_bytes() >= want_bytes

    def evict_emptiest(self, want_bytes: int) -> None:
        """Evict this pool's cached free blocks from the pages holding the fewest blocks,
        page by page, while the budget has less than ``want_bytes`` free."""
        ledger = self.ledger
        pid = self.pool_id
        ref = self.ref
        evictable = self.evictable
        num_pages = ledger.num_pages(pid)
        for page, _ in ledger.emptiest_pages(pid, num_pages):
            if ledger.free_bytes() >= want_bytes or not evictable:
                return
            blocks = [b for b in ledger.blocks_on_page(pid, page) if b in evictable]
            held = [b for b in ledger.blocks_on_page(pid, page) if ref[b] > 0]
            if held or not blocks:
                continue  # a live block keeps the page: evicting frees nothing here
            for b in blocks:
                self._drop_cached(b)

    def _drop_cached(self, b: int) -> None:
        """Evict cached free block ``b`` for good (its bytes may go back to the budget)."""
        del self.evictable[b]
        h = self.block_hash[b]
        g = self.block_group[b]
        del self.caches[g][h]
        self.block_hash[b] = None
        self.evictions += 1
        self.epoch += 1
        if self.events.enabled:
            self.events.emit("removed", g, (h,), (b,))
        self._push_plain(b)

    # --- BlockPool's operations, with the ledger ----------------------------------------
    def allocate(self, n: int, group_id: GroupId) -> list[BlockId]:
        ref = self.ref
        group = self.block_group
        if n == 1 and not self.lean:  # a decode step's block: _take_lowest(1), inlined
            free = self.free
            b = free[0] if free else (self.fresh if self.fresh < self.num_blocks else -1)
            if b >= 0:
                if self.ledger.try_use_one(self.pool_id, b):
                    if free:
                        heapq.heappop(free)
                    else:
                        self.fresh = b + 1
                    ref[b] = 1
                    group[b] = group_id
                    self.used[group_id] += 1
                    return [b]
            elif self.evictable:  # no plain id: the LRU's oldest, as the loop below takes it
                b, _ = self.evictable.popitem(last=False)
                if self.report_idle:
                    self.ledger.clear_idle_one(self.pool_id, b)
                h = self.block_hash[b]
                g = group[b]
                del self.caches[g][h]
                self.block_hash[b] = None
                if self.events.enabled:
                    self.events.emit("removed", g, (h,), (b,))
                ref[b] = 1
                group[b] = group_id
                self.evictions += 1
                self.epoch += 1
                self.used[group_id] += 1
                return [b]
        if not self.free and self.fresh >= self.num_blocks and n <= len(self.evictable):
            # no plain id left (a pool full of cached blocks, the steady state of a busy
            # cache): each block is the LRU's oldest, as _take_one takes it then
            # (BlockPool._evict_oldest inlined; a tracking pool records ``out`` in allocate)
            popitem = self.evictable.popitem
            block_hash = self.block_hash
            caches = self.caches
            events = self.events if self.events.enabled else None
            out = []
            append = out.append
            for _ in range(n):
                b, _ = popitem(False)
                h = block_hash[b]
                g = group[b]
                del caches[g][h]
                block_hash[b] = None
                if events is not None:
                    events.emit("removed", g, (h,), (b,))
                ref[b] = 1
                group[b] = group_id
                append(b)
            if self.report_idle:
                self.ledger.clear_idle(self.pool_id, out)
            self.evictions += n
            self.epoch += n
            self.used[group_id] += n
            return out
        out = self._take_lowest(n)
        if len(out) < n:
            try:
                while len(out) < n:
                    out.append(self._take_one())
            finally:  # LRU blocks among them hold new data now: no longer idle (one call)
                if self.report_idle:
                    self.ledger.clear_idle(self.pool_id, out)
        for b in out:
            ref[b] = 1
            group[b] = group_id
        self.used[group_id] += n
        return out

    def _take_lowest(self, n: int) -> list[int]:
        """The ``n`` lowest plain free ids at once when the budget maps all their pages
        (the common case: one ledger call per allocation, not one per block); else none."""
        if n > self.num_plain_free():
            return []
        if n == 1:
            ids = [self._lowest()]
        else:
            ids = self._lowest_ids(n)
        ledger = self.ledger
        if self.lean and self.evictable and ledger.bytes_to_use(self.pool_id, ids):
            return []  # the budget is short: this pool reuses its own cached blocks first
        try:
            ledger.use(self.pool_id, ids)  # all or nothing
        except OutOfBlocksError:
            return []
        free = self.free
        for b in ids:
            if free and free[0] == b:
                heapq.heappop(free)
            else:  # the heap's ids all lie below the watermark: the rest come from it
                self.fresh = b + 1
        return ids

    def release(self, blocks: list[BlockId], group_id: GroupId) -> None:
        ref = self.ref
        block_hash = self.block_hash
        evictable = self.evictable
        null = self.null
        freed = 0
        plain = []
        cached = []
        try:
            for b in blocks:
                r = ref[b] - 1
                if r > 0:  # still shared: the common case first
                    ref[b] = r
                elif r == 0:  # (the null block's count stays 0: never here)
                    ref[b] = 0
                    freed += 1
                    if block_hash[b] is None:
                        plain.append(b)
                    else:
                        evictable[b] = None
                        cached.append(b)
                elif b != null:
                    raise CacheCorruptedError(f"pool {self.pool_id}: block {b} released twice")
        finally:
            self.used[group_id] -= freed
            if cached and self.report_idle:
                self.ledger.set_idle(self.pool_id, cached)
            if plain:
                self.ledger.release(self.pool_id, plain)
                for b in plain:
                    heapq.heappush(self.free, b)

    def uncache(self, block: BlockId) -> None:
        h = self.block_hash[block]
        if h is None:
            return
        g = self.block_group[block]
        del self.caches[g][h]
        self.block_hash[block] = None
        self.epoch += 1
        if block in self.evictable:
            del self.evictable[block]
            self._push_plain(block)
        if self.events.enabled:
            self.events.emit("removed", g, (h,), (block,))

    def clear_cache(self) -> None:
        for g, cache in self.caches.items():
            for b in cache.values():
                self.block_hash[b] = None
            cache.clear()
            if self.events.enabled:
                self.events.emit("cleared", g)
        dropped = list(self.evictable)
        self.evictable.clear()
        for b in dropped:
            self._push_plain(b)
        self.epoch += 1

    def blocks_in_use(self) -> Iterable[int]:
        """Blocks holding data: referenced or cached (what the ledger must have mapped)."""
        ref = self.ref
        return [b for b in range(self.first, self.num_blocks) if ref[b] > 0 or
                self.block_hash[b] is not None]
