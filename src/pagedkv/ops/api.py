"""The public ops: each call runs on the backend ``pagedkv.ops.backend`` selects.

The torch reference (``paged_attention``, ``paged_mla``, ``cache_write`` modules) is the
oracle; the Triton kernels (``pagedkv.ops.triton``) take the same arguments and are
imported only when that backend runs. ``write_state`` and the fp8 helpers have no kernel.
"""

from __future__ import annotations

import math

import torch

import pagedkv.ops.cache_write as _ref_write
import pagedkv.ops.paged_attention as _ref_attn
import pagedkv.ops.paged_mla as _ref_mla
from pagedkv.ops.backend import get_backend
from pagedkv.ops.masks import CAUSAL, Mask


def _kernels():
    import pagedkv.ops.triton as kernels

    return kernels


def paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_table, **kwargs):
    """Attention output [T, Hq, Dv] of packed queries over a paged K/V cache
    (conventions: ``pagedkv.ops.paged_attention.paged_attention``)."""
    impl = _kernels().paged_attention if get_backend() == "triton" else _ref_attn.paged_attention
    return impl(q, k_cache, v_cache, query_start_loc, seq_lens, block_table, **kwargs)


def paged_mla_latent(q_latent, q_rope, latent_cache, query_start_loc, seq_lens, block_table,
                     **kwargs):
    """Absorbed MLA over the latent cache -> o_latent [T, H, R]
    (conventions: ``pagedkv.ops.paged_mla.paged_mla_latent``)."""
    impl = _kernels().paged_mla_latent if get_backend() == "triton" else _ref_mla.paged_mla_latent
    return impl(q_latent, q_rope, latent_cache, query_start_loc, seq_lens, block_table, **kwargs)


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
) -> torch.Tensor:
    """MLA output [T, H, Dv]: absorb W_UK, attend over the latent cache, project by W_UV."""
    if get_backend() == "torch":
        return _ref_mla.paged_mla(
            q_nope, q_rope, latent_cache, query_start_loc, seq_lens, block_table, w_uk=w_uk,
            w_uv=w_uv, scale=scale, mask=mask, latent_scale=latent_scale,
            compute_dtype=compute_dtype, out_dtype=out_dtype)
    rope_dim = 0 if q_rope is None else q_rope.shape[-1]
    if scale is None:
        scale = 1.0 / math.sqrt(q_nope.shape[-1] + rope_dim)
    q_latent = _ref_mla.absorb_query(q_nope.to(torch.float32), w_uk)
    o_latent = _kernels().paged_mla_latent(
        q_latent, None if q_rope is None else q_rope.to(torch.float32), latent_cache,
        query_start_loc, seq_lens, block_table, scale=scale, mask=mask,
        latent_scale=latent_scale)
    return _ref_mla.project_output(o_latent, w_uv).to(out_dtype or q_nope.dtype)


def write_kv(key, value, k_cache, v_cache, slot_mapping, **kwargs) -> None:
    """key [T, Hkv, D], value [T, Hkv, Dv] -> their slots (``pagedkv.ops.cache_write``)."""
    impl = _kernels().write_kv if get_backend() == "triton" else _ref_write.write_kv
    impl(key, value, k_cache, v_cache, slot_mapping, **kwargs)


def write_mla_latent(latent, rope, cache, slot_mapping, **kwargs) -> None:
    """latent [T, R] and rope [T, P] -> one cache entry per slot (``pagedkv.ops.cache_write``)."""
    impl = _kernels().write_mla_latent if get_backend() == "triton" else _ref_write.write_mla_latent
    impl(latent, rope, cache, slot_mapping, **kwargs)
