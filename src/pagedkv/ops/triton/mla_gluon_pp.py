"""Paged absorbed MLA in Gluon for Hopper: the warp-specialized ping-pong variant of the
64-row kernel: two consumer warpgroups on alternate key tiles (m64n64 scores, each tile's
scores computed once), P over the tile's rope part, the kernel's own warpgroup issuing the
copies. ``EARLY`` (``gluon="pingpong_early"``): each warpgroup releases the other's slot
before its own softmax, not after it (7% faster than ``mla_gluon._mla_gluon_fwd`` on the
H200; plain ``gluon="pingpong"`` 1-2%). The default, ``mla_gluon_pph``, is this kernel over
half-tile slots (docs/kernels.md, "MLA, Gluon 64-row pass"). Shared pieces come from
``mla_gluon``."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

from pagedkv.ops.triton.mla_gluon import (
    _extents,
    _flag_bad,
    _issue,
    _queries,
    _split_tiles,
    _zero_past_end,
)

# 3 warpgroups (copies, 2 consumers) at launch: 3 x 128 x 168 <= 65536 registers
PP_MAXNREG = 168


@gluon.jit
def _pp_scores(q_smem, qr_smem, kv_own, pv_own, ready, G: gl.constexpr, j, s0):
    """The own tile's scores, issued (rope part first, so that waiting down to one group
    leaves only a value product queued behind them in flight)."""
    mbarrier.wait(ready.index(G), j & 1)
    s = warpgroup_mma(qr_smem, pv_own.permute((1, 0)), s0, use_acc=False, is_async=True)
    return warpgroup_mma(q_smem, kv_own.permute((1, 0)), s, is_async=True)


@gluon.jit
def _pp_own(sc, acc_t, m_prev, l_i, u, G: gl.constexpr, kv_own, pv_own, stat, sready, empty,
            hi, kn, s_lo, page, num_blocks, flag_ptr, qk_scale,
            HALF: gl.constexpr, BLOCK_N: gl.constexpr, orow: gl.constexpr,
            RELEASED: gl.constexpr):
    """Own tile u with its scores ``sc`` in hand: softmax against the running maximum,
    publish (P over the tile's rope part, maximum and rescale factor, ``sready``), then
    this warpgroup's half of the value product; ``acc_t``: the product of tile u - 1 in
    flight (or the accumulator), whose slot is released once it is done (``RELEASED``:
    done and released already). ``page``: the tile's block id, read before its scores
    were waited for (no table read on the softmax chain)."""
    n0 = s_lo + u * BLOCK_N
    bad = _flag_bad(page, num_blocks, flag_ptr)
    keys = n0 + kn
    seen = (keys[None, :] < hi[:, None]) & (bad == 0)
    sc = gl.where(seen, sc * qk_scale, float("-inf"))
    m_new = gl.maximum(m_prev, gl.max(sc, 1))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(sc - m_use[:, None])
    alpha = gl.exp2(m_prev - m_use)
    l_i = l_i * alpha + gl.sum(p, 1)
    pv_own.store(p.to(pv_own.dtype))
    stat.index(2 * G).store(m_new)
    stat.index(2 * G + 1).store(alpha)
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(sready.index(G), count=1)
    if RELEASED:
        acc = acc_t
    else:
        acc = warpgroup_mma_wait(0, deps=[acc_t])
        gl.thread_barrier()  # every warp past its wait before the one arrive
        mbarrier.arrive(empty.index(1 - G), count=1, pred=u >= 1)
    acc = acc * gl.convert_layout(alpha, orow)[:, None]
    acc = warpgroup_mma(pv_own, kv_own.slice(G * HALF, HALF, dim=1), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=[acc])
    gl.thread_barrier()
    mbarrier.arrive(empty.index(G), count=1)
    return acc, m_new, l_i


@gluon.jit
def _pp_consumer(args, G: gl.constexpr, R: gl.constexpr, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, HAS_DRAFT: gl.constexpr,
                 EARLY: gl.constexpr):
    """Warpgroup G of the ping-pong kernel: scores and softmax of the tiles t = G mod 2 (which
    always sit in ring slot G), and output columns [G R/2, (G+1) R/2) over every tile. Tile
    t's owner publishes its running row maximum, its rescale factor and P (bf16, written over
    the tile's rope part, which only the scores read) and signals ``sready[t % 2]``; the
    other warpgroup's value product of tile t waits for that. Each arrives ``empty`` of a
    slot once its value product of that slot's tile is done."""
    (q_smem, qr_smem, kv_smem, kr_smem, stat, ready, empty, sready, done, kd, rd, table_row,
     s_lo, n_tiles, block_size, num_blocks, seq_len, flag_ptr, q_len, tile, heads, draft,
     qk_scale, q_start, split, num_splits, ws_o, ws_m, ws_l) = args
    HALF: gl.constexpr = R // 2
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BLOCK_N, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, R // 2, 16])
    z_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    srow: gl.constexpr = gl.SliceLayout(1, s_l)
    orow: gl.constexpr = gl.SliceLayout(1, o_l)
    m_s = tile * BLOCK_M + gl.arange(0, BLOCK_M, layout=srow)
    hi = _extents(m_s // heads, q_len, seq_len, draft, CAUSAL, HAS_DRAFT)
    kn = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_l))
    s0 = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_l)
    m_prev = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=srow)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=srow)
    acc = gl.zeros([BLOCK_M, HALF], gl.float32, layout=o_l)
    kv_own = kv_smem.index(G)
    pv_own = kr_smem.index(G)  # P of the own tile, over its rope part
    kv_other = kv_smem.index(1 - G)
    pv_other = kr_smem.index(1 - G)
    if G == 0:  # tile 0: no earlier tile to take in (peeled: no branch in the loop)
        if n_tiles > 0:
            if s_lo + BLOCK_N > seq_len:  # tile 0 is the sequence's last
                mbarrier.wait(ready.index(G), 0)
                _zero_past_end(kv_own, s_lo, seq_len, BLOCK_N, R, z_l)
            page = gl.load(table_row + s_lo // block_size)
            s = _pp_scores(q_smem.index(0), qr_smem.index(0), kv_own, pv_own, ready, G, 0, s0)
            sc = warpgroup_mma_wait(0, deps=[s])
            acc, m_prev, l_i = _pp_own(
                sc, warpgroup_mma_init(acc), m_prev, l_i, 0, G, kv_own, pv_own, stat, sready,
                empty, hi, kn, s_lo, page, num_blocks, flag_ptr, qk_scale, HALF, BLOCK_N, orow,
                False)
    first = 1 - G  # own tiles u = G + 2j from here on all follow another warpgroup's tile
    for j in range(first, gl.maximum(n_tiles - G + 1, 0) // 2):
        u = G + 2 * j
        n0 = s_lo + u * BLOCK_N
        dyn = j // (n_tiles + 2)
        kv_own = kv_smem.index(G + dyn)
        pv_own = kr_smem.index(G + dyn)
        kv_other = kv_smem.index(1 - G + dyn)
        pv_other = kr_smem.index(1 - G + dyn)
        if n0 + BLOCK_N > seq_len:  # the sequence's last, partly written tile
            mbarrier.wait(ready.index(G), j & 1)
            _zero_past_end(kv_own, n0, seq_len, BLOCK_N, R, z_l)
        page = gl.load(table_row + n0 // block_size)
        s = _pp_scores(q_smem.index(dyn), qr_smem.index(dyn), kv_own, pv_own, ready, G, j, s0)
        # the other warpgroup's tile u - 1: its value product, queued behind our scores
        t = u - 1
        mbarrier.wait(sready.index(1 - G), (t // 2) & 1)
        mbarrier.wait(ready.index(1 - G), (t // 2) & 1)  # (long done: the copy's visibility)
        m_prev = stat.index(2 * (1 - G)).load(srow)
        alpha_t = stat.index(2 * (1 - G) + 1).load(srow)
        l_i = l_i * alpha_t
        acc_t = warpgroup_mma(pv_other, kv_other.slice(G * HALF, HALF, dim=1),
                              acc * gl.convert_layout(alpha_t, orow)[:, None], is_async=True)
        if EARLY:  # both products done: the other's slot released before this softmax
            sc, acc_d = warpgroup_mma_wait(0, deps=[s, acc_t])
            gl.thread_barrier()
            mbarrier.arrive(empty.index(1 - G), count=1)
            acc, m_prev, l_i = _pp_own(
                sc, acc_d, m_prev, l_i, u, G, kv_own, pv_own, stat, sready, empty, hi, kn,
                s_lo, page, num_blocks, flag_ptr, qk_scale, HALF, BLOCK_N, orow, True)
        else:  # this softmax overlaps the other's value product; its slot released after
            sc = warpgroup_mma_wait(1, deps=[s])
            acc, m_prev, l_i = _pp_own(
                sc, acc_t, m_prev, l_i, u, G, kv_own, pv_own, stat, sready, empty, hi, kn,
                s_lo, page, num_blocks, flag_ptr, qk_scale, HALF, BLOCK_N, orow, False)
    t_last = n_tiles - 1
    if (t_last >= 0) & (t_last % 2 != G):  # the last tile is the other warpgroup's
        mbarrier.wait(sready.index(1 - G), (t_last // 2) & 1)
        mbarrier.wait(ready.index(1 - G), (t_last // 2) & 1)
        m_prev = stat.index(2 * (1 - G)).load(srow)
        alpha_t = stat.index(2 * (1 - G) + 1).load(srow)
        l_i = l_i * alpha_t
        acc = acc * gl.convert_layout(alpha_t, orow)[:, None]
        acc = warpgroup_mma(pv_other, kv_other.slice(G * HALF, HALF, dim=1), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])
        gl.thread_barrier()
        mbarrier.arrive(empty.index(1 - G), count=1)
    out = acc

    # row sums: warpgroup 1 hands its part to warpgroup 0, which writes m and l
    if G == 1:
        stat.index(4).store(l_i)
        gl.thread_barrier()
        mbarrier.arrive(done.index(0), count=1)
    else:
        mbarrier.wait(done.index(0), 0)
        l_i = l_i + stat.index(4).load(srow)
        base = ((q_start + m_s // heads).to(gl.int64) * heads + m_s % heads) * num_splits + split
        rmask = m_s // heads < q_len
        gl.store(ws_m + base, m_prev, mask=rmask)
        gl.store(ws_l + base, l_i, mask=rmask)
    m_o = tile * BLOCK_M + gl.arange(0, BLOCK_M, layout=orow)
    base_o = ((q_start + m_o // heads).to(gl.int64) * heads + m_o % heads) * num_splits + split
    co = G * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, o_l))
    gl.store(ws_o + base_o[:, None] * R + co[None, :], out, mask=(m_o // heads < q_len)[:, None])


@gluon.jit
def _pp_wg0(args, R: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
            CAUSAL: gl.constexpr, HAS_DRAFT: gl.constexpr, EARLY: gl.constexpr):
    _pp_consumer(args, 0, R, BLOCK_M, BLOCK_N, CAUSAL, HAS_DRAFT, EARLY)


@gluon.jit
def _pp_wg1(args, R: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
            CAUSAL: gl.constexpr, HAS_DRAFT: gl.constexpr, EARLY: gl.constexpr):
    _pp_consumer(args, 1, R, BLOCK_M, BLOCK_N, CAUSAL, HAS_DRAFT, EARLY)


@gluon.jit
def _pp_producer(args, R: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 CAUSAL: gl.constexpr, HAS_DRAFT: gl.constexpr):
    """The ring's copies: tile t into slot t % 2 once both consumer warpgroups are done with
    tile t - 2 (``empty``)."""
    (q_smem, qr_smem, kv_smem, kr_smem, stat, ready, empty, sready, done, kd, rd, table_row,
     s_lo, n_tiles, block_size, num_blocks, seq_len, flag_ptr, q_len, tile, heads, draft,
     qk_scale, q_start, split, num_splits, ws_o, ws_m, ws_l) = args
    for t in range(n_tiles):
        slot = t % 2
        n0 = s_lo + t * BLOCK_N
        page = gl.load(table_row + n0 // block_size)  # read while the slot is still busy
        mbarrier.wait(empty.index(slot), ((t // 2) & 1) ^ 1)
        _issue(kd, rd, kv_smem, kr_smem, ready, page, n0, slot, block_size, num_blocks, True, R)


@gluon.jit
def _mla_gluon_pp(
    ql_ptr, qr_ptr, qsl_ptr, lens_ptr, table_ptr, ws_o, ws_m, ws_l, flag_ptr, kd, rd,
    stride_qt, stride_qh, stride_rt, stride_rh, stride_tb,
    num_blocks, block_size, heads, scale, draft, tiles, num_splits,
    R: gl.constexpr, P: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, CAUSAL: gl.constexpr, HAS_DRAFT: gl.constexpr,
    EARLY: gl.constexpr = False,
):
    """64-row tiles, ping-pong (after FlashMLA's sm90 decode design; own code): two consumer
    warpgroups take alternate 64-key tiles, each computing its tile's full 64 x 64 scores
    (m64n64 wgmma: the queries are read once per tile, not once per warpgroup), so one
    warpgroup's softmax runs while the other's products run; the kernel's own warpgroup
    keeps the 2-slot ring filled. P lands over the tile's rope part (free once its scores are done),
    so the shared memory is that of ``_mla_gluon_fwd`` less its P buffer."""
    gl.static_assert(gl.num_warps() == 4)
    gl.static_assert(STAGES == 2)
    dt: gl.constexpr = kd.dtype
    q_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    r_l: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    st_l: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])

    pid = gl.program_id(0)
    split = gl.program_id(1)
    b = pid // tiles
    tile = pid % tiles
    q_start = gl.load(qsl_ptr + b)
    q_len = gl.load(qsl_ptr + b + 1) - q_start
    seq_len = gl.load(lens_ptr + b)
    # a tile past the request's rows: every row invalid, so no keys (n_tiles 0), no stores
    q_smem, qr_smem = _queries(ql_ptr, qr_ptr, q_start, q_len, tile, heads, stride_qt,
                               stride_qh, stride_rt, stride_rh, dt, BLOCK_M, R, P, q_l, True)
    kv_smem = gl.allocate_shared_memory(dt, [STAGES, BLOCK_N, R], kd.layout)
    kr_smem = gl.allocate_shared_memory(dt, [STAGES, BLOCK_N, P], rd.layout)
    stat = gl.allocate_shared_memory(gl.float32, [5, BLOCK_M], st_l)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    sready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    done = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
        mbarrier.init(sready.index(i), count=1)
    mbarrier.init(done.index(0), count=1)
    fence_async_shared()  # the queries' stores and the barriers' init, before async readers
    gl.thread_barrier()

    m_r = tile * BLOCK_M + gl.arange(0, BLOCK_M, layout=r_l)
    hi = _extents(m_r // heads, q_len, seq_len, draft, CAUSAL, HAS_DRAFT)
    s_lo, n_tiles = _split_tiles(hi, split, num_splits, BLOCK_N)
    table_row = table_ptr + b.to(gl.int64) * stride_tb
    qk_scale = scale * 1.4426950408889634
    args = (q_smem, qr_smem, kv_smem, kr_smem, stat, ready, empty, sready, done, kd, rd,
            table_row, s_lo, n_tiles, block_size, num_blocks, seq_len, flag_ptr, q_len, tile,
            heads, draft, qk_scale, q_start, split, num_splits, ws_o, ws_m, ws_l)
    # the kernel's own 4 warps issue the copies (the default partition is compiled under
    # the launch's register cap, so it gets the light work); the two consumer warpgroups
    # are workers with 240 registers each: 240 + 240 + 24 = 3 x PP_MAXNREG
    gl.warp_specialize([(_pp_producer, (args, R, BLOCK_M, BLOCK_N, CAUSAL, HAS_DRAFT)),
                        (_pp_wg0, (args, R, BLOCK_M, BLOCK_N, CAUSAL, HAS_DRAFT, EARLY)),
                        (_pp_wg1, (args, R, BLOCK_M, BLOCK_N, CAUSAL, HAS_DRAFT, EARLY))],
                       [4, 4], [240, 240])
