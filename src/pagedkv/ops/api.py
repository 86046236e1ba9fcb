"""The public ops: each call runs on the backend ``pagedkv.ops.backend`` selects.

The torch reference (``paged_attention``, ``paged_mla``, ``cache_write`` modules) is the
oracle; the Triton kernels (``pagedkv.ops.triton``) take the same arguments and are
imported only when that backend runs. ``write_state`` and the fp8 helpers have no kernel.
"""

from __future__ import annotations

import torch

import pagedkv.ops.cache_write as _ref_write
import pagedkv.ops.paged_attention as _ref_attn
import pagedkv.ops.paged_mla as _ref_mla
from pagedkv.ops.backend import get_backend


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


def paged_mla(q_nope, q_rope, latent_cache, query_start_loc, seq_lens, block_table, **kwargs):
    """MLA output [T, H, Dv] (conventions: ``pagedkv.ops.paged_mla.paged_mla``); on the
    Triton backend the latent attention is the kernel, and absorption and projection run
    in float32 (the kernel's accumulation dtype)."""
    if get_backend() == "triton":
        kwargs.update(latent_op=_kernels().paged_mla_latent, compute_dtype=torch.float32)
    return _ref_mla.paged_mla(q_nope, q_rope, latent_cache, query_start_loc, seq_lens,
                              block_table, **kwargs)


def write_kv(key, value, k_cache, v_cache, slot_mapping, **kwargs) -> None:
    """key [T, Hkv, D], value [T, Hkv, Dv] -> their slots (``pagedkv.ops.cache_write``)."""
    impl = _kernels().write_kv if get_backend() == "triton" else _ref_write.write_kv
    impl(key, value, k_cache, v_cache, slot_mapping, **kwargs)


def write_mla_latent(latent, rope, cache, slot_mapping, **kwargs) -> None:
    """latent [T, R] and rope [T, P] -> one cache entry per slot (``pagedkv.ops.cache_write``)."""
    impl = _kernels().write_mla_latent if get_backend() == "triton" else _ref_write.write_mla_latent
    impl(latent, rope, cache, slot_mapping, **kwargs)
