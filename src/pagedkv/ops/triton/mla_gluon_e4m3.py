"""Absorbed MLA decode over a per-tensor e4m3 latent cache with both products on the 8-bit
tensor cores (Gluon, Hopper sm_90): the <= 16-row kernel of ``mla_gluon`` for fp8 caches.

Why: a bf16 kernel on widened tiles (deleted) spent its time converting; here the MMAs read
e4m3 operands, so a tile costs its 37 KB once. What the products need:
- Scores S^T = K Q^T: keys on the MMA's M side (64 keys a tile), K as stored (K-major), the
  <= 16 (query row, head) rows as N; the queries split into e4m3 hi + lo with one scale per
  row (amax / 448 over the 576 columns), so the scores keep about bf16's 8 significant bits.
- Values O^T = V^T P^T: 8-bit wgmma operands from shared memory must be K-major (keys
  contiguous) and the cache's latent is not, so each tile's latent is transposed into a
  [512, 64] V^T buffer (keys past the sequence or behind a bad block id zeroed: NaN-filled
  slots would survive a zero probability).
- P x 256 split into e4m3 hi + lo (one e4m3 tile alone gives 1-2.5% relative error,
  benchmarks/fp8_probs.py); each tile's product in a fresh accumulator, added to the
  running output in registers, because e4m3 MMAs accumulate with limited precision
  (benchmarks/fp8_split_error.py). Hi and lo sit side by side as one MMA operand (N = 32).

The kernel is warp-specialized: the transpose, about half of a tile's instructions, had
kept a one-warpgroup kernel at one warp per scheduler issuing every 3.5 cycles (Nsight
Compute, docs/kernels-log.md). The kernel's own warpgroup transposes every tile (the 8 x 8
matrix instructions, ``_transpose_matrix``) into V^T buffer pair t % 2; two MMA warpgroups
take alternate tiles (scores, softmax, P, then the value MMAs once V^T is ready), each with
its own running state, written as two workspace splits that the combine merges like any
others. A tile's ring slot is refilled (TMA, ``STAGES`` slots) by its MMA warpgroup once
both readers are done with it.

The transpose's matrix instructions are free of bank conflicts by construction (each
``ldmatrix`` matrix 8 consecutive keys, each ``stmatrix`` matrix 8 consecutive V^T rows), at
the price of V^T's key and row orders, which P (``gluon_common.key_order``) and the output
store (``latent_dim``) follow. H200 (2026-12-04 21:37-21:38 UTC, torch 2.11+cu130, triton
3.6.0; ``PYTHONPATH=src python3 benchmarks/mla_fp8_forms.py e4m3 STAGES=3 STAGES=2``), B64
ctx8K h16 q1 page 64, CUDA-graph replays: 95.2-95.5 us against the bf16 Gluon kernel's
149.7-149.9 in the same process (1.57x its throughput); with the conflicted transpose 110.7
against 145.7 (1.32x, 21:23 UTC). Deleted forms (docs/kernels-log.md "MLA e4m3, warp-spec.."):
one warpgroup doing both (1.05-1.07x bf16), one MMA warpgroup beside the transposer
(1.18-1.25x), key-pair stores instead of the matrix instructions (1.26-1.29x).

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

# ring slots of 36.9 KB; with the two V^T buffer pairs (64 KB), the queries (20 KB) and P
# (4 KB) 3 fit in 227 KB (2 ran 2% slower on the H200, 19:24 UTC)
STAGES = 3
# registers a thread at launch (12 warps); each MMA warpgroup is set to ``MMA_REGS``, the
# transposing warpgroup to the rest (72; at 224 it got 56 and its loop spilled once a tile,
# the two timed the same on the H200, 19:46 UTC)
MAXNREG = 168
MMA_REGS = gl.constexpr(216)
# workspace splits one program writes (one per MMA warpgroup: ``_mma``'s "2 split + G")
SPLITS_PER_PROGRAM = 2


@gluon.jit
def _ring_page(kd, rd, kv_smem, kr_smem, bars, table_row, s_lo, n_tiles, i: gl.constexpr,
               block_size, num_blocks, BLOCK_N: gl.constexpr, R: gl.constexpr):
    """Ring slot i's first copy (tile i of the split, if any); returns its block id."""
    page = gl.load(table_row + (s_lo + i * BLOCK_N) // block_size, mask=n_tiles > i, other=0)
    _issue(kd, rd, kv_smem, kr_smem, bars, page, s_lo + i * BLOCK_N, i, block_size, num_blocks,
           n_tiles > i, R)
    return page


@gluon.jit
def _pair_quads(x):
    """4 int16 (keys k, k + 1 | k + 8, k + 9 of byte columns 2p, 2p + 1, as
    ``_transpose_matrix`` loads them) -> the 4 int16 (key pairs (k, k + 8), (k + 1, k + 9)
    of column 2p | of column 2p + 1): two byte permutes."""
    return gl.inline_asm_elementwise(
        "prmt.b32 $0, $2, $3, 0x6240;\n\tprmt.b32 $1, $2, $3, 0x7351;", "=r,=r,r,r", [x],
        dtype=gl.int16, is_pure=True, pack=4)


@gluon.jit
def latent_dim(i):
    """V^T row i -> its latent dimension: in each 128 rows, row 64h + p holds dimension
    2p + h (``_transpose_matrix``)."""
    return (i // 128) * 128 + 2 * (i % 64) + (i % 128) // 64


@gluon.jit
def _transpose_matrix(kv, vt16, vt16_b, n_keep, MASK: gl.constexpr, R: gl.constexpr,
                      ROWS: gl.constexpr):
    """A landed [64 keys, R] e4m3 tile's latent -> V^T (K-major for the value MMA; its first
    ``ROWS`` rows into ``vt16``, the rest into ``vt16_b``, both seen as [rows, 32] int16
    key pairs) through the 8 x 8 b16 matrix instructions; with ``MASK`` keys from
    ``n_keep`` on zeroed (NaN-filled slots would survive a zero probability).

    The latent seen as int16 (two columns of one key) is read with ``ldmatrix.trans`` in
    ``ld_l``: each matrix's 8 rows are 8 consecutive keys, so its
    8 row addresses fall in distinct banks under the 128-byte swizzle; a thread gets keys
    k, k + 1 (matrix A) and k + 8, k + 9 (matrix B) of a column pair, two byte permutes
    make 4-key words of one column, and ``stmatrix`` writes them, 8 consecutive V^T rows
    a matrix (distinct banks under the 64-byte swizzle). That fixes two orders, both
    undone elsewhere: V^T's keys (``gluon_common.key_order``, which P follows) and its rows
    (``latent_dim``, which the output store follows). Triton picks both instructions from
    the layouts (checked in the sm_90 PTX): per 128 columns 4 + 4 a thread."""
    # registers: key +1, +8 (two matrices), column +8 (two more), +16, +32 (more loads);
    # lanes: key +2, +4 (a matrix's row pairs), column +1, +2, +4; warps: key +16, +32
    ld_l: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[1, 0], [8, 0], [0, 8], [0, 16], [0, 32]],
        lane_bases=[[2, 0], [4, 0], [0, 1], [0, 2], [0, 4]],
        warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 64])
    keep = gl.arange(0, 64, layout=gl.SliceLayout(1, ld_l)) < n_keep
    kv16 = kv._reinterpret(gl.int16, [64, R // 2], gl.NVMMASharedLayout(
        swizzle_byte_width=128, element_bitwidth=16, rank=2))
    for c in gl.static_range(R // 128):
        y = kv16.slice(c * 64, 64, dim=1).load(ld_l)
        if MASK:
            y = gl.where(keep[:, None], y, gl.zeros_like(y))
        y = _pair_quads(y)
        # (key 16w + 8h + 2q + e, column pair p) holds V^T row 64h + p, key pair 8w + 2q + e
        # (keys 16w + 2q + e, 16w + 2q + e + 8)
        y = gl.reshape(gl.permute(gl.reshape(y, [4, 2, 4, 2, 64]), (1, 4, 0, 2, 3)), [128, 32])
        if c * 128 < ROWS:
            vt16.slice(c * 128, 128, dim=0).store(y)
        else:
            vt16_b.slice(c * 128 - ROWS, 128, dim=0).store(y)


@gluon.jit
def ws_barriers(STAGES: gl.constexpr):
    """The warp-specialized MLA fp8 kernels' barriers, initialised: a ring slot's copy
    landed (``STAGES``), V^T pair t % 2 written (``vt_ready``) and free (``vt_free``)."""
    bar_l: gl.constexpr = mbarrier.MBarrierLayout()
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_l)
    vt_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
    vt_free = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(vt_ready.index(i), count=1)
        mbarrier.init(vt_free.index(i), count=1)
    return bars, vt_ready, vt_free


@gluon.jit
def query_rows(ql_ptr, qr_ptr, stride_qt, stride_qh, stride_rt, stride_rh, tile, q_start,
               q_len, heads, R: gl.constexpr, P: gl.constexpr, BLOCK_M: gl.constexpr,
               q_l: gl.constexpr):
    """This row tile's queries (row m: token m // heads, head m % heads; rows past the
    request's 0): the latent as float32 [BLOCK_M, R], the rope as stored [BLOCK_M, P]."""
    mq = tile * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, q_l))
    tq = (q_start + mq // heads).to(gl.int64)
    qmask = (mq // heads < q_len)[:, None]
    x = gl.load(ql_ptr + tq[:, None] * stride_qt + (mq % heads)[:, None] * stride_qh
                + gl.arange(0, R, layout=gl.SliceLayout(0, q_l))[None, :],
                mask=qmask, other=0.0).to(gl.float32)
    y = gl.load(qr_ptr + tq[:, None] * stride_rt + (mq % heads)[:, None] * stride_rh
                + gl.arange(0, P, layout=gl.SliceLayout(0, q_l))[None, :],
                mask=qmask, other=0.0)
    return x, y


@gluon.jit
def own_tiles(G: gl.constexpr, s_lo, n_tiles, table_row, block_size, STAGES: gl.constexpr,
              BLOCK_N: gl.constexpr):
    """MMA warpgroup G's share of the split: (its tile count, the block ids of its first
    tile and of the tile that tile's ring slot takes next)."""
    n_own = gl.maximum(n_tiles - G + 1, 0) // 2
    n0 = s_lo + G * BLOCK_N
    page = gl.load(table_row + n0 // block_size, mask=n_own > 0, other=0)
    page_next = gl.load(table_row + (n0 + STAGES * BLOCK_N) // block_size,
                        mask=G + STAGES < n_tiles, other=0)
    return n_own, page, page_next


@gluon.jit
def own_tile(G: gl.constexpr, j, s_lo, n_tiles, table_row, block_size, STAGES: gl.constexpr,
             BLOCK_N: gl.constexpr):
    """MMA warpgroup G's j-th tile u = G + 2j of the split: (u, its ring slot, first key,
    ``wi`` (always 0: keeps the MMA descriptors in the loop), whether its slot is refilled,
    the block ids of its next own tile and of the tile that slot takes after that)."""
    u = G + 2 * j
    stage = u % STAGES
    n0 = s_lo + u * BLOCK_N
    wi = j // (n_tiles + 1)
    refill = u + STAGES < n_tiles
    page_a = gl.load(table_row + (n0 + 2 * BLOCK_N) // block_size, mask=u + 2 < n_tiles,
                     other=0)
    page_b = gl.load(table_row + (n0 + (STAGES + 2) * BLOCK_N) // block_size,
                     mask=u + 2 + STAGES < n_tiles, other=0)
    return u, stage, n0, wi, refill, page_a, page_b


@gluon.jit
def _ring_fill(kd, rd, kv_smem, kr_smem, bars, table_row, s_lo, n_tiles, block_size,
               num_blocks, STAGES: gl.constexpr, BLOCK_N: gl.constexpr, R: gl.constexpr):
    """Every ring slot's first copy."""
    gl.static_assert((STAGES >= 2) & (STAGES <= 3))
    _ring_page(kd, rd, kv_smem, kr_smem, bars, table_row, s_lo, n_tiles, 0, block_size,
               num_blocks, BLOCK_N, R)
    _ring_page(kd, rd, kv_smem, kr_smem, bars, table_row, s_lo, n_tiles, 1, block_size,
               num_blocks, BLOCK_N, R)
    if STAGES > 2:
        _ring_page(kd, rd, kv_smem, kr_smem, bars, table_row, s_lo, n_tiles, 2, block_size,
                   num_blocks, BLOCK_N, R)


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
    co = latent_dim(gl.arange(0, H, layout=gl.SliceLayout(1, o_l)))  # V^T's row order
    gl.store(ws_o + base_o[None, :] * R + co[:, None], acc0 * (lscale / 256.0), mask=omask)
    gl.store(ws_o + base_o[None, :] * R + (co + H)[:, None], acc1 * (lscale / 256.0),
             mask=omask)


@gluon.jit
def _values(vt_a, vt_b, p2, o0, acc0, acc1, alpha):
    """O^T halves += V^T halves x P^T hi and lo (N = 2 x rows), each half's product in a
    fresh accumulator summed (hi + lo) into the running one, one half in flight at a time
    (64 accumulator registers: the MMA warpgroups have 216)."""
    alpha_o = gl.convert_layout(alpha, gl.SliceLayout(0, acc0.type.layout))
    o_a = warpgroup_mma(vt_a, p2.permute((1, 0)), o0, use_acc=False, is_async=True)
    o_a = warpgroup_mma_wait(0, deps=[o_a])
    acc0 = acc0 * alpha_o[None, :] + _half_sum(o_a)
    o_b = warpgroup_mma(vt_b, p2.permute((1, 0)), o0, use_acc=False, is_async=True)
    o_b = warpgroup_mma_wait(0, deps=[o_b])
    acc1 = acc1 * alpha_o[None, :] + _half_sum(o_b)
    return acc0, acc1


@gluon.jit
def _transposer(args, R: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """The kernel's own warpgroup: tile t's latent, once its copy lands, into V^T buffer
    pair t % 2 once its MMA warpgroup (t % 2) is done with tile t - 2's; signals
    ``vt_ready``. A sequence's last tile, or one behind a bad block id, goes the masked way
    (keys past the end or in the bad block zeroed). Block ids read one tile ahead."""
    (kv_smem, vt_smem, bars, vt_ready, vt_free, table_row, s_lo, n_tiles, block_size,
     num_blocks, seq_len) = args
    H: gl.constexpr = R // 2
    vt16_lay: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=BLOCK_N,
                                                  element_bitwidth=16, rank=2)
    page = gl.load(table_row + s_lo // block_size, mask=n_tiles > 0, other=0)
    for it in range(n_tiles):
        j = it % 2
        n0 = s_lo + it * BLOCK_N
        page_nx = gl.load(table_row + (n0 + BLOCK_N) // block_size, mask=it + 1 < n_tiles,
                          other=0)
        bad = (page < 0) | (page >= num_blocks)
        vt_a = vt_smem.index(2 * j)
        vt_b = vt_smem.index(2 * j + 1)
        mbarrier.wait(vt_free.index(j), ((it // 2) & 1) ^ 1)  # (fresh: passes)
        mbarrier.wait(bars.index(it % STAGES), (it // STAGES) & 1)
        kv = kv_smem.index(it % STAGES)
        vt16_a = vt_a._reinterpret(gl.int16, [H, BLOCK_N // 2], vt16_lay)
        vt16_b = vt_b._reinterpret(gl.int16, [H, BLOCK_N // 2], vt16_lay)
        if (n0 + BLOCK_N > seq_len) | bad:
            _transpose_matrix(kv, vt16_a, vt16_b, gl.where(bad, 0, seq_len - n0), True, R, H)
        else:
            _transpose_matrix(kv, vt16_a, vt16_b, BLOCK_N, False, R, H)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(vt_ready.index(j), count=1)
        page = page_nx


@gluon.jit
def _mma(args, G: gl.constexpr, R: gl.constexpr, BLOCK_M: gl.constexpr,
         BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
         HAS_DRAFT: gl.constexpr):
    """MMA warpgroup G: the split's tiles u = G mod 2, each its scores, softmax and P, then
    (V^T pair G ready, so the ring slot has no other reader) the slot's refill and the
    value MMAs; its own running state, written as workspace split 2 split + G. Block ids
    read one own tile ahead."""
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
    n_own, page, page_next = own_tiles(G, s_lo, n_tiles, table_row, block_size, STAGES,
                                       BLOCK_N)
    for j in range(n_own):
        u, stage, n0, wi, refill, page_a, page_b = own_tile(G, j, s_lo, n_tiles, table_row,
                                                            block_size, STAGES, BLOCK_N)
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
        alpha, m_i, l_acc = _e4m3_softmax(s, m_i, l_acc, p2_smem.index(G + wi), BLOCK_M,
                                          True)
        fence_async_shared()
        gl.thread_barrier()  # P stored and every warp's score MMAs over
        mbarrier.wait(vt_ready.index(G), j & 1)
        _issue(kd, rd, kv_smem, kr_smem, bars, page_next, n0 + STAGES * BLOCK_N, stage,
               block_size, num_blocks, refill, R)
        acc0, acc1 = _values(vt_smem.index(2 * G + wi), vt_smem.index(2 * G + 1 + wi),
                             p2_smem.index(G + wi), o0, acc0, acc1, alpha)
        gl.thread_barrier()  # every warp's value MMAs over: V^T pair G and P are free
        mbarrier.arrive(vt_free.index(G), count=1)
        page = page_a
        page_next = page_b
    _store_halves(ws_o, ws_m, ws_l, m_r, m_i, l_acc, acc0, acc1, tile, q_start, q_len, heads,
                  2 * num_splits, 2 * split + G, lscale, BLOCK_M, R)


@gluon.jit
def _mma0(args, R: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
          STAGES: gl.constexpr, CAUSAL: gl.constexpr, HAS_DRAFT: gl.constexpr):
    _mma(args, 0, R, BLOCK_M, BLOCK_N, STAGES, CAUSAL, HAS_DRAFT)


@gluon.jit
def _mma1(args, R: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
          STAGES: gl.constexpr, CAUSAL: gl.constexpr, HAS_DRAFT: gl.constexpr):
    _mma(args, 1, R, BLOCK_M, BLOCK_N, STAGES, CAUSAL, HAS_DRAFT)


@gluon.jit
def _mla_gluon_e4m3(
    ql_ptr, qr_ptr, qsl_ptr, lens_ptr, table_ptr, ws_o, ws_m, ws_l, flag_ptr, kd, rd,
    stride_qt, stride_qh, stride_rt, stride_rh, stride_tb,
    num_blocks, block_size, heads, scale, draft, tiles, num_splits, lscale,
    R: gl.constexpr, P: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, CAUSAL: gl.constexpr, HAS_DRAFT: gl.constexpr,
):
    """Program (request x row tile, split): this split's keys for <= 16 rows (module
    docstring), written as workspace splits 2 split and 2 split + 1 (o scaled by
    ``lscale``); ``num_splits`` is the grid's."""
    gl.static_assert(gl.num_warps() == 4)
    gl.static_assert(STAGES <= 3)  # 3 x 36.9 KB ring + 2 x 32 KB V^T + queries, P
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
        e4, [4, H, BLOCK_N], gl.NVMMASharedLayout.get_default_for([H, BLOCK_N], e4))
    p2_smem = gl.allocate_shared_memory(
        e4, [2, N2, BLOCK_N], gl.NVMMASharedLayout.get_default_for([N2, BLOCK_N], e4))
    rs_smem = gl.allocate_shared_memory(gl.float32, [1, BLOCK_M],
                                        gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    bars, vt_ready, vt_free = ws_barriers(STAGES)

    # the queries as e4m3 hi + lo, interleaved rows; each row's score scale for both
    # MMA warpgroups
    x, y = query_rows(ql_ptr, qr_ptr, stride_qt, stride_qh, stride_rt, stride_rh, tile,
                      q_start, q_len, heads, R, P, BLOCK_M, q_l)
    y = y.to(gl.float32)
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
        [(_transposer, (t_args, R, BLOCK_N, STAGES)),
         (_mma0, (mma_args, R, BLOCK_M, BLOCK_N, STAGES, CAUSAL, HAS_DRAFT)),
         (_mma1, (mma_args, R, BLOCK_M, BLOCK_N, STAGES, CAUSAL, HAS_DRAFT))],
        [4, 4], [MMA_REGS, MMA_REGS])

