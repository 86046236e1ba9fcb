"""Cache tensors for a plan: each pool one byte buffer, each planned view a tensor at its
byte offset in it (aliased views share memory, as planned).

K/V (and latent) tensors take the engine's KV dtype; recurrent state tensors keep the
plan's dtype, except in an fp32 engine, where everything is fp32 (exact comparisons).
When a view's element size differs from the plan's (an fp32 engine: the planner counts
16-bit KV), the views cannot sit at the plan's offsets: every view then gets a tensor of
its own (aliased views still share one).
"""

from __future__ import annotations

import torch

from pagedkv.kvspec import DType
from pagedkv.ops import fill_nan_
from pagedkv.plan.types import Plan, TensorView

_TORCH = {
    DType.FP32: torch.float32, DType.BF16: torch.bfloat16, DType.FP16: torch.float16,
    DType.FP8: torch.float8_e4m3fn, DType.FP8_E5M2: torch.float8_e5m2,
    DType.UINT8: torch.uint8, DType.INT8: torch.int8,
}

LayerCaches = dict[str, dict[str, torch.Tensor]]


def allocate_caches(plan: Plan, *, device: torch.device, kv_dtype: torch.dtype,
                    nan: bool = False) -> LayerCaches:
    """layer name -> {tensor name: tensor} for rank 0 of ``plan``; ``nan`` fills every
    byte with NaN (tests: an unwritten slot that is read shows up), else zeros."""
    rank = plan.ranks[0]
    recurrent = {g.id for g in plan.groups if g.is_recurrent}
    pool_groups = {p.id: p.group_ids for p in rank.pools}
    dtypes = [_dtype(v, kv_dtype, any(g in recurrent for g in pool_groups.get(v.pool, ())))
              for v in rank.views]
    carve = all(d.itemsize == v.dtype.itemsize for v, d in zip(rank.views, dtypes))
    out: LayerCaches = {}
    if carve:
        buffers = {p.id: torch.empty(p.nbytes, dtype=torch.uint8, device=device)
                   for p in rank.pools}
        for buf in buffers.values():
            buf.fill_(0xFF if nan else 0)  # 0xFF bytes are NaN in every float format
        for view, dtype in zip(rank.views, dtypes):
            raw = buffers[view.pool][view.offset : view.offset + view.nbytes]
            out.setdefault(view.layer, {})[view.tensor] = raw.view(dtype).view(view.shape)
        return out
    shared: dict[tuple[int, int], torch.Tensor] = {}
    for view, dtype in zip(rank.views, dtypes):
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


def _dtype(view: TensorView, kv_dtype: torch.dtype, is_state: bool) -> torch.dtype:
    if view.dtype in (DType.UINT8, DType.INT8):  # packed formats keep their bytes
        return _TORCH[view.dtype]
    if not is_state or kv_dtype == torch.float32:
        return kv_dtype
    return _TORCH[view.dtype]
