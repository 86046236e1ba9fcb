"""Recurrent state (Mamba, GatedDeltaNet, KDA...): one state slot per request.

With prefix caching and ``checkpoint_every`` = c, the state after every c blocks is saved
into a spare slot (reserved before the step, written by its forward, cached at commit
under that point's block hash); a hit resumes only at such a checkpoint. A hit copies the checkpoint into the request's own slot (copy on branch), so
the checkpoint stays shareable; when the pool has no spare slot, a checkpoint nobody
holds is taken over instead. Copies and saves are listed for the
engine as :class:`CopyOp`, to run before the step's forward.
"""

from __future__ import annotations

from pagedkv.blocks.base import GroupManager
from pagedkv.blocks.events import CopyOp, EventLog
from pagedkv.blocks.pool import BlockPool
from pagedkv.blocks.request import INF, RequestState
from pagedkv.plan.types import Group


class RecurrentManager(GroupManager):
    holds_tokens = False

    def __init__(self, index: int, group: Group, pool: BlockPool, caching: bool,
                 events: EventLog,
                 default_checkpoint_every: int | None = None) -> None:
        every = group.retention.checkpoint_every or default_checkpoint_every  # type: ignore[union-attr]
        self.can_cache = every is not None
        super().__init__(index, group, pool, caching, events)
        self.interval = every * group.block_size if every else 0

    def find_hit(self, req: RequestState, max_tokens: int) -> tuple[int, list[int]]:
        if not self.caching:
            return 0, []
        step = self.interval // self.bs
        get = self.cache.get
        j = min(max_tokens // self.bs, len(req.hashes[self.bs])) // step
        while j > 0:
            b = get(self.key(req, j * step - 1))
            if b is not None:
                return j * self.interval, [b]
            j -= 1
        return 0, []

    def blocks_needed(self, req: RequestState, end: int, hit: list[int] | None) -> int:
        if req.tables[self.index]:
            return 0
        if hit and self.pool.ref[hit[0]] == 0:
            return 2 if self.pool.num_free() >= 2 else 1
        return 1

    def allocate(self, req: RequestState, end: int, hit: list[int] | None) -> None:
        i = self.index
        if req.tables[i]:
            return
        pool = self.pool
        if hit:
            src = hit[0]
            if pool.ref[src] == 0 and pool.num_free() < 2:
                pool.uncache(src)  # take the checkpoint over: it becomes this request's state
                req.tables[i] = pool.allocate(1, self.gid)
            else:
                pool.touch([src], self.gid)
                req.tables[i] = slot = pool.allocate(1, self.gid)
                req.copy_src[i] = src
                self.ops.append(CopyOp("restore", self.gid, src, slot[0], req.pending[0]))
        else:
            req.tables[i] = pool.allocate(1, self.gid)

    def reserve_checkpoints(self, req: RequestState, start: int, end: int) -> None:
        """Before a step over positions [start, end): a slot for the state after every
        checkpoint position the step reaches (its forward writes them), when one is free.
        Opportunistic: never fails an allocation, never counts toward admission."""
        if not self.caching or not req.tables[self.index]:
            return
        interval = self.interval
        pool = self.pool
        step = interval // self.bs
        hashes = req.hashes[self.bs]
        saves = req.saves[self.index]
        working = req.tables[self.index][0]
        for j in range(start // interval + 1, end // interval + 1):
            if j * step > len(hashes) or pool.num_free() == 0:
                break  # past the known tokens (drafts), or no spare slot
            position = j * interval
            if hashes[j * step - 1] in self.cache or any(p == position for p, _ in saves):
                continue
            slot = pool.allocate(1, self.gid)[0]
            saves.append((position, slot))
            self.ops.append(CopyOp("save", self.gid, working, slot, position))

    def commit(self, req: RequestState) -> int:
        """Cache the saved states of committed positions; drop those of rejected drafts."""
        self.release_copy_source(req)  # the restore ran with the step that just finished
        saves = req.saves[self.index]
        if saves:
            pool = self.pool
            for position, slot in saves:
                if position <= req.num_computed:
                    h = self.key(req, position // self.bs - 1)
                    if pool.cache(self.gid, slot, h) and self.events.enabled:
                        self.events.emit("stored", self.gid, (h,), (slot,))
                pool.release([slot], self.gid)  # cached: evictable; otherwise plain free
            saves.clear()
        return INF

    def free(self, req: RequestState) -> None:
        saves = req.saves[self.index]
        if saves:
            self.pool.release([slot for _, slot in saves], self.gid)
            saves.clear()
        super().free(req)

    def fast_limit(self, end: int) -> int:
        """Steps ending before the next checkpoint position need no call to this group."""
        if not self.caching:
            return INF
        return (end // self.interval + 1) * self.interval - 1

    def trim(self, req: RequestState) -> None:
        """Nothing: a rejected token's state change is the engine's to roll back."""

    def admission_blocks(self, num_tokens: int, max_batched_tokens: int) -> int:
        return 1
