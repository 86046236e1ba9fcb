"""Paged absorbed MLA in Triton over the latent cache (R + P wide, e.g. 512 + 64).

The cache holds one shared "head": a program folds (query row, head) pairs of one request
into its BLOCK_M tile (query lengths 1..16 with 16..128 heads), so a request's latent is
read once per tile, not once per query token; the tiles of one request run side by side
and share reads in L2. Scores are q_latent . c_kv + q_rope . k_rope, the value is c_kv
itself (read once for both). Per-row key extents give causal (bottom-right) and
non-causal draft blocks. Formats: bf16/fp16/fp32, per-tensor fp8 (scale folded into the
scores and output) and fp8_ds_mla (per-128 fp32 scales applied on load, bf16 rope).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.errors import InvalidArgumentError
from pagedkv.ops.fp8 import DS_MLA_GROUP, is_fp8
from pagedkv.ops.masks import CAUSAL, Mask
from pagedkv.ops.paged_mla import check_latent_args
from pagedkv.ops.sequences import check_index_tensors
from pagedkv.ops.triton.attention import host_extents
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
from pagedkv.ops.triton.rows import row_extents


@triton.jit
def _rope_mask(rows, p_, P, P_FULL: tl.constexpr):
    """[rows, BLOCK_P] load mask; constant along the columns unless BLOCK_P pads P, so that
    the rope loads stay vectorized."""
    if P_FULL:
        return tl.broadcast_to(rows[:, None], (rows.shape[0], p_.shape[0]))
    else:
        return rows[:, None] & (p_[None, :] < P)


@triton.jit
def _paged_mla_fwd(
    ql_ptr, qr_ptr, c_ptr, c8_ptr, f32_ptr, bf16_ptr, qsl_ptr, lens_ptr, table_ptr,
    ws_o, ws_m, ws_l, lscale_ptr, flag_ptr,
    stride_qt, stride_qh, stride_rt, stride_rh, stride_cb, stride_ct, stride_tb,
    num_blocks, block_size, heads, P, scale, lscale_f, window, chunk, draft, tiles, num_splits,
    tail_align, ws_splits,
    R: tl.constexpr, DVS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_P: tl.constexpr, HAS_ROPE: tl.constexpr, DS_MLA: tl.constexpr, GROUP: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_DRAFT: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_CHUNK: tl.constexpr, F32: tl.constexpr, PAGE_TILE: tl.constexpr,
    SCALE_PTR: tl.constexpr, P_FULL: tl.constexpr, SWAP: tl.constexpr,
):
    """One program: BLOCK_M (query row, head) pairs of one request x one KV split x one
    slice of R // DVS output columns (scores over the whole R + P entry either way)."""
    DV: tl.constexpr = R // DVS
    pid = tl.program_id(0)
    split = tl.program_id(1)
    dv = pid % DVS
    b = pid // DVS // tiles
    tile = pid // DVS % tiles
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    if tile * BLOCK_M >= q_len * heads:
        return
    seq_len = tl.load(lens_ptr + b)
    m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row = m // heads
    h = m % heads
    lo, hi = row_extents(row, q_len, seq_len, window, chunk, draft,
                         CAUSAL, HAS_DRAFT, HAS_WINDOW, HAS_CHUNK)
    kv_lo = tl.min(lo, 0)
    kv_hi = tl.max(hi, 0)
    # this split's keys: [kv_lo, kv_hi) in num_splits BLOCK_N-aligned pieces; with
    # tail_align > 0 only the keys from seq_len's last multiple of it on, as split ws_splits - 1
    start = (tl.minimum(kv_lo, kv_hi) // BLOCK_N) * BLOCK_N
    if tail_align > 0:
        s_lo = tl.maximum(start, seq_len // tail_align * tail_align)
        s_hi = kv_hi
        out_split = ws_splits - 1
    else:
        per = tl.cdiv(tl.cdiv(tl.maximum(kv_hi - start, 0), num_splits), BLOCK_N) * BLOCK_N
        s_lo = start + split * per
        s_hi = tl.minimum(s_lo + per, kv_hi)
        out_split = split
    rmask = row < q_len
    r = tl.arange(0, R)
    cols = dv * DV + tl.arange(0, DV)
    p_ = tl.arange(0, BLOCK_P)
    g3 = tl.arange(0, R // GROUP)
    j3 = tl.arange(0, GROUP)
    qrow = (q_start + row).to(tl.int64)
    if SWAP:  # keys on the tile's rows (s^T = c q^T, o^T = c^T p^T): MMA-shaped for few query rows
        qt = tl.load(ql_ptr + qrow[None, :] * stride_qt + h[None, :] * stride_qh + r[:, None],
                     mask=rmask[None, :], other=0.0)
        if HAS_ROPE:
            qrt = tl.load(qr_ptr + qrow[None, :] * stride_rt + h[None, :] * stride_rh + p_[:, None],
                          mask=tl.trans(_rope_mask(rmask, p_, P, P_FULL)), other=0.0)
        if F32:
            qt = qt.to(tl.float32)
            if HAS_ROPE:
                qrt = qrt.to(tl.float32)
        qdt = qt.dtype
    else:
        ql = tl.load(ql_ptr + qrow[:, None] * stride_qt + h[:, None] * stride_qh + r[None, :],
                     mask=rmask[:, None], other=0.0)
        if HAS_ROPE:
            qr = tl.load(qr_ptr + qrow[:, None] * stride_rt + h[:, None] * stride_rh + p_[None, :],
                         mask=_rope_mask(rmask, p_, P, P_FULL), other=0.0)
        if F32:
            ql = ql.to(tl.float32)
            if HAS_ROPE:
                qr = qr.to(tl.float32)
        qdt = ql.dtype
    if SCALE_PTR:
        lscale = tl.load(lscale_ptr)
    else:
        lscale = lscale_f
    qk_scale = scale * lscale * 1.4426950408889634

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if SWAP:
        acc = tl.zeros([DV, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, DV], dtype=tl.float32)
    tb = table_ptr + b * stride_tb
    for n0 in range(s_lo, s_hi, BLOCK_N):
        keys = n0 + tl.arange(0, BLOCK_N)
        kin = (keys < s_hi) & (keys >= kv_lo)
        if PAGE_TILE:  # the tile lies in one page: one block id, contiguous entries
            page = tl.load(tb + n0 // block_size)
            bad = (page < 0) | (page >= num_blocks)
            tl.store(flag_ptr, 1, mask=bad)
            tl.store(flag_ptr + 1, page, mask=bad)
            page = tl.where(bad, 0, page).to(tl.int64)
            kin = kin & ~bad
            entry = page * stride_cb + (keys % block_size) * stride_ct
        else:  # one block id per key (any block size)
            pg = tl.load(tb + keys // block_size, mask=kin, other=0)
            bad = kin & ((pg < 0) | (pg >= num_blocks))
            tl.store(flag_ptr + keys * 0, 1, mask=bad)
            tl.store(flag_ptr + 1 + keys * 0, pg, mask=bad)
            kin = kin & ~bad
            entry = tl.where(kin, pg, 0).to(tl.int64) * stride_cb + (keys % block_size) * stride_ct
        if DS_MLA:
            c3 = tl.load(c8_ptr + entry[:, None, None] + (g3 * GROUP)[None, :, None]
                         + j3[None, None, :], mask=kin[:, None, None], other=0.0)
            cs = tl.load(f32_ptr + (entry[:, None] + R) // 4 + g3[None, :], mask=kin[:, None],
                         other=0.0)
            c = tl.reshape(c3.to(tl.float32) * cs[:, :, None], [BLOCK_N, R])
            if DVS > 1:
                v = tl.load(c8_ptr + entry[:, None] + cols[None, :], mask=kin[:, None],
                            other=0.0).to(tl.float32)
                v = v * tl.load(f32_ptr + (entry[:, None] + R) // 4 + (cols // GROUP)[None, :],
                                mask=kin[:, None], other=0.0)
            if HAS_ROPE:
                kr = tl.load(bf16_ptr + (entry[:, None] + R + 4 * (R // GROUP)) // 2 + p_[None, :],
                             mask=_rope_mask(kin, p_, P, P_FULL), other=0.0)
        else:
            c = tl.load(c_ptr + entry[:, None] + r[None, :], mask=kin[:, None], other=0.0)
            if DVS > 1:
                v = tl.load(c_ptr + entry[:, None] + cols[None, :], mask=kin[:, None], other=0.0)
            if HAS_ROPE:
                kr = tl.load(c_ptr + entry[:, None] + R + p_[None, :],
                             mask=_rope_mask(kin, p_, P, P_FULL), other=0.0)
        c = c.to(qdt)  # float32 under F32 (the query is), else the query's bf16/fp16
        if DVS == 1:
            v = c
        else:
            v = v.to(qdt)
        if HAS_ROPE:
            kr = kr.to(qdt)
        if SWAP:
            if F32:
                s = tl.dot(c, qt, input_precision="ieee")
                if HAS_ROPE:
                    s += tl.dot(kr, qrt, input_precision="ieee")
            else:
                s = tl.dot(c, qt)
                if HAS_ROPE:
                    s += tl.dot(kr, qrt)
            s = s * qk_scale
            seen = (keys[:, None] >= lo[None, :]) & (keys[:, None] < hi[None, :]) & kin[:, None]
            s = tl.where(seen, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 0))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            pr = tl.exp2(s - m_use[None, :])
            alpha = tl.exp2(m_i - m_use)
            l_i = l_i * alpha + tl.sum(pr, 0)
            if F32:
                acc = acc * alpha[None, :] + tl.dot(tl.trans(v), pr, input_precision="ieee")
            else:
                acc = acc * alpha[None, :] + tl.dot(tl.trans(v), pr.to(qdt))
        else:
            if F32:
                s = tl.dot(ql, tl.trans(c), input_precision="ieee")
                if HAS_ROPE:
                    s += tl.dot(qr, tl.trans(kr), input_precision="ieee")
            else:
                s = tl.dot(ql, tl.trans(c))
                if HAS_ROPE:
                    s += tl.dot(qr, tl.trans(kr))
            s = s * qk_scale
            seen = (keys[None, :] >= lo[:, None]) & (keys[None, :] < hi[:, None]) & kin[None, :]
            s = tl.where(seen, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            pr = tl.exp2(s - m_use[:, None])
            alpha = tl.exp2(m_i - m_use)
            l_i = l_i * alpha + tl.sum(pr, 1)
            if F32:
                acc = acc * alpha[:, None] + tl.dot(pr, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(pr.to(qdt), v)
        m_i = m_new

    base = (qrow * heads + h) * ws_splits + out_split
    tl.store(ws_m + base, m_i, mask=rmask & (dv == 0))
    tl.store(ws_l + base, l_i, mask=rmask & (dv == 0))
    if SWAP:
        tl.store(ws_o + base[None, :] * R + cols[:, None], acc * lscale, mask=rmask[None, :])
    else:
        tl.store(ws_o + base[:, None] * R + cols[None, :], acc * lscale, mask=rmask[:, None])


@triton.jit
def _ds_scaled(c, f32_ptr, entry, col, R: tl.constexpr, GROUP: tl.constexpr,
               BLOCK_N: tl.constexpr, HALF: tl.constexpr):
    """fp8_ds_mla: columns [col, col + HALF) of a tile times their per-GROUP fp32 scales."""
    NG: tl.constexpr = HALF // GROUP if HALF >= GROUP else 1
    GS: tl.constexpr = GROUP if HALF >= GROUP else HALF
    sc = tl.load(f32_ptr + (entry[:, None] + R) // 4 + col // GROUP + tl.arange(0, NG)[None, :])
    c3 = tl.reshape(c.to(tl.float32), [BLOCK_N, NG, GS]) * sc[:, :, None]
    return tl.reshape(c3, [BLOCK_N, HALF])


@triton.jit
def _tile_step(q0, q1, qr, c0, c1, kr, keys, kin, lo, hi, qk_scale, m_i, l_i, acc0, acc1,
               HAS_ROPE: tl.constexpr, BOTH: tl.constexpr, F32: tl.constexpr):
    """Online softmax over one key tile held as two column halves (c0 is this program's
    output half; c1 the other, accumulated too when BOTH)."""
    if F32:
        s = tl.dot(q0, tl.trans(c0), input_precision="ieee")
        s += tl.dot(q1, tl.trans(c1), input_precision="ieee")
        if HAS_ROPE:
            s += tl.dot(qr, tl.trans(kr), input_precision="ieee")
    else:
        s = tl.dot(q0, tl.trans(c0))
        s = tl.dot(q1, tl.trans(c1), s)
        if HAS_ROPE:
            s = tl.dot(qr, tl.trans(kr), s)
    s = s * qk_scale
    seen = (keys[None, :] >= lo[:, None]) & (keys[None, :] < hi[:, None]) & kin[None, :]
    s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    pr = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(pr, 1)
    if F32:
        acc0 = acc0 * alpha[:, None] + tl.dot(pr, c0, input_precision="ieee")
        if BOTH:
            acc1 = acc1 * alpha[:, None] + tl.dot(pr, c1, input_precision="ieee")
    else:
        p16 = pr.to(c0.dtype)
        acc0 = tl.dot(p16, c0, acc0 * alpha[:, None])
        if BOTH:
            acc1 = tl.dot(p16, c1, acc1 * alpha[:, None])
    return m_new, l_i, acc0, acc1


@triton.jit
def _tile_step_t(q0, q1, qr, c0, c1, kr, keys, kin, lo, hi, qk_scale, m_i, l_i, acc0, acc1,
                 HAS_ROPE: tl.constexpr, BOTH: tl.constexpr, F32: tl.constexpr):
    """``_tile_step`` with keys on the MMA's M side: q* are [cols, BLOCK_M], scores
    [BLOCK_N, BLOCK_M], accumulators [R/2, BLOCK_M]. The warps split keys for the scores and
    output columns for the values, so no warp repeats another's score work."""
    if F32:
        s = tl.dot(c0, q0, input_precision="ieee")
        s += tl.dot(c1, q1, input_precision="ieee")
        if HAS_ROPE:
            s += tl.dot(kr, qr, input_precision="ieee")
    else:
        s = tl.dot(c0, q0)
        s = tl.dot(c1, q1, s)
        if HAS_ROPE:
            s = tl.dot(kr, qr, s)
    s = s * qk_scale
    seen = (keys[:, None] >= lo[None, :]) & (keys[:, None] < hi[None, :]) & kin[:, None]
    s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 0))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    pr = tl.exp2(s - m_use[None, :])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(pr, 0)
    if F32:
        acc0 = acc0 * alpha[None, :] + tl.dot(tl.trans(c0), pr, input_precision="ieee")
        if BOTH:
            acc1 = acc1 * alpha[None, :] + tl.dot(tl.trans(c1), pr, input_precision="ieee")
    else:
        p16 = pr.to(c0.dtype)
        acc0 = tl.dot(tl.trans(c0), p16, acc0 * alpha[None, :])
        if BOTH:
            acc1 = tl.dot(tl.trans(c1), p16, acc1 * alpha[None, :])
    return m_new, l_i, acc0, acc1


@triton.jit
def _paged_mla_tma(
    ql_ptr, qr_ptr, kd, rd, c_ptr, f32_ptr, bf16_ptr, qsl_ptr, lens_ptr, table_ptr,
    ws_o, ws_m, ws_l, lscale_ptr, flag_ptr,
    stride_qt, stride_qh, stride_rt, stride_rh, stride_cb, stride_ct, stride_tb,
    num_blocks, block_size, heads, P, rope_col, scale, lscale_f, window, chunk, draft, tiles,
    num_splits,
    R: tl.constexpr, DVS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_P: tl.constexpr, HAS_ROPE: tl.constexpr, DS_MLA: tl.constexpr, GROUP: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_DRAFT: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_CHUNK: tl.constexpr, F32: tl.constexpr, SCALE_PTR: tl.constexpr, P_FULL: tl.constexpr,
    SWAP: tl.constexpr,
):
    """Page-contiguous tiles (block_size % BLOCK_N == 0) read by the tensor-memory
    accelerator as two R/2 column halves plus the rope columns, straight into shared
    memory: no per-element addresses in registers. DVS == 2 programs own one half of the
    output each (scores over both halves either way). Keys from the last multiple of BLOCK_N
    below seq_len on (a tile whose unwritten slots may hold NaN) are left to a second launch
    of the pointer kernel (``tail_align``), which writes the extra split ``num_splits``."""
    HALF: tl.constexpr = R // 2
    pid = tl.program_id(0)
    split = tl.program_id(1)
    dv = pid % DVS
    b = pid // DVS // tiles
    tile = pid // DVS % tiles
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    if tile * BLOCK_M >= q_len * heads:
        return
    seq_len = tl.load(lens_ptr + b)
    m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row = m // heads
    h = m % heads
    lo, hi = row_extents(row, q_len, seq_len, window, chunk, draft,
                         CAUSAL, HAS_DRAFT, HAS_WINDOW, HAS_CHUNK)
    kv_lo = tl.min(lo, 0)
    kv_hi = tl.max(hi, 0)
    start = (tl.minimum(kv_lo, kv_hi) // BLOCK_N) * BLOCK_N
    per = tl.cdiv(tl.cdiv(tl.maximum(kv_hi - start, 0), num_splits), BLOCK_N) * BLOCK_N
    s_lo = start + split * per
    s_hi = tl.minimum(s_lo + per, kv_hi)
    # whole tiles below the last written slot; the rest is the tail launch's (extra split)
    t_hi = tl.minimum(s_hi, seq_len // BLOCK_N * BLOCK_N)
    rmask = row < q_len
    col0 = dv * HALF if DVS == 2 else 0
    col1 = HALF - col0
    hcol = tl.arange(0, HALF)
    p_ = tl.arange(0, BLOCK_P)
    qrow = (q_start + row).to(tl.int64)
    if SWAP:  # queries transposed: [cols, BLOCK_M]
        qbase = ql_ptr + qrow[None, :] * stride_qt + h[None, :] * stride_qh
        q0 = tl.load(qbase + col0 + hcol[:, None], mask=rmask[None, :], other=0.0)
        q1 = tl.load(qbase + col1 + hcol[:, None], mask=rmask[None, :], other=0.0)
        qr = q0
        if HAS_ROPE:
            qr = tl.load(qr_ptr + qrow[None, :] * stride_rt + h[None, :] * stride_rh + p_[:, None],
                         mask=tl.trans(_rope_mask(rmask, p_, P, P_FULL)), other=0.0)
    else:
        qbase = ql_ptr + qrow[:, None] * stride_qt + h[:, None] * stride_qh
        q0 = tl.load(qbase + col0 + hcol[None, :], mask=rmask[:, None], other=0.0)
        q1 = tl.load(qbase + col1 + hcol[None, :], mask=rmask[:, None], other=0.0)
        qr = q0
        if HAS_ROPE:
            qr = tl.load(qr_ptr + qrow[:, None] * stride_rt + h[:, None] * stride_rh + p_[None, :],
                         mask=_rope_mask(rmask, p_, P, P_FULL), other=0.0)
    if F32:
        q0 = q0.to(tl.float32)
        q1 = q1.to(tl.float32)
        qr = qr.to(tl.float32)
    qdt = q0.dtype
    if SCALE_PTR:
        lscale = tl.load(lscale_ptr)
    else:
        lscale = lscale_f
    qk_scale = scale * lscale * 1.4426950408889634

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if SWAP:
        acc0 = tl.zeros([HALF, BLOCK_M], dtype=tl.float32)
        acc1 = tl.zeros([HALF, BLOCK_M], dtype=tl.float32)
    else:
        acc0 = tl.zeros([BLOCK_M, HALF], dtype=tl.float32)
        acc1 = tl.zeros([BLOCK_M, HALF], dtype=tl.float32)
    tb = table_ptr + b * stride_tb
    kn = tl.arange(0, BLOCK_N)
    for n0 in range(s_lo, t_hi, BLOCK_N):
        keys = n0 + kn
        page = tl.load(tb + n0 // block_size)
        bad = (page < 0) | (page >= num_blocks)
        tl.store(flag_ptr, 1, mask=bad)
        tl.store(flag_ptr + 1, page, mask=bad)
        page = tl.where(bad, 0, page)
        kin = (keys >= kv_lo) & ~bad
        slot = page * block_size + n0 % block_size
        c0 = kd.load([slot, col0])
        c1 = kd.load([slot, col1])
        kr = c0
        if HAS_ROPE:
            kr = rd.load([slot, rope_col])
        if DS_MLA:
            entry = (slot.to(tl.int64) + kn) * stride_ct
            c0 = _ds_scaled(c0, f32_ptr, entry, col0, R, GROUP, BLOCK_N, HALF)
            c1 = _ds_scaled(c1, f32_ptr, entry, col1, R, GROUP, BLOCK_N, HALF)
        if SWAP:
            m_i, l_i, acc0, acc1 = _tile_step_t(q0, q1, qr, c0.to(qdt), c1.to(qdt), kr.to(qdt), keys,
                                                kin, lo, hi, qk_scale, m_i, l_i, acc0, acc1,
                                                HAS_ROPE, DVS == 1, F32)
        else:
            m_i, l_i, acc0, acc1 = _tile_step(q0, q1, qr, c0.to(qdt), c1.to(qdt), kr.to(qdt), keys,
                                              kin, lo, hi, qk_scale, m_i, l_i, acc0, acc1,
                                              HAS_ROPE, DVS == 1, F32)
    base = (qrow * heads + h) * (num_splits + 1) + split
    tl.store(ws_m + base, m_i, mask=rmask & (dv == 0))
    tl.store(ws_l + base, l_i, mask=rmask & (dv == 0))
    if SWAP:
        obase = ws_o + base[None, :] * R + hcol[:, None]
        tl.store(obase + col0, acc0 * lscale, mask=rmask[None, :])
        if DVS == 1:
            tl.store(obase + col1, acc1 * lscale, mask=rmask[None, :])
    else:
        obase = ws_o + base[:, None] * R + hcol[None, :]
        tl.store(obase + col0, acc0 * lscale, mask=rmask[:, None])
        if DVS == 1:
            tl.store(obase + col1, acc1 * lscale, mask=rmask[:, None])


def launch_defaults(rows_per_request: int, block_size: int, f32: bool, fp8: bool) -> dict:
    """Launch config by shape family, chosen from benchmarks/attention.py's sweeps on the
    H200 (docs/kernels-log.md). bf16/fp16 with page tiles: the TMA kernel; <= 16 query rows per
    request with keys on the MMA's M side (``swap``), more rows as 64-row tiles; with block
    sizes that are multiples of 64, ``gluon`` (the Hopper kernels, where they run). fp8 caches:
    the pointer kernel (a TMA tile converted to bf16 in registers spills), except <= 16 rows
    per request on blocks of multiples of 64, where ``gluon`` (per-tensor e4m3 with a float
    scale: ``mla_gluon_e4m3``, both products on e4m3 MMAs, 0.64x the bf16 Gluon kernel's
    time; fp8_ds_mla: ``mla_gluon_ds``, warp-specialized, 140 us where the pointer kernel
    took 396; H200 B64 ctx8K h16 q1, 2026-12-04 21:37 and 17:12 UTC,
    docs/kernels-log.md; ``mla_gluon.supported``
    sends the rest back to the pointer kernel with this config, e.g. any call off Hopper).
    ``waves``: programs per multiprocessor that the KV splits aim at (rounded down: a second
    partial wave cost more than it gained in the sweeps)."""
    if interpreting():
        return dict(block_m=min(64, max(16, next_pow2(rows_per_request))), block_n=64,
                    dv_splits=1, num_warps=4, num_stages=2, waves=0.0, swap=False, tma=None,
                    gluon=False)
    if f32 or block_size % 32 or fp8:
        # float32 (reference-precision) path, fp8 caches, or blocks TMA tiles do not fit
        bm = 16 if fp8 else min(64, max(16, next_pow2(rows_per_request)))
        gluon = fp8 and not f32 and rows_per_request <= 16 and block_size % 64 == 0
        return dict(block_m=bm, block_n=16 if f32 else 32, dv_splits=2 if bm == 64 else 1,
                    num_warps=8 if bm == 64 else 4, num_stages=2, waves=2.0, swap=False,
                    tma=False if fp8 else None, gluon=gluon)
    block_n = 64 if block_size % 64 == 0 else 32
    # the Gluon kernels (mla_gluon) where they run: faster in every bf16 family measured
    # (docs/kernels-log.md, "MLA, Gluon kernels")
    gluon = block_size % 64 == 0
    if rows_per_request <= 16:
        return dict(block_m=16, block_n=block_n, dv_splits=1, num_warps=4, num_stages=2,
                    waves=1.0, swap=True, tma=True, gluon=gluon)
    return dict(block_m=64, block_n=block_n, dv_splits=1, num_warps=8, num_stages=2, waves=1.0,
                swap=False, tma=True, gluon=gluon)


def _splits(work_items: int, max_seq_len: int, waves: float) -> int:
    """KV splits: floor(waves x SMs / programs), at least 256 keys each, 1..64."""
    if interpreting() or not waves:
        return num_splits(1, max_seq_len, 256)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return max(1, min(int(waves * sms) // max(1, work_items), -(-max_seq_len // 256), 64))


def _tma_descriptors(cache: torch.Tensor, rank: int, block_p: int, block_n: int):
    """(latent-halves descriptor, rope descriptor, rope column) over the cache seen as one
    row per slot, or None where the layout does not allow TMA (16-byte alignment, slots of
    one block contiguous)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    num_blocks, block_size, width = cache.shape
    if cache.stride(0) != block_size * cache.stride(1) or cache.stride(2) != 1:
        return None
    ds = cache.dtype == torch.uint8
    row_bytes = cache.stride(1) * cache.element_size()
    if row_bytes % 16 or cache.data_ptr() % 16 or (rank // 2) * (1 if ds else cache.element_size()) < 16:
        return None
    rows = num_blocks * block_size
    if ds:
        lat = cache.view(torch.float8_e4m3fn)
        rope = cache.view(torch.bfloat16)
        rope_col = (rank + 4 * (rank // DS_MLA_GROUP)) // 2
        rope_shape, rope_stride = [rows, width // 2], [cache.stride(1) // 2, 1]
    else:
        lat = rope = cache
        rope_col = rank
        rope_shape, rope_stride = [rows, width], [cache.stride(1), 1]
    kd = TensorDescriptor(lat, [rows, width], [cache.stride(1), 1], [block_n, rank // 2])
    rd = TensorDescriptor(rope, rope_shape, rope_stride, [block_n, block_p])
    return kd, rd, rope_col


_GLUON_PLANS: dict[tuple, object] = {}
_MAX_PLANS = 64  # (each holds its cache alive through the descriptors; cleared when full)


def _gluon_key(q_latent, q_rope, cache, query_start_loc, seq_lens, block_table, scale, mask,
               latent_scale, max_query_len, max_seq_len, splits, gluon, variant) -> tuple:
    """Everything a Gluon call's checks and launch depend on, tensor values aside; the cache's
    address too (the TMA descriptors embed it). ``max_seq_len`` as far as ``_splits`` reads it."""
    return (
        q_latent.shape, q_latent.stride(), q_latent.dtype, q_latent.device,
        None if q_rope is None else (q_rope.shape, q_rope.stride(), q_rope.dtype, q_rope.device),
        cache.shape, cache.stride(), cache.dtype, cache.device, cache.data_ptr(),
        query_start_loc.shape, query_start_loc.dtype, query_start_loc.device,
        seq_lens.shape, seq_lens.dtype, seq_lens.device, block_table.stride(),
        block_table.dtype, block_table.device, scale, mask,
        latent_scale if not isinstance(latent_scale, torch.Tensor) else "tensor",
        max_query_len, min(64, -(-max_seq_len // 256)), splits, gluon, variant, interpreting(),
        _ds_settings(cache),
    )


def _ds_settings(cache) -> tuple | None:
    """fp8_ds_mla: the Gluon kernel's switch (``mla_gluon_ds.STAGES``), which a kept plan
    must follow."""
    if cache.dtype != torch.uint8:
        return None
    from pagedkv.ops.triton import mla_gluon_ds

    return (mla_gluon_ds.STAGES,)


def _run_gluon(plan, q_latent, q_rope, cache, query_start_loc, seq_lens, block_table,
               check_blocks):
    """A cached Gluon plan's call: output, flag, launches, the flag's read-back."""
    rows, heads, rank = q_latent.shape
    out = torch.empty(rows, heads, rank, dtype=torch.float32, device=q_latent.device)
    flag = torch.zeros(2, dtype=torch.int32, device=q_latent.device)
    table = block_table if block_table.stride(-1) == 1 else block_table.contiguous()
    ql = q_latent if q_latent.stride(-1) == 1 else q_latent.contiguous()
    qr = q_rope if q_rope.stride(-1) == 1 else q_rope.contiguous()
    plan(ql, qr, query_start_loc, seq_lens, table, flag, out)
    if check_blocks:
        raise_on_bad_block(flag, cache.shape[0])
    return out


def paged_mla_latent(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor | None,
    latent_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    scale: float,
    mask: Mask = CAUSAL,
    latent_scale: float | torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float32,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    splits: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    dv_splits: int | None = None,
    swap: bool | None = None,
    tma: bool | None = None,
    gluon: bool | str | None = None,
    check_blocks: bool = True,
) -> torch.Tensor:
    """o_latent [T, H, R] (float32; see ``pagedkv.ops.paged_mla.paged_mla_latent``).

    ``max_query_len`` / ``max_seq_len``: as for ``pagedkv.ops.triton.paged_attention``;
    ``splits``, ``block_m``, ``block_n``, ``num_warps``, ``num_stages``, ``dv_splits`` (output
    column slices, each program recomputing the scores) and ``swap`` (keys on the MMA's M side:
    scores computed transposed), ``tma`` (page tiles through tensor descriptors; default: where
    the layout allows) override the launch defaults. ``gluon``: the Hopper Gluon kernels of
    ``mla_gluon`` (default: where ``launch_defaults`` says so, no Triton override above is
    given and ``mla_gluon.supported`` accepts the call, else the Triton kernels; True where
    they cannot run raises; only ``splits`` applies to them; a name from
    ``mla_gluon.ROWS_VARIANTS`` is True with that variant of the 64-row kernel, one from
    ``mla_gluon.FP8_VARIANTS`` True with that <= 16-row kernel of an e4m3 cache).
    ``check_blocks=False`` skips reading back the out-of-cache flag (one host sync; it is
    also skipped inside CUDA-graph capture). Given ``max_query_len`` and ``max_seq_len``, a
    Gluon call keeps its launch plan (``mla_gluon.Plan``) keyed by every shape, stride,
    dtype, device and option it depends on and the cache's address: a later call with the
    same key skips the checks, the launch decisions and the descriptors' construction.
    """
    del compute_dtype  # the kernel accumulates in float32
    variant = None
    if isinstance(gluon, str):
        from pagedkv.ops.triton import mla_gluon

        if gluon not in mla_gluon.ROWS_VARIANTS + mla_gluon.FP8_VARIANTS:
            raise InvalidArgumentError(f"gluon={gluon!r}: a bool or one of "
                                       f"{mla_gluon.ROWS_VARIANTS + mla_gluon.FP8_VARIANTS}")
        if gluon in mla_gluon.FP8_VARIANTS and latent_cache.dtype != torch.float8_e4m3fn:
            raise InvalidArgumentError(
                f"gluon={gluon!r} is a kernel of e4m3 caches, not of a {latent_cache.dtype} one")
        variant, gluon = gluon, True
    triton_knobs = (block_m, block_n, num_warps, num_stages, dv_splits, swap, tma)
    key = None
    if (max_query_len is not None and max_seq_len is not None and gluon is not False
            and all(k is None for k in triton_knobs)):
        key = _gluon_key(q_latent, q_rope, latent_cache, query_start_loc, seq_lens, block_table,
                         scale, mask, latent_scale, max_query_len, max_seq_len, splits, gluon,
                         variant)
        plan = _GLUON_PLANS.get(key)
        if plan is not None:  # these arguments passed every check below before
            return _run_gluon(plan, q_latent, q_rope, latent_cache, query_start_loc, seq_lens,
                              block_table, check_blocks)
    check_latent_args(q_latent, q_rope, latent_cache)
    rows, heads, rank = q_latent.shape
    rope_dim = 0 if q_rope is None else q_rope.shape[-1]
    check_device(q_latent, q_rope, latent_cache, query_start_loc, seq_lens, block_table)
    check_index_tensors(query_start_loc, seq_lens, block_table)
    ds = latent_cache.dtype == torch.uint8
    width = latent_cache.shape[-1]
    cache_rope = (width - rank - 4 * (rank // DS_MLA_GROUP)) // 2 if ds else width - rank
    if ds and latent_scale is not None:
        raise InvalidArgumentError("fp8_ds_mla carries its own scales; pass no latent scale")
    if not ds and is_fp8(latent_cache.dtype) and latent_scale is None:
        raise InvalidArgumentError(f"a {latent_cache.dtype} cache needs its per-tensor scale")
    if not ds and not is_fp8(latent_cache.dtype) and latent_scale is not None:
        raise InvalidArgumentError(
            f"a scale was given for a {latent_cache.dtype} cache, which has none")
    if cache_rope != rope_dim:
        raise InvalidArgumentError(
            f"the cache holds {cache_rope} rope values per token, the query {rope_dim}")
    if rank != next_pow2(rank) or rank < 16 or latent_cache.stride(-1) != 1:
        raise InvalidArgumentError(
            f"the triton MLA kernel needs a power-of-two kv_lora_rank >= 16 and a contiguous "
            f"entry, got {rank}")
    num_blocks, block_size = latent_cache.shape[:2]
    if max_query_len is None or max_seq_len is None:
        if capturing():
            raise InvalidArgumentError("inside CUDA-graph capture pass max_query_len and max_seq_len")
        mq, ms = host_extents(query_start_loc, seq_lens, block_table, rows, block_size, mask)
        max_query_len = mq if max_query_len is None else max_query_len
        max_seq_len = ms if max_seq_len is None else max_seq_len
    f32 = interpreting() or q_latent.dtype == torch.float32
    cfg = launch_defaults(max(1, max_query_len) * heads, block_size, f32,
                          ds or is_fp8(latent_cache.dtype))
    if gluon is None:  # a Triton launch override selects the Triton kernels
        use_gluon = cfg["gluon"] and all(k is None for k in triton_knobs)
    else:
        use_gluon = bool(gluon)
    if use_gluon:
        from pagedkv.ops.triton import mla_gluon

        why = mla_gluon.supported(q_latent, q_rope, latent_cache, mask, latent_scale,
                                  max(1, max_query_len) * heads)
        if why is not None and gluon:
            raise InvalidArgumentError(f"gluon=True cannot run this call: {why}")
        use_gluon = why is None
    if use_gluon:  # fixed tiles: 64 keys; 16 rows (transposed, 4 warps) or 64 rows (8 warps)
        block_m = mla_gluon.tile_rows(max(1, max_query_len) * heads)
        block_n, dv_splits = 64, 1
        cfg = dict(cfg, num_stages=2, waves=1.0)
    block_m = block_m or cfg["block_m"]
    block_n = block_n or cfg["block_n"]
    dv_splits = dv_splits or cfg["dv_splits"]
    swap = cfg["swap"] if swap is None else bool(swap)
    tma = cfg["tma"] if tma is None else tma
    if dv_splits < 1 or rank % dv_splits or rank // dv_splits < 16:
        raise InvalidArgumentError(
            f"dv_splits={dv_splits} must divide kv_lora_rank {rank} into slices of >= 16")
    tiles = max(1, -(-max(1, max_query_len) * heads // block_m))
    batch = seq_lens.shape[0]
    if splits is None:
        splits = _splits(batch * tiles * dv_splits, max_seq_len, cfg["waves"])
    out = torch.empty(rows, heads, rank, dtype=torch.float32, device=q_latent.device)
    scale_ptr = isinstance(latent_scale, torch.Tensor)
    lscale_f = 1.0 if latent_scale is None or scale_ptr else float(latent_scale)
    lscale = scale_vector((latent_scale,), q_latent.device) if scale_ptr else seq_lens
    flag = torch.zeros(2, dtype=torch.int32, device=q_latent.device)
    ql = q_latent if q_latent.stride(-1) == 1 else q_latent.contiguous()
    qr = ql if q_rope is None else (q_rope if q_rope.stride(-1) == 1 else q_rope.contiguous())
    if ds:
        if latent_cache.stride(0) % 4 or latent_cache.stride(1) % 4 or width % 4:
            raise InvalidArgumentError("fp8_ds_mla entries must be 4-byte aligned in the cache")
        views = (latent_cache.view(torch.float8_e4m3fn), latent_cache.view(torch.float32),
                 latent_cache.view(torch.bfloat16))
    else:
        views = (latent_cache, latent_cache, latent_cache)
    table = block_table if block_table.stride(-1) == 1 else block_table.contiguous()
    block_p = max(16, next_pow2(rope_dim))
    common = dict(R=rank, BLOCK_P=block_p, HAS_ROPE=rope_dim > 0, DS_MLA=ds,
                  GROUP=min(DS_MLA_GROUP, rank), CAUSAL=mask.causal,
                  HAS_DRAFT=mask.draft_block is not None, HAS_WINDOW=mask.window is not None,
                  HAS_CHUNK=mask.chunk is not None, F32=f32, SCALE_PTR=scale_ptr,
                  P_FULL=rope_dim == block_p)
    warps, stages = num_warps or cfg["num_warps"], num_stages or cfg["num_stages"]
    # num_stages 1: the TMA kernel is not software-pipelined, and on the H200 it returned
    # wrong results at long contexts (docs/kernels-log.md, MLA section); auto picks the pointer kernel
    descs = _tma_descriptors(latent_cache, rank, block_p, block_n) if (
        not use_gluon and tma is not False and dv_splits <= 2 and block_size % block_n == 0
        and stages >= 2) else None
    if tma and descs is None and not use_gluon:
        raise InvalidArgumentError(
            f"tma=True needs block_size % block_n == 0 ({block_size}, {block_n}), dv_splits <= 2, "
            f"num_stages >= 2 (got {stages}) and 16-byte aligned, page-contiguous entries")
    ws = None if (use_gluon and batch and rows) else workspace(rows, heads, splits + (descs is not None), rank,
                                          q_latent.device)
    args = (query_start_loc, seq_lens, table, *(ws or ()), lscale, flag, ql.stride(0), ql.stride(1),
            qr.stride(0), qr.stride(1), latent_cache.stride(0), latent_cache.stride(1),
            table.stride(0), num_blocks, block_size, heads, rope_dim)
    masks = (mask.window or 0, mask.chunk or 0, mask.draft_block or 0)
    if batch and rows and use_gluon:  # one launch, every key (no tail launch)
        made = mla_gluon.launch(ql, qr, latent_cache, query_start_loc, seq_lens, table, out,
                                flag, scale=scale, mask=mask, tiles=tiles, splits=splits,
                                block_m=block_m, variant=variant, latent_scale=latent_scale)
        if key is not None:
            if len(_GLUON_PLANS) >= _MAX_PLANS:
                _GLUON_PLANS.clear()
            _GLUON_PLANS[key] = made
        if check_blocks:
            raise_on_bad_block(flag, num_blocks)
        return out
    elif batch and rows and descs is not None:
        kd, rd, rope_col = descs
        _paged_mla_tma[(batch * tiles * dv_splits, splits)](
            ql, qr, kd, rd, *views, *args, rope_col, scale, lscale_f, *masks, tiles, splits,
            DVS=dv_splits, BLOCK_M=block_m, BLOCK_N=block_n, SWAP=swap, num_warps=warps,
            num_stages=stages, **common)
        # the keys of each sequence's last, partly written tile: masked loads, extra split
        tail_tiles = -(-max(1, max_query_len) * heads // 16)
        _paged_mla_fwd[(batch * tail_tiles, 1)](
            ql, qr, latent_cache, *views, *args, scale, lscale_f, *masks, tail_tiles, 1,
            block_n, splits + 1, DVS=1, BLOCK_M=16, BLOCK_N=16, PAGE_TILE=True, SWAP=False,
            num_warps=4, num_stages=1, **common)
    elif batch and rows:
        _paged_mla_fwd[(batch * tiles * dv_splits, splits)](
            ql, qr, latent_cache, *views, *args, scale, lscale_f, *masks, tiles, splits, 0,
            splits, DVS=dv_splits, BLOCK_M=block_m, BLOCK_N=block_n,
            PAGE_TILE=block_size % block_n == 0, SWAP=swap, num_warps=warps, num_stages=stages,
            **common)
    combine(ws, out, query_start_loc, None)
    if check_blocks:
        raise_on_bad_block(flag, num_blocks)
    return out
