"""Absorbed MLA decode over a per-tensor e4m3 latent cache with both products on the 8-bit
tensor cores (Gluon, Hopper sm_90): the <= 16-row kernel of ``mla_gluon`` without widening.

Why: the first fp8 Gluon kernel (``WIDEN``, since deleted) converted every fp8 tile to bf16
in shared memory (37 KB read, 74 KB written by the warpgroup, on the critical path of each
tile) and then ran bf16 MMAs; here the MMAs read e4m3 operands, so a tile costs its 37 KB
once.

- Keys on the MMA's M side (64 keys a tile), the <= 16 (query row, head) rows as N, one
  warpgroup, the TMA ring of ``mla_gluon`` (``STAGES`` slots of [64, 512] + [64, 64] e4m3
  boxes), block ids read a ring's length ahead.
- Scores S^T = K Q^T: K as stored (K-major), the queries split into e4m3 hi + lo with one
  scale per row (amax / 448 over the 576 columns), so the scores keep about bf16's 8
  significant bits; hi and lo accumulate in one MMA chain over the 576 columns.
- Values O^T = V^T P^T: 8-bit wgmma operands from shared memory must be K-major (keys
  contiguous) and the cache's latent is not, so the warpgroup transposes each tile's latent
  through registers into a [512, 64] buffer while the score MMAs run (keys past the
  sequence or behind a bad block id zeroed: NaN-filled slots would survive a zero
  probability). The ring slot is refilled right after the score MMAs, before the softmax.
- P x 256 split into e4m3 hi + lo (two value MMAs; one e4m3 tile alone gives 1-2.5%
  relative error, benchmarks/fp8_probs.py); each tile's product in a fresh accumulator,
  added to the running output in registers, because e4m3 MMAs accumulate with limited
  precision (benchmarks/fp8_split_error.py). The row sums add the e4m3 values the MMA
  multiplies.

Hi and lo of the queries, and of P, sit side by side as one MMA operand (N = 32: 34
m64n32k32 a tile), so the tensor cores read each K tile and V^T once
(``_mla_gluon_e4m3_stacked``). On an H200 (2026-12-04 17:12-17:13 UTC, torch 2.11+cu130,
triton 3.6.0; ``PAGEDKV_BENCH_MLA_FAMILIES=mla_q1,mla_fp8,mla_ds
PAGEDKV_BENCH_GLUON_VARIANTS= PAGEDKV_BENCH_E4M3=4:0:1,4:0:1:2,3:0:1:2 PAGEDKV_BENCH_DS=4,3
PYTHONPATH=src python3 benchmarks/attention.py --only mla --quick --graphs --no-mla-sweep
--gluon``, the e4m3 forms' format of that date), B64 ctx8K h16 q1 page 64, us eager / CUDA
graph: this kernel 145.8 / 144.7, bf16 Gluon 157.4 / 156.6, the widening kernel it
replaced 306.3 / 304.6. Forms that lost and were deleted: the same kernel on two
warpgroups splitting each tile (153.0 / 152.5 with 4 ring slots, 152.8 / 152.6 with 3), hi
and lo as two MMA chains (171.9 / 171.9, 13:56 UTC). docs/kernels.md, "MLA, Gluon fp8
kernel with both products on e4m3", has the earlier runs.

Scope is ``mla_gluon``'s fp8 scope (per-tensor e4m3 cache with a float scale, bf16/fp16
queries, <= 16 rows per request, blocks of multiples of 64, causal / non-causal /
draft-block masks); ``mla_gluon.plan`` launches it for every such call.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from pagedkv.ops.triton.gluon_common import e4m3_softmax as _e4m3_softmax
from pagedkv.ops.triton.gluon_common import half_sum as _half_sum
from pagedkv.ops.triton.gluon_common import request_tile as _request_tile
from pagedkv.ops.triton.mla_gluon import _extents, _flag_bad, _issue, _split_tiles, _ws_rows

# ring slots: 64-key e4m3 tiles are 36.9 KB; the transposed latent (32 KB), the queries
# (18 KB) and P (2 KB) leave room for up to 4 in 227 KB; one program per SM either way.
# 4: 171.8 us against 175.4 with 3 (two-chain form, one H200 run each, 2%: within noise)
STAGES = 4
# the latent transposed as key pairs through two byte permutes per 4 pairs (``_transpose_pairs``);
# False: the compiler's own byte shuffle (``_transpose_latent``, ~3x the permutes)
PAIRS = True
# the warp-specialized form (``_mla_gluon_e4m3_ws``): a second warpgroup transposes each
# tile's latent into one of two V^T buffers while the kernel's own warpgroup runs the MMAs
# and the softmax; False: ``_mla_gluon_e4m3_stacked``, one warpgroup doing both in turn
WS = True
# with WS: "pp" = ``_mla_gluon_e4m3_pp`` (two MMA warpgroups), "one" = ``_mla_gluon_e4m3_ws``
FORM = "pp"
# its registers: 168 a thread at launch (8 warps), the transposing warpgroup set to
# ``WS_WORKER_REGS``, the MMA warpgroup to the rest (240)
WS_MAXNREG = 168
WS_WORKER_REGS = gl.constexpr(96)
PROBE = 0  # TEMP


@gluon.jit
def _ring_page(kd, rd, kv_smem, kr_smem, bars, table_row, s_lo, n_tiles, i: gl.constexpr,
               block_size, num_blocks, BLOCK_N: gl.constexpr, R: gl.constexpr):
    """Ring slot i's first copy (tile i of the split, if any); returns its block id."""
    page = gl.load(table_row + (s_lo + i * BLOCK_N) // block_size, mask=n_tiles > i, other=0)
    _issue(kd, rd, kv_smem, kr_smem, bars, page, s_lo + i * BLOCK_N, i, block_size, num_blocks,
           n_tiles > i, R)
    return page


@gluon.jit
def _transpose_latent(kv, vt, vt_b, keep, MASK: gl.constexpr, R: gl.constexpr,
                      ROWS: gl.constexpr, v_l: gl.constexpr):
    """The latent of a landed [64 keys, R] e4m3 tile -> ``vt`` [R, 64] (K-major for the value
    MMA; or its first ``ROWS`` rows into ``vt`` and the rest into ``vt_b``), 128 columns at
    a time through registers (2 keys x 16 columns a thread, byte permutes); with ``MASK``
    keys not ``keep`` zeroed (per byte: ~4 instructions each, so only for a sequence's last
    tile or a bad block id)."""
    for c in gl.static_range(R // 128):
        x = kv.slice(c * 128, 128, dim=1).load(v_l)
        if MASK:
            x = gl.where(keep[:, None], x, gl.zeros_like(x))
        if c * 128 < ROWS:
            vt.slice(c * 128, 128, dim=0).store(gl.permute(x, (1, 0)))
        else:
            vt_b.slice(c * 128 - ROWS, 128, dim=0).store(gl.permute(x, (1, 0)))


@gluon.jit
def _pair_keys(a, b):
    """Each 4 e4m3 of an even key (a) and the next key (b), same 4 columns -> the 4 (even,
    odd) byte pairs as int16: two byte permutes per 4 pairs (the compiler's own shuffle
    extracts and re-packs every byte, 3 instructions a pair)."""
    return gl.inline_asm_elementwise(
        "prmt.b32 $0, $2, $3, 0x5140;\n\tprmt.b32 $1, $2, $3, 0x7362;", "=r,=r,r,r", [a, b],
        dtype=gl.int16, is_pure=True, pack=4)


@gluon.jit
def _transpose_pairs(kv, vt16, vt16_b, R: gl.constexpr, ROWS: gl.constexpr,
                     v_l: gl.constexpr):
    """``_transpose_latent`` without masking, as key pairs: each thread's two adjacent keys
    joined per column by ``_pair_keys`` and stored as int16 into ``vt16`` / ``vt16_b`` (the
    e4m3 buffers seen as [rows, 32] int16: the same bytes)."""
    for c in gl.static_range(R // 128):
        x = kv.slice(c * 128, 128, dim=1).load(v_l)
        a, b = gl.split(gl.permute(gl.reshape(x, [32, 2, 128]), (0, 2, 1)))
        h = gl.permute(_pair_keys(a, b), (1, 0))
        if c * 128 < ROWS:
            vt16.slice(c * 128, 128, dim=0).store(h)
        else:
            vt16_b.slice(c * 128 - ROWS, 128, dim=0).store(h)


@gluon.jit
def _ring_fill(kd, rd, kv_smem, kr_smem, bars, table_row, s_lo, n_tiles, block_size,
               num_blocks, STAGES: gl.constexpr, BLOCK_N: gl.constexpr, R: gl.constexpr):
    """Every ring slot's first copy; returns the block ids of the tiles in the ring (slots
    past ``STAGES`` repeat the second), which ride along the loop (``_ring_next``), so no
    table read sits between a tile's arrival and its use."""
    gl.static_assert((STAGES >= 2) & (STAGES <= 4))
    pa = _ring_page(kd, rd, kv_smem, kr_smem, bars, table_row, s_lo, n_tiles, 0, block_size,
                    num_blocks, BLOCK_N, R)
    pb = _ring_page(kd, rd, kv_smem, kr_smem, bars, table_row, s_lo, n_tiles, 1, block_size,
                    num_blocks, BLOCK_N, R)
    pc = pb
    pd = pb
    if STAGES > 2:
        pc = _ring_page(kd, rd, kv_smem, kr_smem, bars, table_row, s_lo, n_tiles, 2,
                        block_size, num_blocks, BLOCK_N, R)
    if STAGES > 3:
        pd = _ring_page(kd, rd, kv_smem, kr_smem, bars, table_row, s_lo, n_tiles, 3,
                        block_size, num_blocks, BLOCK_N, R)
    return pa, pb, pc, pd


@gluon.jit
def _ring_next(pb, pc, pd, page_next, STAGES: gl.constexpr):
    """The ring's block ids one tile on: the next tile's first, ``page_next`` (the tile the
    slot just consumed takes next) last."""
    pa = pb
    if STAGES == 2:
        pb = page_next
    elif STAGES == 3:
        pb = pc
        pc = page_next
    else:
        pb = pc
        pc = pd
        pd = page_next
    return pa, pb, pc, pd


@gluon.jit
def _values_hilo(vt_a, vt_b, p2, o0, acc0, acc1, alpha):
    """O^T halves += V^T halves x P^T hi and lo (N = 2 x rows), each half in a fresh
    accumulator summed (hi + lo) into the running one: the first half's sum overlaps the
    second's MMAs. V^T and P stored and fenced by every warp before this."""
    o_a = warpgroup_mma(vt_a, p2.permute((1, 0)), o0, use_acc=False, is_async=True)
    o_b = warpgroup_mma(vt_b, p2.permute((1, 0)), o0, use_acc=False, is_async=True)
    alpha_o = gl.convert_layout(alpha, gl.SliceLayout(0, acc0.type.layout))
    o_a = warpgroup_mma_wait(1, deps=[o_a])
    acc0 = acc0 * alpha_o[None, :] + _half_sum(o_a)
    o_b = warpgroup_mma_wait(0, deps=[o_b])
    acc1 = acc1 * alpha_o[None, :] + _half_sum(o_b)
    return acc0, acc1


@gluon.jit
def _store_halves(ws_o, ws_m, ws_l, m_r, m_i, l_acc, acc0, acc1, tile, q_start, q_len, heads,
                  num_splits, split, lscale, BLOCK_M: gl.constexpr, R: gl.constexpr):
    """This split's workspace rows: maxima, row sums and the output halves (each thread
    the dims its accumulators hold), the factor 256 of P and ``lscale`` undone."""
    H: gl.constexpr = R // 2
    o_l: gl.constexpr = acc0.type.layout
    base = _ws_rows(m_r, q_start, heads, num_splits, split)
    rmask = m_r // heads < q_len
    gl.store(ws_m + base, m_i, mask=rmask)
    gl.store(ws_l + base, gl.sum(l_acc, 0) * (1.0 / 256.0), mask=rmask)
    m_o = tile * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, o_l))
    base_o = _ws_rows(m_o, q_start, heads, num_splits, split)
    omask = (m_o // heads < q_len)[None, :]
    co = gl.arange(0, H, layout=gl.SliceLayout(1, o_l))
    gl.store(ws_o + base_o[None, :] * R + co[:, None], acc0 * (lscale / 256.0), mask=omask)
    gl.store(ws_o + base_o[None, :] * R + (co + H)[:, None], acc1 * (lscale / 256.0),
             mask=omask)


@gluon.jit
def _mla_gluon_e4m3_stacked(
    ql_ptr, qr_ptr, qsl_ptr, lens_ptr, table_ptr, ws_o, ws_m, ws_l, flag_ptr, kd, rd,
    stride_qt, stride_qh, stride_rt, stride_rh, stride_tb,
    num_blocks, block_size, heads, scale, draft, tiles, num_splits, lscale,
    R: gl.constexpr, P: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, CAUSAL: gl.constexpr, HAS_DRAFT: gl.constexpr,
    PAIRS: gl.constexpr = True,
):
    """Program (request x row tile, split): this split's keys for <= 16 rows; writes split
    ``split`` of the workspace (o scaled by ``lscale``, as ``_mla_gluon_swap``). Hi and lo
    side by side as the MMAs' N (rows [0, 16) hi, [16, 32) lo of one operand): each K tile
    and each V^T half is read once by the tensor cores per tile (18 score + 16 value
    m64n32k32 MMAs), the hi + lo sums taken in registers (``_half_sum``); the scores then
    move to the N = 16 MMA layout, from which P is stored."""
    gl.static_assert(gl.num_warps() == 4)
    e4: gl.constexpr = gl.float8e4nv
    N2: gl.constexpr = 2 * BLOCK_M
    H: gl.constexpr = R // 2
    t2_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                   instr_shape=[16, N2, 32])
    t_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BLOCK_M, 32])
    per_row: gl.constexpr = gl.SliceLayout(0, t_l)
    per_key: gl.constexpr = gl.SliceLayout(1, t_l)
    q_l: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    v_l: gl.constexpr = gl.BlockedLayout([2, 16], [32, 1], [1, 4], [1, 0])

    b, tile, split, q_start, q_len, seq_len = _request_tile(qsl_ptr, lens_ptr, tiles)
    if tile * BLOCK_M >= q_len * heads:
        return

    q2_smem = gl.allocate_shared_memory(e4, [1, N2, R],
                                        gl.NVMMASharedLayout.get_default_for([N2, R], e4))
    q2r_smem = gl.allocate_shared_memory(e4, [1, N2, P],
                                         gl.NVMMASharedLayout.get_default_for([N2, P], e4))
    kv_smem = gl.allocate_shared_memory(kd.dtype, [STAGES, BLOCK_N, R], kd.layout)
    kr_smem = gl.allocate_shared_memory(rd.dtype, [STAGES, BLOCK_N, P], rd.layout)
    vt_smem = gl.allocate_shared_memory(
        e4, [2, H, BLOCK_N], gl.NVMMASharedLayout.get_default_for([H, BLOCK_N], e4))
    p2_smem = gl.allocate_shared_memory(
        e4, [1, N2, BLOCK_N], gl.NVMMASharedLayout.get_default_for([N2, BLOCK_N], e4))
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)

    # the queries as e4m3 hi + lo, interleaved rows
    mq = tile * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, q_l))
    tq = (q_start + mq // heads).to(gl.int64)
    qmask = (mq // heads < q_len)[:, None]
    x = gl.load(ql_ptr + tq[:, None] * stride_qt + (mq % heads)[:, None] * stride_qh
                + gl.arange(0, R, layout=gl.SliceLayout(0, q_l))[None, :],
                mask=qmask, other=0.0).to(gl.float32)
    y = gl.load(qr_ptr + tq[:, None] * stride_rt + (mq % heads)[:, None] * stride_rh
                + gl.arange(0, P, layout=gl.SliceLayout(0, q_l))[None, :],
                mask=qmask, other=0.0).to(gl.float32)
    amax = gl.maximum(gl.max(gl.abs(x), 1), gl.max(gl.abs(y), 1))
    sq = gl.where(amax > 0, amax / 448.0, 1.0)
    x = x / sq[:, None]
    xh = x.to(e4)
    q2_smem.index(0).slice(0, BLOCK_M, dim=0).store(xh)
    q2_smem.index(0).slice(BLOCK_M, BLOCK_M, dim=0).store((x - xh.to(gl.float32)).to(e4))
    y = y / sq[:, None]
    yh = y.to(e4)
    q2r_smem.index(0).slice(0, BLOCK_M, dim=0).store(yh)
    q2r_smem.index(0).slice(BLOCK_M, BLOCK_M, dim=0).store((y - yh.to(gl.float32)).to(e4))
    fence_async_shared()  # the queries' stores and the barriers' init, before async readers
    gl.thread_barrier()

    s0 = gl.zeros([BLOCK_N, N2], gl.float32, layout=t2_l)
    o0 = gl.zeros([H, N2], gl.float32, layout=t2_l)
    l_acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=t_l)
    # the output halves [R / 2, rows] in the layout of the hi + lo sums
    acc0 = _half_sum(o0)
    acc1 = acc0
    vt16_lay: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=BLOCK_N,
                                                  element_bitwidth=16, rank=2)
    row_scale = gl.convert_layout(sq, per_row) * (scale * lscale * 1.4426950408889634)

    m_r = tile * BLOCK_M + gl.arange(0, BLOCK_M, layout=per_row)
    hi = _extents(m_r // heads, q_len, seq_len, draft, CAUSAL, HAS_DRAFT)
    s_lo, n_tiles = _split_tiles(hi, split, num_splits, BLOCK_N)
    table_row = table_ptr + b.to(gl.int64) * stride_tb
    pa, pb, pc, pd = _ring_fill(kd, rd, kv_smem, kr_smem, bars, table_row, s_lo, n_tiles,
                                block_size, num_blocks, STAGES, BLOCK_N, R)

    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=per_row)
    kn = gl.arange(0, BLOCK_N, layout=per_key)
    kt = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, v_l))
    for it in range(n_tiles):
        stage = it % STAGES
        n0 = s_lo + it * BLOCK_N
        wi = it // (n_tiles + 1)  # always 0
        page = pa
        refill = it + STAGES < n_tiles
        page_next = gl.load(table_row + (n0 + STAGES * BLOCK_N) // block_size, mask=refill,
                            other=0)
        bad = _flag_bad(page, num_blocks, flag_ptr)
        mbarrier.wait(bars.index(stage), (it // STAGES) & 1)
        kv = kv_smem.index(stage)
        s2 = warpgroup_mma(kv, q2_smem.index(wi).permute((1, 0)), s0, use_acc=False,
                           is_async=True)
        s2 = warpgroup_mma(kr_smem.index(stage), q2r_smem.index(wi).permute((1, 0)), s2,
                           is_async=True)
        vt_a = vt_smem.index(wi)  # latent columns [0, R / 2) and [R / 2, R) as V^T halves
        vt_b = vt_smem.index(wi + 1)
        # V^T of the slot while the score MMAs run: the masked byte shuffle only on the
        # sequence's last tile or one behind a bad block id, key pairs elsewhere
        if (n0 + BLOCK_N > seq_len) | bad:  # the sequence's last, partly written tile
            _transpose_latent(kv, vt_a, vt_b, (n0 + kt < seq_len) & (bad == 0), True, R, H,
                              v_l)
        elif PAIRS:
            _transpose_pairs(kv, vt_a._reinterpret(gl.int16, [H, BLOCK_N // 2], vt16_lay),
                             vt_b._reinterpret(gl.int16, [H, BLOCK_N // 2], vt16_lay), R, H,
                             v_l)
        else:
            _transpose_latent(kv, vt_a, vt_b, kt, False, R, H, v_l)
        s2 = warpgroup_mma_wait(0, deps=[s2])
        gl.thread_barrier()  # every warp's reads of the slot are over: refill it now
        _issue(kd, rd, kv_smem, kr_smem, bars, page_next, n0 + STAGES * BLOCK_N, stage,
               block_size, num_blocks, refill, R)
        s = gl.convert_layout(_half_sum(s2), t_l)
        seen = ((n0 + kn)[:, None] < hi[None, :]) & (bad == 0)
        s = gl.where(seen, s * row_scale[None, :], float("-inf"))
        alpha, m_i, l_acc = _e4m3_softmax(s, m_i, l_acc, p2_smem.index(wi), BLOCK_M)
        fence_async_shared()
        gl.thread_barrier()  # V^T and P stored by every warp
        acc0, acc1 = _values_hilo(vt_a, vt_b, p2_smem.index(wi), o0, acc0, acc1, alpha)
        gl.thread_barrier()  # every warp done with V^T and P before they are rewritten
        pa, pb, pc, pd = _ring_next(pb, pc, pd, page_next, STAGES)

    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    _store_halves(ws_o, ws_m, ws_l, m_r, m_i, l_acc, acc0, acc1, tile, q_start, q_len, heads,
                  num_splits, split, lscale, BLOCK_M, R)


@gluon.jit
def _ws_transposer(args, R: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                   PAIRS: gl.constexpr, PROBE: gl.constexpr, VT: gl.constexpr):
    """The transposing warpgroup: tile t's latent, once its copy lands, into V^T buffer
    pair t % VT once the MMA warpgroups are done with tile t - VT's (masked as in
    ``_mla_gluon_e4m3_stacked``); signals ``vt_ready``. Each tile's block id is read one
    tile ahead."""
    (kv_smem, vt_smem, bars, vt_ready, vt_free, table_row, s_lo, n_tiles, block_size,
     num_blocks, seq_len) = args
    H: gl.constexpr = R // 2
    v_l: gl.constexpr = gl.BlockedLayout([2, 16], [32, 1], [1, 4], [1, 0])
    vt16_lay: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=BLOCK_N,
                                                  element_bitwidth=16, rank=2)
    kt = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, v_l))
    page = gl.load(table_row + s_lo // block_size, mask=n_tiles > 0, other=0)
    for it in range(n_tiles):
        j = it % VT
        n0 = s_lo + it * BLOCK_N
        page_nx = gl.load(table_row + (n0 + BLOCK_N) // block_size, mask=it + 1 < n_tiles,
                          other=0)
        bad = (page < 0) | (page >= num_blocks)
        vt_a = vt_smem.index(2 * j)
        vt_b = vt_smem.index(2 * j + 1)
        mbarrier.wait(vt_free.index(j), ((it // VT) & 1) ^ 1)  # (fresh: passes)
        mbarrier.wait(bars.index(it % STAGES), (it // STAGES) & 1)
        kv = kv_smem.index(it % STAGES)
        if PROBE == 1:
            pass
        elif (n0 + BLOCK_N > seq_len) | bad:  # the sequence's last, partly written tile
            _transpose_latent(kv, vt_a, vt_b, (n0 + kt < seq_len) & (bad == 0), True, R, H,
                              v_l)
        elif PAIRS:
            _transpose_pairs(kv, vt_a._reinterpret(gl.int16, [H, BLOCK_N // 2], vt16_lay),
                             vt_b._reinterpret(gl.int16, [H, BLOCK_N // 2], vt16_lay), R, H,
                             v_l)
        else:
            _transpose_latent(kv, vt_a, vt_b, kt, False, R, H, v_l)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(vt_ready.index(j), count=1)
        page = page_nx


@gluon.jit
def _ws_mma(args, out_args, row_scale, pa, pb, pc, pd, R: gl.constexpr, BLOCK_M: gl.constexpr,
            BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PROBE: gl.constexpr):
    """The kernel's own warpgroup: per tile the score MMAs, the softmax and P, then (V^T
    ready, so the ring slot has no other reader) the slot's refill and the value MMAs;
    releases the V^T pair. Writes the split's workspace rows (so no value lives across the
    warp-specialized region: ptxas would keep it on the stack)."""
    (q2_smem, q2r_smem, kv_smem, kr_smem, vt_smem, p2_smem, bars, vt_ready, vt_free, kd, rd,
     table_row, s_lo, n_tiles, block_size, num_blocks, flag_ptr, hi) = args
    ws_o, ws_m, ws_l, tile, q_start, q_len, heads, num_splits, split, lscale = out_args
    N2: gl.constexpr = 2 * BLOCK_M
    H: gl.constexpr = R // 2
    t2_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                   instr_shape=[16, N2, 32])
    t_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BLOCK_M, 32])
    per_row: gl.constexpr = gl.SliceLayout(0, t_l)
    per_key: gl.constexpr = gl.SliceLayout(1, t_l)
    s0 = gl.zeros([BLOCK_N, N2], gl.float32, layout=t2_l)
    o0 = gl.zeros([H, N2], gl.float32, layout=t2_l)
    l_acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=t_l)
    acc0 = _half_sum(o0)
    acc1 = acc0
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=per_row)
    kn = gl.arange(0, BLOCK_N, layout=per_key)
    for it in range(n_tiles):
        stage = it % STAGES
        j = it % 2
        n0 = s_lo + it * BLOCK_N
        wi = it // (n_tiles + 1)  # always 0
        page = pa
        refill = it + STAGES < n_tiles
        page_next = gl.load(table_row + (n0 + STAGES * BLOCK_N) // block_size, mask=refill,
                            other=0)
        bad = _flag_bad(page, num_blocks, flag_ptr)
        mbarrier.wait(bars.index(stage), (it // STAGES) & 1)
        s2 = warpgroup_mma(kv_smem.index(stage), q2_smem.index(wi).permute((1, 0)), s0,
                           use_acc=False, is_async=True)
        s2 = warpgroup_mma(kr_smem.index(stage), q2r_smem.index(wi).permute((1, 0)), s2,
                           is_async=True)
        s2 = warpgroup_mma_wait(0, deps=[s2])
        s = gl.convert_layout(_half_sum(s2), t_l)
        seen = ((n0 + kn)[:, None] < hi[None, :]) & (bad == 0)
        s = gl.where(seen, s * row_scale[None, :], float("-inf"))
        alpha, m_i, l_acc = _e4m3_softmax(s, m_i, l_acc, p2_smem.index(wi), BLOCK_M)
        fence_async_shared()
        gl.thread_barrier()  # P stored and every warp's score MMAs over
        mbarrier.wait(vt_ready.index(j), (it // 2) & 1)
        _issue(kd, rd, kv_smem, kr_smem, bars, page_next, n0 + STAGES * BLOCK_N, stage,
               block_size, num_blocks, refill, R)
        if PROBE != 2:
            acc0, acc1 = _values_hilo(vt_smem.index(2 * j + wi), vt_smem.index(2 * j + 1 + wi),
                                      p2_smem.index(wi), o0, acc0, acc1, alpha)
        gl.thread_barrier()  # every warp's value MMAs over: V^T pair j and P are free
        mbarrier.arrive(vt_free.index(j), count=1)
        pa, pb, pc, pd = _ring_next(pb, pc, pd, page_next, STAGES)
    m_r = tile * BLOCK_M + gl.arange(0, BLOCK_M, layout=per_row)
    _store_halves(ws_o, ws_m, ws_l, m_r, m_i, l_acc, acc0, acc1, tile, q_start, q_len, heads,
                  num_splits, split, lscale, BLOCK_M, R)


@gluon.jit
def _mla_gluon_e4m3_ws(
    ql_ptr, qr_ptr, qsl_ptr, lens_ptr, table_ptr, ws_o, ws_m, ws_l, flag_ptr, kd, rd,
    stride_qt, stride_qh, stride_rt, stride_rh, stride_tb,
    num_blocks, block_size, heads, scale, draft, tiles, num_splits, lscale,
    R: gl.constexpr, P: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, CAUSAL: gl.constexpr, HAS_DRAFT: gl.constexpr,
    PAIRS: gl.constexpr = True, PROBE: gl.constexpr = 0,
):
    """``_mla_gluon_e4m3_stacked`` on two warpgroups (``WS``): the V^T transpose, about
    half of a tile's instructions, runs in its own warpgroup into two alternating V^T
    buffers, so it overlaps the MMA warpgroup's work on the previous tile; the profile
    (docs/kernels.md, Nsight Compute) found the one-warpgroup kernel bound by one warp per
    scheduler issuing. Same workspace output."""
    gl.static_assert(gl.num_warps() == 4)
    gl.static_assert(STAGES <= 3)  # 3 x 36.9 KB ring + 2 x 32 KB V^T + queries, P
    e4: gl.constexpr = gl.float8e4nv
    N2: gl.constexpr = 2 * BLOCK_M
    H: gl.constexpr = R // 2
    t_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BLOCK_M, 32])
    per_row: gl.constexpr = gl.SliceLayout(0, t_l)
    q_l: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])

    b, tile, split, q_start, q_len, seq_len = _request_tile(qsl_ptr, lens_ptr, tiles)
    if tile * BLOCK_M >= q_len * heads:
        return

    q2_smem = gl.allocate_shared_memory(e4, [1, N2, R],
                                        gl.NVMMASharedLayout.get_default_for([N2, R], e4))
    q2r_smem = gl.allocate_shared_memory(e4, [1, N2, P],
                                         gl.NVMMASharedLayout.get_default_for([N2, P], e4))
    kv_smem = gl.allocate_shared_memory(kd.dtype, [STAGES, BLOCK_N, R], kd.layout)
    kr_smem = gl.allocate_shared_memory(rd.dtype, [STAGES, BLOCK_N, P], rd.layout)
    vt_smem = gl.allocate_shared_memory(
        e4, [4, H, BLOCK_N], gl.NVMMASharedLayout.get_default_for([H, BLOCK_N], e4))
    p2_smem = gl.allocate_shared_memory(
        e4, [1, N2, BLOCK_N], gl.NVMMASharedLayout.get_default_for([N2, BLOCK_N], e4))
    bar_l: gl.constexpr = mbarrier.MBarrierLayout()
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_l)
    vt_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
    vt_free = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(vt_ready.index(i), count=1)
        mbarrier.init(vt_free.index(i), count=1)

    # the queries as e4m3 hi + lo, interleaved rows
    mq = tile * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, q_l))
    tq = (q_start + mq // heads).to(gl.int64)
    qmask = (mq // heads < q_len)[:, None]
    x = gl.load(ql_ptr + tq[:, None] * stride_qt + (mq % heads)[:, None] * stride_qh
                + gl.arange(0, R, layout=gl.SliceLayout(0, q_l))[None, :],
                mask=qmask, other=0.0).to(gl.float32)
    y = gl.load(qr_ptr + tq[:, None] * stride_rt + (mq % heads)[:, None] * stride_rh
                + gl.arange(0, P, layout=gl.SliceLayout(0, q_l))[None, :],
                mask=qmask, other=0.0).to(gl.float32)
    amax = gl.maximum(gl.max(gl.abs(x), 1), gl.max(gl.abs(y), 1))
    sq = gl.where(amax > 0, amax / 448.0, 1.0)
    x = x / sq[:, None]
    xh = x.to(e4)
    q2_smem.index(0).slice(0, BLOCK_M, dim=0).store(xh)
    q2_smem.index(0).slice(BLOCK_M, BLOCK_M, dim=0).store((x - xh.to(gl.float32)).to(e4))
    y = y / sq[:, None]
    yh = y.to(e4)
    q2r_smem.index(0).slice(0, BLOCK_M, dim=0).store(yh)
    q2r_smem.index(0).slice(BLOCK_M, BLOCK_M, dim=0).store((y - yh.to(gl.float32)).to(e4))
    fence_async_shared()  # the queries' stores and the barriers' init, before async readers
    gl.thread_barrier()
    row_scale = gl.convert_layout(sq, per_row) * (scale * lscale * 1.4426950408889634)

    m_r = tile * BLOCK_M + gl.arange(0, BLOCK_M, layout=per_row)
    hi = _extents(m_r // heads, q_len, seq_len, draft, CAUSAL, HAS_DRAFT)
    s_lo, n_tiles = _split_tiles(hi, split, num_splits, BLOCK_N)
    table_row = table_ptr + b.to(gl.int64) * stride_tb
    pa, pb, pc, pd = _ring_fill(kd, rd, kv_smem, kr_smem, bars, table_row, s_lo, n_tiles,
                                block_size, num_blocks, STAGES, BLOCK_N, R)
    mma_args = (q2_smem, q2r_smem, kv_smem, kr_smem, vt_smem, p2_smem, bars, vt_ready,
                vt_free, kd, rd, table_row, s_lo, n_tiles, block_size, num_blocks, flag_ptr, hi)
    t_args = (kv_smem, vt_smem, bars, vt_ready, vt_free, table_row, s_lo, n_tiles, block_size,
              num_blocks, seq_len)
    out_args = (ws_o, ws_m, ws_l, tile, q_start, q_len, heads, num_splits, split, lscale)
    gl.warp_specialize(
        [(_ws_mma, (mma_args, out_args, row_scale, pa, pb, pc, pd, R, BLOCK_M, BLOCK_N,
                    STAGES, PROBE)),
         (_ws_transposer, (t_args, R, BLOCK_N, STAGES, PAIRS, PROBE, 2))], [4],
        [WS_WORKER_REGS])


# the ping-pong form (``_mla_gluon_e4m3_pp``): registers at launch (12 warps), each MMA
# warpgroup set to ``PP_MMA_REGS``, the transposing warpgroup (the kernel's own) to the rest
PP_MAXNREG = 168
PP_MMA_REGS = gl.constexpr(224)
# V^T buffer pairs of the ping-pong form: 2 (one per MMA warpgroup) with 3 ring slots, or 4
# (the transposer up to two tiles ahead of each) with 2
PP_VT = 2


@gluon.jit
def _values_one_by_one(vt_a, vt_b, p2, o0, acc0, acc1, alpha):
    """``_values_hilo`` with one half's product in flight at a time (64 accumulator
    registers instead of 128: the ping-pong form's MMA warpgroups have 232)."""
    alpha_o = gl.convert_layout(alpha, gl.SliceLayout(0, acc0.type.layout))
    o_a = warpgroup_mma(vt_a, p2.permute((1, 0)), o0, use_acc=False, is_async=True)
    o_a = warpgroup_mma_wait(0, deps=[o_a])
    acc0 = acc0 * alpha_o[None, :] + _half_sum(o_a)
    o_b = warpgroup_mma(vt_b, p2.permute((1, 0)), o0, use_acc=False, is_async=True)
    o_b = warpgroup_mma_wait(0, deps=[o_b])
    acc1 = acc1 * alpha_o[None, :] + _half_sum(o_b)
    return acc0, acc1


@gluon.jit
def _pp_mma(args, G: gl.constexpr, R: gl.constexpr, BLOCK_M: gl.constexpr,
            BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
            HAS_DRAFT: gl.constexpr, VT: gl.constexpr):
    """MMA warpgroup G: the tiles u = G mod 2 of the split, each as ``_ws_mma`` does one
    (scores, softmax, P; V^T pair G ready: the slot's refill, the value MMAs), into its own
    running state, written as workspace split 2 split + G (the combine merges the two like
    any splits)."""
    (q2_smem, q2r_smem, kv_smem, kr_smem, vt_smem, p2_smem, rs_smem, bars, vt_ready, vt_free,
     kd, rd, table_row, s_lo, n_tiles, block_size, num_blocks, flag_ptr, seq_len, draft,
     ws_o, ws_m, ws_l, tile, q_start, q_len, heads, num_splits, split, lscale) = args
    N2: gl.constexpr = 2 * BLOCK_M
    H: gl.constexpr = R // 2
    t2_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                   instr_shape=[16, N2, 32])
    t_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BLOCK_M, 32])
    per_row: gl.constexpr = gl.SliceLayout(0, t_l)
    per_key: gl.constexpr = gl.SliceLayout(1, t_l)
    m_r = tile * BLOCK_M + gl.arange(0, BLOCK_M, layout=per_row)
    hi = _extents(m_r // heads, q_len, seq_len, draft, CAUSAL, HAS_DRAFT)
    row_scale = rs_smem.index(0).load(per_row)
    s0 = gl.zeros([BLOCK_N, N2], gl.float32, layout=t2_l)
    o0 = gl.zeros([H, N2], gl.float32, layout=t2_l)
    l_acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=t_l)
    acc0 = _half_sum(o0)
    acc1 = acc0
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=per_row)
    kn = gl.arange(0, BLOCK_N, layout=per_key)
    n_own = gl.maximum(n_tiles - G + 1, 0) // 2
    # block ids of the own tile and of the tile its slot takes next, read one own tile ahead
    n0 = s_lo + G * BLOCK_N
    page = gl.load(table_row + n0 // block_size, mask=n_own > 0, other=0)
    page_next = gl.load(table_row + (n0 + STAGES * BLOCK_N) // block_size,
                        mask=G + STAGES < n_tiles, other=0)
    for j in range(n_own):
        u = G + 2 * j
        stage = u % STAGES
        vb = u % VT
        n0 = s_lo + u * BLOCK_N
        wi = j // (n_tiles + 1)  # always 0
        refill = u + STAGES < n_tiles
        page_a = gl.load(table_row + (n0 + 2 * BLOCK_N) // block_size, mask=u + 2 < n_tiles,
                         other=0)
        page_b = gl.load(table_row + (n0 + (STAGES + 2) * BLOCK_N) // block_size,
                         mask=u + 2 + STAGES < n_tiles, other=0)
        bad = _flag_bad(page, num_blocks, flag_ptr)
        mbarrier.wait(bars.index(stage), (u // STAGES) & 1)
        s2 = warpgroup_mma(kv_smem.index(stage), q2_smem.index(wi).permute((1, 0)), s0,
                           use_acc=False, is_async=True)
        s2 = warpgroup_mma(kr_smem.index(stage), q2r_smem.index(wi).permute((1, 0)), s2,
                           is_async=True)
        s2 = warpgroup_mma_wait(0, deps=[s2])
        s = gl.convert_layout(_half_sum(s2), t_l)
        seen = ((n0 + kn)[:, None] < hi[None, :]) & (bad == 0)
        s = gl.where(seen, s * row_scale[None, :], float("-inf"))
        alpha, m_i, l_acc = _e4m3_softmax(s, m_i, l_acc, p2_smem.index(G + wi), BLOCK_M)
        fence_async_shared()
        gl.thread_barrier()  # P stored and every warp's score MMAs over
        mbarrier.wait(vt_ready.index(vb), (u // VT) & 1)
        _issue(kd, rd, kv_smem, kr_smem, bars, page_next, n0 + STAGES * BLOCK_N, stage,
               block_size, num_blocks, refill, R)
        acc0, acc1 = _values_one_by_one(vt_smem.index(2 * vb + wi),
                                        vt_smem.index(2 * vb + 1 + wi), p2_smem.index(G + wi),
                                        o0, acc0, acc1, alpha)
        gl.thread_barrier()  # every warp's value MMAs over: V^T pair vb and P are free
        mbarrier.arrive(vt_free.index(vb), count=1)
        page = page_a
        page_next = page_b
    _store_halves(ws_o, ws_m, ws_l, m_r, m_i, l_acc, acc0, acc1, tile, q_start, q_len, heads,
                  2 * num_splits, 2 * split + G, lscale, BLOCK_M, R)


@gluon.jit
def _pp_mma0(args, R: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
             STAGES: gl.constexpr, CAUSAL: gl.constexpr, HAS_DRAFT: gl.constexpr,
             VT: gl.constexpr):
    _pp_mma(args, 0, R, BLOCK_M, BLOCK_N, STAGES, CAUSAL, HAS_DRAFT, VT)


@gluon.jit
def _pp_mma1(args, R: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
             STAGES: gl.constexpr, CAUSAL: gl.constexpr, HAS_DRAFT: gl.constexpr,
             VT: gl.constexpr):
    _pp_mma(args, 1, R, BLOCK_M, BLOCK_N, STAGES, CAUSAL, HAS_DRAFT, VT)


@gluon.jit
def _mla_gluon_e4m3_pp(
    ql_ptr, qr_ptr, qsl_ptr, lens_ptr, table_ptr, ws_o, ws_m, ws_l, flag_ptr, kd, rd,
    stride_qt, stride_qh, stride_rt, stride_rh, stride_tb,
    num_blocks, block_size, heads, scale, draft, tiles, num_splits, lscale,
    R: gl.constexpr, P: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, CAUSAL: gl.constexpr, HAS_DRAFT: gl.constexpr,
    PAIRS: gl.constexpr = True, PROBE: gl.constexpr = 0, VT: gl.constexpr = 2,
):
    """``_mla_gluon_e4m3_ws`` with two MMA warpgroups taking alternate tiles (each its own
    V^T pair, P buffer and running state, written as two workspace splits, so
    ``num_splits`` here is half the workspace's), the kernel's own warpgroup transposing
    every tile: the one MMA warpgroup of ``_ws_mma`` was the bound (H200 probes,
    docs/kernels.md)."""
    gl.static_assert(gl.num_warps() == 4)
    # 3 x 36.9 KB ring + 2 x 32 KB V^T, or 2 x 36.9 + 4 x 32, + queries, P
    gl.static_assert(STAGES * 37 + VT * 32 <= 202)
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
    q2r_smem = gl.allocate_shared_memory(e4, [1, N2, P],
                                         gl.NVMMASharedLayout.get_default_for([N2, P], e4))
    kv_smem = gl.allocate_shared_memory(kd.dtype, [STAGES, BLOCK_N, R], kd.layout)
    kr_smem = gl.allocate_shared_memory(rd.dtype, [STAGES, BLOCK_N, P], rd.layout)
    vt_smem = gl.allocate_shared_memory(
        e4, [2 * VT, H, BLOCK_N], gl.NVMMASharedLayout.get_default_for([H, BLOCK_N], e4))
    p2_smem = gl.allocate_shared_memory(
        e4, [2, N2, BLOCK_N], gl.NVMMASharedLayout.get_default_for([N2, BLOCK_N], e4))
    rs_smem = gl.allocate_shared_memory(gl.float32, [1, BLOCK_M],
                                        gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    bar_l: gl.constexpr = mbarrier.MBarrierLayout()
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_l)
    vt_ready = gl.allocate_shared_memory(gl.int64, [VT, 1], bar_l)
    vt_free = gl.allocate_shared_memory(gl.int64, [VT, 1], bar_l)
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    for i in gl.static_range(VT):
        mbarrier.init(vt_ready.index(i), count=1)
        mbarrier.init(vt_free.index(i), count=1)

    # the queries as e4m3 hi + lo, interleaved rows; each row's score scale for both
    # MMA warpgroups
    mq = tile * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, q_l))
    tq = (q_start + mq // heads).to(gl.int64)
    qmask = (mq // heads < q_len)[:, None]
    x = gl.load(ql_ptr + tq[:, None] * stride_qt + (mq % heads)[:, None] * stride_qh
                + gl.arange(0, R, layout=gl.SliceLayout(0, q_l))[None, :],
                mask=qmask, other=0.0).to(gl.float32)
    y = gl.load(qr_ptr + tq[:, None] * stride_rt + (mq % heads)[:, None] * stride_rh
                + gl.arange(0, P, layout=gl.SliceLayout(0, q_l))[None, :],
                mask=qmask, other=0.0).to(gl.float32)
    amax = gl.maximum(gl.max(gl.abs(x), 1), gl.max(gl.abs(y), 1))
    sq = gl.where(amax > 0, amax / 448.0, 1.0)
    x = x / sq[:, None]
    xh = x.to(e4)
    q2_smem.index(0).slice(0, BLOCK_M, dim=0).store(xh)
    q2_smem.index(0).slice(BLOCK_M, BLOCK_M, dim=0).store((x - xh.to(gl.float32)).to(e4))
    y = y / sq[:, None]
    yh = y.to(e4)
    q2r_smem.index(0).slice(0, BLOCK_M, dim=0).store(yh)
    q2r_smem.index(0).slice(BLOCK_M, BLOCK_M, dim=0).store((y - yh.to(gl.float32)).to(e4))
    rs_smem.index(0).store(gl.convert_layout(sq, r_l)
                           * (scale * lscale * 1.4426950408889634))
    fence_async_shared()  # the queries' stores and the barriers' init, before async readers
    gl.thread_barrier()

    m_r = tile * BLOCK_M + gl.arange(0, BLOCK_M, layout=r_l)
    hi = _extents(m_r // heads, q_len, seq_len, draft, CAUSAL, HAS_DRAFT)
    s_lo, n_tiles = _split_tiles(hi, split, num_splits, BLOCK_N)
    table_row = table_ptr + b.to(gl.int64) * stride_tb
    _ring_fill(kd, rd, kv_smem, kr_smem, bars, table_row, s_lo, n_tiles, block_size,
               num_blocks, STAGES, BLOCK_N, R)
    mma_args = (q2_smem, q2r_smem, kv_smem, kr_smem, vt_smem, p2_smem, rs_smem, bars, vt_ready,
                vt_free, kd, rd, table_row, s_lo, n_tiles, block_size, num_blocks, flag_ptr,
                seq_len, draft, ws_o, ws_m, ws_l, tile, q_start, q_len, heads, num_splits,
                split, lscale)
    t_args = (kv_smem, vt_smem, bars, vt_ready, vt_free, table_row, s_lo, n_tiles, block_size,
              num_blocks, seq_len)
    gl.warp_specialize(
        [(_ws_transposer, (t_args, R, BLOCK_N, STAGES, PAIRS, PROBE, VT)),
         (_pp_mma0, (mma_args, R, BLOCK_M, BLOCK_N, STAGES, CAUSAL, HAS_DRAFT, VT)),
         (_pp_mma1, (mma_args, R, BLOCK_M, BLOCK_N, STAGES, CAUSAL, HAS_DRAFT, VT))],
        [4, 4], [PP_MMA_REGS, PP_MMA_REGS])


def form(stages: int | None = None) -> tuple[object, dict]:
    """The kernel the switches (``WS``, ``FORM``, ``PP_VT``, ``STAGES`` or ``stages``,
    ``PAIRS``) pick, with the constexprs and launch options ``mla_gluon.plan`` passes it;
    the ping-pong kernel writes two workspace splits per grid split
    (``workspace_splits``)."""
    st = stages or STAGES
    consts = dict(num_warps=4, PAIRS=PAIRS)
    if not WS:
        return _mla_gluon_e4m3_stacked, dict(consts, STAGES=st)
    if FORM == "one":
        return _mla_gluon_e4m3_ws, dict(consts, STAGES=min(st, 3), maxnreg=WS_MAXNREG)
    return _mla_gluon_e4m3_pp, dict(consts, STAGES=2 if PP_VT == 4 else min(st, 3), VT=PP_VT,
                                    maxnreg=PP_MAXNREG)


def workspace_splits(fn) -> int:
    """Workspace splits a program of kernel ``fn`` writes."""
    return 2 if fn is _mla_gluon_e4m3_pp else 1
