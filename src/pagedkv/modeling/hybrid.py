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


Piece = tuple[str, tuple]  # (parameter or buffer name, index into it; () for all of it)


def load_pieces(module: torch.nn.Module, weights, pieces_of) -> None:  # noqa: ANN001
    """Copy checkpoint tensors into ``module``: ``pieces_of(name)`` says where each
    checkpoint tensor goes (a list of pieces, empty to skip it). Every parameter and
    persistent buffer must be covered exactly once; shapes must match."""
    targets = dict(module.named_parameters())
    targets.update({n: b for n, b in module.named_buffers()
                    if n.rsplit(".", 1)[-1] not in _non_persistent(module, n)})
    covered: dict[str, int] = {}
    seen: set[tuple[str, str]] = set()
    for name, tensor in weights:
        for target, index in pieces_of(name):
            param = targets.get(target)
            if param is None:
                raise MetadataError(f"checkpoint tensor {name!r} maps to {target!r}, which the "
                                    "model does not have")
            dst = param.data[index] if index else param.data
            if tuple(dst.shape) != tuple(tensor.shape):
                raise MetadataError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                                    f"the model's {target!r}{list(index) if index else ''} is "
                                    f"{tuple(dst.shape)}")
            key = (target, repr(index))
            if key in seen:
                raise MetadataError(f"checkpoint tensor {name!r}: {target!r} given twice")
            seen.add(key)
            with torch.no_grad():
                dst.copy_(tensor)
            covered[target] = covered.get(target, 0) + dst.numel()
    missing = sorted(n for n, p in targets.items() if covered.get(n, 0) != p.numel())
    if missing:
        raise MetadataError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:4]}")


def _non_persistent(module: torch.nn.Module, name: str) -> set[str]:
    owner = module.get_submodule(name.rsplit(".", 1)[0]) if "." in name else module
    return owner._non_persistent_buffers_set
