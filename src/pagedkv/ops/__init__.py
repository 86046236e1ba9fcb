"""Paged-attention ops: cache writes and paged attention (GQA/MHA and absorbed MLA).

Every public op runs on the backend ``set_backend`` selects ("torch" reference or "triton"
kernels; env PAGEDKV_OPS_BACKEND).

The torch reference modules are the oracle every fast kernel is tested against: plain
torch, CPU or CUDA, clarity first. Conventions shared with pagedkv.batch are stated in ``sequences``
(query_start_loc, seq_lens, block_table), ``cache_write`` (slot mapping) and ``masks``.
"""

from pagedkv.ops.api import paged_attention, paged_mla, paged_mla_latent, write_kv, write_mla_latent
from pagedkv.ops.backend import get_backend, set_backend, triton_available, use_backend
from pagedkv.ops.cache_write import write_state
from pagedkv.ops.debug import fill_nan_
from pagedkv.ops.fp8 import (
    DS_MLA_GROUP,
    dequantize_fp8,
    ds_mla_entry_bytes,
    fp8_scale,
    pack_fp8_ds_mla,
    quantize_fp8,
    unpack_fp8_ds_mla,
)
from pagedkv.ops.masks import CAUSAL, Mask, visible_keys
from pagedkv.ops.paged_attention import attend
from pagedkv.ops.paged_mla import absorb_query, project_output

__all__ = [
    "CAUSAL", "DS_MLA_GROUP", "Mask", "absorb_query", "attend", "dequantize_fp8",
    "ds_mla_entry_bytes", "fill_nan_", "fp8_scale", "get_backend", "set_backend",
    "triton_available", "use_backend", "pack_fp8_ds_mla", "paged_attention",
    "paged_mla", "paged_mla_latent", "project_output", "quantize_fp8", "unpack_fp8_ds_mla",
    "visible_keys", "write_kv", "write_mla_latent", "write_state",
]
