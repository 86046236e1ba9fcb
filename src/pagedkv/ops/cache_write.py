"""Writing new tokens (and recurrent states) into the cache through the slot mapping.

Conventions (shared with pagedkv.batch): slot = block_id * block_size + offset_in_block,
int32 or int64, one per new token; slot -1 means "do not write" (padding rows). Cache
tensors are the planner's per-layer views: K [num_blocks, block_size, Hkv, D], V
[num_blocks, block_size, Hkv, Dv], MLA latent [num_blocks, block_size, E], recurrent state
[num_slots, *state_shape]. Writes are in place and work on strided views too. Two tokens
of one call never share a slot, and every slot is inside the cache (MetadataError).
"""

from __future__ import annotations

import torch

from pagedkv.errors import InvalidArgumentError, MetadataError
from pagedkv.ops.fp8 import is_fp8, pack_fp8_ds_mla, quantize_fp8


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
) -> None:
    """key [T, Hkv, D], value [T, Hkv, Dv] -> their slots; fp8 caches need their scale."""
    _write_slots(to_stored(key, k_cache.dtype, k_scale), k_cache, slot_mapping, 2)
    _write_slots(to_stored(value, v_cache.dtype, v_scale), v_cache, slot_mapping, 2)


def write_mla_latent(
    latent: torch.Tensor,
    rope: torch.Tensor | None,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    scale: float | torch.Tensor | None = None,
) -> None:
    """latent [T, R] and rope [T, P] (None for NoPE) -> one cache entry per slot.

    The cache's dtype picks the format: bf16/fp16/fp32 store [latent | rope]; fp8 stores it
    scaled by the per-tensor ``scale``; uint8 stores fp8_ds_mla entries.
    """
    rope = latent_rope(latent, rope)
    if cache.dtype == torch.uint8:
        if scale is not None:
            raise InvalidArgumentError("fp8_ds_mla carries its own scales; pass no latent scale")
        entries = pack_fp8_ds_mla(latent, rope)
    else:
        entries = to_stored(torch.cat([latent, rope.to(latent.dtype)], dim=-1), cache.dtype, scale)
    _write_slots(entries, cache, slot_mapping, 2)


def latent_rope(latent: torch.Tensor, rope: torch.Tensor | None) -> torch.Tensor:
    """The rope rows to write beside ``latent`` [T, R]: ``rope`` [T, P] checked, or [T, 0]
    for NoPE (None)."""
    if rope is None and latent.dim() == 2:
        return latent.new_zeros(latent.shape[0], 0)
    if latent.dim() != 2 or rope is None or rope.dim() != 2 or rope.shape[0] != latent.shape[0]:
        raise InvalidArgumentError(
            f"latent {tuple(latent.shape)} and rope "
            f"{None if rope is None else tuple(rope.shape)}: need [T, R] and [T, P]")
    return rope


def check_slot_ids(slots: torch.Tensor) -> None:
    if slots.dtype not in (torch.int32, torch.int64):
        raise InvalidArgumentError(f"slot ids must be int32 or int64, got {slots.dtype}")


def write_state(state: torch.Tensor, cache: torch.Tensor, slot_ids: torch.Tensor) -> None:
    """state [B, *state_shape] -> cache[slot_ids[b]]; slot id -1 skips a row."""
    _write_slots(state.to(cache.dtype), cache, slot_ids, 1)


def to_stored(
    values: torch.Tensor, dtype: torch.dtype, scale: float | torch.Tensor | None
) -> torch.Tensor:
    """Values as a cache of ``dtype`` stores them; fp8 needs its scale, other dtypes none."""
    if is_fp8(dtype):
        if scale is None:
            raise InvalidArgumentError(f"writing a {dtype} cache needs its per-tensor scale")
        return quantize_fp8(values, scale, dtype)
    if scale is not None:
        raise InvalidArgumentError(f"a scale was given for a {dtype} cache, which has none")
    return values.to(dtype)


def _write_slots(
    values: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, slot_dims: int
) -> None:
    """values [T, *entry] -> cache; ``slot_dims`` 2 for [blocks, block_size, ...], 1 for states."""
    entry = tuple(cache.shape[slot_dims:])
    check_slot_ids(slots)
    if slots.dim() != 1 or values.shape[0] != slots.shape[0] or tuple(values.shape[1:]) != entry:
        raise InvalidArgumentError(
            f"{tuple(values.shape)} values for {tuple(slots.shape)} slots into a cache "
            f"{tuple(cache.shape)}: need [T, *{entry}] and [T]"
        )
    slots = slots.to(device=cache.device, dtype=torch.long)
    keep = slots != -1
    target = slots[keep]
    capacity = 1
    for d in cache.shape[:slot_dims]:
        capacity *= d
    check_slots(target, capacity)
    data = values.to(cache.device)[keep]
    if slot_dims == 2:
        cache[target // cache.shape[1], target % cache.shape[1]] = data
    else:
        cache[target] = data


def check_slots(target: torch.Tensor, capacity: int) -> None:
    """Slots to write (padding removed) must lie inside the cache and be distinct."""
    bad = (target < 0) | (target >= capacity)
    if bool(bad.any()):
        raise MetadataError(
            f"slots {target[bad][:8].tolist()} are outside the cache's {capacity} slots "
            "(-1 is the only padding value)"
        )
    if target.unique().numel() != target.numel():
        raise MetadataError(f"one call writes some slots twice: {sorted(target.tolist())[:16]}")
