"""Which layers each rank holds, with its tensor-parallel shard of their layouts.

Pipeline parallelism splits the target's decoder layers (``LayerSpec.index``, 0-based)
into ``pp`` contiguous stages, the first ``L % pp`` stages taking one layer more, as
engines split ``num_hidden_layers``; every drafter layer lives on the last stage (it reads
the target's last hidden states). Tensor parallelism shards each layout (KV heads split or
replicated, MLA latent replicated, recurrent ``shard_dim`` split): every TP rank of a stage
holds the same shapes, so a stage is computed once and stands for its ``tp`` ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedkv.errors import InvalidArgumentError
from pagedkv.kvspec import TARGET, LayerSpec, Layout


@dataclass(frozen=True)
class StageLayer:
    """A layer on one pipeline stage: its sharded layout and its block-table group."""

    layer: LayerSpec
    layout: Layout
    group: int


@dataclass(frozen=True)
class Stage:
    index: int
    layers: tuple[StageLayer, ...]


def stage_bounds(num_decoder_layers: int, pp: int) -> tuple[int, ...]:
    """First decoder-layer index of each stage, plus the end: ``pp + 1`` numbers."""
    if pp > num_decoder_layers:
        raise InvalidArgumentError(
            f"pp={pp} stages need at least {pp} target decoder layers, the model has "
            f"{num_decoder_layers}"
        )
    base, extra = divmod(num_decoder_layers, pp)
    bounds = [0]
    for stage in range(pp):
        bounds.append(bounds[-1] + base + (1 if stage < extra else 0))
    return tuple(bounds)


def split_stages(
    layers: Sequence[LayerSpec], group_of: Sequence[int], tp: int, pp: int
) -> tuple[Stage, ...]:
    """Every pipeline stage's layers (input order kept) with layouts sharded over ``tp``."""
    for key, value in (("tp", tp), ("pp", pp)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise InvalidArgumentError(f"{key} must be a positive integer, got {value!r}")
    target_indices = [layer.index for layer in layers if layer.model == TARGET]
    if any(i < 0 for i in target_indices):
        raise InvalidArgumentError(f"layer indices must be >= 0, got {min(target_indices)}")
    num_decoder_layers = max(target_indices, default=-1) + 1
    stage_of_index: list[int] = []
    if pp > 1:
        bounds = stage_bounds(num_decoder_layers, pp)
        for stage in range(pp):
            stage_of_index.extend([stage] * (bounds[stage + 1] - bounds[stage]))
    sharded: dict[Layout, Layout] = {}
    members: list[list[StageLayer]] = [[] for _ in range(pp)]
    for layer, group in zip(layers, group_of, strict=True):
        layout = sharded.get(layer.layout)
        if layout is None:
            layout = sharded[layer.layout] = layer.layout.shard(tp)
        if pp == 1:
            stage = 0
        elif layer.model == TARGET:
            stage = stage_of_index[layer.index]
        else:
            stage = pp - 1
        members[stage].append(StageLayer(layer, layout, group))
    return tuple(Stage(i, tuple(m)) for i, m in enumerate(members))
