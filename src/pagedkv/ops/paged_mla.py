"""Reference paged MLA in absorbed form over the latent cache (DeepSeek / Kimi layers).

Per head h, the decompressed key is k_nope = W_UK[h] @ c_kv (plus the shared k_rope) and
the value is W_UV[h] @ c_kv. Absorbing W_UK into the query lets attention run directly on
the cached latent, as multi-query attention with one shared "head":

    q_latent[h] = W_UK[h]^T q_nope[h]                  [R]
    score       = scale * (q_latent . c_kv + q_rope . k_rope)
    o_latent[h] = softmax(score) @ c_kv                [R]
    out[h]      = W_UV[h] @ o_latent[h]                [Dv]

Shapes: q_nope [T, H, Dn], q_rope [T, H, P] (None or P = 0 for NoPE models), W_UK
[H, Dn, R], W_UV [H, Dv, R] (kv_b_proj.weight viewed [H, Dn + Dv, R] and split), the
latent cache [num_blocks, block_size, E] in bf16/fp16/fp32 (E = R + P), per-tensor fp8
with ``latent_scale``, or uint8 fp8_ds_mla entries (see ``fp8``). The scale defaults to
1/sqrt(Dn + P), the head dim of the unabsorbed query.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from pagedkv.errors import InvalidArgumentError
from pagedkv.ops.gather import read_positions, split_latent
from pagedkv.ops.masks import CAUSAL, Mask, visible_keys
from pagedkv.ops.paged_attention import attend
from pagedkv.ops.sequences import sequences


def absorb_query(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """q_nope [T, H, Dn], W_UK [H, Dn, R] -> q_latent [T, H, R]."""
    if q_nope.dim() != 3 or w_uk.dim() != 3 or w_uk.shape[:2] != q_nope.shape[1:]:
        raise InvalidArgumentError(
            f"need q_nope [T, H, Dn] and W_UK [H, Dn, R], got {tuple(q_nope.shape)} and "
            f"{tuple(w_uk.shape)}"
        )
    return torch.einsum("thd,hdr->thr", q_nope, w_uk.to(q_nope.dtype))


def project_output(o_latent: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """o_latent [T, H, R], W_UV [H, Dv, R] -> out [T, H, Dv]."""
    if o_latent.dim() != 3 or w_uv.dim() != 3 or (w_uv.shape[0], w_uv.shape[2]) != o_latent.shape[1:]:
        raise InvalidArgumentError(
            f"need o_latent [T, H, R] and W_UV [H, Dv, R], got {tuple(o_latent.shape)} and "
            f"{tuple(w_uv.shape)}"
        )
    return torch.einsum("thr,hvr->thv", o_latent, w_uv.to(o_latent.dtype))


def check_latent_args(q_latent: torch.Tensor, q_rope: torch.Tensor | None,
                      latent_cache: torch.Tensor) -> None:
    """InvalidArgumentError unless q_latent is [T, H, R], q_rope [T, H, P] (or None) and the
    cache [num_blocks, block_size, entry]."""
    if q_latent.dim() != 3 or (q_rope is not None and (
            q_rope.dim() != 3 or q_rope.shape[:2] != q_latent.shape[:2])):
        raise InvalidArgumentError(
            f"q_latent {tuple(q_latent.shape)} and q_rope "
            f"{None if q_rope is None else tuple(q_rope.shape)}: need [T, H, R] and [T, H, P]")
    if latent_cache.dim() != 3:
        raise InvalidArgumentError(
            f"the latent cache is [num_blocks, block_size, entry], got {tuple(latent_cache.shape)}"
        )


def paged_mla_latent(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor | None,
    latent_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    scale: float,
    mask: Mask = CAUSAL,
    latent_scale: float | torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The kernel-level op: absorbed queries -> o_latent [T, H, R] in ``compute_dtype``."""
    check_latent_args(q_latent, q_rope, latent_cache)
    rows, heads, rank = q_latent.shape
    rope_dim = 0 if q_rope is None else q_rope.shape[-1]
    q_full = q_latent if q_rope is None else torch.cat([q_latent, q_rope.to(q_latent.dtype)], -1)
    out = torch.zeros(rows, heads, rank, dtype=compute_dtype, device=q_latent.device)
    for s in sequences(query_start_loc, seq_lens, block_table, rows, latent_cache.shape[1]):
        seen = visible_keys(mask, s.seq_len, s.q_len, q_latent.device)
        read = seen.any(dim=0).nonzero().flatten()
        entries = read_positions(latent_cache, block_table[s.index], read)
        c_kv, k_rope = split_latent(entries, rank, latent_scale, compute_dtype)
        if k_rope.shape[-1] != rope_dim:
            raise InvalidArgumentError(
                f"the cache holds {k_rope.shape[-1]} rope values per token, the query {rope_dim}"
            )
        key = torch.cat([c_kv, k_rope], dim=-1)[:, None, :]  # one shared KV head
        rows_q = q_full[s.q_start : s.q_start + s.q_len].to(compute_dtype)
        out[s.q_start : s.q_start + s.q_len] = attend(
            rows_q, key, c_kv[:, None, :], seen[:, read], scale
        )
    return out


def paged_mla(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor | None,
    latent_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float | None = None,
    mask: Mask = CAUSAL,
    latent_scale: float | torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float32,
    out_dtype: torch.dtype | None = None,
    latent_op: Callable[..., torch.Tensor] = paged_mla_latent,
) -> torch.Tensor:
    """MLA output [T, H, Dv]: absorb W_UK, attend over the latent cache, project by W_UV.

    ``latent_op``: the attention over the latent cache, with the arguments of
    :func:`paged_mla_latent` (the Triton kernel takes its place on that backend).
    """
    rope_dim = 0 if q_rope is None else q_rope.shape[-1]
    if scale is None:
        scale = 1.0 / math.sqrt(q_nope.shape[-1] + rope_dim)
    q_latent = absorb_query(q_nope.to(compute_dtype), w_uk)
    o_latent = latent_op(
        q_latent,
        None if q_rope is None else q_rope.to(compute_dtype),
        latent_cache,
        query_start_loc,
        seq_lens,
        block_table,
        scale=scale,
        mask=mask,
        latent_scale=latent_scale,
        compute_dtype=compute_dtype,
    )
    return project_output(o_latent, w_uv).to(out_dtype or q_nope.dtype)
