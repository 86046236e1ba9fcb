"""Paged absorbed MLA in Gluon for Hopper: the "pair" variant of the 64-row kernel
(``paged_mla_latent(..., gluon="pair")``), a schedule after FlashMLA's sm90 decode kernel
(read, not copied). Why: in ``mla_gluon._mla_gluon_fwd`` every step of a tile waits for the
previous one, and in ``mla_gluon_pp`` a ring slot is refilled only when both warpgroups are
done with all of it; here each slot is two halves that each have one reader besides the
scores, so a half is refilled as soon as that reader is done.

Two warpgroups (``gl.warp_specialize``: the kernel's own 4 warps and one 4-warp worker), key
tiles taken in pairs (tile 2k in slot 0, tile 2k + 1 in slot 1):
- warpgroup g computes the full 64 x 64 scores of tile 2k + g (m64n64; the query rope part
  from registers) and its softmax, warpgroup 1 after warpgroup 0 (it needs tile 2k's row
  maximum, shared memory ``stat``);
- warpgroup g owns output columns [256 g, 256 g + 256): its own tile's P from registers,
  the other tile's P from shared memory (P of tile 2k rescaled to tile 2k + 1's maximum);
- slot half L (latent columns 0-255) is read only by warpgroup 0's value products, half R
  (columns 256-511 and the rope) only by warpgroup 1's, so warpgroup 0 refills the L halves
  and warpgroup 1 the R halves, each right after its own product on that half.
P of tile 2k + 1 is written over the queries' rope part, which sits in registers by then.
Scope and the tail handling as ``mla_gluon`` (keys past the sequence zeroed in shared
memory, a missing second tile of the last pair zeroed whole).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from pagedkv.ops.triton.mla_gluon import _extents, _flag_bad, _split_tiles

HALF = gl.constexpr(256)  # latent columns per slot half
PAIR_WORKER_REGS = gl.constexpr(256)  # warpgroup 1's registers (setmaxnreg)


@gluon.jit
def _copy_half(kd, rd, bufs, bar, page, n0, block_size, num_blocks, pred, G: gl.constexpr,
               R: gl.constexpr):
    """TMA copy of one half of the tile at key n0: L (G == 0: latent 0-255) or R (latent
    256-511 and the rope)."""
    kv_l, kv_r, kr = bufs
    page = gl.where((page < 0) | (page >= num_blocks), 0, page)  # flagged at compute time
    row = page * block_size + n0 % block_size
    if G == 0:
        mbarrier.expect(bar, kd.block_type.nbytes, pred=pred)
        tma.async_copy_global_to_shared(kd, [row, 0], bar, kv_l, pred=pred)
    else:
        mbarrier.expect(bar, kd.block_type.nbytes + rd.block_type.nbytes, pred=pred)
        tma.async_copy_global_to_shared(kd, [row, HALF], bar, kv_r, pred=pred)
        tma.async_copy_global_to_shared(rd, [row, R], bar, kr, pred=pred)


@gluon.jit
def _zero_keys(v, n0, lim, BLOCK_N: gl.constexpr, z_l: gl.constexpr):
    """Zero the rows (keys) >= lim of a landed half tile [64 keys, 256]: slots past the
    sequence may hold NaN (a zero probability times NaN is NaN); lim <= n0 zeroes all."""
    keep = (n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, z_l)) < lim)[:, None]
    for c in gl.static_range(HALF // 64):
        chunk = v.slice(c * 64, 64, dim=1)
        x = chunk.load(z_l)
        chunk.store(gl.where(keep, x, gl.zeros_like(x)))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _scores(ql, qr, q_rope, kv_l, kv_r, kr, bar_l, bar_r, phase, exists, s0,
            R_FIRST: gl.constexpr):
    """A tile's 64 x 64 scores issued as its halves land (``R_FIRST``: the R half first,
    the one this warpgroup copied itself); the rope part with the queries from registers."""
    if R_FIRST:
        mbarrier.wait(bar_r, phase, pred=exists)
        s = warpgroup_mma(q_rope, kr.permute((1, 0)), s0, use_acc=False, is_async=True)
        s = warpgroup_mma(qr, kv_r.permute((1, 0)), s, is_async=True)
        mbarrier.wait(bar_l, phase, pred=exists)
        s = warpgroup_mma(ql, kv_l.permute((1, 0)), s, is_async=True)
    else:
        mbarrier.wait(bar_l, phase, pred=exists)
        s = warpgroup_mma(ql, kv_l.permute((1, 0)), s0, use_acc=False, is_async=True)
        mbarrier.wait(bar_r, phase, pred=exists)
        s = warpgroup_mma(qr, kv_r.permute((1, 0)), s, is_async=True)
        s = warpgroup_mma(q_rope, kr.permute((1, 0)), s, is_async=True)
    return s


@gluon.jit
def _softmax(s, n0, hi, kn, page, exists, m_old, qk_scale, num_blocks, flag_ptr):
    """Masked scores -> (P in fp32, new running maximum, rescale factor of the old one, row
    sums of P)."""
    bad = _flag_bad(page, num_blocks, flag_ptr)
    seen = ((n0 + kn)[None, :] < hi[:, None]) & (bad == 0) & exists
    s = gl.where(seen, s * qk_scale, float("-inf"))
    m_new = gl.maximum(m_old, gl.max(s, 1))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(s - m_use[:, None])
    return p, m_new, gl.exp2(m_old - m_use), gl.sum(p, 1)


@gluon.jit
def _pair_wg(args, G: gl.constexpr, R: gl.constexpr, P: gl.constexpr, BLOCK_M: gl.constexpr,
             BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, HAS_DRAFT: gl.constexpr):
    """Warpgroup G over the pairs of key tiles (module docstring). Every mbarrier completes
    once per pair, so pair k waits on parity k & 1 (the slots' for the tiles of pair k + 1:
    (k + 1) & 1)."""
    (q_l, q_r, q_p, kv_l, kv_r, kr, p0_smem, stat, kbar_l, kbar_r, sync, kd, rd, table_row,
     s_lo, n_tiles, block_size, num_blocks, seq_len, flag_ptr, q_len, tile, heads, draft,
     qk_scale, q_start, split, num_splits, ws_o, ws_m, ws_l) = args
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BLOCK_N, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, HALF, 16])
    pa_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
    qa_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_l, k_width=2)
    z_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    srow: gl.constexpr = gl.SliceLayout(1, s_l)
    orow: gl.constexpr = gl.SliceLayout(1, o_l)
    dt: gl.constexpr = kd.dtype

    m_s = tile * BLOCK_M + gl.arange(0, BLOCK_M, layout=srow)
    hi = _extents(m_s // heads, q_len, seq_len, draft, CAUSAL, HAS_DRAFT)
    kn = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_l))
    s0 = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_l)
    acc = gl.zeros([BLOCK_M, HALF], gl.float32, layout=o_l)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=srow)
    q_rope = q_p.index(0).load(qa_l)  # before any P of tile 2k + 1 lands there
    n_pairs = gl.cdiv(n_tiles, 2)
    own_exists = G < n_tiles
    own_page = gl.load(table_row + (s_lo + G * BLOCK_N) // block_size, mask=own_exists, other=0)
    # the own first tile's scores (slot G, parity 0)
    s = _scores(q_l.index(0), q_r.index(0), q_rope, kv_l.index(G), kv_r.index(G), kr.index(G),
                kbar_l.index(G), kbar_r.index(G), 0, own_exists, s0, False)
    s = warpgroup_mma_wait(0, deps=[s])
    for k in range(n_pairs):
        ph = k & 1
        dyn = k // (n_pairs + 1)  # always 0, not foldable: keeps the wgmma descriptors here
        b = 2 * k
        n0 = s_lo + b * BLOCK_N  # tile b (slot 0); tile b + 1 at n0 + BLOCK_N (slot 1)
        next_ok = b + 2 + G < n_tiles  # this warpgroup's next own tile exists
        ok2 = b + 2 < n_tiles
        ok3 = b + 3 < n_tiles
        one_ok = b + 1 < n_tiles
        page2 = gl.load(table_row + (n0 + 2 * BLOCK_N) // block_size, mask=ok2, other=0)
        page3 = gl.load(table_row + (n0 + 3 * BLOCK_N) // block_size, mask=ok3, other=0)
        kl0 = kv_l.index(dyn)
        kl1 = kv_l.index(1 + dyn)
        kr0 = kv_r.index(dyn)
        kr1 = kv_r.index(1 + dyn)
        if G == 0:
            m_old = stat.index(0).load(srow)
            p, m_new, scale, rsum = _softmax(s, n0, hi, kn, own_page, True, m_old, qk_scale,
                                             num_blocks, flag_ptr)
            # tile b: softmax against the running maximum, publish it (sync 0)
            l_i = l_i * scale + rsum
            stat.index(0).store(m_new)
            stat.index(1).store(scale)
            gl.thread_barrier()
            mbarrier.arrive(sync.index(0), count=1)
            acc = acc * gl.convert_layout(scale, orow)[:, None]
            if n0 + BLOCK_N > seq_len:  # tile b is the sequence's last
                _zero_keys(kl0, n0, seq_len, BLOCK_N, z_l)
            pa = gl.convert_layout(p.to(dt), pa_l)
            acc = warpgroup_mma(pa, kl0, acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=[acc])
            gl.thread_barrier()  # every warp done with slot 0's L half: refill it
            _copy_half(kd, rd, (kl0, kr0, kr.index(dyn)), kbar_l.index(0), page2,
                       n0 + 2 * BLOCK_N, block_size, num_blocks, ok2, 0, R)
            # tile b + 1's maximum (sync 1): P of tile b rescaled to it, to warpgroup 1
            mbarrier.wait(sync.index(1), ph)
            s1 = stat.index(2).load(srow)
            p0_smem.index(dyn).store((p * s1[:, None]).to(dt))
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(sync.index(2), count=1)
            l_i = l_i * s1
            acc = acc * gl.convert_layout(s1, orow)[:, None]
            # tile b + 1's P (sync 3) times slot 1's L half
            mbarrier.wait(sync.index(3), ph)
            mbarrier.wait(kbar_l.index(1), ph, pred=one_ok)
            if n0 + 2 * BLOCK_N > gl.where(one_ok, seq_len, 0):  # b + 1 last or missing
                _zero_keys(kl1, n0 + BLOCK_N, gl.where(one_ok, seq_len, 0), BLOCK_N, z_l)
            acc = warpgroup_mma(q_p.index(dyn), kl1, acc, is_async=True)
            # tile b + 2's scores behind it
            s = _scores(q_l.index(dyn), q_r.index(dyn), q_rope, kl0, kr0, kr.index(dyn),
                        kbar_l.index(0), kbar_r.index(0), 1 - ph, next_ok, s0, False)
            acc = warpgroup_mma_wait(3, deps=[acc])
            gl.thread_barrier()  # done with slot 1's L half: refill it (tile b + 3)
            _copy_half(kd, rd, (kl1, kr1, kr.index(1 + dyn)), kbar_l.index(1), page3,
                       n0 + 3 * BLOCK_N, block_size, num_blocks, ok3, 0, R)
            s = warpgroup_mma_wait(0, deps=[s])
            own_page = page2
        else:
            # tile b + 1 after tile b's maximum (sync 0); its own maximum out (sync 1)
            mbarrier.wait(sync.index(0), ph)
            m_old = stat.index(0).load(srow)
            s0_scale = stat.index(1).load(srow)
            p, m_new, scale, rsum = _softmax(s, n0 + BLOCK_N, hi, kn, own_page, one_ok, m_old,
                                             qk_scale, num_blocks, flag_ptr)
            both = s0_scale * scale
            l_i = l_i * both + rsum
            gl.thread_barrier()  # every warp has read the old maximum
            stat.index(0).store(m_new)
            stat.index(2).store(scale)
            gl.thread_barrier()
            mbarrier.arrive(sync.index(1), count=1)
            pb = p.to(dt)
            q_p.index(dyn).store(pb)  # P of tile b + 1 for warpgroup 0 (sync 3)
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(sync.index(3), count=1)
            acc = acc * gl.convert_layout(both, orow)[:, None]
            if n0 + 2 * BLOCK_N > gl.where(one_ok, seq_len, 0):  # b + 1 last or missing
                _zero_keys(kr1, n0 + BLOCK_N, gl.where(one_ok, seq_len, 0), BLOCK_N, z_l)
            acc = warpgroup_mma(gl.convert_layout(pb, pa_l), kr1, acc, is_async=True)
            # P of tile b (sync 2) times slot 0's R half
            mbarrier.wait(sync.index(2), ph)
            mbarrier.wait(kbar_r.index(0), ph)
            if n0 + BLOCK_N > seq_len:
                _zero_keys(kr0, n0, seq_len, BLOCK_N, z_l)
            acc = warpgroup_mma(p0_smem.index(dyn), kr0, acc, is_async=True)
            acc = warpgroup_mma_wait(1, deps=[acc])
            gl.thread_barrier()  # done with slot 1's R half: refill it (tile b + 3)
            _copy_half(kd, rd, (kl1, kr1, kr.index(1 + dyn)), kbar_r.index(1), page3,
                       n0 + 3 * BLOCK_N, block_size, num_blocks, ok3, 1, R)
            acc = warpgroup_mma_wait(0, deps=[acc])
            gl.thread_barrier()  # done with slot 0's R half: refill it (tile b + 2)
            _copy_half(kd, rd, (kl0, kr0, kr.index(dyn)), kbar_r.index(0), page2,
                       n0 + 2 * BLOCK_N, block_size, num_blocks, ok2, 1, R)
            s = _scores(q_l.index(dyn), q_r.index(dyn), q_rope, kl1, kr1, kr.index(1 + dyn),
                        kbar_l.index(1), kbar_r.index(1), 1 - ph, next_ok, s0, False)
            s = warpgroup_mma_wait(0, deps=[s])
            own_page = page3

    # row sums: warpgroup 1 hands its part to warpgroup 0, which writes m and l
    if G == 1:
        stat.index(3).store(l_i)
        gl.thread_barrier()
        mbarrier.arrive(sync.index(4), count=1)
    else:
        mbarrier.wait(sync.index(4), 0)
        l_i = l_i + stat.index(3).load(srow)
        m_i = stat.index(0).load(srow)
        base = ((q_start + m_s // heads).to(gl.int64) * heads + m_s % heads) * num_splits + split
        rmask = m_s // heads < q_len
        gl.store(ws_m + base, m_i, mask=rmask)
        gl.store(ws_l + base, l_i, mask=rmask)
    m_o = tile * BLOCK_M + gl.arange(0, BLOCK_M, layout=orow)
    base_o = ((q_start + m_o // heads).to(gl.int64) * heads + m_o % heads) * num_splits + split
    co = G * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, o_l))
    gl.store(ws_o + base_o[:, None] * R + co[None, :], acc, mask=(m_o // heads < q_len)[:, None])


@gluon.jit
def _pair_wg0(args, R: gl.constexpr, P: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, HAS_DRAFT: gl.constexpr):
    _pair_wg(args, 0, R, P, BLOCK_M, BLOCK_N, CAUSAL, HAS_DRAFT)


@gluon.jit
def _pair_wg1(args, R: gl.constexpr, P: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, HAS_DRAFT: gl.constexpr):
    _pair_wg(args, 1, R, P, BLOCK_M, BLOCK_N, CAUSAL, HAS_DRAFT)


@gluon.jit
def _mla_gluon_pair(
    ql_ptr, qr_ptr, qsl_ptr, lens_ptr, table_ptr, ws_o, ws_m, ws_l, flag_ptr, kd, rd,
    stride_qt, stride_qh, stride_rt, stride_rh, stride_tb,
    num_blocks, block_size, heads, scale, draft, tiles, num_splits,
    R: gl.constexpr, P: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, CAUSAL: gl.constexpr, HAS_DRAFT: gl.constexpr,
):
    """64-row tiles, key tiles in pairs over two warpgroups (module docstring). ``kd``: a
    [64, 256] box over the cache rows, ``rd``: the [64, 64] rope box."""
    gl.static_assert(gl.num_warps() == 4)
    gl.static_assert(STAGES == 2)
    gl.static_assert(R == 2 * HALF)
    dt: gl.constexpr = kd.dtype
    q_bl: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    r_l: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    st_l: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    h_lay: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HALF], dt)
    p_lay: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, P], dt)

    pid = gl.program_id(0)
    split = gl.program_id(1)
    b = pid // tiles
    tile = pid % tiles
    q_start = gl.load(qsl_ptr + b)
    q_len = gl.load(qsl_ptr + b + 1) - q_start
    seq_len = gl.load(lens_ptr + b)
    # a tile past the request's rows: every row invalid, so no keys (n_tiles 0), no stores

    # queries: latent halves and rope, [1, ...] buffers (indexed by an unfoldable zero)
    mq = tile * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, q_bl))
    tq = (q_start + mq // heads).to(gl.int64)
    hq = mq % heads
    qmask = (mq // heads < q_len)[:, None]
    ch = gl.arange(0, HALF, layout=gl.SliceLayout(0, q_bl))
    cp = gl.arange(0, P, layout=gl.SliceLayout(0, q_bl))
    q_row = ql_ptr + tq[:, None] * stride_qt + hq[:, None] * stride_qh
    q_l = gl.allocate_shared_memory(dt, [1, BLOCK_M, HALF], h_lay)
    q_l.index(0).store(gl.load(q_row + ch[None, :], mask=qmask, other=0.0))
    q_r = gl.allocate_shared_memory(dt, [1, BLOCK_M, HALF], h_lay)
    q_r.index(0).store(gl.load(q_row + HALF + ch[None, :], mask=qmask, other=0.0))
    q_p = gl.allocate_shared_memory(dt, [1, BLOCK_M, P], p_lay)
    q_p.index(0).store(gl.load(qr_ptr + tq[:, None] * stride_rt + hq[:, None] * stride_rh
                               + cp[None, :], mask=qmask, other=0.0))
    kv_l = gl.allocate_shared_memory(dt, [STAGES, BLOCK_N, HALF], kd.layout)
    kv_r = gl.allocate_shared_memory(dt, [STAGES, BLOCK_N, HALF], kd.layout)
    kr = gl.allocate_shared_memory(dt, [STAGES, BLOCK_N, P], rd.layout)
    p0_smem = gl.allocate_shared_memory(dt, [1, BLOCK_M, BLOCK_N], p_lay)
    # running maximum, tile 2k's and tile 2k+1's rescale factors, warpgroup 1's row sums
    stat = gl.allocate_shared_memory(gl.float32, [4, BLOCK_M], st_l)
    kbar_l = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kbar_r = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    # 0: max of tile 2k; 1: max of tile 2k+1; 2: P of 2k stored; 3: P of 2k+1 stored;
    # 4: warpgroup 1's row sums stored
    sync = gl.allocate_shared_memory(gl.int64, [5, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(kbar_l.index(i), count=1)
        mbarrier.init(kbar_r.index(i), count=1)
    for i in gl.static_range(5):
        mbarrier.init(sync.index(i), count=1)
    stat.index(0).store(gl.full([BLOCK_M], float("-inf"), gl.float32, layout=r_l))

    m_r = tile * BLOCK_M + gl.arange(0, BLOCK_M, layout=r_l)
    hi = _extents(m_r // heads, q_len, seq_len, draft, CAUSAL, HAS_DRAFT)
    s_lo, n_tiles = _split_tiles(hi, split, num_splits, BLOCK_N)
    table_row = table_ptr + b.to(gl.int64) * stride_tb
    fence_async_shared()  # the queries' stores and the barriers' init, before async readers
    gl.thread_barrier()
    for t in gl.static_range(STAGES):
        ok = t < n_tiles
        page = gl.load(table_row + (s_lo + t * BLOCK_N) // block_size, mask=ok, other=0)
        bufs = (kv_l.index(t), kv_r.index(t), kr.index(t))
        _copy_half(kd, rd, bufs, kbar_l.index(t), page, s_lo + t * BLOCK_N, block_size,
                   num_blocks, ok, 0, R)
        _copy_half(kd, rd, bufs, kbar_r.index(t), page, s_lo + t * BLOCK_N, block_size,
                   num_blocks, ok, 1, R)
    qk_scale = scale * 1.4426950408889634
    args = (q_l, q_r, q_p, kv_l, kv_r, kr, p0_smem, stat, kbar_l, kbar_r, sync, kd, rd,
            table_row, s_lo, n_tiles, block_size, num_blocks, seq_len, flag_ptr, q_len, tile,
            heads, draft, qk_scale, q_start, split, num_splits, ws_o, ws_m, ws_l)
    gl.warp_specialize([(_pair_wg0, (args, R, P, BLOCK_M, BLOCK_N, CAUSAL, HAS_DRAFT)),
                        (_pair_wg1, (args, R, P, BLOCK_M, BLOCK_N, CAUSAL, HAS_DRAFT))],
                       [4], [PAIR_WORKER_REGS])
