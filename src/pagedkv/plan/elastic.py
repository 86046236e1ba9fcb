"""Elastic pools: one byte budget per rank, shared by every pool by demand.

A fixed plan sizes every pool for requests of ``max_model_len`` (or ``typical_len``). With
elastic capacity the block manager grants blocks to whichever pool needs them while the
bytes of mapped physical pages stay within the rank's budget. Each pool keeps a **floor**
that is always mapped -- one request of ``max_model_len`` in every group it serves plus
one step's blocks, plus its reserved (null) block -- and can grow to a **ceiling**: its
floor plus every byte the other pools' floors leave free. Block ids run up to the ceiling.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.errors import DoesNotFitError
from pagedkv.plan.types import Group, Plan

PHYSICAL_PAGE_BYTES = 2 << 20  # CUDA's virtual-memory granularity: pages map 2 MiB at a time


@dataclass(frozen=True)
class PoolBounds:
    """What one pool may hold. ``block_bytes``: one block (or state slot) over every layer
    of the pool, the stride of its block-major byte range."""

    pool_id: int
    group_ids: tuple[int, ...]
    block_bytes: int
    reserved_blocks: int
    floor_blocks: int  # reserved + one max_model_len request + one step, per group
    ceiling_blocks: int  # block ids 0 .. ceiling - 1

    @property
    def usable_ceiling(self) -> int:
        return self.ceiling_blocks - self.reserved_blocks


def floor_pages(blocks: int, block_bytes: int, page_bytes: int = PHYSICAL_PAGE_BYTES) -> int:
    """Pages covering blocks ``0 .. blocks - 1`` of a block-major range."""
    return -(-blocks * block_bytes // page_bytes) if blocks else 0


def group_floor(group: Group) -> int:
    """Blocks one group always keeps: one ``max_model_len`` request plus one step (a
    recurrent group: one state slot)."""
    floor = group.blocks_per_request + group.step_blocks
    return max(1, floor) if group.is_recurrent else floor


def pool_bounds(pools: dict[int, tuple[tuple[Group, ...], int, int]], budget_bytes: int,
                page_bytes: int = PHYSICAL_PAGE_BYTES) -> tuple[PoolBounds, ...]:
    """Floors and ceilings of ``pools`` (pool id -> (its groups, block bytes, reserved
    blocks)) sharing ``budget_bytes``. Raises DoesNotFitError when the floors do not fit."""
    floors = {pid: reserved + sum(group_floor(g) for g in groups)
              for pid, (groups, _, reserved) in pools.items()}
    floor_bytes = {pid: floor_pages(floors[pid], bb, page_bytes) * page_bytes
                   for pid, (_, bb, _) in pools.items()}
    total = sum(floor_bytes.values())
    if total > budget_bytes:
        raise DoesNotFitError(
            f"the pools' floors (one max_model_len request each) need {total} bytes of "
            f"{page_bytes}-byte pages, over the budget of {budget_bytes} bytes"
        )
    out = []
    for pid, (groups, bb, reserved) in pools.items():
        spare = budget_bytes - (total - floor_bytes[pid])
        ceiling = max(floors[pid], spare // bb)
        out.append(PoolBounds(pid, tuple(g.id for g in groups), bb, reserved, floors[pid],
                              ceiling))
    return tuple(out)


def plan_bounds(plan: Plan, page_bytes: int = PHYSICAL_PAGE_BYTES) -> tuple[PoolBounds, ...]:
    """Floors and ceilings of rank 0's pools under the plan's per-rank budget."""
    by_id = {g.id: g for g in plan.groups}
    if plan.ranks and plan.ranks[0].pools:
        pools = {p.id: (tuple(by_id[g] for g in p.group_ids if g in by_id), p.page_bytes,
                        p.reserved_pages) for p in plan.ranks[0].pools}
    else:
        pools = {g.id: ((g,), g.page_bytes, g.reserved_blocks) for g in plan.groups}
    return pool_bounds(pools, plan.budget_bytes, page_bytes)
