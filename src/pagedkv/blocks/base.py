"""What every per-retention manager provides to the manager (:mod:`pagedkv.blocks.manager`).

A manager owns one block-table group: it finds that group's longest valid prefix hit,
counts and takes the blocks a request needs, offers newly full committed blocks to the
prefix cache, and gives blocks back. It never decides admission or preemption.

A prefill chunk's full blocks are cached when they are allocated, before the forward that
writes them ("unwritten" until the request commits). A request of the same step may take
them as whole blocks of its hit: the forward writes every request's KV of a layer before
any of them attends. It may not end its hit inside one: that block is copied before the
forward, so the copy would read KV not written yet; such a hit stops at the block's start.
"""

from __future__ import annotations

from collections import deque

from pagedkv.blocks.events import CopyOp, EventLog
from pagedkv.blocks.ids import BlockId, GroupId, GroupIndex
from pagedkv.blocks.pool import BlockPool
from pagedkv.blocks.request import INF, RequestState
from pagedkv.errors import CacheCorruptedError
from pagedkv.kvspec.retention import blocks_per_request, cdiv, step_blocks
from pagedkv.plan.types import Group

# Where a manager reports a request whose block table it changed other than by blocks
# appended at the table's end: nowhere (a deque that keeps nothing, a C-level no-op) until
# an engine watches the tables (``KVCacheManager.watch_tables``)
NOWHERE: deque = deque(maxlen=0)


class GroupManager:
    """Base class; subclasses override the methods whose behaviour their retention changes."""

    holds_tokens = True  # block table indexed by token position (False: state slots, encoder)
    can_cache = True
    changed = NOWHERE  # see NOWHERE

    def __init__(self, index: GroupIndex, group: Group, pool: BlockPool, caching: bool,
                 events: EventLog) -> None:
        self.index = index
        self.group = group
        self.gid = GroupId(group.id)
        self.pool = pool
        self.bs = group.block_size
        self.offset = group.position_offset
        self.caching = caching and self.can_cache
        self.cache = pool.cache_for(group.id)
        self.events = events
        self.ops: list[CopyOp] = []
        # cached at allocation, not yet written: never the partly hit block of a hit
        self.unwritten: set[BlockId] = set()

    # --- prefix hits -------------------------------------------------------------------
    def key(self, req: RequestState, i: int) -> int:
        """Cache key of block ``i``: the chained hash of the tokens up to its end."""
        return req.hashes[self.bs][i]

    def hit_block_limit(self, req: RequestState, max_tokens: int) -> int:
        """How many leading blocks could take part in a hit of at most ``max_tokens``."""
        return max(0, min(cdiv(max_tokens + self.offset, self.bs), len(req.hashes[self.bs])))

    def find_hit(self, req: RequestState, max_tokens: int) -> tuple[int, list[BlockId]]:
        """Longest valid hit of at most ``max_tokens`` tokens: (tokens, blocks to adopt,
        the last one partly when the hit ends inside it). Layers with position offset k
        computed position p from token p+k, so only a run's first ``len * bs - k``
        positions are valid: such groups back off by k tokens, not by a block. A hit never
        ends inside an unwritten block (:attr:`unwritten`): it stops at that block's start."""
        raise NotImplementedError

    def partial_ok(self, block: BlockId) -> bool:
        """Whether a hit may end inside ``block``, i.e. copy it before the step's forward:
        only once the step that writes it has finished."""
        return not self.unwritten or block not in self.unwritten

    # --- allocation --------------------------------------------------------------------
    def blocks_needed(self, req: RequestState, end: int, hit: list[BlockId] | None) -> int:
        """Blocks the pool must hand out so positions [0, end) have slots (hit blocks that
        sit in the LRU count too: adopting them takes them off the free count)."""
        table = req.tables[self.index]
        if hit is None:
            return max(0, cdiv(end, self.bs) - len(table))
        ref = self.pool.ref
        null = self.pool.null
        revived = sum(1 for b in hit if b != null and ref[b] == 0)
        adopted = len(hit) - (1 if hit and req.pending.tokens % self.bs else 0)
        return max(0, cdiv(end, self.bs) - adopted) + revived

    def new_and_revived(self, req: RequestState, end: int, hit: list[BlockId] | None
                        ) -> tuple[int, list[BlockId] | None]:
        """:meth:`blocks_needed` split into blocks the pool must hand out anew and the hit
        blocks it takes back out of its LRU (already holding data: they cost no bytes, but
        they can no longer be evicted to make room). None for the latter when the count
        did not need them: :meth:`revived` lists them."""
        if not hit:
            return self.blocks_needed(req, end, hit), []
        if type(self).blocks_needed is GroupManager.blocks_needed:  # its sum, not done twice
            adopted = len(hit) - (1 if req.pending.tokens % self.bs else 0)
            return max(0, cdiv(end, self.bs) - adopted), None
        revived = self.revived(hit)
        return self.blocks_needed(req, end, hit) - len(revived), revived

    def revived(self, hit: list[BlockId]) -> list[BlockId]:
        """The blocks of ``hit`` in the pool's LRU (no reference): adopting takes them out."""
        ref = self.pool.ref
        null = self.pool.null
        return [b for b in hit if b != null and ref[b] == 0]

    def adopt(self, req: RequestState, hit: list[BlockId] | None) -> None:
        """Phase one of an allocation with a prefix hit: the hit's blocks leave the LRU
        for the request's table. The manager has every group adopt its hit before any
        group allocates (:meth:`allocate`), so a pool that several groups share never
        evicts one group's hit blocks to make room for another group's new blocks."""
        if hit is None:
            return
        i = self.index
        self.pool.touch(hit, self.gid)
        req.tables[i] = list(hit)
        self.changed.append(req)
        req.ncached[i] = req.pending.tokens // self.bs

    def allocate(self, req: RequestState, end: int, hit: list[BlockId] | None) -> None:
        """Phase two, after :meth:`adopt`: a hit ending inside its last block gets a copy
        of it, then new blocks up to ``end``."""
        i = self.index
        table = req.tables[i]
        if hit is not None:
            h = req.pending.tokens
            if h % self.bs:  # the hit ends inside its last block: copy it, never write it
                src = table.pop()
                if not self.partial_ok(src):
                    raise CacheCorruptedError(
                        f"request {req.id!r} group {self.gid}: a hit of {h} tokens would copy "
                        f"block {src} before the forward that writes it")
                dst = self.pool.allocate(1, self.gid)[0]
                table.append(dst)
                req.set_copy_src(i, src)
                self.ops.append(CopyOp("copy", self.gid, src, dst, h))
        need = cdiv(end, self.bs) - len(table)
        if need > 0:
            table += self.pool.allocate(need, self.gid)

    def drop_out_of_window(self, req: RequestState) -> None:
        """Free blocks the request will never read again (windowed retention only)."""

    # --- commit ------------------------------------------------------------------------
    def commit(self, req: RequestState) -> int:
        """Offer blocks now full of committed tokens to the cache; return the committed
        count at which this group next has work."""
        i = self.index
        if req.copy_src[i] is not None:
            self.release_copy_source(req)
        if req.unwritten[i]:
            self.mark_written(req)
        return self.offer(req, req.num_computed)

    def mark_written(self, req: RequestState) -> None:
        """The step that allocated (and cached) the request's blocks has run: their KV is
        written, so they may now be the partly hit block of a hit."""
        mine = req.unwritten[self.index]
        if mine:
            self.unwritten.difference_update(mine)
            req.unwritten[self.index] = ()

    def drop_unwritten(self, req: RequestState) -> None:
        """The request leaves before the commit of the step that was to write the blocks
        it cached at allocation: they may hold no KV, so those no other request holds
        leave the cache (one that another request of the step shares stays: both read
        it in the same forward)."""
        mine = req.unwritten[self.index]
        if mine:
            self.unwritten.difference_update(mine)
            req.unwritten[self.index] = ()
            ref = self.pool.ref
            for b in mine:
                if ref[b] == 0:
                    self.pool.uncache(b)

    def release_copy_source(self, req: RequestState) -> None:
        """A copy source is held until the step that ran the copy has finished."""
        src = req.copy_src[self.index]
        if src is not None:
            req.copy_src[self.index] = None
            self.pool.release([src], self.gid)

    def offer(self, req: RequestState, upto: int, unwritten: bool = False) -> int:
        """Cache the blocks whose every position below ``upto`` has final KV, or gets it in
        this step's forward (``unwritten``: at allocation; they are recorded as such)."""
        if not self.caching:
            return INF
        i = self.index
        bs = self.bs
        k = self.offset
        table = req.tables[i]
        start = req.ncached[i]
        hashes = req.hashes[bs]
        limit = min((upto - k) // bs, len(table), len(hashes))
        if limit == start + 1 and not unwritten and not self.events.enabled:
            # one block filled while decoding: the loop below for one block, without it
            b = table[start]
            h = hashes[start]
            pool = self.pool
            block_hash = pool.block_hash
            if b != pool.null and block_hash[b] is None and h not in self.cache:
                self.cache[h] = b
                block_hash[b] = h
            req.ncached[i] = limit
            return (limit + 1) * bs + k
        if limit > start:
            pool = self.pool
            gid = self.gid
            cache = self.cache
            block_hash = pool.block_hash
            null = pool.null
            stored: list[int] = []
            for j in range(start, limit):
                b = table[j]
                h = hashes[j]
                # enter b unless it is the null block, already cached, or a duplicate
                if b != null and block_hash[b] is None and h not in cache:
                    cache[h] = b
                    block_hash[b] = h
                    stored.append(j)
            req.ncached[i] = limit
            start = limit
            if stored and unwritten:
                fresh = (table[stored[0]:limit] if len(stored) == limit - stored[0]
                         else [table[j] for j in stored])  # usually every block: a slice
                self.unwritten.update(fresh)
                mine = req.unwritten[i]
                if mine:
                    mine += fresh  # type: ignore[operator]
                else:  # () until now
                    req.unwritten[i] = fresh
            if stored and self.events.enabled:
                first = stored[0]
                self.events.emit("stored", gid, tuple(hashes[j] for j in stored),
                                 tuple(table[j] for j in stored),
                                 hashes[first - 1] if first > 0 else None)
        return (start + 1) * bs + k

    def trim(self, req: RequestState) -> None:
        """Give back blocks that only rejected draft tokens used (all past the committed)."""
        table = req.tables[self.index]
        keep = cdiv(req.num_computed, self.bs)
        if len(table) > keep:
            self.changed.append(req)
            extra = table[keep:]
            del table[keep:]
            extra.reverse()
            self.pool.release(extra, self.gid)

    def free(self, req: RequestState) -> None:
        """Release every block; the tail first, so the LRU evicts tails before prefixes."""
        i = self.index
        if req.copy_src[i] is not None:
            self.release_copy_source(req)
        table = req.tables[i]
        if table:
            self.pool.release(table[::-1], self.gid)
            req.tables[i] = []
        if req.unwritten[i]:
            self.drop_unwritten(req)

    # --- arithmetic --------------------------------------------------------------------
    def admission_blocks(self, num_tokens: int, max_batched_tokens: int) -> int:
        """Most blocks one request of ``num_tokens`` tokens can hold: the planner's numbers."""
        ret = self.group.retention
        windowed = (blocks_per_request(ret, num_tokens, self.bs)
                    + step_blocks(ret, min(max_batched_tokens, num_tokens), self.bs))
        return min(windowed, cdiv(num_tokens, self.bs))  # never more than every token
