"""Sliding-window and chunked-local attention: blocks leave the window while a request
runs; a hit at position h needs live cached blocks for everything h will attend to."""

from __future__ import annotations

from pagedkv.blocks.base import GroupManager
from pagedkv.blocks.events import EventLog
from pagedkv.blocks.ids import GroupIndex
from pagedkv.blocks.pool import BlockPool
from pagedkv.blocks.request import RequestState
from pagedkv.kvspec.retention import cdiv
from pagedkv.plan.types import Group


class WindowManager(GroupManager):
    def __init__(self, index: GroupIndex, group: Group, pool: BlockPool, caching: bool,
                 events: EventLog) -> None:
        super().__init__(index, group, pool, caching, events)
        self.first_needed = group.retention.first_needed  # type: ignore[union-attr]

    def find_hit(self, req: RequestState, max_tokens: int) -> tuple[int, list[int]]:
        bs = self.bs
        k = self.offset
        first_needed = self.first_needed
        n = self.hit_block_limit(req, max_tokens) if self.caching else 0
        get = self.cache.get
        hashes = req.hashes[bs] if n else ()
        found: list[int | None] = []
        run_start = 0  # first block of the current run of cached blocks
        best = 0
        for j in range(n):
            b = get(hashes[j])
            found.append(b)
            if b is None:
                run_start = j + 1
            h = min(max_tokens, (j + 1) * bs - k)
            if h % bs and not self.partial_ok(found[h // bs]):  # type: ignore[arg-type]
                h -= h % bs  # that block is written by this step: not copied yet
            # valid when every block h reads, [first_needed(h), h), is in the run
            if h > best and run_start <= first_needed(h) // bs:
                best = h
        need_from = first_needed(best) // bs
        blocks = [self.pool.null] * need_from + found[need_from:cdiv(best, bs)]
        return best, blocks  # type: ignore[return-value]

    def drop_out_of_window(self, req: RequestState) -> None:
        i = self.index
        table = req.tables[i]
        first = min(self.first_needed(req.num_computed) // self.bs, len(table))
        live = req.first_live[i]
        if first > live:
            self.changed.append(req)
            null = self.pool.null
            dropped = [b for b in table[live:first] if b != null]
            table[live:first] = [null] * (first - live)
            req.first_live[i] = first
            self.pool.release(dropped, self.gid)

    def free(self, req: RequestState) -> None:
        super().free(req)
        req.first_live[self.index] = 0
