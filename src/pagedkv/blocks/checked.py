"""Checked mode: the block manager, verifying its invariants after every call.

``KVCacheManager(..., checked=True)`` (or env ``PAGEDKV_DEBUG=1``) builds this subclass.
Each public call first refuses to run once a violation was found (the state can no longer
be trusted), then runs, then verifies (:mod:`pagedkv.blocks.checks`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

from pagedkv.blocks import checks
from pagedkv.blocks.manager import KVCacheManager
from pagedkv.errors import CacheCorruptedError

F = TypeVar("F", bound=Callable)


def _verified(method: F) -> F:
    """``method``, refused once corrupted and followed by a check."""

    @functools.wraps(method)
    def call(self: CheckedKVCacheManager, *args: object, **kwargs: object) -> object:
        self._refuse_if_corrupted()
        result = method(self, *args, **kwargs)
        self.check_invariants()
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

    def __init__(self, *args: object, **kwargs: object) -> None:
        self._corrupted: str | None = None
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
