"""What a hybrid model's layers read during one forward: attention metadata and K/V caches
for attention layers, segments and state tensors for recurrent layers; and RoPE.

The runner fills a :class:`HybridContext` per step; a layer asks it by its own name
(``model.layers.{i}.self_attn``, ``.linear_attn``, ``.mamba``), the names of
:func:`pagedkv.models.layers_from_config`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from pagedkv.batch import GroupMetadata
from pagedkv.errors import MetadataError
from pagedkv.modeling.recurrent_state import RecurrentBatch, StateDict


@dataclass(frozen=True, eq=False)
class HybridContext:
    """One step's view of the caches, by layer name.

    ``groups``: layer name -> block-table group id; ``metadata``: group id -> the step's
    metadata (attention groups); ``batches``: group id -> the step's segments (recurrent
    groups); ``kv``: layer -> (K cache, V cache); ``states``: layer -> state tensors.
    """

    groups: Mapping[str, int]
    metadata: Mapping[int, GroupMetadata]
    batches: Mapping[int, RecurrentBatch]
    kv: Mapping[str, tuple[torch.Tensor, torch.Tensor]]
    states: Mapping[str, StateDict]

    def attention(self, layer: str) -> tuple[GroupMetadata, torch.Tensor, torch.Tensor]:
        gid = self._group(layer)
        k, v = self.kv[layer]
        return self.metadata[gid], k, v

    def recurrent(self, layer: str) -> tuple[RecurrentBatch, StateDict]:
        return self.batches[self._group(layer)], self.states[layer]

    def _group(self, layer: str) -> int:
        gid = self.groups.get(layer)
        if gid is None:
            raise MetadataError(f"layer {layer!r} is in no block-table group of the plan")
        return gid


def rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, rotary_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE on the first ``rotary_dim`` channels of q [T, H, D] and k [T, Hk, D]
    (the rest passes through), default frequencies ``theta ** (-2i / rotary_dim)``."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float,
                                             device=q.device) / rotary_dim))
    freqs = positions.float()[:, None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().to(q.dtype)[:, None], emb.sin().to(q.dtype)[:, None]

    def apply(x: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
        half = rotary_dim // 2
        rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
        return torch.cat([rot * cos + rotated * sin, rest], dim=-1)

    return apply(q), apply(k)
