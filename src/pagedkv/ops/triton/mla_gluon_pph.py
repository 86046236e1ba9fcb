"""Paged absorbed MLA in Gluon for Hopper: the 64-row kernel for more than 16 rows per
request (``paged_mla_latent(..., gluon="pingpong_halves")``, the default there: 1.35x
``mla_gluon._mla_gluon_fwd``, "serial", on the H200, docs/kernels-log.md "MLA, Gluon 64-row
pass"). Warp-specialized after FlashMLA's sm90 decode design (read, not copied): two
consumer warpgroups take alternate 64-key tiles and the kernel's own warpgroup issues the
copies. Tile t's owner (warpgroup t % 2, ring slot t % 2) computes its 64 x 64 scores and
softmax and publishes the row maximum, the rescale factor and P through shared memory; both
warpgroups accumulate their 256 output columns over every tile, the owner's own value
product taking P from registers. Each ring slot is two halves, each read by one
warpgroup's value products besides the owner's scores:
- L (latent columns 0-255): warpgroup 0's products (its output columns);
- R (latent columns 256-511 and the rope): warpgroup 1's products; P of a slot-0 tile is
  written over that tile's rope part (warpgroup 1 reads it with the R half), P of a slot-1
  tile goes to its own buffer (warpgroup 0 reads it with the L half);
so each half has its own ready and empty barriers and is refilled as soon as its one reader
is done (a whole slot would wait for the later of the two value products), each warpgroup
releases the other's slot before its own softmax, and the scores start on the half that is
usually refilled first. Slower variants tried on the way (a ping-pong over whole slots, a
FlashMLA-like pair schedule, an overlapped serial kernel) are recorded in docs/kernels-log.md.
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

from pagedkv.ops.triton.gluon_common import request_tile as _request_tile
from pagedkv.ops.triton.mla_gluon import (
    _extents,
    _flag_bad,
    _split_tiles,
    _ws_rows,
    _zero_past_end,
)

HALF = gl.constexpr(256)  # latent columns per slot half


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


PPH_MAXNREG = 168  # 3 warpgroups at launch; consumers 240, producer 24 (setmaxnreg)


@gluon.jit
def _pph_scores(bufs, q_l, q_r, q_p, ready_l, ready_r, ph, s0, G: gl.constexpr):
    """The own tile's scores, issued half by half as they land (the half its owner's
    partner releases last, second)."""
    kl, kr_, kp = bufs
    if G == 0:
        mbarrier.wait(ready_l, ph)
        s = warpgroup_mma(q_l, kl.permute((1, 0)), s0, use_acc=False, is_async=True)
        mbarrier.wait(ready_r, ph)
        s = warpgroup_mma(q_r, kr_.permute((1, 0)), s, is_async=True)
        s = warpgroup_mma(q_p, kp.permute((1, 0)), s, is_async=True)
    else:
        mbarrier.wait(ready_r, ph)
        s = warpgroup_mma(q_p, kp.permute((1, 0)), s0, use_acc=False, is_async=True)
        s = warpgroup_mma(q_r, kr_.permute((1, 0)), s, is_async=True)
        mbarrier.wait(ready_l, ph)
        s = warpgroup_mma(q_l, kl.permute((1, 0)), s, is_async=True)
    return s


@gluon.jit
def _pph_consumer(args, G: gl.constexpr, R: gl.constexpr, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, HAS_DRAFT: gl.constexpr):
    """Warpgroup G: scores, softmax and P of the tiles t = G mod 2 (slot G), output columns
    [G 256, G 256 + 256) over every tile (module docstring). Barrier phases: the tile in a
    slot changes every two tiles, so tile t's are (t // 2) & 1."""
    (q_l, q_r, q_p, kv_l, kv_r, kr, p1_smem, stat, ready_l, ready_r, empty_l, empty_r, sready,
     done, kd, rd, table_row, s_lo, n_tiles, block_size, num_blocks, seq_len, flag_ptr, q_len,
     tile, heads, draft, qk_scale, q_start, split, num_splits, ws_o, ws_m, ws_l) = args
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BLOCK_N, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, HALF, 16])
    pa_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
    z_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    srow: gl.constexpr = gl.SliceLayout(1, s_l)
    orow: gl.constexpr = gl.SliceLayout(1, o_l)
    dt: gl.constexpr = kd.dtype
    # the half of every slot this warpgroup's value products read, and its barriers
    if G == 0:
        mine = kv_l
        my_ready = ready_l
        my_empty = empty_l
    else:
        mine = kv_r
        my_ready = ready_r
        my_empty = empty_r
    m_s = tile * BLOCK_M + gl.arange(0, BLOCK_M, layout=srow)
    hi = _extents(m_s // heads, q_len, seq_len, draft, CAUSAL, HAS_DRAFT)
    kn = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_l))
    s0 = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_l)
    m_prev = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=srow)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=srow)
    acc = gl.zeros([BLOCK_M, HALF], gl.float32, layout=o_l)
    n_own = gl.maximum(n_tiles - G + 1, 0) // 2
    for j in range(0, n_own):
        u = G + 2 * j
        n0 = s_lo + u * BLOCK_N
        ph = j & 1
        dyn = j // (n_tiles + 2)  # always 0, not foldable: keeps the wgmma descriptors here
        own = (kv_l.index(G + dyn), kv_r.index(G + dyn), kr.index(G + dyn))
        page = gl.load(table_row + n0 // block_size)
        if n0 + BLOCK_N > seq_len:  # the sequence's last, partly written tile
            mbarrier.wait(ready_l.index(G), ph)
            mbarrier.wait(ready_r.index(G), ph)
            _zero_past_end(own[0], n0, seq_len, BLOCK_N, HALF, z_l)
            _zero_past_end(own[1], n0, seq_len, BLOCK_N, HALF, z_l)
        s = _pph_scores(own, q_l.index(dyn), q_r.index(dyn), q_p.index(dyn), ready_l.index(G),
                        ready_r.index(G), ph, s0, G)
        if u >= 1:
            # the other warpgroup's tile u - 1: its value product behind our scores, then
            # both waited for and this warpgroup's half of the other slot released
            t = u - 1
            pht = (t // 2) & 1
            mbarrier.wait(sready.index(1 - G), pht)
            mbarrier.wait(my_ready.index(1 - G), pht)  # (long done: the copy's visibility)
            m_prev = stat.index(2 * (1 - G)).load(srow)
            alpha_t = stat.index(2 * (1 - G) + 1).load(srow)
            l_i = l_i * alpha_t
            if G == 0:
                p_other = p1_smem.index(dyn)
            else:
                p_other = kr.index(dyn)
            acc_t = warpgroup_mma(p_other, mine.index(1 - G + dyn),
                                  acc * gl.convert_layout(alpha_t, orow)[:, None], is_async=True)
            sc, acc = warpgroup_mma_wait(0, deps=[s, acc_t])
            gl.thread_barrier()
            mbarrier.arrive(my_empty.index(1 - G), count=1)
        else:
            sc = warpgroup_mma_wait(0, deps=[s])
        # own tile u: softmax against the running maximum, publish it and P
        bad = _flag_bad(page, num_blocks, flag_ptr)
        seen = ((n0 + kn)[None, :] < hi[:, None]) & (bad == 0)
        sc = gl.where(seen, sc * qk_scale, float("-inf"))
        m_new = gl.maximum(m_prev, gl.max(sc, 1))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(sc - m_use[:, None])
        alpha = gl.exp2(m_prev - m_use)
        l_i = l_i * alpha + gl.sum(p, 1)
        m_prev = m_new
        pb = p.to(dt)
        if G == 0:
            own[2].store(pb)  # over the own tile's rope part: warpgroup 1 reads it with R
        else:
            p1_smem.index(dyn).store(pb)
        stat.index(2 * G).store(m_new)
        stat.index(2 * G + 1).store(alpha)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(sready.index(G), count=1)
        acc = acc * gl.convert_layout(alpha, orow)[:, None]
        acc = warpgroup_mma(gl.convert_layout(pb, pa_l), mine.index(G + dyn), acc,
                            is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])
        gl.thread_barrier()
        mbarrier.arrive(my_empty.index(G), count=1)
    t_last = n_tiles - 1
    if (t_last >= 0) & (t_last % 2 != G):  # the last tile is the other warpgroup's
        pht = (t_last // 2) & 1
        mbarrier.wait(sready.index(1 - G), pht)
        mbarrier.wait(my_ready.index(1 - G), pht)
        m_prev = stat.index(2 * (1 - G)).load(srow)
        alpha_t = stat.index(2 * (1 - G) + 1).load(srow)
        l_i = l_i * alpha_t
        if G == 0:
            p_other = p1_smem.index(0)
        else:
            p_other = kr.index(0)
        acc = acc * gl.convert_layout(alpha_t, orow)[:, None]
        acc = warpgroup_mma(p_other, mine.index(1 - G), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])
        gl.thread_barrier()
        mbarrier.arrive(my_empty.index(1 - G), count=1)

    # row sums: warpgroup 1 hands its part to warpgroup 0, which writes m and l
    if G == 1:
        stat.index(4).store(l_i)
        gl.thread_barrier()
        mbarrier.arrive(done.index(0), count=1)
    else:
        mbarrier.wait(done.index(0), 0)
        l_i = l_i + stat.index(4).load(srow)
        base = _ws_rows(m_s, q_start, heads, num_splits, split)
        rmask = m_s // heads < q_len
        gl.store(ws_m + base, m_prev, mask=rmask)
        gl.store(ws_l + base, l_i, mask=rmask)
    m_o = tile * BLOCK_M + gl.arange(0, BLOCK_M, layout=orow)
    base_o = _ws_rows(m_o, q_start, heads, num_splits, split)
    co = G * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, o_l))
    gl.store(ws_o + base_o[:, None] * R + co[None, :], acc, mask=(m_o // heads < q_len)[:, None])


@gluon.jit
def _pph_wg0(args, R: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
             CAUSAL: gl.constexpr, HAS_DRAFT: gl.constexpr):
    _pph_consumer(args, 0, R, BLOCK_M, BLOCK_N, CAUSAL, HAS_DRAFT)


@gluon.jit
def _pph_wg1(args, R: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
             CAUSAL: gl.constexpr, HAS_DRAFT: gl.constexpr):
    _pph_consumer(args, 1, R, BLOCK_M, BLOCK_N, CAUSAL, HAS_DRAFT)


@gluon.jit
def _pph_producer(args, R: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  CAUSAL: gl.constexpr, HAS_DRAFT: gl.constexpr):
    """The copies: each half of tile t into slot t % 2 once its reader is done with tile
    t - 2's (slot 0: L first, its owner's half; slot 1: R first)."""
    (q_l, q_r, q_p, kv_l, kv_r, kr, p1_smem, stat, ready_l, ready_r, empty_l, empty_r, sready,
     done, kd, rd, table_row, s_lo, n_tiles, block_size, num_blocks, seq_len, flag_ptr, q_len,
     tile, heads, draft, qk_scale, q_start, split, num_splits, ws_o, ws_m, ws_l) = args
    for t in range(n_tiles):
        slot = t % 2
        ph = ((t // 2) & 1) ^ 1
        n0 = s_lo + t * BLOCK_N
        page = gl.load(table_row + n0 // block_size)  # read while the slot is still busy
        bufs = (kv_l.index(slot), kv_r.index(slot), kr.index(slot))
        if slot == 0:
            mbarrier.wait(empty_l.index(0), ph)
            _copy_half(kd, rd, bufs, ready_l.index(0), page, n0, block_size, num_blocks, True,
                       0, R)
            mbarrier.wait(empty_r.index(0), ph)
            _copy_half(kd, rd, bufs, ready_r.index(0), page, n0, block_size, num_blocks, True,
                       1, R)
        else:
            mbarrier.wait(empty_r.index(1), ph)
            _copy_half(kd, rd, bufs, ready_r.index(1), page, n0, block_size, num_blocks, True,
                       1, R)
            mbarrier.wait(empty_l.index(1), ph)
            _copy_half(kd, rd, bufs, ready_l.index(1), page, n0, block_size, num_blocks, True,
                       0, R)


@gluon.jit
def _mla_gluon_pph(
    ql_ptr, qr_ptr, qsl_ptr, lens_ptr, table_ptr, ws_o, ws_m, ws_l, flag_ptr, kd, rd,
    stride_qt, stride_qh, stride_rt, stride_rh, stride_tb,
    num_blocks, block_size, heads, scale, draft, tiles, num_splits,
    R: gl.constexpr, P: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, CAUSAL: gl.constexpr, HAS_DRAFT: gl.constexpr,
):
    """64-row tiles, ping-pong over half-tile slots (module docstring). ``kd``: a [64, 256]
    box over the cache rows, ``rd``: the [64, 64] rope box."""
    gl.static_assert(gl.num_warps() == 4)
    gl.static_assert(STAGES == 2)
    gl.static_assert(R == 2 * HALF)
    dt: gl.constexpr = kd.dtype
    q_bl: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    r_l: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    st_l: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    h_lay: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HALF], dt)
    p_lay: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, P], dt)

    b, tile, split, q_start, q_len, seq_len = _request_tile(qsl_ptr, lens_ptr, tiles)
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
    p1_smem = gl.allocate_shared_memory(dt, [1, BLOCK_M, BLOCK_N], p_lay)
    # per warpgroup g: running maximum (2g) and rescale factor (2g + 1); 4: warpgroup 1's
    # row sums
    stat = gl.allocate_shared_memory(gl.float32, [5, BLOCK_M], st_l)
    bar_l: gl.constexpr = mbarrier.MBarrierLayout()
    ready_l = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_l)
    ready_r = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_l)
    empty_l = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_l)
    empty_r = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_l)
    sready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_l)
    done = gl.allocate_shared_memory(gl.int64, [1, 1], bar_l)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready_l.index(i), count=1)
        mbarrier.init(ready_r.index(i), count=1)
        mbarrier.init(empty_l.index(i), count=1)
        mbarrier.init(empty_r.index(i), count=1)
        mbarrier.init(sready.index(i), count=1)
    mbarrier.init(done.index(0), count=1)
    fence_async_shared()  # the queries' stores and the barriers' init, before async readers
    gl.thread_barrier()

    m_r = tile * BLOCK_M + gl.arange(0, BLOCK_M, layout=r_l)
    hi = _extents(m_r // heads, q_len, seq_len, draft, CAUSAL, HAS_DRAFT)
    s_lo, n_tiles = _split_tiles(hi, split, num_splits, BLOCK_N)
    table_row = table_ptr + b.to(gl.int64) * stride_tb
    qk_scale = scale * 1.4426950408889634
    args = (q_l, q_r, q_p, kv_l, kv_r, kr, p1_smem, stat, ready_l, ready_r, empty_l, empty_r,
            sready, done, kd, rd, table_row, s_lo, n_tiles, block_size, num_blocks, seq_len,
            flag_ptr, q_len, tile, heads, draft, qk_scale, q_start, split, num_splits, ws_o,
            ws_m, ws_l)
    # the kernel's own 4 warps issue the copies; the consumers get 240 registers each
    gl.warp_specialize([(_pph_producer, (args, R, BLOCK_M, BLOCK_N, CAUSAL, HAS_DRAFT)),
                        (_pph_wg0, (args, R, BLOCK_M, BLOCK_N, CAUSAL, HAS_DRAFT)),
                        (_pph_wg1, (args, R, BLOCK_M, BLOCK_N, CAUSAL, HAS_DRAFT))],
                       [4, 4], [240, 240])
