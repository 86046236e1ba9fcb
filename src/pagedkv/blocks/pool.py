"""Block pool: fixed pages of one memory pool, reference counted, with an LRU of cached
free blocks.

Every operation is O(1) per block: plain free blocks sit on a stack, cached free blocks
in an insertion-ordered LRU (oldest evicted first). Block 0 is the null block: never
allocated, used as a placeholder in block tables for positions a window has dropped.
Several block-table groups may draw from one pool; each has its own hash -> block map.
Only pools serving windowed groups need the null block (``reserve_null``); the others
hand out every page. The planner counts the null block in the pool's pages
(``Pool.reserved_pages``), so ``usable`` equals the blocks it planned for requests and
admission and planning agree to the block.
"""

from __future__ import annotations

from collections import OrderedDict

from pagedkv.blocks.events import EventLog
from pagedkv.blocks.ids import BlockId, GroupId, PoolId
from pagedkv.errors import CacheCorruptedError, InvalidArgumentError, OutOfBlocksError

NULL_BLOCK = 0


class BlockPool:
    __slots__ = ("pool_id", "num_blocks", "ref", "block_hash", "block_group", "free",
                 "evictable", "caches", "events", "evictions", "epoch", "used", "null", "first")

    def __init__(self, num_blocks: int, pool_id: PoolId = 0,  # type: ignore[assignment]
                 events: EventLog | None = None,
                 reserve_null: bool = True) -> None:
        least = 2 if reserve_null else 1
        if not isinstance(num_blocks, int) or num_blocks < least:
            raise InvalidArgumentError(
                f"pool {pool_id}: needs at least {least} blocks"
                f"{' (one is the null block)' if reserve_null else ''}, got {num_blocks!r}"
            )
        self.null = NULL_BLOCK if reserve_null else -1  # -1: matches no block
        self.first = 1 if reserve_null else 0
        self.pool_id = pool_id
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_group = [-1] * num_blocks
        # popped from the end: hands out 1, 2, 3, ... first
        self.free = list(range(num_blocks - 1, self.first - 1, -1))
        self.evictable: OrderedDict[int, None] = OrderedDict()
        self.caches: dict[GroupId, dict[int, BlockId]] = {}
        self.events = events or EventLog(False)
        self.evictions = 0
        self.used: dict[GroupId, int] = {}  # group id -> blocks with a reference
        self.epoch = 0  # bumps whenever a cached block loses its hash

    @property
    def usable(self) -> int:
        return self.num_blocks - self.first

    def num_plain_free(self) -> int:
        """Free blocks that hold no cached data."""
        return len(self.free)

    def free_blocks(self) -> list[int]:
        """The plain free blocks (a copy, for checks)."""
        return list(self.free)

    def num_free(self) -> int:
        """Blocks an allocation can take now (plain free + cached free)."""
        return len(self.free) + len(self.evictable)

    def cache_for(self, group_id: GroupId) -> dict[int, BlockId]:
        self.used.setdefault(group_id, 0)
        return self.caches.setdefault(group_id, {})

    def allocate(self, n: int, group_id: GroupId) -> list[BlockId]:
        """``n`` blocks with reference count 1, evicting least recently used cached ones."""
        if n > len(self.free) + len(self.evictable):
            raise OutOfBlocksError(
                f"pool {self.pool_id}: asked for {n} blocks, {self.num_free()} free"
            )
        free = self.free
        ref = self.ref
        group = self.block_group
        out = []
        for _ in range(n):
            b = free.pop() if free else self._evict_oldest()
            ref[b] = 1
            group[b] = group_id
            out.append(b)
        self.used[group_id] += n
        return out

    def _evict_oldest(self) -> BlockId:
        b, _ = self.evictable.popitem(last=False)
        h = self.block_hash[b]
        g = self.block_group[b]
        del self.caches[g][h]
        self.block_hash[b] = None
        self.evictions += 1
        self.epoch += 1
        if self.events.enabled:
            self.events.emit("removed", g, (h,), (b,))
        return b

    def touch(self, blocks: list[BlockId], group_id: GroupId) -> None:
        """Take a reference on cached blocks of ``group_id`` (a prefix hit); pulls them
        out of the LRU."""
        ref = self.ref
        evictable = self.evictable
        null = self.null
        revived = 0
        for b in blocks:
            r = ref[b]
            if r:  # held by another request already: the common case first
                ref[b] = r + 1
            elif b != null:  # (the null block's count stays 0: never taken)
                del evictable[b]
                revived += 1
                ref[b] = 1
        self.used[group_id] += revived

    def release(self, blocks: list[BlockId], group_id: GroupId) -> None:
        """Drop one reference on each block of ``group_id``, in order: the first released
        is evicted first."""
        ref = self.ref
        block_hash = self.block_hash
        free = self.free
        evictable = self.evictable
        null = self.null
        freed = 0
        for b in blocks:
            r = ref[b] - 1
            if r > 0:  # still shared: the common case first
                ref[b] = r
            elif r == 0:  # (the null block's count stays 0: never here)
                ref[b] = 0
                freed += 1
                if block_hash[b] is None:
                    free.append(b)
                else:
                    evictable[b] = None
            elif b != null:
                self.used[group_id] -= freed
                raise CacheCorruptedError(f"pool {self.pool_id}: block {b} released twice")
        self.used[group_id] -= freed

    def cache(self, group_id: GroupId, block: BlockId, h: int) -> bool:
        """Enter ``block`` under hash ``h``; False when an equal block is cached already
        (then this one stays private and goes back to the plain free list when released)."""
        cache = self.caches[group_id]
        if h in cache or self.block_hash[block] is not None:
            return False
        cache[h] = block
        self.block_hash[block] = h
        return True

    def uncache(self, block: BlockId) -> None:
        """Drop ``block``'s hash (its contents are about to change)."""
        h = self.block_hash[block]
        if h is None:
            return
        g = self.block_group[block]
        del self.caches[g][h]
        self.block_hash[block] = None
        self.epoch += 1
        if block in self.evictable:
            del self.evictable[block]
            self.free.append(block)
        if self.events.enabled:
            self.events.emit("removed", g, (h,), (block,))

    def clear_cache(self) -> None:
        """Forget every hash (e.g. after new weights); cached free blocks become plain free."""
        for g, cache in self.caches.items():
            for b in cache.values():
                self.block_hash[b] = None
            cache.clear()
            if self.events.enabled:
                self.events.emit("cleared", g)
        self.free.extend(self.evictable)
        self.evictable.clear()
        self.epoch += 1
