"""Reading a paged cache: token positions of one sequence -> cache entries, dequantized.

Conventions (shared with pagedkv.batch): a sequence's position p lives in block
``block_table[b, p // block_size]`` at offset ``p % block_size``; a paged cache tensor is
[num_blocks, block_size, *entry]. Only positions some query row reads are gathered, so
block-table entries of freed (out-of-window) blocks are never dereferenced.
"""

from __future__ import annotations

import torch

from pagedkv.errors import InvalidArgumentError, MetadataError
from pagedkv.ops.fp8 import dequantize_fp8, is_fp8, unpack_fp8_ds_mla


def read_positions(
    cache: torch.Tensor, block_row: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """Entries [len(positions), *entry] of one sequence, read through its block-table row."""
    num_blocks, block_size = cache.shape[0], cache.shape[1]
    columns = positions // block_size
    if positions.numel() and int(columns.max()) >= block_row.numel():
        raise MetadataError(
            f"position {int(positions.max())} needs block-table column {int(columns.max())}, "
            f"but the row has {block_row.numel()} columns"
        )
    blocks = block_row.to(device=cache.device, dtype=torch.long)[columns]
    bad = (blocks < 0) | (blocks >= num_blocks)
    if bool(bad.any()):
        first = int(bad.nonzero()[0, 0])
        raise MetadataError(
            f"position {int(positions[first])} is read through block id {int(blocks[first])}, "
            f"outside the cache's {num_blocks} blocks"
        )
    return cache[blocks, positions % block_size]


def to_compute(
    values: torch.Tensor, scale: float | torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """Stored values in ``dtype``; fp8 values need their per-tensor scale, others none."""
    if is_fp8(values.dtype):
        if scale is None:
            raise InvalidArgumentError(f"a {values.dtype} cache needs its per-tensor scale")
        return dequantize_fp8(values, scale, dtype)
    if scale is not None:
        raise InvalidArgumentError(f"a scale was given for a {values.dtype} cache, which has none")
    return values.to(dtype)


def split_latent(
    entries: torch.Tensor,
    kv_lora_rank: int,
    scale: float | torch.Tensor | None,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA cache entries [n, E] in any latent format -> (c_kv [n, R], k_rope [n, P])."""
    if entries.dtype == torch.uint8:
        if scale is not None:
            raise InvalidArgumentError("fp8_ds_mla carries its own scales; pass no latent scale")
        return unpack_fp8_ds_mla(entries, kv_lora_rank, dtype)
    if entries.shape[-1] < kv_lora_rank:
        raise InvalidArgumentError(
            f"latent entries of width {entries.shape[-1]} are narrower than kv_lora_rank "
            f"{kv_lora_rank}"
        )
    values = to_compute(entries, scale, dtype)
    return values[..., :kv_lora_rank], values[..., kv_lora_rank:]
