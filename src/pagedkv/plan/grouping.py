"""Layers -> block-table groups, and the default block size.

Layers share a block table when their retention, block size and positions line up
(:func:`pagedkv.kvspec.block_table_compatibility`); layout and attention flags never matter.
The block size is one per plan, so the grouping key is (retention, position offset).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedkv.errors import ConfigError
from pagedkv.kvspec import LayerSpec, MLALatent, Retention

BLOCK_SIZE_MLA = 64  # FlashMLA's page size
BLOCK_SIZE_DEFAULT = 16


def default_block_size(layers: Sequence[LayerSpec]) -> int:
    """64 when any layer keeps an MLA latent (FlashMLA pages), else 16."""
    if any(isinstance(layer.layout, MLALatent) for layer in layers):
        return BLOCK_SIZE_MLA
    return BLOCK_SIZE_DEFAULT


@dataclass(frozen=True)
class LayerGroup:
    """The layers of one block table, in input order."""

    retention: Retention
    position_offset: int
    layers: tuple[LayerSpec, ...]

    @property
    def models(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(layer.model for layer in self.layers))


def group_layers(layers: Sequence[LayerSpec]) -> tuple[tuple[LayerGroup, ...], tuple[int, ...]]:
    """Groups in order of their first layer, and each layer's group index (input order).

    Raises ConfigError on duplicate layer names: views and block tables are keyed by name.
    """
    members: dict[tuple[Retention, int], list[LayerSpec]] = {}
    group_of: list[int] = []
    index: dict[tuple[Retention, int], int] = {}
    seen: set[str] = set()
    for layer in layers:
        if layer.name in seen:
            raise ConfigError(f"duplicate layer name {layer.name!r}: layer names must be unique")
        seen.add(layer.name)
        key = (layer.retention, layer.position_offset)
        if key not in members:
            index[key] = len(members)
            members[key] = []
        members[key].append(layer)
        group_of.append(index[key])
    groups = tuple(
        LayerGroup(retention, offset, tuple(group))
        for (retention, offset), group in members.items()
    )
    return groups, tuple(group_of)
