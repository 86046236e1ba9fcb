"""The three concerns of a layer's cache need — Layout, Retention, Attention — and LayerSpec.

Pure data (frozen dataclasses) and pure functions; no torch.
"""

from pagedkv.kvspec.attention import Attention
from pagedkv.kvspec.dtypes import DType, parse_dtype
from pagedkv.kvspec.layer import (
    TARGET,
    Compatibility,
    LayerSpec,
    block_table_compatibility,
    require_block_table_compatible,
)
from pagedkv.kvspec.layout import (
    AttentionKV,
    IndexerKV,
    Layout,
    MLALatent,
    RecurrentState,
    SharedKV,
    StateTensor,
    TensorSpec,
    bytes_per_request,
    bytes_per_token,
)
from pagedkv.kvspec.retention import (
    RETENTION_KINDS,
    ChunkedLocal,
    Compressed,
    Cross,
    Full,
    Recurrent,
    Retention,
    SlidingWindow,
    blocks_per_request,
    cdiv,
    step_blocks,
)

__all__ = [
    "Attention", "AttentionKV", "ChunkedLocal", "Compatibility", "Compressed", "Cross", "DType", "Full",
    "IndexerKV", "LayerSpec", "Layout", "MLALatent", "RETENTION_KINDS", "Recurrent",
    "RecurrentState", "Retention", "SharedKV", "SlidingWindow", "StateTensor", "TARGET", "TensorSpec",
    "block_table_compatibility", "blocks_per_request", "bytes_per_request", "bytes_per_token",
    "cdiv", "parse_dtype", "require_block_table_compatible", "step_blocks",
]
