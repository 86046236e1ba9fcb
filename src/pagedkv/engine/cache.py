"""Cache tensors for a plan: each pool one byte buffer, each planned view a tensor at its
byte offset in it (aliased views share memory, as planned).

Two layouts of a pool's buffer, the same bytes per block either way:
- layer-major (default, the plan's ``TensorView.offset``): layer after layer, each a
  contiguous ``(num_pages, block_size, ...)`` tensor; block b of a layer sits at
  ``offset + b * layer_block_bytes``.
- block-major (``block_major=True``): block b holds every layer's block b together at
  bytes ``[b * page_bytes, (b + 1) * page_bytes)`` of the pool (``Pool.page_bytes``),
  layers in the plan's order inside it; each layer is a view with a block stride of
  ``page_bytes`` (:func:`pagedkv.memory.views.layer_view`). This is the layout the elastic
  page ledger (:mod:`pagedkv.blocks.pages`) counts: a physical page then holds whole
  blocks of every layer, so mapping the pages under a block backs all of its layers.

K/V (and latent) tensors take the engine's KV dtype; recurrent state tensors keep the
plan's dtype, except in an fp32 engine, where everything is fp32 (exact comparisons).
When a view's element size differs from the plan's (an fp32 engine: the planner counts
16-bit KV), the views cannot sit at the plan's offsets: every view then gets a tensor of
its own (aliased views still share one).
"""

from __future__ import annotations

import math

import torch

from pagedkv.errors import InvalidArgumentError
from pagedkv.kvspec import DType
from pagedkv.memory.views import layer_view
from pagedkv.ops import fill_nan_
from pagedkv.plan.types import Plan, TensorView

_TORCH = {
    DType.FP32: torch.float32, DType.BF16: torch.bfloat16, DType.FP16: torch.float16,
    DType.FP8: torch.float8_e4m3fn, DType.FP8_E5M2: torch.float8_e5m2,
    DType.UINT8: torch.uint8, DType.INT8: torch.int8,
}

LayerCaches = dict[str, dict[str, torch.Tensor]]


def allocate_caches(plan: Plan, *, device: torch.device, kv_dtype: torch.dtype,
                    nan: bool = False, block_major: bool = False) -> LayerCaches:
    """layer name -> {tensor name: tensor} for rank 0 of ``plan``; ``nan`` fills every
    byte with NaN (tests: an unwritten slot that is read shows up), else zeros.
    ``block_major``: lay each pool out block by block (module docstring)."""
    rank = plan.ranks[0]
    recurrent = {g.id for g in plan.groups if g.is_recurrent}
    pool_groups = {p.id: p.group_ids for p in rank.pools}
    dtypes = [_dtype(v, kv_dtype, any(g in recurrent for g in pool_groups.get(v.pool, ())))
              for v in rank.views]
    carve = all(d.itemsize == v.dtype.itemsize for v, d in zip(rank.views, dtypes))
    out: LayerCaches = {}
    if block_major and not carve:
        raise InvalidArgumentError(
            "a block-major cache needs the plan's element sizes (an fp32 engine over a "
            "16-bit plan gives every view a tensor of its own)")
    if carve:
        buffers = {p.id: torch.empty(p.nbytes, dtype=torch.uint8, device=device)
                   for p in rank.pools}
        for buf in buffers.values():
            buf.fill_(0xFF if nan else 0)  # 0xFF bytes are NaN in every float format
        if block_major:
            return _block_major(plan, dtypes, buffers)
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


def _block_major(plan: Plan, dtypes: list[torch.dtype],
                 buffers: dict[int, torch.Tensor]) -> LayerCaches:
    """Views of each pool's buffer with block b of every layer inside bytes
    ``[b * page_bytes, (b + 1) * page_bytes)``: the plan's views in its order, each at the
    next offset its element size allows; aliased views (the same plan offset) share one."""
    rank = plan.ranks[0]
    out: LayerCaches = {}
    for pool in rank.pools:
        buf = buffers[pool.id][: pool.num_pages * pool.page_bytes]
        inner: dict[int, int] = {}  # the plan's layer-major offset -> offset inside a block
        at = 0
        for view, dtype in zip(rank.views, dtypes):
            if view.pool != pool.id:
                continue
            if view.shape[0] != pool.num_pages:
                raise InvalidArgumentError(
                    f"view {view.layer}.{view.tensor} has {view.shape[0]} blocks, its pool "
                    f"{pool.id} {pool.num_pages}")
            if view.offset not in inner:
                item = dtype.itemsize
                at = -(-at // item) * item
                inner[view.offset] = at
                at += math.prod(view.shape[1:]) * item
            out.setdefault(view.layer, {})[view.tensor] = layer_view(
                buf, pool.page_bytes, inner[view.offset], tuple(view.shape[1:]), dtype)
        if at > pool.page_bytes:
            raise InvalidArgumentError(
                f"pool {pool.id}: its layers need {at} bytes per block, its pages "
                f"{pool.page_bytes}")
    return out


def _dtype(view: TensorView, kv_dtype: torch.dtype, is_state: bool) -> torch.dtype:
    if view.dtype in (DType.UINT8, DType.INT8):  # packed formats keep their bytes
        return _TORCH[view.dtype]
    if not is_state or kv_dtype == torch.float32:
        return kv_dtype
    return _TORCH[view.dtype]
