"""fp8 storage formats of the KV cache: per-tensor scaled fp8 and DeepSeek's fp8_ds_mla.

Per-tensor fp8 keeps one float scale per layer tensor: stored = clamp(x / scale) in fp8,
read back as stored * scale. ``fp8_ds_mla`` packs one MLA latent entry into raw bytes, in
exactly this order (little-endian, as the CUDA kernels read it):

    [ kv_lora_rank fp8 e4m3 latent | kv_lora_rank/128 fp32 scales | rope_dim bf16 rope ]

which is 512 + 16 + 128 = 656 bytes for DeepSeek/Kimi geometry. Each scale covers 128
consecutive latent values (amax / 448, the e4m3 maximum); the rope part is kept in bf16
because positional detail does not survive 3 mantissa bits.
"""

from __future__ import annotations

import torch

from pagedkv.errors import InvalidArgumentError

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
DS_MLA_GROUP = 128  # latent values per fp32 scale in fp8_ds_mla


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def _scale_tensor(scale: float | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A per-tensor scale as a 0-d float32 tensor; it must be finite and positive."""
    s = torch.as_tensor(scale, dtype=torch.float32, device=device)
    if s.numel() != 1:
        raise InvalidArgumentError(f"a per-tensor fp8 scale has one value, got shape {tuple(s.shape)}")
    value = float(s)
    if not (value > 0 and value != float("inf")):
        raise InvalidArgumentError(f"fp8 scale must be finite and > 0, got {value!r}")
    return s.reshape(())


def fp8_scale(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """The per-tensor scale that maps max|x| onto the format's largest value (1 for all-zero x)."""
    return _scale_for(x.detach().abs().amax().float(), torch.finfo(dtype).max)


def _scale_for(amax: torch.Tensor, fmax: float) -> torch.Tensor:
    """amax / fmax, never 0 (tiny amax would underflow float32) and 1 where amax is 0."""
    tiny = torch.finfo(torch.float32).tiny
    return torch.where(amax > 0, (amax / fmax).clamp_min(tiny), torch.ones_like(amax))


def quantize_fp8(
    x: torch.Tensor, scale: float | torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn
) -> torch.Tensor:
    """x / scale, saturated to the format's range (fp8 casts do not saturate), in ``dtype``."""
    if not is_fp8(dtype):
        raise InvalidArgumentError(f"quantize_fp8 needs an fp8 dtype {FP8_DTYPES}, got {dtype}")
    fmax = torch.finfo(dtype).max
    s = _scale_tensor(scale, x.device)
    return (x.float() / s).clamp(-fmax, fmax).to(dtype)


def dequantize_fp8(
    x: torch.Tensor, scale: float | torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    return x.to(dtype) * _scale_tensor(scale, x.device).to(dtype)


def ds_mla_entry_bytes(kv_lora_rank: int, rope_dim: int) -> int:
    """Bytes of one packed fp8_ds_mla entry (656 for 512 + 64)."""
    if kv_lora_rank <= 0 or kv_lora_rank % DS_MLA_GROUP or rope_dim < 0:
        raise InvalidArgumentError(
            f"fp8_ds_mla needs kv_lora_rank a positive multiple of {DS_MLA_GROUP} and "
            f"rope_dim >= 0, got {kv_lora_rank}, {rope_dim}"
        )
    return kv_lora_rank + 4 * (kv_lora_rank // DS_MLA_GROUP) + 2 * rope_dim


def pack_fp8_ds_mla(latent: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """latent [..., R] and rope [..., P] -> uint8 [..., ds_mla_entry_bytes(R, P)]."""
    rank = latent.shape[-1]
    ds_mla_entry_bytes(rank, rope.shape[-1])  # validates the geometry
    if latent.shape[:-1] != rope.shape[:-1]:
        raise InvalidArgumentError(
            f"latent {tuple(latent.shape)} and rope {tuple(rope.shape)} disagree on leading dims"
        )
    lead = latent.shape[:-1]
    groups = latent.float().reshape(*lead, rank // DS_MLA_GROUP, DS_MLA_GROUP)
    amax = groups.abs().amax(dim=-1, keepdim=True)
    fmax = torch.finfo(torch.float8_e4m3fn).max
    scales = _scale_for(amax, fmax)
    q = (groups / scales).clamp(-fmax, fmax).to(torch.float8_e4m3fn).reshape(*lead, rank)
    parts = (
        q.view(torch.uint8),
        scales.reshape(*lead, rank // DS_MLA_GROUP).contiguous().view(torch.uint8),
        rope.to(torch.bfloat16).contiguous().view(torch.uint8),
    )
    return torch.cat(parts, dim=-1)


def unpack_fp8_ds_mla(
    packed: torch.Tensor, kv_lora_rank: int, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 [..., N] -> (latent [..., kv_lora_rank], rope [..., P]) in ``dtype``."""
    if packed.dtype != torch.uint8:
        raise InvalidArgumentError(f"fp8_ds_mla entries are uint8 bytes, got {packed.dtype}")
    n_scales = kv_lora_rank // DS_MLA_GROUP
    rope_bytes = packed.shape[-1] - kv_lora_rank - 4 * n_scales
    if rope_bytes < 0 or rope_bytes % 2:
        raise InvalidArgumentError(
            f"an fp8_ds_mla entry of {packed.shape[-1]} bytes does not fit kv_lora_rank "
            f"{kv_lora_rank}"
        )
    ds_mla_entry_bytes(kv_lora_rank, rope_bytes // 2)  # validates the rank
    lead = packed.shape[:-1]
    raw = packed.contiguous()
    q = raw[..., :kv_lora_rank].contiguous().view(torch.float8_e4m3fn)
    scales = raw[..., kv_lora_rank : kv_lora_rank + 4 * n_scales].contiguous().view(torch.float32)
    rope = raw[..., kv_lora_rank + 4 * n_scales :].contiguous().view(torch.bfloat16)
    latent = q.to(dtype).reshape(*lead, n_scales, DS_MLA_GROUP) * scales.to(dtype)[..., None]
    return latent.reshape(*lead, kv_lora_rank), rope.to(dtype)
