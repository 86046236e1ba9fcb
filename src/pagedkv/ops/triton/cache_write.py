"""Cache writes through the slot mapping in Triton: K/V (plain or per-tensor fp8) and the MLA
latent (plain, per-tensor fp8, or DeepSeek's 656-byte fp8_ds_mla packing).

One program per (token, KV head) or per token; slot -1 writes nothing. Outside CUDA-graph
capture the slots are validated on the host as the reference does (range, no slot twice).
Quantization matches the reference: x / scale in float32, saturated, rounded to nearest.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.errors import InvalidArgumentError
from pagedkv.ops.cache_write import check_slot_ids, check_slots, latent_rope, to_stored
from pagedkv.ops.fp8 import DS_MLA_GROUP, ds_mla_entry_bytes, is_fp8
from pagedkv.ops.triton.common import (
    capturing,
    check_device,
    interpreting,
    next_pow2,
    scale_vector,
)


@triton.jit
def _write_rows(
    src_ptr, cache_ptr, slot_ptr, scale_ptr, stride_st, stride_sh, stride_cb, stride_ct,
    stride_ch, block_size, T, H, D, FP8: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_HD: tl.constexpr,
):
    """BLOCK_T tokens x all (head, dim) entries per program."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.load(slot_ptr + t, mask=t < T, other=-1).to(tl.int64)
    e = tl.arange(0, BLOCK_HD)
    h = e // D
    d = e % D
    keep = (slot >= 0)[:, None] & (e < H * D)[None, :]
    x = tl.load(src_ptr + t[:, None].to(tl.int64) * stride_st + (h * stride_sh + d)[None, :],
                mask=keep, other=0.0)
    dst = cache_ptr + ((slot // block_size) * stride_cb + (slot % block_size) * stride_ct)[:, None] \
        + (h * stride_ch + d)[None, :]
    if FP8:
        fmax = 448.0 if cache_ptr.dtype.element_ty == tl.float8e4nv else 57344.0
        y = tl.clamp(x.to(tl.float32) / tl.load(scale_ptr), -fmax, fmax)
        tl.store(dst, y.to(cache_ptr.dtype.element_ty), mask=keep)
    else:
        tl.store(dst, x.to(cache_ptr.dtype.element_ty), mask=keep)


@triton.jit
def _write_ds_mla(
    lat_ptr, rope_ptr, q8_ptr, f32_ptr, bf16_ptr, slot_ptr, stride_lt, stride_rt,
    stride_cb, stride_ct, block_size, R: tl.constexpr, P, BLOCK_P: tl.constexpr,
    GROUP: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    entry = (slot // block_size) * stride_cb + (slot % block_size) * stride_ct  # bytes
    NG: tl.constexpr = R // GROUP
    x = tl.load(lat_ptr + t * stride_lt + tl.arange(0, R)).to(tl.float32)
    xg = tl.reshape(x, [NG, GROUP])
    amax = tl.max(tl.abs(xg), 1)
    sc = tl.where(amax > 0, tl.maximum(amax / 448.0, 1.1754943508222875e-38), 1.0)
    q = tl.clamp(xg / sc[:, None], -448.0, 448.0).to(tl.float8e4nv)
    tl.store(q8_ptr + entry + tl.arange(0, R), tl.reshape(q, [R]))
    tl.store(f32_ptr + (entry + R) // 4 + tl.arange(0, NG), sc)
    p = tl.arange(0, BLOCK_P)
    r = tl.load(rope_ptr + t * stride_rt + p, mask=p < P, other=0.0)
    tl.store(bf16_ptr + (entry + R + 4 * NG) // 2 + p, r.to(tl.bfloat16), mask=p < P)


def _write_slots_check_only(cache: torch.Tensor, slots: torch.Tensor) -> None:
    check_slots(slots[slots != -1].long(), cache.shape[0] * cache.shape[1])


def _shape_check(values: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    entry = tuple(cache.shape[2:])
    check_slot_ids(slots)
    if slots.dim() != 1 or values.shape[0] != slots.shape[0] or tuple(values.shape[1:]) != entry:
        raise InvalidArgumentError(
            f"{tuple(values.shape)} values for {tuple(slots.shape)} slots into a cache "
            f"{tuple(cache.shape)}: need [T, *{entry}] and [T]"
        )
    if cache.stride(-1) != 1 or values.stride(-1) != 1:
        raise InvalidArgumentError("cache entries and values must be contiguous in their last dim")


def _scale(cache: torch.Tensor, scale, device) -> torch.Tensor:
    if not capturing():
        to_stored(torch.zeros(0, device=device), cache.dtype, scale)  # the reference's scale checks
    return scale_vector((1.0 if scale is None else scale,), device)


def _write_one(values: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, scale) -> None:
    _shape_check(values, cache, slots)
    check_device(values, cache, slots)
    if not capturing():
        _write_slots_check_only(cache, slots)
    s = _scale(cache, scale, cache.device)
    if values.shape[0] == 0:
        return
    v3 = values if values.dim() == 3 else values[:, None]
    c4 = cache if cache.dim() == 4 else cache[:, :, None]
    tokens, heads, dim = v3.shape
    block_t = 64 if interpreting() else max(1, min(16, 2048 // next_pow2(heads * dim)))
    _write_rows[(-(-tokens // block_t),)](
        v3, c4, slots, s, v3.stride(0), v3.stride(1), c4.stride(0), c4.stride(1), c4.stride(2),
        c4.shape[1], tokens, heads, dim, FP8=is_fp8(cache.dtype), BLOCK_T=block_t,
        BLOCK_HD=max(16, next_pow2(heads * dim)), num_warps=4,
    )


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
    _write_one(key, k_cache, slot_mapping, k_scale)
    _write_one(value, v_cache, slot_mapping, v_scale)


def write_mla_latent(
    latent: torch.Tensor,
    rope: torch.Tensor | None,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    scale: float | torch.Tensor | None = None,
) -> None:
    """latent [T, R] and rope [T, P] (None for NoPE) -> one cache entry per slot."""
    rope = latent_rope(latent, rope)
    if cache.dtype != torch.uint8:
        _write_one(torch.cat([latent, rope.to(latent.dtype)], dim=-1).contiguous(), cache,
                   slot_mapping, scale)
        return
    if scale is not None:
        raise InvalidArgumentError("fp8_ds_mla carries its own scales; pass no latent scale")
    rank, rope_dim = latent.shape[-1], rope.shape[-1]
    width = ds_mla_entry_bytes(rank, rope_dim)
    fake = latent.new_empty(latent.shape[0], width, dtype=torch.uint8)
    _shape_check(fake, cache, slot_mapping)
    check_device(latent, cache, slot_mapping)
    if not capturing():
        _write_slots_check_only(cache, slot_mapping)
    if latent.shape[0] == 0:
        return
    if cache.stride(0) % 4 or cache.stride(1) % 4 or width % 4:
        raise InvalidArgumentError("fp8_ds_mla entries must be 4-byte aligned in the cache")
    lat = latent.contiguous()
    rp = rope.contiguous()
    _write_ds_mla[(lat.shape[0],)](
        lat, rp, cache.view(torch.float8_e4m3fn), cache.view(torch.float32),
        cache.view(torch.bfloat16), slot_mapping, lat.stride(0), rp.stride(0) if rope_dim else 0,
        cache.stride(0), cache.stride(1), cache.shape[1], R=rank, P=rope_dim,
        BLOCK_P=max(16, next_pow2(rope_dim)), GROUP=DS_MLA_GROUP, num_warps=4,
    )
