"""Per-layer tensors over a block-major pool range.

In a pool backed by pages (:mod:`pagedkv.blocks.pages`) block ``b`` holds all of its layers
together at bytes ``[b * block_bytes, (b + 1) * block_bytes)``, so a block lies on as few
pages as possible. A layer's tensor is then a strided view: dimension 0 is the block id with
a stride of ``block_bytes``, the rest is the layer's own (contiguous) block shape starting
``offset`` bytes into each block. Kernels that take the block stride as an argument (all of
pagedkv's, and the usual paged-attention kernels) read it unchanged.
"""

from __future__ import annotations

import math
from typing import Any

from pagedkv.errors import InvalidArgumentError


def layer_view(pool: Any, block_bytes: int, offset: int, block_shape: tuple[int, ...],
               dtype: Any) -> Any:
    """``(num_blocks, *block_shape)`` view of ``dtype`` over the uint8 pool tensor ``pool``."""
    import torch

    item = torch.empty((), dtype=dtype).element_size()
    need = math.prod(block_shape) * item
    if block_bytes % item or offset % item or offset + need > block_bytes:
        raise InvalidArgumentError(
            f"a {block_shape} {dtype} layer at offset {offset} does not fit blocks of "
            f"{block_bytes} bytes aligned to its {item}-byte elements")
    num_blocks = pool.numel() // block_bytes
    inner = [1] * len(block_shape)
    for i in range(len(block_shape) - 2, -1, -1):
        inner[i] = inner[i + 1] * block_shape[i + 1]
    typed = pool[: num_blocks * block_bytes].view(dtype)
    return typed.as_strided((num_blocks, *block_shape), (block_bytes // item, *inner),
                            typed.storage_offset() + offset // item)
