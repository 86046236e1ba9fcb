"""Paged GQA/MHA attention in Triton: a general kernel for mixed prefill and decode rows,
split-KV with a combine step; short-query batches go to the decode kernel (``decode.py``).

A program owns one sequence's tile of BLOCK_M (query row, query head) pairs of one KV
head — the query heads that share a KV head are folded into the tile, so K/V are read once
per KV head — and one split of the keys the tile's rows see. Keys are gathered per
position through the block table, so any block size works. Same interface and mask
semantics as ``pagedkv.ops.paged_attention``; accumulation is float32 whatever
``compute_dtype`` says. fp8 caches fold their per-tensor scales into the scores and output.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from pagedkv.errors import InvalidArgumentError
from pagedkv.ops.fp8 import is_fp8
from pagedkv.ops.masks import CAUSAL, Mask
from pagedkv.ops.paged_attention import check_attention_args
from pagedkv.ops.sequences import check_index_tensors, sequences
from pagedkv.ops.triton.combine import combine, workspace
from pagedkv.ops.triton.common import (
    capturing,
    check_device,
    interpreting,
    next_pow2,
    num_splits,
    raise_on_bad_block,
    scale_vector,
)
from pagedkv.ops.triton.decode import DECODE_ROWS, DecodePlan, decode_plan, seq_len_key
from pagedkv.ops.triton.rows import row_extents, soft_cap_scores, split_range


@triton.jit
def _paged_attention_fwd(
    q_ptr, k_ptr, v_ptr, qsl_ptr, lens_ptr, table_ptr, ws_o, ws_m, ws_l, scales_ptr, flag_ptr,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_tb, num_blocks, block_size, heads, group, D, DV, scale, cap, window, chunk, draft,
    TILES: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, CAUSAL: tl.constexpr, HAS_DRAFT: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_CHUNK: tl.constexpr, HAS_CAP: tl.constexpr, CHECK: tl.constexpr,
    F32: tl.constexpr,
):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    b = pid // TILES
    tile = pid % TILES
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    if tile * BLOCK_M >= q_len * group:
        return
    seq_len = tl.load(lens_ptr + b)
    m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row = m // group
    qh = kvh * group + m % group
    lo, hi = row_extents(row, q_len, seq_len, window, chunk, draft,
                         CAUSAL, HAS_DRAFT, HAS_WINDOW, HAS_CHUNK)
    kv_lo = tl.min(lo, 0)
    kv_hi = tl.max(hi, 0)
    s_lo, s_hi = split_range(kv_lo, kv_hi, split, NUM_SPLITS, BLOCK_N)

    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    rmask = row < q_len
    q = tl.load(q_ptr + (q_start + row)[:, None].to(tl.int64) * stride_qt + qh[:, None] * stride_qh
                + d[None, :], mask=rmask[:, None] & (d[None, :] < D), other=0.0)
    if F32:
        q = q.to(tl.float32)
    k_scale = tl.load(scales_ptr)
    v_scale = tl.load(scales_ptr + 1)
    qk_scale = scale * k_scale

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    for n0 in range(s_lo, s_hi, BLOCK_N):
        keys = n0 + tl.arange(0, BLOCK_N)
        kin = (keys < s_hi) & (keys >= kv_lo)
        page = tl.load(table_ptr + b * stride_tb + keys // block_size, mask=kin, other=0)
        bad = kin & ((page < 0) | (page >= num_blocks))
        if CHECK:
            tl.store(flag_ptr + keys * 0, 1, mask=bad)
            tl.store(flag_ptr + 1 + keys * 0, page, mask=bad)
        kin = kin & ~bad
        page = tl.where(kin, page, 0).to(tl.int64)
        offset = keys % block_size
        k = tl.load(k_ptr + (page * stride_kb + offset * stride_kt + kvh * stride_kh)[:, None]
                    + d[None, :], mask=kin[:, None] & (d[None, :] < D), other=0.0)
        if F32:
            k = k.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k.to(q.dtype)))
        s = s * qk_scale
        if HAS_CAP:
            s = soft_cap_scores(s, cap)
        s = s * 1.4426950408889634
        seen = (keys[None, :] >= lo[:, None]) & (keys[None, :] < hi[:, None]) & kin[None, :]
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + (page * stride_vb + offset * stride_vt + kvh * stride_vh)[:, None]
                    + dv[None, :], mask=kin[:, None] & (dv[None, :] < DV), other=0.0)
        if F32:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
        m_i = m_new

    base = ((q_start + row).to(tl.int64) * heads + qh) * NUM_SPLITS + split
    tl.store(ws_m + base, m_i, mask=rmask)
    tl.store(ws_l + base, l_i, mask=rmask)
    tl.store(ws_o + base[:, None] * DV + dv[None, :], acc * v_scale,
             mask=rmask[:, None] & (dv[None, :] < DV))


def _scale_pair(cache: torch.Tensor, scale, name: str) -> float | torch.Tensor:
    if is_fp8(cache.dtype):
        if scale is None:
            raise InvalidArgumentError(f"a {cache.dtype} cache needs its per-tensor scale ({name})")
        return scale
    if scale is not None:
        raise InvalidArgumentError(f"a scale was given for a {cache.dtype} cache, which has none")
    return 1.0


def host_extents(query_start_loc, seq_lens, block_table, rows, block_size, mask: Mask):
    """Validate the batch on the host (as the reference does) and return (max q_len, max seq_len)."""
    max_q, max_s = 0, 0
    for s in sequences(query_start_loc, seq_lens, block_table, rows, block_size):
        if not mask.causal and mask.draft_block is not None and s.q_len % mask.draft_block:
            raise InvalidArgumentError(
                f"non-causal draft blocks of {mask.draft_block} need a query length that is a "
                f"multiple of it, got {s.q_len}"
            )
        max_q, max_s = max(max_q, s.q_len), max(max_s, s.seq_len)
    return max_q, max_s


_PLANS: dict[tuple, DecodePlan] = {}
_MAX_PLANS = 256  # (one per batch size and shape an engine runs eagerly; cleared when full)


def _plan_key(q, k_cache, v_cache, query_start_loc, seq_lens, block_table, mask, scale,
              soft_cap, sinks, k_scale, v_scale, out_dtype, max_query_len, max_seq_len,
              options) -> tuple:
    """Everything a decode call's validation and launch depend on, values of tensors aside:
    equal keys may share one checked ``DecodePlan``."""
    return (
        q.shape, q.stride(), q.dtype, q.device, k_cache.shape, k_cache.stride(), k_cache.dtype,
        k_cache.device, v_cache.shape, v_cache.stride(), v_cache.dtype, v_cache.device,
        (k_cache.data_ptr() | v_cache.data_ptr()) & 3, query_start_loc.shape, query_start_loc.dtype,
        query_start_loc.device, seq_lens.shape, seq_lens.dtype, seq_lens.device,
        block_table.stride(), block_table.dtype, block_table.device, mask, scale, soft_cap,
        None if sinks is None else (sinks.shape, sinks.dtype, sinks.device),
        _scale_key(k_scale), _scale_key(v_scale), out_dtype, max_query_len,
        seq_len_key(max_seq_len), interpreting(), options,
    )


def _scale_key(s):
    return (s.shape, s.dtype, s.device) if isinstance(s, torch.Tensor) else s


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    mask: Mask = CAUSAL,
    scale: float | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float32,
    out_dtype: torch.dtype | None = None,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    maxnreg: int | None = None,
    swap: bool | None = None,
    fused: bool | None = None,
    heads_first: bool | None = None,
    block_m: int | None = None,
    page_tiles: bool | None = None,
    widen: bool | None = None,
    gluon: bool | None = None,
) -> torch.Tensor:
    """Attention output [T, Hq, Dv]; see ``pagedkv.ops.paged_attention``.

    Batches whose sequences have at most ``DECODE_ROWS`` (query row, query head) pairs per
    KV head run the decode kernel (``decode.py``); others the general kernel below.
    ``max_query_len`` / ``max_seq_len`` bound the batch; given both, the call makes no host
    read and no host sync (an engine's decode step, CUDA-graph capture): the batch is then
    not validated, and keys behind block ids outside the cache are skipped but not reported.
    Such decode calls keep their launch plan (``DecodePlan``), keyed by every shape, dtype,
    stride, device and option it depends on: a later call with the same key skips the
    argument checks and launch decisions and launches through the compiled kernel's launcher
    (``pagedkv.launch``), so its host time is a fraction of the first's.
    ``splits``, ``block_n``, ``num_warps`` and ``num_stages`` override the launch
    configuration, ``maxnreg`` caps registers per thread on the decode path, ``swap`` (keys
    on the MMA's M side) and ``fused`` (the last split merges, no combine launch) pick decode
    kernel variants, ``heads_first`` the grid order, ``block_m`` the decode tile's rows
    (several row tiles per KV head when smaller than the pairs; benchmarks/attention.py sweeps
    them), ``page_tiles`` one block id per page instead of per key, ``widen`` fp8 tiles
    widened to fp16 in registers before shared memory, ``gluon`` the Gluon fp8 kernel
    (``decode_gluon.py``) where it applies.
    """
    del compute_dtype  # the kernel accumulates in float32
    options = (splits, block_n, num_warps, num_stages, maxnreg, swap, fused, heads_first,
               block_m, page_tiles, widen, gluon)
    key = None
    if max_query_len is not None and max_seq_len is not None:  # an engine's step: plans kept
        key = _plan_key(q, k_cache, v_cache, query_start_loc, seq_lens, block_table, mask, scale,
                        soft_cap, sinks, k_scale, v_scale, out_dtype, max_query_len, max_seq_len,
                        options)
        plan = _PLANS.get(key)
        if plan is not None:  # these arguments' shapes passed every check below before
            out = torch.empty(q.shape[0], q.shape[1], v_cache.shape[-1],
                              dtype=out_dtype or q.dtype, device=q.device)
            plan(q if q.stride(-1) == 1 else q.contiguous(), k_cache, v_cache, query_start_loc,
                 seq_lens, block_table if block_table.stride(-1) == 1 else block_table.contiguous(),
                 out, None, sinks, 1.0 if k_scale is None else k_scale,
                 1.0 if v_scale is None else v_scale)
            return out
    check_attention_args(q, k_cache, v_cache, soft_cap, sinks)
    check_device(q, k_cache, v_cache, query_start_loc, seq_lens, block_table, sinks)
    check_index_tensors(query_start_loc, seq_lens, block_table)
    ks = _scale_pair(k_cache, k_scale, "k_scale")
    vs = _scale_pair(v_cache, v_scale, "v_scale")
    for cache in (k_cache, v_cache):
        if cache.stride(-1) != 1:
            raise InvalidArgumentError("cache entries must be contiguous in their last dim")
    rows, heads, dim = q.shape
    num_blocks, block_size, kv_heads, _ = k_cache.shape
    dv = v_cache.shape[-1]
    group = heads // kv_heads
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    check = max_query_len is None or max_seq_len is None
    if check:
        if capturing():
            raise InvalidArgumentError("inside CUDA-graph capture pass max_query_len and max_seq_len")
        max_q, max_s = host_extents(query_start_loc, seq_lens, block_table, rows, block_size, mask)
        max_query_len = max_q if max_query_len is None else max_query_len
        max_seq_len = max_s if max_seq_len is None else max_seq_len
    out = torch.empty(rows, heads, dv, dtype=out_dtype or q.dtype, device=q.device)
    batch = seq_lens.shape[0]
    f32 = interpreting() or q.dtype == torch.float32
    if not f32 and q.dtype not in (torch.bfloat16, torch.float16):
        raise InvalidArgumentError(f"queries must be bf16, fp16 or fp32, got {q.dtype}")
    qc = q if q.stride(-1) == 1 else q.contiguous()
    table = block_table if block_table.stride(-1) == 1 else block_table.contiguous()
    # the host reads the bad-block flag back only when it validates the batch anyway
    flag = torch.zeros(2, dtype=torch.int32, device=q.device) if check else None
    if max(1, max_query_len) * group <= DECODE_ROWS:
        plan = decode_plan(qc, k_cache, v_cache, query_start_loc, seq_lens, table, out, flag,
                           mask=mask, scale=scale, soft_cap=soft_cap, sinks=sinks, k_scale=ks,
                           v_scale=vs, max_query_len=max_query_len, max_seq_len=max_seq_len,
                           f32=f32, splits=splits, block_n=block_n, num_warps=num_warps,
                           num_stages=num_stages, maxnreg=maxnreg, swap=swap, fused=fused,
                           heads_first=heads_first, block_m=block_m, page_tiles=page_tiles,
                           widen=widen, gluon=gluon)
        if key is not None and plan.cacheable:
            if len(_PLANS) >= _MAX_PLANS:
                _PLANS.clear()
            _PLANS[key] = plan
        plan(qc, k_cache, v_cache, query_start_loc, seq_lens, table, out, flag, sinks, ks, vs)
        if check:
            raise_on_bad_block(flag, num_blocks)
        return out
    block_m = min(64, max(16, next_pow2(max(1, max_query_len) * group)))
    tiles = max(1, -(-max(1, max_query_len) * group // block_m))
    if block_n is None:
        block_n = 64 if interpreting() else (128 if block_m <= 32 else 32)
    if splits is None:
        splits = num_splits(batch * tiles * kv_heads, max_seq_len, 256, waves=12)
    ws = workspace(rows, heads, splits, dv, q.device)
    scales = scale_vector((ks, vs), q.device)
    if batch and rows:
        _paged_attention_fwd[(batch * tiles, kv_heads, splits)](
            qc, k_cache, v_cache, query_start_loc, seq_lens, table, *ws, scales,
            flag if check else seq_lens,
            qc.stride(0), qc.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), table.stride(0),
            num_blocks, block_size, heads, group, dim, dv, scale, soft_cap or 1.0,
            mask.window or 0, mask.chunk or 0, mask.draft_block or 0,
            TILES=tiles, NUM_SPLITS=splits, BLOCK_M=block_m, BLOCK_N=block_n,
            BLOCK_D=max(16, next_pow2(dim)), BLOCK_DV=max(16, next_pow2(dv)),
            CAUSAL=mask.causal, HAS_DRAFT=mask.draft_block is not None,
            HAS_WINDOW=mask.window is not None, HAS_CHUNK=mask.chunk is not None,
            HAS_CAP=soft_cap is not None, CHECK=check, F32=f32, num_warps=num_warps or 4,
            num_stages=num_stages or 2,
        )
    combine(ws, out, query_start_loc, sinks)
    if check:
        raise_on_bad_block(flag, num_blocks)
    return out
