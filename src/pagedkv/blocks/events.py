"""Block events (for external KV indexes) and metrics snapshots."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pagedkv.blocks.ids import BlockId, GroupId

EventKind = Literal["stored", "removed", "cleared"]


@dataclass(frozen=True)
class BlockEvent:
    """One change of the prefix cache. ``seq`` increases by one per event, over all groups.

    ``stored``: blocks entered the cache (``block_hashes`` in chain order, ``parent_hash``
    the hash before the first, None at a request's first block). ``removed``: evicted.
    ``cleared``: the whole cache of ``group_id`` was dropped (hashes empty).
    """

    seq: int
    kind: EventKind
    group_id: int
    block_hashes: tuple[int, ...] = ()
    block_ids: tuple[int, ...] = ()
    parent_hash: int | None = None


class EventLog:
    """Collects events when enabled; a disabled log costs one attribute test per change."""

    __slots__ = ("enabled", "_events", "_seq")

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._events: list[BlockEvent] = []
        self._seq = 0

    def emit(self, kind: EventKind, group_id: int, hashes: tuple[int, ...] = (),
             blocks: tuple[int, ...] = (), parent: int | None = None) -> None:
        self._events.append(BlockEvent(self._seq, kind, group_id, hashes, blocks, parent))
        self._seq += 1

    def drain(self) -> list[BlockEvent]:
        out, self._events = self._events, []
        return out


@dataclass(frozen=True)
class CopyOp:
    """A copy the engine must run before the step's forward, in group ``group_id``.

    ``copy``: block ``src`` to block ``dst`` for positions below ``position`` (a prefix
    hit that ends inside a block; the rest is recomputed into ``dst``). ``restore``:
    recurrent checkpoint slot ``src`` into the request's state slot ``dst`` (state after
    ``position`` tokens). ``save``: the state at ``position`` from the request's slot
    ``src`` into checkpoint slot ``dst`` (chunked scans emit it at block boundaries).
    """

    kind: Literal["copy", "restore", "save"]
    group_id: GroupId
    src: BlockId
    dst: BlockId
    position: int


@dataclass(frozen=True)
class GroupMetrics:
    group_id: int
    retention: str
    blocks_total: int  # usable blocks of the group's pool (null block excluded)
    blocks_used: int  # held by live requests (this group)
    blocks_evictable: int  # free but still cached (pool-wide)
    blocks_cached: int  # in this group's prefix cache, used or not


@dataclass(frozen=True)
class Metrics:
    groups: tuple[GroupMetrics, ...]
    running_requests: int
    prefix_queries: int  # prompt tokens looked up
    prefix_hits: int  # of those, served from the cache
    evictions: int
    preemptions: int

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0
