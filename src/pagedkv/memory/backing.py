"""Storage for the pools' virtual ranges, backed page by page.

A backing holds one byte tensor per pool, as long as the pool's virtual range, and a set of
physical pages: each is mapped at one (pool, page) or waits in the *stock* (created, not
mapped). Mapping takes the page unmapped last (so a page moved from one pool to another
keeps its bytes); it creates one only when the stock is empty, which :meth:`set_stock`,
called between steps, avoids. An unmap first makes sure the step it waits for finished.

A stock page may also be mapped *ahead* (:meth:`map_ahead`) where the ledger is expected
to map next: the driver calls then happen after a launch, while the device works, and the
ledger's map of that page only moves it to the mapped set. Ahead pages hold no data, no
queued work reads them, and they count as stock: mapped + stock + ahead pages stay within
what :meth:`set_stock` was told, so physical memory never exceeds the budget.

:class:`TensorBacking` emulates this with ordinary tensors on any device: the pool tensor
is allocated whole, a mapped page's bytes live in it, an unmapped page's bytes live in its
physical page and the pool range is filled with 0xFF (NaN in every float format), so a
kernel reading an unmapped block sees NaN instead of stale data. Same interface, same
behaviour, no saving of memory: for tests and for machines without CUDA virtual memory.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from pagedkv.blocks.ids import PoolId
from pagedkv.blocks.pages import PAGE_BYTES, MapOp, PageOp, PoolRange, UnmapOp, virtual_pages
from pagedkv.errors import CacheCorruptedError, InvalidArgumentError
from pagedkv.memory.steps import ManualSteps

POISON = 0xFF


class Backing:
    """Bookkeeping shared by the backings: which physical page sits where, the stock, and
    counters (``stats``). Subclasses create, release, attach and detach pages."""

    def __init__(self, pools: Sequence[PoolRange], page_bytes: int, steps: Any) -> None:
        if not isinstance(page_bytes, int) or page_bytes <= 0:
            raise InvalidArgumentError(f"page_bytes must be a positive int, got {page_bytes!r}")
        self.page_bytes = page_bytes
        self.steps = steps if steps is not None else ManualSteps(synchronous=True)
        self.pools = {p.pool_id: p for p in pools}
        if len(self.pools) != len(pools):
            raise InvalidArgumentError(f"pool ids repeat: {[p.pool_id for p in pools]}")
        self.num_pages = {p.pool_id: virtual_pages(p, page_bytes) for p in pools}
        self._mapped: dict[tuple[PoolId, int], Any] = {}
        self._stock: list[Any] = []
        self._ahead: dict[tuple[PoolId, int], Any] = {}  # stock pages mapped ahead of need
        self.stats = {"maps": 0, "unmaps": 0, "created": 0, "released": 0,
                      "created_in_map": 0, "unmap_waits": 0, "ahead_maps": 0,
                      "ahead_hits": 0, "ahead_dropped": 0}

    # ---- subclass hooks -------------------------------------------------------------

    def _create(self) -> Any:
        raise NotImplementedError

    def _release(self, handle: Any) -> None:
        raise NotImplementedError

    def _attach(self, pool_id: PoolId, page: int, handle: Any) -> None:
        raise NotImplementedError

    def _detach(self, pool_id: PoolId, page: int, handle: Any) -> None:
        raise NotImplementedError

    def tensor(self, pool_id: PoolId) -> Any:
        """The pool's whole virtual range as a 1-D uint8 tensor (stable across maps)."""
        raise NotImplementedError

    # ---- pages ----------------------------------------------------------------------

    @property
    def stock(self) -> int:
        return len(self._stock)

    @property
    def physical_pages(self) -> int:
        """Pages that exist: mapped, stock and mapped ahead."""
        return len(self._mapped) + len(self._stock) + len(self._ahead)

    @property
    def ahead(self) -> int:
        """Stock pages mapped ahead of need (see :meth:`map_ahead`)."""
        return len(self._ahead)

    def ahead_pages(self) -> set[tuple[PoolId, int]]:
        return set(self._ahead)

    def is_mapped(self, pool_id: PoolId, page: int) -> bool:
        return (pool_id, page) in self._mapped

    def mapped_pages(self) -> set[tuple[PoolId, int]]:
        return set(self._mapped)

    def map(self, pool_id: PoolId, page: int) -> None:
        key = self._key(pool_id, page)
        if key in self._mapped:
            raise CacheCorruptedError(f"pool {pool_id}: page {page} mapped twice")
        handle = self._ahead.pop(key, None)
        if handle is not None:  # mapped ahead: no driver call now
            self._mapped[key] = handle
            self.stats["maps"] += 1
            self.stats["ahead_hits"] += 1
            return
        if not self._stock and self._ahead:  # take back a page mapped elsewhere ahead
            self.drop_ahead(next(iter(self._ahead)))
        if self._stock:
            handle = self._stock.pop()
        else:
            handle = self._create()
            self.stats["created"] += 1
            self.stats["created_in_map"] += 1
        self._attach(pool_id, page, handle)
        self._mapped[key] = handle
        self.stats["maps"] += 1

    def unmap(self, pool_id: PoolId, page: int) -> None:
        """Unmap now: the caller knows no queued work reads the page (see :meth:`apply`)."""
        key = self._key(pool_id, page)
        handle = self._mapped.pop(key, None)
        if handle is None:
            raise CacheCorruptedError(f"pool {pool_id}: page {page} unmapped but not mapped")
        self._detach(pool_id, page, handle)
        self._stock.append(handle)
        self.stats["unmaps"] += 1

    def map_ahead(self, pool_id: PoolId, page: int) -> bool:
        """Map a stock page at ``page`` of the pool before the ledger asks for it; False
        (nothing done) when it is mapped already or the stock is empty. Never creates."""
        key = self._key(pool_id, page)
        if key in self._mapped or key in self._ahead or not self._stock:
            return False
        handle = self._stock.pop()
        self._attach(pool_id, page, handle)
        self._ahead[key] = handle
        self.stats["ahead_maps"] += 1
        return True

    def drop_ahead(self, key: tuple[PoolId, int]) -> None:
        """Unmap a page mapped ahead (no work reads it) back into the stock."""
        handle = self._ahead.pop(key)
        self._detach(key[0], key[1], handle)
        self._stock.append(handle)
        self.stats["ahead_dropped"] += 1

    def set_stock(self, pages: int) -> None:
        """Create or release pages until ``pages`` wait in the stock, pages mapped ahead
        included (between steps); ahead pages are dropped first if they alone exceed it."""
        while len(self._ahead) > pages:
            self.drop_ahead(next(iter(self._ahead)))
        pages -= len(self._ahead)
        while len(self._stock) < pages:
            self._stock.insert(0, self._create())  # fresh pages go last in line
            self.stats["created"] += 1
        while len(self._stock) > pages:
            self._release(self._stock.pop(0))
            self.stats["released"] += 1

    def apply(self, ops: Iterable[PageOp]) -> None:
        """Apply a ledger's drained ops in order. An unmap whose step is not yet known
        finished waits for it (a CUDA event); a tracker that cannot wait refuses."""
        for op in ops:
            if isinstance(op, UnmapOp):
                if op.after_step > self.steps.finished():
                    self.stats["unmap_waits"] += 1
                    if not self.steps.wait(op.after_step):
                        raise CacheCorruptedError(
                            f"pool {op.pool_id}: unmap of page {op.page} before step "
                            f"{op.after_step} finished (finished: {self.steps.finished()})")
                self.unmap(op.pool_id, op.page)
            elif isinstance(op, MapOp):
                self.map(op.pool_id, op.page)
            else:
                raise InvalidArgumentError(f"not a page op: {op!r}")

    def close(self) -> None:
        """Unmap everything and release every page (tensors from :meth:`tensor` must be
        dropped first on a virtual-memory backing)."""
        for pool_id, page in list(self._mapped):
            self.unmap(pool_id, page)
        self.set_stock(0)  # drops the pages mapped ahead too

    def _key(self, pool_id: PoolId, page: int) -> tuple[PoolId, int]:
        n = self.num_pages.get(pool_id)
        if n is None:
            raise InvalidArgumentError(f"no pool {pool_id} (pools: {sorted(self.num_pages)})")
        if not 0 <= page < n:
            raise InvalidArgumentError(f"pool {pool_id}: page {page} outside 0..{n - 1}")
        return (pool_id, page)


class TensorBacking(Backing):
    """Ordinary tensors on any torch device; see the module docstring."""

    def __init__(self, pools: Sequence[PoolRange], page_bytes: int = PAGE_BYTES,
                 device: Any = "cpu", steps: Any = None) -> None:
        import torch

        super().__init__(pools, page_bytes, steps)
        self._torch = torch
        self.device = torch.device(device)
        self._tensors = {
            pid: torch.full((n * page_bytes,), POISON, dtype=torch.uint8, device=self.device)
            for pid, n in self.num_pages.items()
        }

    def tensor(self, pool_id: PoolId) -> Any:
        self._key(pool_id, 0)
        return self._tensors[pool_id]

    def _range(self, pool_id: PoolId, page: int) -> Any:
        return self._tensors[pool_id][page * self.page_bytes:(page + 1) * self.page_bytes]

    def _create(self) -> Any:
        # a fresh physical page holds whatever was there: poison says so
        return self._torch.full((self.page_bytes,), POISON, dtype=self._torch.uint8,
                                device=self.device)

    def _release(self, handle: Any) -> None:
        del handle

    def _attach(self, pool_id: PoolId, page: int, handle: Any) -> None:
        self._range(pool_id, page).copy_(handle)

    def _detach(self, pool_id: PoolId, page: int, handle: Any) -> None:
        view = self._range(pool_id, page)
        handle.copy_(view)
        view.fill_(POISON)
