"""Cache tensors for a plan: one tensor per planned view, aliased views sharing one.

K/V (and latent) tensors take the engine's KV dtype; recurrent state tensors keep the
plan's dtype, except in an fp32 engine, where everything is fp32 (exact comparisons).
"""

from __future__ import annotations

import torch

from pagedkv.kvspec import DType
from pagedkv.ops import fill_nan_
from pagedkv.plan.types import Plan

_TORCH = {
    DType.FP32: torch.float32, DType.BF16: torch.bfloat16, DType.FP16: torch.float16,
    DType.FP8: torch.float8_e4m3fn, DType.FP8_E5M2: torch.float8_e5m2,
    DType.UINT8: torch.uint8, DType.INT8: torch.int8,
}

LayerCaches = dict[str, dict[str, torch.Tensor]]


def allocate_caches(plan: Plan, *, device: torch.device, kv_dtype: torch.dtype,
                    nan: bool = False) -> LayerCaches:
    """layer name -> {tensor name: tensor} for rank 0 of ``plan``; ``nan`` fills every
    byte with NaN (tests: an unwritten slot that is read shows up)."""
    recurrent = {g.id for g in plan.groups if g.is_recurrent}
    pool_groups = {p.id: p.group_ids for p in plan.ranks[0].pools}
    shared: dict[tuple[int, int], torch.Tensor] = {}
    out: LayerCaches = {}
    for view in plan.ranks[0].views:
        is_state = any(g in recurrent for g in pool_groups.get(view.pool, ()))
        if not is_state or kv_dtype == torch.float32:
            dtype = kv_dtype if view.dtype not in (DType.UINT8, DType.INT8) else _TORCH[view.dtype]
        else:
            dtype = _TORCH[view.dtype]
        key = (view.pool, view.offset)
        tensor = shared.get(key)
        if tensor is None or tuple(tensor.shape) != tuple(view.shape) or tensor.dtype != dtype:
            tensor = torch.empty(view.shape, dtype=dtype, device=device)
            if nan:
                fill_nan_(tensor)
            else:
                tensor.zero_()
            shared[key] = tensor
        out.setdefault(view.layer, {})[view.tensor] = tensor
    return out
