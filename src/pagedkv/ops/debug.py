"""Debug aid: fill freshly allocated pages with NaN, so that any read of an unwritten slot
shows up as NaN in the output instead of silently reusing stale values.

All bytes are set to 0xFF, which is a NaN in fp32, fp64, bf16, fp16, fp8 e4m3fn and e5m2.
For packed uint8 formats (fp8_ds_mla) that makes every fp8 value, scale and bf16 rope
value of the entry NaN as well.
"""

from __future__ import annotations

import torch

from pagedkv.errors import InvalidArgumentError

_NAN_BYTES_OK = (
    torch.float64, torch.float32, torch.bfloat16, torch.float16,
    torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8,
)


def fill_nan_(cache: torch.Tensor, pages: torch.Tensor | list[int] | None = None) -> torch.Tensor:
    """NaN-fill ``cache`` in place: the whole tensor, or the pages (dim-0 indices) given.

    Works for K/V, latent and recurrent-state caches alike; returns ``cache``.
    """
    if cache.dtype not in _NAN_BYTES_OK:
        raise InvalidArgumentError(
            f"cannot NaN-fill a {cache.dtype} cache; supported: {_NAN_BYTES_OK}"
        )
    if pages is None:
        cache.view(torch.uint8).fill_(0xFF)
        return cache
    index = torch.as_tensor(pages, dtype=torch.long, device=cache.device)
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= cache.shape[0]):
        raise InvalidArgumentError(
            f"pages {index.tolist()[:16]} outside the cache's {cache.shape[0]} pages"
        )
    cache.view(torch.uint8)[index] = 0xFF
    return cache
