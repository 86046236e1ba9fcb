"""Pools and per-layer tensor views of one rank.

Each pool present on a rank (pool id = the id of its first group) holds, layer after layer
of its first group (input order), one tensor per TensorSpec of the layer's sharded layout:
``(num_pages, block_size, *token_shape)`` for token layouts, ``(num_slots, *state_shape)``
for recurrent state, each at a 256-byte-aligned offset. Views of one group never overlap.
In a shared pool (:mod:`pagedkv.plan.sharing`) layer j of every other group (slot order)
gets exactly the views of the first group's layer j: declared aliases, safe because a page
belongs to one group at a time. A pool's reserved pages (the null block) are page 0 of its
tensors, counted in ``num_pages``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pagedkv.plan.sharing import PoolMap, sorted_members
from pagedkv.plan.sizing import ALIGNMENT, StageBytes
from pagedkv.plan.stages import Stage
from pagedkv.plan.types import Pool, TensorView


def _align(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


def stage_pools(
    stage: Stage,
    pools: PoolMap,
    sb: StageBytes,
    recurrent: Sequence[bool],
    reserved: Sequence[int],
    num_pages: Sequence[int],
    block_size: int,
) -> tuple[tuple[Pool, ...], tuple[TensorView, ...]]:
    """Pools (pool order) and views (input layer order within each pool) of one rank.

    ``sb``, ``recurrent``, ``reserved`` and ``num_pages`` are per pool index."""
    by_group: dict[int, list] = {}
    for member in stage.layers:
        by_group.setdefault(member.group, []).append(member)
    present = sorted({pools.pool_of[g] for g in by_group})
    out_pools: list[Pool] = []
    views: list[TensorView] = []
    for p in present:
        groups = pools.sets[p]
        pid = groups[0]
        count = num_pages[p]
        lead = (count,) if recurrent[p] else (count, block_size)
        rows = math.prod(lead)
        shapes: dict[object, tuple] = {}  # layout -> ((name, shape, dtype, aligned bytes), ...)
        placed: dict[str, list[TensorView]] = {}  # layer -> its views
        offset = 0
        for member in by_group[pid]:
            tensors = shapes.get(member.layout)
            if tensors is None:
                specs = (
                    member.layout.request_tensors()
                    if recurrent[p]
                    else member.layout.token_tensors()
                )
                tensors = tuple(
                    (t.name, lead + t.shape, t.dtype, _align(t.nbytes * rows)) for t in specs
                )
                shapes[member.layout] = tensors
            mine = placed[member.layer.name] = []
            for name, shape, dtype, nbytes in tensors:
                mine.append(TensorView(member.layer.name, name, pid, offset, shape, dtype))
                offset += nbytes
        if len(groups) == 1:
            for mine in placed.values():
                views.extend(mine)
        else:  # alias layer j of each other group onto slot j of the first group
            slots = [placed[m.layer.name] for m in sorted_members(stage, pid)]
            for g in groups[1:]:
                for j, m in enumerate(sorted_members(stage, g)):
                    names = [t.name for t in m.layout.token_tensors()]
                    placed[m.layer.name] = [
                        TensorView(m.layer.name, name, pid, v.offset, v.shape, v.dtype)
                        for name, v in zip(names, slots[j], strict=True)
                    ]
            in_pool = set(groups)
            for member in stage.layers:  # input layer order
                if member.group in in_pool:
                    views.extend(placed[member.layer.name])
        unit = sb.unit[p]
        page = unit if recurrent[p] else unit * block_size
        out_pools.append(Pool(pid, groups, offset, count, page, reserved[p]))
    return tuple(out_pools), tuple(views)
