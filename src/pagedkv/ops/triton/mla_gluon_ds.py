"""Absorbed MLA decode over an fp8_ds_mla cache in Gluon (Hopper sm_90): the per-tensor e4m3
kernel (``mla_gluon_e4m3``) extended to per-128-column fp32 scales and a bf16 rope; the
default for the fp8_ds_mla calls it takes (``supported``) on Hopper.

Why: fp8_ds_mla (DeepSeek / Kimi) was served by the Triton pointer kernel, ~0.54x the bf16
kernel's throughput on the H200 (docs/kernels-log.md). History: a one-warpgroup form of this
kernel (``_mla_gluon_ds``, behind ``WS = False``) was deleted (commit 5fc7975, 2026-12-04
21:28 UTC) after the lead's H200 check (2026-12-04 21:22-21:24 UTC, main at b6288d0, torch
2.11.0+cu130, triton 3.6.0; ``PYTHONPATH=src python3 benchmarks/mla_fp8_forms.py ds WS=1
WS=0``, B64 ctx8K h16 q1 page 64, CUDA-graph replays): this kernel 147.8 us, 0.99x the bf16
Gluon kernel's throughput (146.2 us; relative error 2.8e-2), the one-warpgroup form 194.0
us (0.75x). With the e4m3 kernel's transpose free of bank conflicts (21:37 UTC, ``...
mla_fp8_forms.py ds WS=1``, the switch since deleted): 140.2 us against 148.1, 1.06x.

``_mla_gluon_ds_ws`` is warp-specialized as ``mla_gluon_e4m3._mla_gluon_e4m3``: that
module's transposing warpgroup (``_transposer``: each tile's latent into V^T buffer pair
t % 2, the four 128-column groups as row slices) and two MMA warpgroups on alternate tiles
(``_ds_mma``, ``MMA_REGS`` registers each, the value MMAs one group at a time), ``STAGES``
ring slots, two workspace splits a program (one per MMA warpgroup; the combine merges them
like any others).

The cache's 656-byte entries ``[512 e4m3 | 4 fp32 scales | 64 bf16 rope]`` (``ops/fp8.py``)
arrive by TMA as three boxes per 64-key tile, all on one mbarrier: the latent as a [64, 512]
e4m3 box of the bytes seen as [slots, 656], the rope as a [64, 64] bf16 box at column 264 of
the bytes seen as bf16 [slots, 328], the scales as a [64, 4] fp32 box at column 128 of
[slots, 164] (16-byte rows, the TMA minimum; 656 = 41 x 16, so every view's row stride is
16-byte aligned). Per tile, with g the 4 groups of 128 latent columns and s_g(key) its scale:

- Scores S = sum_g s_g (K8_g . Q_g) + K_rope . Q_rope: one e4m3 MMA chain per group (the
  queries as e4m3 hi + lo rows stacked as N = 32, one scale per row: amax / 448 over the
  512 latent columns) into its own accumulator, scaled per key in registers; the rope as a
  bf16 MMA on bf16 queries (the cache keeps rope in bf16, so no hi/lo is needed).
- Values O_g^T = V_g^T (P s_g)^T: V_g^T a row slice of the K-major V^T pair; P x 256
  scaled per key by s_g / max_g (max_g: the tile's largest scale of group g, so the
  operand stays within e4m3's range and keeps its largest values normal), split into e4m3
  hi + lo, one MMA per group; each product (a fresh accumulator) is multiplied back by
  max_g when added to the running output. Row sums add the unscaled P in fp32.
- Keys past the sequence or behind a bad block id: scores masked to -inf, their latent
  bytes zeroed in the transpose, and their scales *selected* to 0 (unwritten slots hold NaN
  scales too; 0 x NaN would leak).

Scope: fp8_ds_mla with R = 512, P = 64, bf16/fp16 queries (the rope query rounded to bf16),
<= 16 (query row, head) rows per request, blocks of multiples of 64, causal / non-causal /
draft-block masks; ``supported`` says why not (those calls, and any off Hopper, take the
Triton kernel, as does ``gluon=False``). Grid, splits, workspace and combine are
``mla_gluon``'s.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from pagedkv.ops.fp8 import DS_MLA_GROUP, ds_mla_entry_bytes
from pagedkv.ops.triton.gluon_common import half_sum as _half_sum
from pagedkv.ops.triton.gluon_common import key_order
from pagedkv.ops.triton.gluon_common import request_tile as _request_tile
from pagedkv.ops.triton.mla_gluon import (
    BLOCK_N,
    RANK,
    ROPE,
    SWAP_ROWS,
    _extents,
    _flag_bad,
    _split_tiles,
    _ws_rows,
)
from pagedkv.ops.triton.mla_gluon_e4m3 import (
    MAXNREG,
    _transposer,
    latent_dim,
    own_tile,
    own_tiles,
    query_rows,
    ws_barriers,
)

# ring slots of 41 KB (latent 32 KB, rope 8 KB, scales 1 KB); the kernel (its first ring
# fill, a ``static_assert``) is written for 2
STAGES = 2
# each MMA warpgroup's registers (``setmaxnreg``; the transposing warpgroup gets the rest of
# ``mla_gluon_e4m3.MAXNREG`` x 12 warps)
MMA_REGS = gl.constexpr(232)
ENTRY = ds_mla_entry_bytes(RANK, ROPE)  # 656 bytes
GROUPS = RANK // DS_MLA_GROUP  # 4 scales per key
_ROPE_COL = gl.constexpr((RANK + 4 * GROUPS) // 2)  # bf16 column of the rope (byte 528)
_SCALE_COL = gl.constexpr(RANK // 4)  # fp32 column of the first scale (byte 512)


@gluon.jit
def _issue_ds(kd, rd, sd, kv_smem, kr_smem, ks_smem, bars, page, n0, stage, block_size,
              num_blocks, pred):
    """TMA copies of the 64-key tile at key n0 (block ``page``): latent, rope and scales
    into ring slot ``stage``, one barrier."""
    page = gl.where((page < 0) | (page >= num_blocks), 0, page)  # flagged at compute time
    slot = page * block_size + n0 % block_size
    bar = bars.index(stage)
    mbarrier.expect(bar, kd.block_type.nbytes + rd.block_type.nbytes + sd.block_type.nbytes,
                    pred=pred)
    tma.async_copy_global_to_shared(kd, [slot, 0], bar, kv_smem.index(stage), pred=pred)
    tma.async_copy_global_to_shared(rd, [slot, _ROPE_COL], bar, kr_smem.index(stage), pred=pred)
    tma.async_copy_global_to_shared(sd, [slot, _SCALE_COL], bar, ks_smem.index(stage), pred=pred)


@gluon.jit
def _ring_page_ds(kd, rd, sd, kv_smem, kr_smem, ks_smem, bars, table_row, s_lo, n_tiles,
                  i: gl.constexpr, block_size, num_blocks, BLOCK_N: gl.constexpr):
    """Ring slot i's first copy (tile i of the split, if any); returns its block id."""
    page = gl.load(table_row + (s_lo + i * BLOCK_N) // block_size, mask=n_tiles > i, other=0)
    _issue_ds(kd, rd, sd, kv_smem, kr_smem, ks_smem, bars, page, s_lo + i * BLOCK_N, i,
              block_size, num_blocks, n_tiles > i)
    return page


@gluon.jit
def _group(x, sel, g: gl.constexpr, layout: gl.constexpr):
    """Column g of the per-thread [keys, 4] scales as a per-key vector in ``layout``."""
    return gl.convert_layout(gl.sum(gl.where(sel[None, :] == g, x, 0.0), 1), layout)


@gluon.jit
def _pick(v, sel, g: gl.constexpr):
    """Element g of a 4-vector held whole by every thread, as a scalar."""
    return gl.sum(gl.where(sel == g, v, 0.0), 0)


@gluon.jit
def _store_p(p, f, dst, BLOCK_M: gl.constexpr):
    """P x f (f: per key) as e4m3 hi (rows [0, BLOCK_M) of ``dst``) + lo (the next rows)."""
    e4: gl.constexpr = gl.float8e4nv
    pg = p * f[:, None]
    p8 = pg.to(e4)
    lo = key_order((pg - p8.to(gl.float32)).to(e4))
    # hi and lo as one [2 x BLOCK_M, 64] store (two stores into one buffer: a barrier
    # between them)
    both = gl.permute(gl.join(key_order(p8), lo), (2, 1, 0))
    dst.store(gl.reshape(both, [2 * BLOCK_M, p.shape[0]]))


@gluon.jit
def _group_value(vt_g, p_g, o0, acc, alpha, smax_g):
    """One group's value product V_g^T P_g^T (hi and lo side by side), waited for, added to
    its accumulator: acc x alpha + (hi + lo) x the group's scale maximum."""
    o = warpgroup_mma(vt_g, p_g.permute((1, 0)), o0, use_acc=False, is_async=True)
    o = warpgroup_mma_wait(0, deps=[o])
    return acc * alpha[None, :] + _half_sum(o) * smax_g


@gluon.jit
def _ds_mma(args, G: gl.constexpr, R: gl.constexpr, BLOCK_M: gl.constexpr,
            BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
            HAS_DRAFT: gl.constexpr):
    """MMA warpgroup G of ``_mla_gluon_ds_ws``: the split's tiles u = G mod 2, each with its
    own running state (group scores; once V^T pair G is ready, the slot's refill; then the
    softmax, P per group and the groups' value MMAs one at a time), written as workspace
    split 2 split + G."""
    (q2_smem, qr_smem, kv_smem, kr_smem, ks_smem, vt_smem, p2_smem, rs_smem, bars, vt_ready,
     vt_free, kd, rd, sd, table_row, s_lo, n_tiles, block_size, num_blocks, flag_ptr, seq_len,
     draft, ws_o, ws_m, ws_l, tile, q_start, q_len, heads, num_splits, split, qk_scale) = args
    GW: gl.constexpr = 128
    N2: gl.constexpr = 2 * BLOCK_M
    t2_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                   instr_shape=[16, N2, 32])
    t_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BLOCK_M, 32])
    tr_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                   instr_shape=[16, BLOCK_M, 16])
    per_row: gl.constexpr = gl.SliceLayout(0, t_l)
    per_key: gl.constexpr = gl.SliceLayout(1, t_l)
    sc_l: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [8, 0]], lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[BLOCK_N, 4])
    m_r = tile * BLOCK_M + gl.arange(0, BLOCK_M, layout=per_row)
    hi = _extents(m_r // heads, q_len, seq_len, draft, CAUSAL, HAS_DRAFT)
    row_scale = rs_smem.index(0).load(per_row)
    s0 = gl.zeros([BLOCK_N, N2], gl.float32, layout=t2_l)
    r0 = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=tr_l)
    o0 = gl.zeros([GW, N2], gl.float32, layout=t2_l)
    l_acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=t_l)
    acc0 = _half_sum(o0)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    o_l: gl.constexpr = acc0.type.layout
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=per_row)
    kn = gl.arange(0, BLOCK_N, layout=per_key)
    kc = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, sc_l))
    sel = gl.arange(0, 4, layout=gl.SliceLayout(0, sc_l))
    n_own, page, page_next = own_tiles(G, s_lo, n_tiles, table_row, block_size, STAGES,
                                       BLOCK_N)
    for j in range(n_own):
        u, stage, n0, wi, refill, page_a, page_b = own_tile(G, j, s_lo, n_tiles, table_row,
                                                            block_size, STAGES, BLOCK_N)
        bad = _flag_bad(page, num_blocks, flag_ptr)
        mbarrier.wait(bars.index(stage), (u // STAGES) & 1)
        kv = kv_smem.index(stage)
        q2 = q2_smem.index(wi)
        a0 = warpgroup_mma(kv.slice(0, GW, dim=1), q2.slice(0, GW, dim=1).permute((1, 0)),
                           s0, use_acc=False, is_async=True)
        a1 = warpgroup_mma(kv.slice(GW, GW, dim=1), q2.slice(GW, GW, dim=1).permute((1, 0)),
                           s0, use_acc=False, is_async=True)
        a2 = warpgroup_mma(kv.slice(2 * GW, GW, dim=1),
                           q2.slice(2 * GW, GW, dim=1).permute((1, 0)), s0, use_acc=False,
                           is_async=True)
        a3 = warpgroup_mma(kv.slice(3 * GW, GW, dim=1),
                           q2.slice(3 * GW, GW, dim=1).permute((1, 0)), s0, use_acc=False,
                           is_async=True)
        r = warpgroup_mma(kr_smem.index(stage), qr_smem.index(wi).permute((1, 0)), r0,
                          use_acc=False, is_async=True)
        sc = ks_smem.index(stage).load(sc_l)
        # selected, not multiplied: unwritten slots' scales may be NaN
        sc = gl.where(((n0 + kc < seq_len) & (bad == 0))[:, None], sc, 0.0)
        smax = gl.max(sc, 0)  # the tile's largest scale per group
        fac = sc * gl.where(smax > 0, 1.0 / smax, 0.0)[None, :]
        a0, a1, a2, a3, r = warpgroup_mma_wait(0, deps=[a0, a1, a2, a3, r])
        # the slot's readers done (every warp's score MMAs and scale reads, the
        # transposer's V^T pair G): its refill now, before the softmax and P (6% faster
        # than after them: H200 2026-12-05, docs/kernels-log.md)
        gl.thread_barrier()
        mbarrier.wait(vt_ready.index(G), j & 1)
        _issue_ds(kd, rd, sd, kv_smem, kr_smem, ks_smem, bars, page_next,
                  n0 + STAGES * BLOCK_N, stage, block_size, num_blocks, refill)
        s = gl.convert_layout(_half_sum(a0), t_l) * _group(sc, sel, 0, per_key)[:, None]
        s += gl.convert_layout(_half_sum(a1), t_l) * _group(sc, sel, 1, per_key)[:, None]
        s += gl.convert_layout(_half_sum(a2), t_l) * _group(sc, sel, 2, per_key)[:, None]
        s += gl.convert_layout(_half_sum(a3), t_l) * _group(sc, sel, 3, per_key)[:, None]
        s = s * row_scale[None, :] + gl.convert_layout(r, t_l) * qk_scale
        seen = ((n0 + kn)[:, None] < hi[None, :]) & (bad == 0)
        s = gl.where(seen, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 0))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s - m_use[None, :]) * 256.0  # x 256 as in mla_gluon_e4m3
        alpha = gl.exp2(m_i - m_use)
        m_i = m_new
        l_acc = l_acc * alpha[None, :] + p
        pt0 = p2_smem[0].index(G + wi)
        pt1 = p2_smem[1].index(G + wi)
        pt2 = p2_smem[2].index(G + wi)
        pt3 = p2_smem[3].index(G + wi)
        _store_p(p, _group(fac, sel, 0, per_key), pt0, BLOCK_M)
        _store_p(p, _group(fac, sel, 1, per_key), pt1, BLOCK_M)
        _store_p(p, _group(fac, sel, 2, per_key), pt2, BLOCK_M)
        _store_p(p, _group(fac, sel, 3, per_key), pt3, BLOCK_M)
        fence_async_shared()
        gl.thread_barrier()  # P stored by every warp
        alpha_o = gl.convert_layout(alpha, gl.SliceLayout(0, o_l))
        va = vt_smem.index(2 * G + wi)  # latent rows [0, 256): groups 0 and 1
        vb = vt_smem.index(2 * G + 1 + wi)
        acc0 = _group_value(va.slice(0, GW, dim=0), pt0, o0, acc0, alpha_o,
                            _pick(smax, sel, 0))
        acc1 = _group_value(va.slice(GW, GW, dim=0), pt1, o0, acc1, alpha_o,
                            _pick(smax, sel, 1))
        acc2 = _group_value(vb.slice(0, GW, dim=0), pt2, o0, acc2, alpha_o,
                            _pick(smax, sel, 2))
        acc3 = _group_value(vb.slice(GW, GW, dim=0), pt3, o0, acc3, alpha_o,
                            _pick(smax, sel, 3))
        gl.thread_barrier()  # every warp's value MMAs over: V^T pair G and P are free
        mbarrier.arrive(vt_free.index(G), count=1)
        page = page_a
        page_next = page_b
    base = _ws_rows(m_r, q_start, heads, 2 * num_splits, 2 * split + G)
    rmask = m_r // heads < q_len
    gl.store(ws_m + base, m_i, mask=rmask)
    gl.store(ws_l + base, gl.sum(l_acc, 0) * (1.0 / 256.0), mask=rmask)
    m_o = tile * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, o_l))
    out = ws_o + _ws_rows(m_o, q_start, heads, 2 * num_splits, 2 * split + G)[None, :] * R \
        + latent_dim(gl.arange(0, GW, layout=gl.SliceLayout(1, o_l)))[:, None]
    omask = (m_o // heads < q_len)[None, :]
    gl.store(out, acc0 * (1.0 / 256.0), mask=omask)
    gl.store(out + GW, acc1 * (1.0 / 256.0), mask=omask)
    gl.store(out + 2 * GW, acc2 * (1.0 / 256.0), mask=omask)
    gl.store(out + 3 * GW, acc3 * (1.0 / 256.0), mask=omask)


@gluon.jit
def _ds_mma0(args, R: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
             STAGES: gl.constexpr, CAUSAL: gl.constexpr, HAS_DRAFT: gl.constexpr):
    _ds_mma(args, 0, R, BLOCK_M, BLOCK_N, STAGES, CAUSAL, HAS_DRAFT)


@gluon.jit
def _ds_mma1(args, R: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
             STAGES: gl.constexpr, CAUSAL: gl.constexpr, HAS_DRAFT: gl.constexpr):
    _ds_mma(args, 1, R, BLOCK_M, BLOCK_N, STAGES, CAUSAL, HAS_DRAFT)


@gluon.jit
def _mla_gluon_ds_ws(
    ql_ptr, qr_ptr, qsl_ptr, lens_ptr, table_ptr, ws_o, ws_m, ws_l, flag_ptr, kd, rd, sd,
    stride_qt, stride_qh, stride_rt, stride_rh, stride_tb,
    num_blocks, block_size, heads, scale, draft, tiles, num_splits,
    R: gl.constexpr, P: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, CAUSAL: gl.constexpr, HAS_DRAFT: gl.constexpr,
):
    """Program (request x row tile, split): this split's keys for <= 16 rows of an
    fp8_ds_mla cache. The kernel's own warpgroup transposes (``mla_gluon_e4m3._transposer``),
    two MMA warpgroups take alternate tiles; workspace splits 2 split and 2 split + 1."""
    gl.static_assert(gl.num_warps() == 4)
    gl.static_assert((R == 512) & (BLOCK_N == 64) & (STAGES == 2))
    e4: gl.constexpr = gl.float8e4nv
    N2: gl.constexpr = 2 * BLOCK_M
    H: gl.constexpr = R // 2
    q_l: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    r_l: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])

    b, tile, split, q_start, q_len, seq_len = _request_tile(qsl_ptr, lens_ptr, tiles)
    if tile * BLOCK_M >= q_len * heads:
        return

    q2_smem = gl.allocate_shared_memory(e4, [1, N2, R],
                                        gl.NVMMASharedLayout.get_default_for([N2, R], e4))
    qr_smem = gl.allocate_shared_memory(
        gl.bfloat16, [1, BLOCK_M, P],
        gl.NVMMASharedLayout.get_default_for([BLOCK_M, P], gl.bfloat16))
    kv_smem = gl.allocate_shared_memory(kd.dtype, [STAGES, BLOCK_N, R], kd.layout)
    kr_smem = gl.allocate_shared_memory(rd.dtype, [STAGES, BLOCK_N, P], rd.layout)
    ks_smem = gl.allocate_shared_memory(sd.dtype, [STAGES, BLOCK_N, 4], sd.layout)
    vt_smem = gl.allocate_shared_memory(
        e4, [4, H, BLOCK_N], gl.NVMMASharedLayout.get_default_for([H, BLOCK_N], e4))
    # P_g per group, each its own buffer (one per MMA warpgroup): stores into one
    # allocation are fenced from each other by barriers, into different ones not
    p_lay: gl.constexpr = gl.NVMMASharedLayout.get_default_for([N2, BLOCK_N], e4)
    p2_smem = (gl.allocate_shared_memory(e4, [2, N2, BLOCK_N], p_lay),
               gl.allocate_shared_memory(e4, [2, N2, BLOCK_N], p_lay),
               gl.allocate_shared_memory(e4, [2, N2, BLOCK_N], p_lay),
               gl.allocate_shared_memory(e4, [2, N2, BLOCK_N], p_lay))
    rs_smem = gl.allocate_shared_memory(gl.float32, [1, BLOCK_M],
                                        gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    bars, vt_ready, vt_free = ws_barriers(STAGES)

    # the queries: latent as e4m3 hi + lo (rows [0, 16) and [16, 32)), rope as bf16; each
    # row's latent score scale for both MMA warpgroups
    x, y = query_rows(ql_ptr, qr_ptr, stride_qt, stride_qh, stride_rt, stride_rh, tile,
                      q_start, q_len, heads, R, P, BLOCK_M, q_l)
    amax = gl.max(gl.abs(x), 1)
    sq = gl.where(amax > 0, amax / 448.0, 1.0)
    x = x / sq[:, None]
    xh = x.to(e4)
    q2_smem.index(0).slice(0, BLOCK_M, dim=0).store(xh)
    q2_smem.index(0).slice(BLOCK_M, BLOCK_M, dim=0).store((x - xh.to(gl.float32)).to(e4))
    qr_smem.index(0).store(y.to(gl.bfloat16))
    qk_scale = scale * 1.4426950408889634
    rs_smem.index(0).store(gl.convert_layout(sq, r_l) * qk_scale)
    fence_async_shared()  # the queries' stores and the barriers' init, before async readers
    gl.thread_barrier()

    m_r = tile * BLOCK_M + gl.arange(0, BLOCK_M, layout=r_l)
    hi = _extents(m_r // heads, q_len, seq_len, draft, CAUSAL, HAS_DRAFT)
    s_lo, n_tiles = _split_tiles(hi, split, num_splits, BLOCK_N)
    table_row = table_ptr + b.to(gl.int64) * stride_tb
    _ring_page_ds(kd, rd, sd, kv_smem, kr_smem, ks_smem, bars, table_row, s_lo, n_tiles, 0,
                  block_size, num_blocks, BLOCK_N)
    _ring_page_ds(kd, rd, sd, kv_smem, kr_smem, ks_smem, bars, table_row, s_lo, n_tiles, 1,
                  block_size, num_blocks, BLOCK_N)
    mma_args = (q2_smem, qr_smem, kv_smem, kr_smem, ks_smem, vt_smem, p2_smem, rs_smem, bars,
                vt_ready, vt_free, kd, rd, sd, table_row, s_lo, n_tiles, block_size, num_blocks,
                flag_ptr, seq_len, draft, ws_o, ws_m, ws_l, tile, q_start, q_len, heads,
                num_splits, split, qk_scale)
    t_args = (kv_smem, vt_smem, bars, vt_ready, vt_free, table_row, s_lo, n_tiles, block_size,
              num_blocks, seq_len)
    gl.warp_specialize(
        [(_transposer, (t_args, R, BLOCK_N, STAGES)),
         (_ds_mma0, (mma_args, R, BLOCK_M, BLOCK_N, STAGES, CAUSAL, HAS_DRAFT)),
         (_ds_mma1, (mma_args, R, BLOCK_M, BLOCK_N, STAGES, CAUSAL, HAS_DRAFT))],
        [4, 4], [MMA_REGS, MMA_REGS])


def descriptors(cache: torch.Tensor):
    """(latent, rope, scales) Gluon tensor descriptors over an fp8_ds_mla cache's bytes seen
    as one row per slot: [64, 512] e4m3 (128-byte swizzle), [64, 64] bf16 (128-byte
    swizzle), [64, 4] fp32 (none)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    num_blocks, block_size, width = cache.shape
    rows, row = num_blocks * block_size, cache.stride(1)

    def desc(dtype, gdt, box):
        size = torch.tensor([], dtype=dtype).element_size()
        return TensorDescriptor(cache.view(dtype), [rows, width // size], [row // size, 1],
                                [BLOCK_N, box],
                                gl.NVMMASharedLayout.get_default_for([BLOCK_N, box], gdt))

    return (desc(torch.float8_e4m3fn, gl.float8e4nv, RANK),
            desc(torch.bfloat16, gl.bfloat16, ROPE),
            desc(torch.float32, gl.float32, GROUPS))


def supported(q_latent, q_rope, cache, mask, rows: int = 1) -> str | None:
    """Why the fp8_ds_mla Gluon kernel cannot take this call (None: it can); ``rows``: query
    rows per request (q_len x heads). Device checks last."""
    if cache.dtype != torch.uint8 or cache.dim() != 3 or cache.shape[-1] != ENTRY:
        return (f"a {cache.dtype} cache of entry {cache.shape[-1]} (fp8_ds_mla uint8 entries "
                f"of {ENTRY} bytes only)")
    if rows > SWAP_ROWS:
        return f"{rows} rows per request (the <= {SWAP_ROWS}-row kernel only)"
    if q_latent.dtype not in (torch.bfloat16, torch.float16) or q_rope is None or (
            q_rope.dtype != q_latent.dtype):
        return f"{q_latent.dtype} queries (bf16/fp16 with a rope part of the same dtype only)"
    if q_latent.shape[-1] != RANK or q_rope.shape[-1] != ROPE:
        return f"rank {q_latent.shape[-1]} + rope {q_rope.shape[-1]} (512 + 64 only)"
    if cache.shape[1] % BLOCK_N:
        return f"block size {cache.shape[1]} (multiples of {BLOCK_N})"
    if cache.stride(2) != 1 or cache.stride(0) != cache.shape[1] * cache.stride(1) or (
            cache.stride(1) % 16 or cache.data_ptr() % 16):
        return "cache entries not page-contiguous and 16-byte aligned"
    if mask.window is not None or mask.chunk is not None:
        return "sliding-window / chunked masks"
    if cache.device.type != "cuda" or torch.cuda.get_device_capability(cache.device) != (9, 0):
        return "not a Hopper (sm_90) device"
    return None


def plan(ql, qr, cache, query_start_loc, seq_lens, table, out, *, scale: float, mask,
         tiles: int, splits: int):
    """``mla_gluon.plan`` for an fp8_ds_mla cache: this kernel (its ``STAGES`` as set now),
    the same combine over two workspace splits a program."""
    from pagedkv.launch import Launch
    from pagedkv.ops.triton.combine import combine_launch
    from pagedkv.ops.triton.mla_gluon import Plan

    descs = descriptors(cache)
    num_blocks, block_size = cache.shape[:2]
    rows, heads = ql.shape[:2]
    consts = dict(R=RANK, P=ROPE, BLOCK_M=SWAP_ROWS, BLOCK_N=BLOCK_N, STAGES=STAGES,
                  CAUSAL=mask.causal, HAS_DRAFT=mask.draft_block is not None, num_warps=4,
                  maxnreg=MAXNREG)
    kernel = Launch(_mla_gluon_ds_ws, (seq_lens.shape[0] * tiles, splits), (
        *descs, ql.stride(0), ql.stride(1), qr.stride(0), qr.stride(1), table.stride(0),
        num_blocks, block_size, heads, scale, mask.draft_block or 0, tiles, splits), consts)
    ws_shape = (rows, heads, 2 * splits, RANK)
    return Plan(kernel, combine_launch(ws_shape, out, query_start_loc, None), ws_shape, descs)
