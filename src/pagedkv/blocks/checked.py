"""Checked mode: the block manager, verifying its invariants after every call.

``KVCacheManager(..., checked=True)`` (or env ``PAGEDKV_DEBUG=1``) builds this subclass.
Each public call first refuses to run once a violation was found (the state can no longer
be trusted), then runs, then verifies what it touched: the blocks its pools handed out,
took back, cached or evicted (recorded by :class:`TrackingBlockPool`), the table entries
and cache entries its requests gained, and each pool's counters. That costs a few times
the call itself. Every ``sweep_every`` calls, and on ``check_invariants()``, the full
sweep of :mod:`pagedkv.blocks.checks` walks everything (reference counts against owners,
every hash, every free list).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

from pagedkv.blocks import checks
from pagedkv.blocks.elastic import ElasticPool
from pagedkv.blocks.manager import KVCacheManager
from pagedkv.blocks.pool import BlockPool
from pagedkv.blocks.request import RequestState
from pagedkv.errors import CacheCorruptedError

F = TypeVar("F", bound=Callable)


class _Tracking:
    """Mixin for a pool class: records every block whose state an operation changed."""

    __slots__ = ()

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        self.touched: set[int] = set()
        self.all_touched = False  # a pool-wide change (clear_cache): sweep it whole

    def allocate(self, n, group_id):  # noqa: ANN001, ANN201 - BlockPool's signature
        out = super().allocate(n, group_id)
        self.touched.update(out)
        return out

    def _evict_oldest(self):  # noqa: ANN201
        b = super()._evict_oldest()
        self.touched.add(b)
        return b

    def touch(self, blocks, group_id):  # noqa: ANN001, ANN201
        self.touched.update(blocks)
        super().touch(blocks, group_id)

    def release(self, blocks, group_id):  # noqa: ANN001, ANN201
        self.touched.update(blocks)
        super().release(blocks, group_id)

    def cache(self, group_id, block, h):  # noqa: ANN001, ANN201
        self.touched.add(block)
        return super().cache(group_id, block, h)

    def uncache(self, block):  # noqa: ANN001, ANN201
        self.touched.add(block)
        super().uncache(block)

    def clear_cache(self):  # noqa: ANN201
        self.all_touched = True
        super().clear_cache()

    def _drop_cached(self, b):  # noqa: ANN001, ANN201 - elastic pools' eviction for good
        self.touched.add(b)
        super()._drop_cached(b)


class TrackingBlockPool(_Tracking, BlockPool):
    __slots__ = ("touched", "all_touched")


class TrackingElasticPool(_Tracking, ElasticPool):
    __slots__ = ("touched", "all_touched")


def _verified(method: F) -> F:
    """``method`` (its first argument a request id or a list of them), refused once
    corrupted, followed by the checks of what it touched."""

    @functools.wraps(method)
    def call(self: CheckedKVCacheManager, *args: object, **kwargs: object) -> object:
        self._refuse_if_corrupted()
        result = method(self, *args, **kwargs)
        self._after_call(args[0] if args else None)
        return result

    return call  # type: ignore[return-value]


def _refused(method: F) -> F:
    """``method`` (a query), refused once corrupted."""

    @functools.wraps(method)
    def call(self: CheckedKVCacheManager, *args: object, **kwargs: object) -> object:
        self._refuse_if_corrupted()
        return method(self, *args, **kwargs)

    return call  # type: ignore[return-value]


class CheckedKVCacheManager(KVCacheManager):
    """A :class:`KVCacheManager` that verifies every call and refuses calls once corrupted."""

    checked = True
    pool_class = TrackingBlockPool
    elastic_pool_class = TrackingElasticPool

    def __init__(self, *args: object, **kwargs: object) -> None:
        self._corrupted: str | None = None
        self._calls = 0
        # per request id: (table length, cached prefix) per group at its last check
        self._seen: dict[object, list[tuple[int, int]]] = {}
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def _refuse_if_corrupted(self) -> None:
        if self._corrupted is not None:
            raise CacheCorruptedError(f"manager refuses calls after: {self._corrupted}")

    def check_invariants(self) -> None:
        """Full sweep; on a violation the manager is marked corrupted and refuses calls."""
        self._refuse_if_corrupted()
        try:
            checks.sweep(self)
        except CacheCorruptedError as exc:
            self._corrupted = str(exc)
            raise
        self._forget_touched()

    def _forget_touched(self) -> None:
        for pool in self.pools:
            pool.touched.clear()  # type: ignore[attr-defined]
            pool.all_touched = False  # type: ignore[attr-defined]
        self._seen = {rid: self._shape(req) for rid, req in self.requests.items()}

    @staticmethod
    def _shape(req: RequestState) -> list[tuple[int, int]]:
        return [(len(t), n) for t, n in zip(req.tables, req.ncached)]

    def _after_call(self, ids: object) -> None:
        self._calls += 1
        if (self._calls % self.sweep_every == 0
                or any(p.all_touched for p in self.pools)):  # type: ignore[attr-defined]
            self.check_invariants()
            return
        try:
            self._check_touched(ids)
        except CacheCorruptedError as exc:
            self._corrupted = str(exc)
            raise

    def _check_touched(self, ids: object) -> None:
        reqs = self.requests
        if isinstance(ids, list | tuple):
            touched = [i for i in ids if i in reqs]
        else:
            touched = [ids] if ids in reqs else []
        for pool in self.pools:
            blocks = pool.touched  # type: ignore[attr-defined]
            if blocks:  # counters move only when blocks do
                checks.pool_counters(pool)
                for b in blocks:
                    checks.block_state(pool, b)
                blocks.clear()
        seen = self._seen
        for rid in touched:
            req = reqs[rid]
            shape = self._shape(req)
            before = seen.get(rid)
            if shape == before:  # no table grew, shrank or cached more: progress only
                checks.progress(req)
                continue
            checks.request_tail(self, req, before)
            seen[rid] = shape
        if len(seen) > 2 * len(reqs) + 64:  # forget finished requests now and then
            self._seen = {rid: v for rid, v in seen.items() if rid in reqs}

    # calls that change state
    add_request = _verified(KVCacheManager.add_request)
    find_cached_prefix = _verified(KVCacheManager.find_cached_prefix)
    allocate = _verified(KVCacheManager.allocate)
    allocate_batch = _verified(KVCacheManager.allocate_batch)
    commit = _verified(KVCacheManager.commit)
    commit_batch = _verified(KVCacheManager.commit_batch)
    free = _verified(KVCacheManager.free)
    preempt = _verified(KVCacheManager.preempt)
    drain_copy_ops = _verified(KVCacheManager.drain_copy_ops)
    drain_events = _verified(KVCacheManager.drain_events)
    reset_prefix_cache = _verified(KVCacheManager.reset_prefix_cache)
    # queries
    block_tables = _refused(KVCacheManager.block_tables)
    check_fits = _refused(KVCacheManager.check_fits)
    metrics = _refused(KVCacheManager.metrics)
    num_computed = _refused(KVCacheManager.num_computed)
    num_tokens = _refused(KVCacheManager.num_tokens)
