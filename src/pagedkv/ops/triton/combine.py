"""Split-KV combine: per (query row, head) pair, merge the partial softmax states of every split.

Partial results are (m, l, o): the running maximum (log2 domain), the sum of exp2(s - m)
and the unnormalized output. Attention sinks join the denominator here. Rows past the
batch's last query row, and rows that saw no key, come out as zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.launch import Launch, raw_stream
from pagedkv.ops.triton.common import capturing, interpreting, next_pow2

LOG2E = 1.4426950408889634


@triton.jit
def _combine(
    ws_o, ws_m, ws_l, out_ptr, qsl_ptr, sinks_ptr,
    stride_ot, stride_oh, batch, rows, heads, DV,
    NUM_SPLITS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_DV: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    """BLOCK_E (query row, head) pairs per program."""
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    row = e // heads
    h = e % heads
    d = tl.arange(0, BLOCK_DV)
    total = tl.load(qsl_ptr + batch)
    live = (e < rows * heads) & (row < total)
    sp = tl.arange(0, BLOCK_S)
    es_mask = live[:, None] & (sp < NUM_SPLITS)[None, :]
    base = e.to(tl.int64)[:, None] * NUM_SPLITS + sp[None, :]  # [E, S]
    ms = tl.load(ws_m + base, mask=es_mask, other=float("-inf"))
    ls = tl.load(ws_l + base, mask=es_mask, other=0.0)
    mx = tl.max(ms, 1)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h, mask=live, other=0.0).to(tl.float32) * 1.4426950408889634
        mx = tl.maximum(mx, sink)
    m_use = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.exp2(ms - m_use[:, None])
    denom = tl.sum(ls * w, 1)
    if HAS_SINKS:
        denom += tl.exp2(sink - m_use)
    o = tl.load(ws_o + base[:, :, None] * DV + d[None, None, :],
                mask=es_mask[:, :, None] & (d < DV)[None, None, :], other=0.0)
    o = tl.sum(o * w[:, :, None], 1)
    seen = tl.sum(ls, 1) > 0
    o = tl.where(seen[:, None], o / tl.where(denom > 0, denom, 1.0)[:, None], 0.0)
    out = out_ptr + row.to(tl.int64)[:, None] * stride_ot + h[:, None] * stride_oh + d[None, :]
    tl.store(out, o.to(out_ptr.dtype.element_ty), mask=(e < rows * heads)[:, None] & (d < DV)[None, :])


_WORKSPACES: dict[tuple, tuple[torch.Tensor, ...]] = {}
_MAX_WORKSPACES = 16


def workspace(rows: int, heads: int, splits: int, dv: int, device, reuse: bool = False
              ) -> tuple[torch.Tensor, ...]:
    """Partial (o, m, l) per (row, head, split); every slot a row owns is written by a program.

    ``reuse``: one workspace per (device, stream, shape), kept between calls (three fewer
    allocations per call). Safe because every reader and writer of it is a launch on that
    stream, in order; never inside CUDA-graph capture (the graph gets its own, from its pool,
    so no eager call can overwrite what a replay reads)."""
    if reuse and not capturing():
        stream = raw_stream(device.index) if device.type == "cuda" else 0
        key = (device.type, device.index, stream, rows, heads, splits, dv)
        ws = _WORKSPACES.get(key)
        if ws is None:
            if len(_WORKSPACES) >= _MAX_WORKSPACES:
                _WORKSPACES.clear()  # (a freed block is reused in its own stream's order)
            ws = _WORKSPACES[key] = workspace(rows, heads, splits, dv, device)
        return ws
    return (
        torch.empty(rows, heads, splits, dv, dtype=torch.float32, device=device),
        torch.empty(rows, heads, splits, dtype=torch.float32, device=device),
        torch.empty(rows, heads, splits, dtype=torch.float32, device=device),
    )


def combine_launch(ws_shape, out: torch.Tensor, query_start_loc: torch.Tensor,
                   sinks: torch.Tensor | None, direct: bool = True) -> Launch:
    """The combine's launch for this workspace shape, output layout and batch; called with
    ``(ws_o, ws_m, ws_l, out, query_start_loc, sinks or ws_m)``."""
    rows, heads, splits, dv = ws_shape
    block_s, block_dv = max(2, next_pow2(splits)), max(16, next_pow2(dv))
    pairs = rows * heads
    block_e = next_pow2(pairs) if interpreting() else max(1, min(64, 8192 // (block_s * block_dv)))
    return Launch(_combine, (-(-pairs // block_e),),
                  (out.stride(0), out.stride(1), query_start_loc.shape[0] - 1, rows, heads, dv),
                  dict(NUM_SPLITS=splits, BLOCK_E=block_e, BLOCK_S=block_s, BLOCK_DV=block_dv,
                       HAS_SINKS=sinks is not None, num_warps=4), direct)


def combine(ws, out: torch.Tensor, query_start_loc: torch.Tensor, sinks: torch.Tensor | None) -> None:
    ws_o, ws_m, ws_l = ws
    if ws_o.shape[0] == 0:
        return
    combine_launch(ws_o.shape, out, query_start_loc, sinks, direct=False)(
        ws_o, ws_m, ws_l, out, query_start_loc, sinks if sinks is not None else ws_m)
