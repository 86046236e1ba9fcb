"""Triton kernels behind the same interface as the torch reference ops.

Selected by ``pagedkv.ops.set_backend("triton")``. Importing this package imports triton;
``pagedkv.ops`` does so only when the Triton backend runs an op.
"""

from pagedkv.ops.triton.attention import paged_attention
from pagedkv.ops.triton.cache_write import write_kv, write_mla_latent
from pagedkv.ops.triton.mla import paged_mla_latent

__all__ = ["paged_attention", "paged_mla_latent", "write_kv", "write_mla_latent"]
