"""Pools and per-layer tensor views of one rank.

Each group present on a rank gets one pool (pool id = group id). Inside it, layer after
layer (input order), one tensor per TensorSpec of the layer's sharded layout:
``(num_blocks, block_size, *token_shape)`` for token layouts, ``(num_slots, *state_shape)``
for recurrent state, each at a 256-byte-aligned offset. Views never overlap. A group's
reserved pages (its null block) are page 0 of its tensors, counted in ``num_pages``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pagedkv.plan.sizing import ALIGNMENT, StageBytes
from pagedkv.plan.stages import Stage
from pagedkv.plan.types import Pool, TensorView


def _align(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


def stage_pools(
    stage: Stage,
    sb: StageBytes,
    recurrent: Sequence[bool],
    reserved: Sequence[int],
    num_blocks: Sequence[int],
    block_size: int,
) -> tuple[tuple[Pool, ...], tuple[TensorView, ...]]:
    """Pools (group order) and views (input layer order within each pool) of one rank."""
    by_group: dict[int, list] = {}
    for member in stage.layers:
        by_group.setdefault(member.group, []).append(member)
    pools: list[Pool] = []
    views: list[TensorView] = []
    for group in sorted(by_group):
        count = num_blocks[group]
        lead = (count,) if recurrent[group] else (count, block_size)
        rows = math.prod(lead)
        shapes: dict[object, tuple] = {}  # layout -> ((name, shape, dtype, aligned bytes), ...)
        offset = 0
        for member in by_group[group]:
            tensors = shapes.get(member.layout)
            if tensors is None:
                specs = (
                    member.layout.request_tensors()
                    if recurrent[group]
                    else member.layout.token_tensors()
                )
                tensors = tuple(
                    (t.name, lead + t.shape, t.dtype, _align(t.nbytes * rows))
                    for t in specs
                )
                shapes[member.layout] = tensors
            for name, shape, dtype, nbytes in tensors:
                views.append(TensorView(member.layer.name, name, group, offset, shape, dtype))
                offset += nbytes
        unit = sb.unit[group]
        page = unit if recurrent[group] else unit * block_size
        pools.append(Pool(group, (group,), offset, count, page, reserved[group]))
    return tuple(pools), tuple(views)

