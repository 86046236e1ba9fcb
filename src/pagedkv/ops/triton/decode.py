"""Paged GQA/MHA decode in Triton: rows of short queries (decode, draft and verify blocks).

Used by ``pagedkv.ops.triton.attention.paged_attention`` when every sequence's query rows
times the query heads of one KV head fit one tile (q_len x group <= 64). A program owns one
sequence, one KV head and one split of its keys; all of that sequence's query rows and the
query heads sharing the KV head are folded into the tile's rows, so every K/V entry is read
once per call. Compared with the general kernel it is specialised where decode spends its
time: block size, GQA group and head-dim padding are compile-time constants (shifts, no
masks along the head dim), scales arrive as plain floats when they are floats, the
bad-block flag is written only when the host reads it back, and fp8 K/V tiles are converted once
to fp16 in registers (exact for e4m3/e5m2) so only half the bytes are loaded. With one
split the kernel normalises and writes the output itself (no workspace, no combine).

K/V addresses are built per page: one block id per page of the tile, or per tile when the
page holds it (``page_tiles``, the default for 16-bit and float32 caches). Variants behind
launch overrides, measured on the H200 and left off by default (docs/kernels-log.md): ``swap``
(keys on the MMA's M side, wgmma), ``gluon`` (fp8 caches on Hopper through
``decode_gluon.py``), ``fused`` (the split that
finishes last merges the partial states through an arrival counter, no combine launch),
``heads_first`` (grid order), ``block_m`` smaller than the (row, head) pairs (row tiles),
``widen`` (fp8 tiles loaded as 32-bit words and widened to fp16 before shared memory).

Host side: ``decode_plan`` makes every launch decision from shapes, dtypes, strides and
options into a ``DecodePlan``, which ``attention.paged_attention`` keeps per key so an eager
call of a known shape costs an output allocation and a direct launch (``pagedkv.launch``).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pagedkv.launch import Launch
from pagedkv.ops.fp8 import is_fp8
from pagedkv.ops.triton.combine import combine_launch, workspace
from pagedkv.ops.triton.common import capturing, interpreting, next_pow2, scale_vector
from pagedkv.ops.triton.rows import row_extents, soft_cap_scores


@triton.jit
def _load_v(v_ptrs, kin, dv, dt, DV: tl.constexpr, BLOCK_DV: tl.constexpr, F32: tl.constexpr,
            FP8: tl.constexpr):
    """One V tile [BLOCK_N, BLOCK_DV] in the dot's dtype (fp8 widened to fp16, exact)."""
    if BLOCK_DV == DV:
        v = tl.load(v_ptrs, mask=kin[:, None], other=0.0)
    else:
        v = tl.load(v_ptrs, mask=kin[:, None] & (dv[None, :] < DV), other=0.0)
    if F32:
        v = v.to(tl.float32)
    elif FP8:
        v = v.to(tl.float16)
    else:
        v = v.to(dt)
    return v


@triton.jit
def _page_offsets(t_base, flag_ptr, n0, kin, kv_lo, s_hi, num_blocks, stride_kb, stride_kt,
                  stride_vb, stride_vt, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                  CHECK: tl.constexpr, OFF_ALIGN: tl.constexpr):
    """K and V element offsets of the tile's keys [BLOCK_N] from one block id per page (one
    per tile when the page holds the tile): the table loads, bounds checks and 64-bit
    multiplications happen per page, not per key. Pages without a key in [kv_lo, s_hi) are
    not looked up; keys behind an out-of-cache block id are dropped from ``kin``."""
    if PAGE >= BLOCK_N:  # tiles start BLOCK_N-aligned: the tile lies in one page
        pid = tl.load(t_base + n0 // PAGE)
        bad = (pid < 0) | (pid >= num_blocks)
        if CHECK:
            tl.store(flag_ptr, 1, mask=bad)
            tl.store(flag_ptr + 1, pid, mask=bad)
        kin = kin & ~bad
        pid = tl.where(bad, 0, pid).to(tl.int64)
        slot = (n0 % PAGE) + tl.arange(0, BLOCK_N)
        koff = pid * stride_kb + slot * stride_kt
        voff = pid * stride_vb + slot * stride_vt
    else:
        NP: tl.constexpr = BLOCK_N // PAGE
        pidx = n0 // PAGE + tl.arange(0, NP)
        pin = (pidx * PAGE < s_hi) & (pidx * PAGE + PAGE > kv_lo)
        pid = tl.load(t_base + pidx, mask=pin, other=0)
        bad = pin & ((pid < 0) | (pid >= num_blocks))
        if CHECK:
            tl.store(flag_ptr + pidx * 0, 1, mask=bad)
            tl.store(flag_ptr + 1 + pidx * 0, pid, mask=bad)
        kin = kin & ~tl.reshape(tl.broadcast_to(bad[:, None], [NP, PAGE]), [BLOCK_N])
        pid = tl.where(bad, 0, pid).to(tl.int64)
        slot = tl.arange(0, PAGE)
        koff = tl.reshape((pid * stride_kb)[:, None] + (slot * stride_kt)[None, :], [BLOCK_N])
        voff = tl.reshape((pid * stride_vb)[:, None] + (slot * stride_vt)[None, :], [BLOCK_N])
        # the reshape hides the offsets' alignment (OFF_ALIGN divides every page/slot stride)
        koff = tl.multiple_of(koff, OFF_ALIGN)
        voff = tl.multiple_of(voff, OFF_ALIGN)
    return koff, voff, kin


@triton.jit
def _load_fp8_wide(base, off, kin, E5M2: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr):
    """An fp8 tile [BLOCK_N, BLOCK_D] loaded as 32-bit words (four values each) and widened to
    fp16 (exact) in registers, so shared memory holds whole words and then a 16-bit tile the
    dot reads with ldmatrix. ``off``: element offsets of the keys, multiples of 4."""
    w = tl.arange(0, BLOCK_D // 4)
    ptrs = base.to(tl.pointer_type(tl.int32)) + (off // 4)[:, None] + w[None, :]
    x = tl.load(ptrs, mask=kin[:, None], other=0)
    if E5M2:
        cvt: tl.constexpr = "cvt.rn.f16x2.e5m2x2"
    else:
        cvt: tl.constexpr = "cvt.rn.f16x2.e4m3x2"
    o0, o1, o2, o3 = tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; .reg .b32 a, b; mov.b32 {lo, hi}, $4; " + cvt + " a, lo; "
        + cvt + " b, hi; mov.b32 {$0, $1}, a; mov.b32 {$2, $3}, b; }",
        "=h,=h,=h,=h,r", [x], dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
        is_pure=True, pack=1)
    t = tl.join(tl.join(o0, o1), tl.join(o2, o3))  # [N, D/4, i, j]: value 2 j + i
    return tl.reshape(tl.permute(t, (0, 1, 3, 2)), [BLOCK_N, BLOCK_D])


@triton.jit
def _merge_splits(ws_o, ws_m, ws_l, out_ptr, sinks_ptr, q_start, row, qh, rmask,
                  stride_ot, stride_oh, heads, num_splits, DV: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_SINKS: tl.constexpr):
    """The last split of a (sequence, KV head) to finish merges every split's (m, l, o),
    32 output columns at a time (a whole [rows, DV] float32 tile of pointers and values would
    raise the kernel's register count, its main loop's included)."""
    CH: tl.constexpr = 32 if BLOCK_DV >= 32 else BLOCK_DV
    rbase = ((q_start + row).to(tl.int64) * heads + qh) * num_splits
    mx = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    denom = tl.zeros([BLOCK_M], dtype=tl.float32)
    for sp in tl.range(0, num_splits, num_stages=1):
        m = tl.load(ws_m + rbase + sp, mask=rmask, other=float("-inf"), cache_modifier=".cg")
        ls = tl.load(ws_l + rbase + sp, mask=rmask, other=0.0, cache_modifier=".cg")
        m_top = tl.maximum(mx, m)
        m_use = tl.where(m_top == float("-inf"), 0.0, m_top)
        denom = denom * tl.exp2(mx - m_use) + ls * tl.exp2(m - m_use)
        mx = m_top
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + qh, mask=rmask, other=0.0).to(tl.float32) * 1.4426950408889634
        seen = denom > 0
        m_top = tl.maximum(mx, sink)
        m_use = tl.where(m_top == float("-inf"), 0.0, m_top)
        denom = denom * tl.exp2(tl.where(mx == float("-inf"), m_use, mx) - m_use) \
            + tl.exp2(sink - m_use)
        mx = m_top
    else:
        seen = denom > 0
    m_use = tl.where(mx == float("-inf"), 0.0, mx)
    inv = tl.where(seen, 1.0 / tl.where(denom > 0, denom, 1.0), 0.0)
    obase = out_ptr + (q_start + row).to(tl.int64) * stride_ot + qh * stride_oh
    for c0 in tl.static_range(0, BLOCK_DV, CH):
        c = c0 + tl.arange(0, CH)
        cmask = rmask[:, None] & (c[None, :] < DV)
        o = tl.zeros([BLOCK_M, CH], dtype=tl.float32)
        for sp in tl.range(0, num_splits, num_stages=1):
            w = tl.exp2(tl.load(ws_m + rbase + sp, mask=rmask, other=float("-inf"),
                                cache_modifier=".cg") - m_use)
            o += tl.load(ws_o + (rbase + sp)[:, None] * DV + c[None, :], mask=cmask, other=0.0,
                         cache_modifier=".cg") * w[:, None]
        tl.store(obase[:, None] + c[None, :], (o * inv[:, None]).to(out_ptr.dtype.element_ty),
                 mask=cmask)


@triton.jit(do_not_specialize=["num_blocks", "batch", "rows", "num_splits"])
def _paged_decode_fwd(
    q_ptr, k_ptr, v_ptr, qsl_ptr, lens_ptr, table_ptr, out_ptr, ws_o, ws_m, ws_l,
    scales_ptr, sinks_ptr, flag_ptr, count_ptr,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_tb, stride_ot, stride_oh, num_blocks, batch, rows, heads, scale, k_scale_f,
    v_scale_f, cap, window, chunk, draft, num_splits,
    GROUP: tl.constexpr, PAGE: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    DIRECT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_DRAFT: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_CHUNK: tl.constexpr,
    HAS_CAP: tl.constexpr, HAS_SINKS: tl.constexpr, SCALES_IN_MEMORY: tl.constexpr,
    CHECK: tl.constexpr, F32: tl.constexpr, FP8: tl.constexpr, SWAP: tl.constexpr,
    FUSED: tl.constexpr, HEADS_FIRST: tl.constexpr, ROW_TILES: tl.constexpr,
    PAGE_TILES: tl.constexpr, OFF_ALIGN: tl.constexpr, WIDEN: tl.constexpr,
):
    # one grid dimension holds the (KV head, row tile) pairs; heads-first makes it the fastest
    # one, so the KV heads and row tiles of one (sequence, split) are neighbouring programs
    # (a second row tile then reads its K/V tiles mostly from L2)
    if HEADS_FIRST:
        hr = tl.program_id(0)
        b = tl.program_id(1)
        kv_heads = tl.num_programs(0) // ROW_TILES
    else:
        b = tl.program_id(0)
        hr = tl.program_id(1)
        kv_heads = tl.num_programs(1) // ROW_TILES
    kvh = hr // ROW_TILES
    rt = hr % ROW_TILES
    split = tl.program_id(2)
    dv = tl.arange(0, BLOCK_DV)
    if b == batch:  # direct or fused output: zero the padding rows past the batch's last row
        total = tl.load(qsl_ptr + batch)
        hh = rt * BLOCK_M + tl.arange(0, BLOCK_M)  # query heads of this KV head, per row tile
        hmask = (hh < GROUP)[:, None] & (dv < DV)[None, :]
        zeros = tl.zeros([BLOCK_M, BLOCK_DV], dtype=out_ptr.dtype.element_ty)
        for i in range(0, tl.where(split == 0, rows - total, 0)):
            tl.store(out_ptr + (total + i).to(tl.int64) * stride_ot + (kvh * GROUP + hh)[:, None] * stride_oh
                     + dv[None, :], zeros, mask=hmask)
        return
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    if q_len <= 0:
        return
    seq_len = tl.load(lens_ptr + b)
    m = rt * BLOCK_M + tl.arange(0, BLOCK_M)
    row = m // GROUP
    qh = kvh * GROUP + m % GROUP
    lo, hi = row_extents(row, q_len, seq_len, window, chunk, draft,
                         CAUSAL, HAS_DRAFT, HAS_WINDOW, HAS_CHUNK)
    kv_lo = tl.min(lo, 0)
    kv_hi = tl.max(hi, 0)
    # this split's keys: [kv_lo, kv_hi) cut into num_splits BLOCK_N-aligned pieces
    start = (tl.minimum(kv_lo, kv_hi) // BLOCK_N) * BLOCK_N
    per = tl.cdiv(tl.cdiv(tl.maximum(kv_hi - start, 0), num_splits), BLOCK_N) * BLOCK_N
    s_lo = start + split * per
    s_hi = tl.minimum(s_lo + per, kv_hi)

    d = tl.arange(0, BLOCK_D)
    rmask = row < q_len
    if SWAP:  # queries transposed [BLOCK_D, BLOCK_M]: keys go on the MMA's M side
        q = tl.load(q_ptr + (q_start + row)[None, :].to(tl.int64) * stride_qt
                    + qh[None, :] * stride_qh + d[:, None],
                    mask=rmask[None, :] & (d[:, None] < D), other=0.0)
    else:
        q = tl.load(q_ptr + (q_start + row)[:, None].to(tl.int64) * stride_qt
                    + qh[:, None] * stride_qh + d[None, :],
                    mask=rmask[:, None] & (d[None, :] < D), other=0.0)
    if SCALES_IN_MEMORY:
        k_scale = tl.load(scales_ptr)
        v_scale = tl.load(scales_ptr + 1)
    else:
        k_scale = k_scale_f
        v_scale = v_scale_f
    qk_scale = scale * k_scale * 1.4426950408889634  # log2 domain
    if HAS_CAP:
        qk_scale = scale * k_scale
    if F32:
        q = q.to(tl.float32)
    elif FP8:  # e4m3/e5m2 -> fp16 is exact; the query is clamped into fp16's range
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)

    k_base = k_ptr + kvh * stride_kh
    v_base = v_ptr + kvh * stride_vh
    t_base = table_ptr + b.to(tl.int64) * stride_tb
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if SWAP:
        acc = tl.zeros([BLOCK_DV, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    for n0 in range(s_lo, s_hi, BLOCK_N):
        keys = n0 + tl.arange(0, BLOCK_N)
        kin = (keys < s_hi) & (keys >= kv_lo)
        if PAGE_TILES:  # block ids per page, not per key: address arithmetic per page
            koff, voff, kin = _page_offsets(t_base, flag_ptr, n0, kin, kv_lo, s_hi, num_blocks,
                                            stride_kb, stride_kt, stride_vb, stride_vt,
                                            PAGE, BLOCK_N, CHECK, OFF_ALIGN)
        else:
            page = tl.load(t_base + keys // PAGE, mask=kin, other=0)
            bad = kin & ((page < 0) | (page >= num_blocks))  # never read outside the cache
            if CHECK:
                tl.store(flag_ptr + keys * 0, 1, mask=bad)
                tl.store(flag_ptr + 1 + keys * 0, page, mask=bad)
            kin = kin & ~bad
            page = tl.where(kin, page, 0)
            page = page.to(tl.int64)
            slot = keys % PAGE
            koff = page * stride_kb + slot * stride_kt
            voff = page * stride_vb + slot * stride_vt
        if WIDEN:  # fp8 as 32-bit words, widened to fp16 in registers
            k = _load_fp8_wide(k_base, koff, kin, k_ptr.dtype.element_ty == tl.float8e5, BLOCK_N,
                               BLOCK_D)
        elif BLOCK_D == D and PAGE_TILES:  # in-cache addresses (page 0 for unused keys): no
            k = tl.load(k_base + koff[:, None] + d[None, :])  # mask; their scores are masked
        elif BLOCK_D == D:  # no mask along the head dim: the loads stay 16-byte vectors
            k = tl.load(k_base + koff[:, None] + d[None, :], mask=kin[:, None], other=0.0)
        else:
            k = tl.load(k_base + koff[:, None] + d[None, :], mask=kin[:, None] & (d[None, :] < D),
                        other=0.0)
        if F32:
            k = k.to(tl.float32)
        elif FP8 or WIDEN:
            k = k.to(tl.float16)
        else:
            k = k.to(q.dtype)
        if SWAP:  # s^T = k q^T: [BLOCK_N, BLOCK_M]
            if F32:
                s = tl.dot(k, q, input_precision="ieee")
            else:
                s = tl.dot(k, q)
        else:
            if F32:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
        s = s * qk_scale
        if HAS_CAP:
            s = soft_cap_scores(s, cap) * 1.4426950408889634
        if SWAP:
            seen = (keys[:, None] >= lo[None, :]) & (keys[:, None] < hi[None, :]) & kin[:, None]
            s = tl.where(seen, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 0))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_use[None, :])
            alpha = tl.exp2(m_i - m_use)
            l_i = l_i * alpha + tl.sum(p, 0)
            v = _load_v(v_base + voff[:, None] + dv[None, :], kin, dv,
                        q.dtype, DV, BLOCK_DV, F32, FP8)
            if F32:  # o^T = v^T p^T: [BLOCK_DV, BLOCK_M]
                pv = tl.dot(tl.trans(v), p, input_precision="ieee")
            else:
                pv = tl.dot(tl.trans(v), p.to(v.dtype))
            acc = acc * alpha[None, :] + pv
        else:
            seen = (keys[None, :] >= lo[:, None]) & (keys[None, :] < hi[:, None]) & kin[None, :]
            s = tl.where(seen, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_use[:, None])
            alpha = tl.exp2(m_i - m_use)
            l_i = l_i * alpha + tl.sum(p, 1)
            if WIDEN:
                v = _load_fp8_wide(v_base, voff, kin, v_ptr.dtype.element_ty == tl.float8e5, BLOCK_N,
                                   BLOCK_DV)
            else:
                v = _load_v(v_base + voff[:, None] + dv[None, :], kin, dv,
                            q.dtype, DV, BLOCK_DV, F32, FP8)
            if F32:
                pv = tl.dot(p, v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
        m_i = m_new

    if SWAP:
        acc = tl.trans(acc)
    if DIRECT:  # one split: normalise here
        denom = l_i
        o_scale = v_scale
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + qh, mask=rmask, other=0.0).to(tl.float32) * 1.4426950408889634
            m_use = tl.where(m_i == float("-inf"), 0.0, m_i)
            m_top = tl.maximum(m_use, sink)
            keep = tl.exp2(m_use - m_top)
            denom = l_i * keep + tl.exp2(sink - m_top)
            o_scale = v_scale * keep
        o = tl.where((l_i > 0)[:, None],
                     acc * (o_scale / tl.where(denom > 0, denom, 1.0))[:, None], 0.0)
        tl.store(out_ptr + (q_start + row).to(tl.int64)[:, None] * stride_ot
                 + qh[:, None] * stride_oh + dv[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=rmask[:, None] & (dv[None, :] < DV))
    else:
        base = ((q_start + row).to(tl.int64) * heads + qh) * num_splits + split
        tl.store(ws_m + base, m_i, mask=rmask)
        tl.store(ws_l + base, l_i, mask=rmask)
        tl.store(ws_o + base[:, None] * DV + dv[None, :], acc * v_scale,
                 mask=rmask[:, None] & (dv[None, :] < DV))
        if FUSED:  # no combine launch: the split that finishes last merges (counter per pair)
            tl.debug_barrier()  # every thread's partial stores precede the release below
            counter = count_ptr + (b * kv_heads + kvh) * ROW_TILES + rt
            ticket = tl.atomic_add(counter, 1, sem="acq_rel")
            if ticket == num_splits - 1:
                tl.atomic_xchg(counter, 0)  # zero again for the next launch
                _merge_splits(ws_o, ws_m, ws_l, out_ptr, sinks_ptr, q_start, row, qh, rmask,
                              stride_ot, stride_oh, heads, num_splits, DV, BLOCK_M,
                              BLOCK_DV, HAS_SINKS)


DECODE_ROWS = 64  # at most this many (query row, query head) pairs per KV head take this path

# Launch defaults from the sweep in benchmarks/attention.py on the H200 (docs/kernels-log.md):
# (block_n, num_warps, num_stages). 4 warps, 64 keys per tile and a one-tile-ahead
# prefetch keep a bf16 program at 128 registers (4 programs per SM); fp8 tiles hold twice
# the keys for the same bytes.
BF16_CONFIG = (64, 4, 2)
FP8_CONFIG = (128, 4, 3)
F32_CONFIG = (32, 4, 2)  # float32 queries: the tests' exact path
Q7_MAXNREG = 128  # bf16 tiles of 32 rows (7-token draft blocks): 0.90x the time uncapped
SWAP_Q1 = False  # keys on the MMA's M side for <= 16-row tiles (decode)
SWAP_Q7 = False  # ... for 32-row tiles (7-token blocks at group 4)
FUSED_COMBINE = False  # the last split merges the partials: slower on the H200 (docs)
HEADS_FIRST = False  # KV heads of the same pages in neighbouring programs: no gain measured (docs)
# block ids per page (per tile when the page holds it), not per key, for 16-bit and float32
# caches: 2-3.5% faster on the H200's q1 shapes, 13% on 7-token blocks (docs/kernels-log.md,
# 00:58-01:07 UTC runs); fp8 caches keep per-key ids (page tiles measured 30% slower there)
PAGE_TILES = True
PAGE_TILES_MAXNREG = 128  # bf16 page tiles: 115 (p16) / 146 (p64) registers uncapped, no spill at 128
WIDEN_FP8 = False  # fp8 tiles as 32-bit words widened before shared memory: within 1% (docs)
# the Gluon fp8 kernel (decode_gluon.py, both products on e4m3 tensor cores) for the fp8
# calls it takes (``decode_gluon.supported``: up to 32 (row, head) pairs per KV head): on the
# H200 at B64 p16 (docs/kernels-log.md) 1.52-1.55x the Triton fp8 kernel's speed at q_len 1
# (17:11 UTC), 1.30-1.31x on 3- and 4-token non-causal blocks (18:08 UTC), 1.27-1.29x on
# 7-token ones (18:00 UTC); causal blocks and 2, 5, 6 or 8 tokens not timed
GLUON_FP8 = True
PROGRAMS_PER_SM = 4
MIN_SPLIT_KEYS = 512
ONE_SPLIT_FILL = 0.9  # one split once the unsplit programs fill this much of a wave (one_wave)


@functools.lru_cache(maxsize=8)
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def decode_splits(programs: int, max_seq_len: int, device, one_wave: bool = False) -> int:
    """KV splits per (sequence, KV head): about ``PROGRAMS_PER_SM`` programs per multiprocessor
    and at least two splits, each split at least ``MIN_SPLIT_KEYS`` keys, at most 64. With
    ``one_wave`` (16-row bf16/fp16 page-tile programs), one split (direct output, no combine)
    once the unsplit programs fill ``ONE_SPLIT_FILL`` of a wave: on the H200 it was as fast or
    faster on every q1 shape of the benchmark (docs/kernels-log.md, 01:07 UTC run)."""
    if interpreting():
        return min(2, max(1, -(-max_seq_len // 64)))  # exercise the combine, stay fast
    sms = _multiprocessors(device.index if device.index is not None else torch.cuda.current_device())
    if one_wave and programs >= ONE_SPLIT_FILL * PROGRAMS_PER_SM * sms:
        return 1
    want = max(2, -(-PROGRAMS_PER_SM * sms // max(1, programs)))
    most = max(1, max_seq_len // MIN_SPLIT_KEYS)
    return max(1, min(want, most, 64))


_COUNTERS: dict[tuple, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []  # outgrown counter buffers stay alive: a captured graph may use one


def split_counters(pairs: int, device) -> torch.Tensor | None:
    """Zeroed int32 arrival counters, one per (sequence, KV head), for the fused combine; each
    launch leaves them zero again. One buffer per device and stream (kernels on two streams
    never share counters). None inside CUDA-graph capture when the buffer would have to grow
    (an allocation made during capture belongs to the graph's pool): the caller then combines
    in a second launch."""
    stream = 0 if device.type != "cuda" else torch.cuda.current_stream(device).cuda_stream
    key = (device.type, device.index, stream)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < pairs:
        if capturing():
            return None
        if buf is not None:
            _RETIRED.append(buf)
        buf = torch.zeros(max(pairs, 4096), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf


def _offset_align(k_cache, v_cache) -> int:
    """The largest power of two up to 16 dividing every page and slot stride of K and V."""
    align = 16
    for st in (k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1)):
        while align > 1 and st % align:
            align //= 2
    return align


def _word_aligned(k_cache, v_cache, dim, dv) -> bool:
    """fp8 tiles can be loaded as 32-bit words: power-of-two head dims (no column mask) and
    every entry 4-byte aligned."""
    pow2 = dim == max(16, next_pow2(dim)) and dv == max(16, next_pow2(dv))
    strides = [c.stride(i) for c in (k_cache, v_cache) for i in range(3)]
    ptrs = [k_cache.data_ptr(), v_cache.data_ptr()]
    return pow2 and all(x % 4 == 0 for x in strides) and all(x % 4 == 0 for x in ptrs)


def register_cap(block_m: int, block_d: int, block_dv: int, page_tiles: bool) -> int | None:
    """The register cap of a 16-bit decode program (None: the compiler's choice), only on
    the tiles it was measured on: head dims up to 128 and up to 32 rows, where 128 registers
    keep 4 programs per SM without spills (``Q7_MAXNREG`` for 32-row tiles: 164 -> 128;
    ``PAGE_TILES_MAXNREG`` for page tiles). Larger tiles get what they need: a 64-row tile
    over head dim 256 holds a [64, 256] float32 accumulator, which ptxas cannot place under
    128 registers at all (found by fuzz/gpu_gqa.py), and at 32 rows it spills under the cap."""
    if block_m > 32 or block_d > 128 or block_dv > 128:
        return None
    if block_m == 32:
        return Q7_MAXNREG
    return PAGE_TILES_MAXNREG if page_tiles else None


def launch_config(fp8: bool, f32: bool) -> tuple[int, int, int]:
    if interpreting():
        return (32, 4, 2)
    return F32_CONFIG if f32 else (FP8_CONFIG if fp8 else BF16_CONFIG)


def seq_len_key(max_seq_len: int) -> tuple[int, bool]:
    """What ``decode_splits`` reads of ``max_seq_len``: a plan made for one value serves every
    value with the same key (an engine's growing lengths do not miss the plan cache)."""
    return min(64, max(1, max_seq_len // MIN_SPLIT_KEYS)), max_seq_len > 64


class DecodePlan:
    """One decode call's launch, decided from shapes, dtypes, strides, the mask, scalar
    options and ``seq_len_key(max_seq_len)`` alone (``decode_plan``): reusable for every call
    that agrees on those. ``cacheable`` is False for the fused combine (its counters depend
    on the stream and on capture at call time)."""

    __slots__ = ("kernel", "ws_shape", "combine", "in_memory", "counters", "cacheable", "empty")

    def __init__(self, kernel, ws_shape, combine_, in_memory, counters, cacheable, empty=False):
        self.kernel, self.ws_shape, self.combine = kernel, ws_shape, combine_
        self.in_memory, self.counters, self.cacheable, self.empty = (
            in_memory, counters, cacheable, empty)

    def __call__(self, q, k_cache, v_cache, query_start_loc, seq_lens, table, out, flag, sinks,
                 k_scale, v_scale) -> None:
        if self.empty:
            out.zero_()
            return
        fill = seq_lens  # any tensor, for pointer arguments the variant does not read
        scales = scale_vector((k_scale, v_scale), q.device) if self.in_memory else fill
        ws = (out, out, out) if self.ws_shape is None else workspace(*self.ws_shape, q.device,
                                                                      reuse=True)
        self.kernel(q, k_cache, v_cache, query_start_loc, seq_lens, table, out, *ws, scales,
                    fill if sinks is None else sinks, fill if flag is None else flag,
                    fill if self.counters is None else self.counters)
        if self.combine is not None:
            self.combine(*ws, out, query_start_loc, ws[1] if sinks is None else sinks)


def decode_plan(q, k_cache, v_cache, query_start_loc, seq_lens, table, out, flag, *, mask,
                scale, soft_cap, sinks, k_scale, v_scale, max_query_len, max_seq_len, f32,
                splits=None, block_n=None, num_warps=None, num_stages=None,
                maxnreg=None, swap=None, fused=None, heads_first=None, block_m=None,
                page_tiles=None, widen=None, gluon=None) -> DecodePlan:
    """The decode launch for these arguments (``launch_decode`` says what the options do).
    Tensor values are not read: only shapes, dtypes, strides and K/V's 4-byte alignment."""
    rows, heads, dim = q.shape
    num_blocks, block_size, kv_heads, _ = k_cache.shape
    dv = v_cache.shape[-1]
    group = heads // kv_heads
    batch = seq_lens.shape[0]
    if not (batch and rows):
        return DecodePlan(None, None, None, False, None, True, empty=True)
    fp8 = is_fp8(k_cache.dtype) and is_fp8(v_cache.dtype) and not f32
    if gluon is None:
        gluon = GLUON_FP8
    if fp8 and gluon and not interpreting():
        plan = _gluon_plan(q, k_cache, v_cache, query_start_loc, seq_lens, table, out, flag,
                           mask, scale, soft_cap, sinks, k_scale, v_scale, max_query_len,
                           max_seq_len, splits, num_stages, block_n, maxnreg)
        if plan is not None:
            return plan
    pairs = max(1, max_query_len) * group  # (query row, query head) pairs per KV head
    block_m = max(16, next_pow2(pairs)) if block_m is None else max(16, next_pow2(block_m))
    row_tiles = -(-pairs // block_m)
    cfg = launch_config(fp8, f32)
    block_n, num_warps, num_stages = block_n or cfg[0], num_warps or cfg[1], num_stages or cfg[2]
    if swap is None:
        swap = (SWAP_Q7 if block_m == 32 else SWAP_Q1) and not f32
    if page_tiles is None:
        page_tiles = PAGE_TILES and not fp8
    # (page tiles read K unmasked at page 0 for unused keys: the cache must hold a page)
    page_tiles = page_tiles and num_blocks > 0 and (
        block_size % block_n == 0 or block_n % block_size == 0)
    widen = (WIDEN_FP8 if widen is None else widen) and fp8 and not swap and _word_aligned(
        k_cache, v_cache, dim, dv)
    if splits is None:  # one split: measured for 16-row 16-bit page-tile programs only
        one_wave = page_tiles and block_m == 16 and row_tiles == 1 and not (fp8 or f32 or swap)
        splits = decode_splits(batch * kv_heads, max_seq_len, q.device, one_wave)
    if maxnreg is None and not (fp8 or f32 or swap):
        maxnreg = register_cap(block_m, next_pow2(dim), next_pow2(dv), page_tiles)
    extra = {"maxnreg": maxnreg} if maxnreg and not interpreting() else {}
    in_memory = isinstance(k_scale, torch.Tensor) or isinstance(v_scale, torch.Tensor)
    direct = splits == 1
    fused = not direct and (FUSED_COMBINE if fused is None else fused)
    counters = split_counters(batch * kv_heads * row_tiles, q.device) if fused else None
    ws_shape = None if direct else (rows, heads, splits, dv)
    programs = batch + 1 if direct or counters is not None else batch
    if heads_first is None:  # row tiles of one (sequence, KV head) side by side: L2 reuse
        heads_first = HEADS_FIRST or row_tiles > 1
    heads_first = heads_first and programs < 65536  # grid dims 1 and 2 stop at 65535
    hr = kv_heads * row_tiles
    grid = (hr, programs, splits) if heads_first else (programs, hr, splits)
    kernel = Launch(_paged_decode_fwd, grid, (
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), table.stride(0),
        out.stride(0), out.stride(1), num_blocks, batch, rows, heads, scale,
        1.0 if in_memory else float(k_scale), 1.0 if in_memory else float(v_scale),
        soft_cap or 1.0, mask.window or 0, mask.chunk or 0, mask.draft_block or 0, splits,
    ), dict(
        GROUP=group, PAGE=block_size, D=dim, DV=dv, DIRECT=direct, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_D=max(16, next_pow2(dim)), BLOCK_DV=max(16, next_pow2(dv)),
        CAUSAL=mask.causal, HAS_DRAFT=mask.draft_block is not None,
        HAS_WINDOW=mask.window is not None, HAS_CHUNK=mask.chunk is not None,
        HAS_CAP=soft_cap is not None, HAS_SINKS=sinks is not None, SCALES_IN_MEMORY=in_memory,
        CHECK=flag is not None, F32=f32, FP8=fp8, SWAP=bool(swap), FUSED=counters is not None,
        HEADS_FIRST=heads_first, ROW_TILES=row_tiles, PAGE_TILES=bool(page_tiles),
        OFF_ALIGN=_offset_align(k_cache, v_cache), WIDEN=bool(widen),
        num_warps=num_warps, num_stages=num_stages, **extra,
    ), direct=not fused)
    merge = None
    if not direct and counters is None:
        merge = combine_launch(ws_shape, out, query_start_loc, sinks, direct=not fused)
    return DecodePlan(kernel, ws_shape, merge, in_memory, counters, not fused)


def _gluon_plan(q, k_cache, v_cache, query_start_loc, seq_lens, table, out, flag, mask, scale,
                soft_cap, sinks, k_scale, v_scale, max_query_len, max_seq_len, splits,
                stages, block_n=None, maxnreg=None) -> DecodePlan | None:
    """The Gluon fp8 kernel's plan (workspace + combine), or None where it does not apply
    (``decode_gluon.supported``)."""
    from pagedkv.ops.triton import decode_gluon

    in_memory = isinstance(k_scale, torch.Tensor) or isinstance(v_scale, torch.Tensor)
    if block_n not in (None, decode_gluon.BLOCK_N):  # (one m64 key tile per warpgroup)
        return None
    if decode_gluon.supported(q, k_cache, v_cache, mask, soft_cap, max_query_len, sinks,
                              in_memory) is not None:
        return None
    rows, heads, _ = q.shape
    batch, kv_heads = seq_lens.shape[0], k_cache.shape[2]
    if splits is None:
        splits = decode_splits(batch * kv_heads, max_seq_len, q.device)
    grid, scalars, consts = decode_gluon.plan_args(
        q, k_cache, batch, table, mask, scale, k_scale, v_scale, max_query_len, splits, stages,
        in_memory, flag is not None, block_n=block_n, maxnreg=maxnreg)
    kernel = decode_gluon._GluonLaunch(Launch(decode_gluon._paged_decode_gluon, grid, scalars,
                                              consts, direct=False))
    ws_shape = (rows, heads, splits, v_cache.shape[-1])
    merge = combine_launch(ws_shape, out, query_start_loc, sinks)
    return DecodePlan(kernel, ws_shape, merge, in_memory, None, True)


def launch_decode(q, k_cache, v_cache, query_start_loc, seq_lens, table, out, flag, *, mask,
                  scale, soft_cap, sinks, k_scale, v_scale, max_query_len, max_seq_len, f32,
                  **options) -> None:
    """Run the decode kernel into ``out`` (a plan made for this call alone; the Triton
    backend's ``paged_attention`` keeps plans between calls). With several splits the last
    split of each (sequence, KV head) merges them (``fused``, default ``FUSED_COMBINE``) or
    a second launch does (``combine.py``). ``swap`` puts the keys on the MMA's M side;
    ``heads_first`` launches the KV heads of one (sequence, split) next to each other;
    ``block_m`` below the sequence's (row, head) pairs per KV head splits them into row
    tiles, launched side by side (each reads the K/V tiles; the second one mostly from L2).
    ``page_tiles`` reads one block id per page of the tile (one per tile when the page holds
    it; needs the block size and ``block_n`` to divide one another), ``widen`` loads fp8
    tiles as 32-bit words and widens them to fp16 in registers (fp8 caches with power-of-two
    head dims and 4-byte aligned entries; ignored otherwise). ``gluon`` runs fp8 caches
    through the Gluon kernel (``decode_gluon.py``: Hopper, head dim 128, blocks of a multiple
    of 16 slots, no window, chunk or soft cap; of the other options only ``splits``, ``num_stages``
    and ``maxnreg`` apply; default ``GLUON_FP8``). Other options:
    ``splits``, ``block_n``, ``num_warps``, ``num_stages``, ``maxnreg``."""
    plan = decode_plan(q, k_cache, v_cache, query_start_loc, seq_lens, table, out, flag,
                       mask=mask, scale=scale, soft_cap=soft_cap, sinks=sinks, k_scale=k_scale,
                       v_scale=v_scale, max_query_len=max_query_len, max_seq_len=max_seq_len,
                       f32=f32, **options)
    plan(q, k_cache, v_cache, query_start_loc, seq_lens, table, out, flag, sinks, k_scale, v_scale)
