"""Which groups share one pool, and the pool-level view of a plan that sizing needs.

Token groups (not recurrent) whose layers pair up exactly share ONE pool on each rank:
same number of layers and, on every rank, the same per-layer token tensor shapes and
dtypes after sorting (the block size is one per plan). The pool holds one tensor set per
layer slot; layer j of each sharing group (in that sorted order) is given slot j's views,
so the groups alias by design: a block id belongs to one group at a time, hence no two
layers ever write the same page. Pages go to whichever group needs them, so short
requests are no longer capped by a small window pool.

A shared pool is sized like one group whose request holds the sum of the groups' blocks:
b = sum b_g, s = sum s_g (once per step), and one null block for the pool if any group
needs it (the block manager reserves one per pool).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedkv.plan.sizing import GroupDemand
from pagedkv.plan.stages import Stage, StageLayer


def slot_key(member: StageLayer) -> tuple:
    """What a layer slot must match: its token tensors' shapes and dtypes."""
    return tuple((t.shape, t.dtype.value) for t in member.layout.token_tensors())


def sorted_members(stage: Stage, group: int) -> list[StageLayer]:
    """A group's layers on ``stage`` in slot order (stable sort by :func:`slot_key`)."""
    return sorted((m for m in stage.layers if m.group == group), key=slot_key)


def pool_sets(
    stages: Sequence[Stage], demands: Sequence[GroupDemand]
) -> tuple[tuple[int, ...], ...]:
    """Groups of each pool, pools in order of their first group: token groups with the
    same sorted slot keys on every rank share one; every other group has its own."""
    token = [g for g, d in enumerate(demands) if not d.recurrent]
    keys: dict[object, tuple] = {}  # layout -> slot key
    per_stage: list[dict[int, list[tuple]]] = []
    for stage in stages:
        found: dict[int, list[tuple]] = {}
        for m in stage.layers:
            key = keys.get(m.layout)
            if key is None and not demands[m.group].recurrent:
                key = keys[m.layout] = slot_key(m)
            found.setdefault(m.group, []).append(key)
        per_stage.append(found)
    signature = {
        g: tuple(tuple(sorted(found.get(g, ()))) for found in per_stage) for g in token
    }
    by_sig: dict[tuple, list[int]] = {}
    sets: list[list[int]] = []
    for g in range(len(demands)):
        sig = signature.get(g)
        if sig is None:
            sets.append([g])
        elif sig in by_sig:
            by_sig[sig].append(g)
        else:
            by_sig[sig] = [g]
            sets.append(by_sig[sig])
    return tuple(tuple(s) for s in sets)


def merged_demand(demands: Sequence[GroupDemand], groups: Sequence[int]) -> GroupDemand:
    """One pool's demand: the groups' blocks and step blocks summed, one null block."""
    parts = [demands[g] for g in groups]
    if len(parts) == 1:
        return parts[0]
    return GroupDemand(
        False,
        sum(d.blocks_per_request for d in parts),
        sum(d.step_blocks for d in parts),
        max(d.reserved for d in parts),
    )


@dataclass(frozen=True)
class PoolMap:
    """Groups -> pools: ``sets[p]`` the groups of pool index p, ``pool_of[g]`` its index."""

    sets: tuple[tuple[int, ...], ...]
    pool_of: tuple[int, ...]

    @classmethod
    def of(cls, sets: tuple[tuple[int, ...], ...]) -> PoolMap:
        pool_of = {g: p for p, groups in enumerate(sets) for g in groups}
        return cls(sets, tuple(pool_of[g] for g in range(len(pool_of))))

    def pool_id(self, group: int) -> int:
        """A pool's id is the id of its first group."""
        return self.sets[self.pool_of[group]][0]

    def demands(self, demands: Sequence[GroupDemand]) -> list[GroupDemand]:
        return [merged_demand(demands, groups) for groups in self.sets]

    def lead_stage(self, stage: Stage) -> Stage:
        """``stage`` with only each pool's first group, numbered by pool index: the layers
        whose tensors a pool allocates."""
        lead = {groups[0]: p for p, groups in enumerate(self.sets)}
        return Stage(
            stage.index,
            tuple(
                StageLayer(m.layer, m.layout, lead[m.group])
                for m in stage.layers
                if m.group in lead
            ),
        )
