"""Paged absorbed MLA in Gluon for Hopper (sm_90): scores computed once per key tile.

Why not ``tl.dot``: with 64 (query row, head) rows on 8 warps Triton gives the score product
a [8, 1] warp layout, so both warpgroups compute the same 64 x 64 scores and the kernel is
compute-bound at half the tensor-core rate (docs/kernels-log.md, MLA sections). Here the layouts
are explicit. One program = one request x one row tile x one KV split.

- ``_mla_gluon_fwd`` (more than 16 rows per request: 64-row tiles, 8 warps): scores
  S = Q K^T over the 576-wide entry with [4, 2] warps (each warpgroup 32 of the 64 keys,
  every score computed once; the row maxima cross the warpgroups in the reduction, row
  sums stay per thread until the end); P (bf16) through shared memory; O += P V split by
  output columns (each warpgroup 256 columns, fp32 accumulators in registers).
  This kernel is ``gluon="serial"``; the default for 64-row tiles is the warp-specialized
  ping-pong kernel over half-tile slots, ``mla_gluon_pph`` (``ROWS_DEFAULT``; 1.35x this
  kernel on the H200, docs/kernels-log.md "MLA, Gluon 64-row pass").
- ``_mla_gluon_swap`` (<= 16 rows: decode with <= 16 heads): one warpgroup, keys on the
  MMA's M side, so no row is padded to 64.
- Both: 64-key page tiles arrive by TMA (512 latent + 64 rope columns, NVMMA-swizzled) in a
  2-slot ring guarded by mbarriers; the copy of tile i + 2 is issued as soon as tile i is
  consumed, with its block id read an iteration earlier.

Scope: bf16/fp16 queries and cache of the same dtype, or (<= 16 rows only) a per-tensor
scaled e4m3 cache (``mla_gluon_e4m3``, both products on e4m3 MMAs) or an fp8_ds_mla one
(``mla_gluon_ds``), R = 512, P = 64, block sizes that are multiples of 64, causal / non-causal / draft-block masks (``supported`` says why not). The
partly written last tile of each sequence is loaded whole and its slots past the sequence
zeroed in shared memory (unwritten slots may hold NaN, which a zero probability does not
cancel in the value product), so one launch covers every key; the split-KV ``combine`` of
the Triton kernels merges the splits. ``plan`` fixes one call's launches (``Plan``: kernel
and combine through ``pagedkv.launch.Launch``, the TMA descriptors built once), which
``ops/triton/mla.py`` keeps per key for eager calls.
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

from pagedkv.launch import Launch
from pagedkv.ops.triton.combine import combine_launch, workspace
from pagedkv.ops.triton.gluon_common import extents as _extents
from pagedkv.ops.triton.gluon_common import request_tile as _request_tile

RANK, ROPE, BLOCK_M, BLOCK_N, STAGES = 512, 64, 64, 64, 2
SWAP_ROWS = 16  # rows per program of the transposed kernel


@gluon.jit
def _issue(kd, rd, kv_smem, kr_smem, bars, page, n0, stage, block_size, num_blocks, pred,
           R: gl.constexpr):
    """TMA copies of the 64-key tile at key n0 (in block ``page``) into ring slot ``stage``."""
    page = gl.where((page < 0) | (page >= num_blocks), 0, page)  # flagged at compute time
    slot = page * block_size + n0 % block_size
    bar = bars.index(stage)
    mbarrier.expect(bar, kd.block_type.nbytes + rd.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(kd, [slot, 0], bar, kv_smem.index(stage), pred=pred)
    tma.async_copy_global_to_shared(rd, [slot, R], bar, kr_smem.index(stage), pred=pred)


@gluon.jit
def _zero_past_end(kv, n0, seq_len, BLOCK_N: gl.constexpr, R: gl.constexpr, z_l: gl.constexpr):
    """Zero the R latent columns of the keys >= seq_len in a landed tile (a whole tile, or
    one 256-column half in ``mla_gluon_pph``): slots past the sequence may hold anything
    (NaN), and a zero probability times NaN is NaN in the value product."""
    keep = (n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, z_l)) < seq_len)[:, None]
    for c in gl.static_range(R // 64):
        chunk = kv.slice(c * 64, 64, dim=1)
        x = chunk.load(z_l)
        chunk.store(gl.where(keep, x, gl.zeros_like(x)))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _queries(ql_ptr, qr_ptr, q_start, q_len, tile, heads, stride_qt, stride_qh, stride_rt,
             stride_rh, dt: gl.constexpr, BLOCK_M: gl.constexpr, R: gl.constexpr,
             P: gl.constexpr, q_l: gl.constexpr, LEAD: gl.constexpr = False):
    """The tile's (query row, head) rows -> NVMMA shared memory, latent and rope parts (rows
    past q_len: zeros). ``LEAD``: as [1, rows, cols] buffers, which a kernel indexes by a value
    the compiler cannot fold, so that ptxas keeps the wgmma descriptors in the key loop
    instead of hoisting (and spilling) them."""
    mq = tile * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, q_l))
    rq = mq // heads
    hq = mq % heads
    tq = (q_start + rq).to(gl.int64)
    qmask = (rq < q_len)[:, None]
    cr = gl.arange(0, R, layout=gl.SliceLayout(0, q_l))
    cp = gl.arange(0, P, layout=gl.SliceLayout(0, q_l))
    q = gl.load(ql_ptr + tq[:, None] * stride_qt + hq[:, None] * stride_qh + cr[None, :],
                mask=qmask, other=0.0)
    ql_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, R], dt)
    if LEAD:
        q_smem = gl.allocate_shared_memory(dt, [1, BLOCK_M, R], ql_layout)
        q_smem.index(0).store(q)
    else:
        q_smem = gl.allocate_shared_memory(dt, [BLOCK_M, R], ql_layout, q)
    qr = gl.load(qr_ptr + tq[:, None] * stride_rt + hq[:, None] * stride_rh + cp[None, :],
                 mask=qmask, other=0.0)
    qr_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, P], dt)
    if LEAD:
        qr_smem = gl.allocate_shared_memory(dt, [1, BLOCK_M, P], qr_layout)
        qr_smem.index(0).store(qr)
    else:
        qr_smem = gl.allocate_shared_memory(dt, [BLOCK_M, P], qr_layout, qr)
    return q_smem, qr_smem


@gluon.jit
def _split_tiles(hi, split, num_splits, BLOCK_N: gl.constexpr):
    """(first key, key tiles) of this split: [0, max hi) cut into num_splits BLOCK_N-aligned
    pieces."""
    kv_hi = gl.max(hi, 0)
    per = gl.cdiv(gl.cdiv(kv_hi, num_splits), BLOCK_N) * BLOCK_N
    s_lo = split * per
    t_hi = gl.minimum(s_lo + per, kv_hi)
    return s_lo, gl.maximum(gl.cdiv(t_hi - s_lo, BLOCK_N), 0)


@gluon.jit
def _ring_start(kd, rd, kv_smem, kr_smem, bars, table_row, s_lo, n_tiles, block_size,
                num_blocks, BLOCK_N: gl.constexpr, R: gl.constexpr):
    """Both ring slots' first copies; returns their block ids, which ride along the loop."""
    page_a = gl.load(table_row + s_lo // block_size, mask=n_tiles > 0, other=0)
    page_b = gl.load(table_row + (s_lo + BLOCK_N) // block_size, mask=n_tiles > 1, other=0)
    _issue(kd, rd, kv_smem, kr_smem, bars, page_a, s_lo, 0, block_size, num_blocks,
           n_tiles > 0, R)
    _issue(kd, rd, kv_smem, kr_smem, bars, page_b, s_lo + BLOCK_N, 1, block_size, num_blocks,
           n_tiles > 1, R)
    return page_a, page_b


@gluon.jit
def _flag_bad(page, num_blocks, flag_ptr):
    """A block id outside the cache: recorded for the host (its tile is masked out)."""
    bad = (page < 0) | (page >= num_blocks)
    gl.store(flag_ptr, 1, mask=bad)
    gl.store(flag_ptr + 1, page, mask=bad)
    return bad


@gluon.jit
def _ws_rows(m, q_start, heads, num_splits, split):
    """Workspace rows of this split for tile rows ``m`` (query row m // heads, head
    m % heads): the layout ``combine`` reads."""
    return ((q_start + m // heads).to(gl.int64) * heads + m % heads) * num_splits + split


@gluon.jit
def _mla_gluon_fwd(
    ql_ptr, qr_ptr, qsl_ptr, lens_ptr, table_ptr, ws_o, ws_m, ws_l, flag_ptr, kd, rd,
    stride_qt, stride_qh, stride_rt, stride_rh, stride_tb,
    num_blocks, block_size, heads, scale, draft, tiles, num_splits,
    R: gl.constexpr, P: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, CAUSAL: gl.constexpr, HAS_DRAFT: gl.constexpr,
):
    """Program (b x tile, split): rows tile*64.. of request b, this split's keys; writes
    split ``split`` of the workspace."""
    gl.static_assert(gl.num_warps() == 8)
    dt: gl.constexpr = kd.dtype
    # scores [64 rows, 64 keys]: warpgroup g computes keys 32g..32g+31
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                  instr_shape=[16, BLOCK_N // 2, 16])
    # output [64 rows, R]: warpgroup g owns columns (R/2)g..
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                  instr_shape=[16, R // 2, 16])
    q_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
    z_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
    srow: gl.constexpr = gl.SliceLayout(1, s_l)
    orow: gl.constexpr = gl.SliceLayout(1, o_l)

    b, tile, split, q_start, q_len, seq_len = _request_tile(qsl_ptr, lens_ptr, tiles)
    if tile * BLOCK_M >= q_len * heads:
        return

    q_smem, qr_smem = _queries(ql_ptr, qr_ptr, q_start, q_len, tile, heads, stride_qt,
                               stride_qh, stride_rt, stride_rh, dt, BLOCK_M, R, P, q_l)
    kv_smem = gl.allocate_shared_memory(dt, [STAGES, BLOCK_N, R], kd.layout)
    kr_smem = gl.allocate_shared_memory(dt, [STAGES, BLOCK_N, P], rd.layout)
    p_smem = gl.allocate_shared_memory(
        dt, [BLOCK_M, BLOCK_N], gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dt))
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()  # the queries' stores and the barriers' init, before async readers
    gl.thread_barrier()

    m_s = tile * BLOCK_M + gl.arange(0, BLOCK_M, layout=srow)
    hi = _extents(m_s // heads, q_len, seq_len, draft, CAUSAL, HAS_DRAFT)
    s_lo, n_tiles = _split_tiles(hi, split, num_splits, BLOCK_N)
    table_row = table_ptr + b.to(gl.int64) * stride_tb
    gl.static_assert(STAGES == 2)  # the block ids of the two tiles in the ring ride along
    page_a, page_b = _ring_start(kd, rd, kv_smem, kr_smem, bars, table_row, s_lo, n_tiles,
                                 block_size, num_blocks, BLOCK_N, R)

    qk_scale = scale * 1.4426950408889634
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=srow)
    # row sums kept per thread (each warpgroup sees half the keys) and reduced once at the
    # end: only the row maxima cross the warpgroups per tile
    l_acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_l)
    acc = gl.zeros([BLOCK_M, R], gl.float32, layout=o_l)
    s0 = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_l)
    kn = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_l))
    for it in range(n_tiles):
        stage = it % STAGES
        n0 = s_lo + it * BLOCK_N
        # block ids are read two tiles ahead (the one this slot takes next, here), so no
        # table read sits between a tile's arrival and its use or its slot's refill
        page = page_a
        refill = it + STAGES < n_tiles
        page_next = gl.load(table_row + (n0 + STAGES * BLOCK_N) // block_size, mask=refill,
                            other=0)
        bad = _flag_bad(page, num_blocks, flag_ptr)
        mbarrier.wait(bars.index(stage), (it // STAGES) & 1)
        kv = kv_smem.index(stage)
        if n0 + BLOCK_N > seq_len:  # the sequence's last, partly written tile
            _zero_past_end(kv, n0, seq_len, BLOCK_N, R, z_l)
        s = warpgroup_mma(q_smem, kv.permute((1, 0)), s0, use_acc=False, is_async=True)
        s = warpgroup_mma(qr_smem, kr_smem.index(stage).permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(0, deps=[s])
        keys = n0 + kn
        seen = (keys[None, :] < hi[:, None]) & (bad == 0)
        s = gl.where(seen, s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s - m_use[:, None])
        alpha = gl.exp2(m_i - m_use)
        l_acc = l_acc * alpha[:, None] + p
        m_i = m_new
        p_smem.store(p.to(dt))
        fence_async_shared()
        gl.thread_barrier()
        acc = acc * gl.convert_layout(alpha, orow)[:, None]
        acc = warpgroup_mma(p_smem, kv, acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])
        gl.thread_barrier()  # both warpgroups are done with this slot and with P
        _issue(kd, rd, kv_smem, kr_smem, bars, page_next, n0 + STAGES * BLOCK_N, stage,
               block_size, num_blocks, refill, R)
        page_a = page_b
        page_b = page_next

    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    base = _ws_rows(m_s, q_start, heads, num_splits, split)
    rmask = m_s // heads < q_len
    gl.store(ws_m + base, m_i, mask=rmask)
    gl.store(ws_l + base, gl.sum(l_acc, 1), mask=rmask)
    m_o = tile * BLOCK_M + gl.arange(0, BLOCK_M, layout=orow)
    base_o = _ws_rows(m_o, q_start, heads, num_splits, split)
    co = gl.arange(0, R, layout=gl.SliceLayout(0, o_l))
    gl.store(ws_o + base_o[:, None] * R + co[None, :], acc, mask=(m_o // heads < q_len)[:, None])


@gluon.jit
def _mla_gluon_swap(
    ql_ptr, qr_ptr, qsl_ptr, lens_ptr, table_ptr, ws_o, ws_m, ws_l, flag_ptr, kd, rd,
    stride_qt, stride_qh, stride_rt, stride_rh, stride_tb,
    num_blocks, block_size, heads, scale, draft, tiles, num_splits, lscale,
    R: gl.constexpr, P: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, CAUSAL: gl.constexpr, HAS_DRAFT: gl.constexpr,
):
    """Few rows (<= 16: decode with <= 16 heads): keys on the MMA's M side, one warpgroup.
    S^T [64 keys, BLOCK_M rows] = K Q^T, O^T [R, BLOCK_M] += V^T P^T (V^T: the key tile read
    transposed from shared memory), so no row is padded to 64. Same grid, workspace and
    TMA ring as ``_mla_gluon_fwd``; the compute per tile is small, so what counts is that
    the copies of the next two tiles are in flight while one is consumed. ``lscale`` (folded
    into the scores and the output) is 1.0: it served the fp8 widening form, since deleted
    (``mla_gluon_e4m3`` took its calls), and stays so that this kernel's code is the one
    timed on the H200."""
    gl.static_assert(gl.num_warps() == 4)
    dt: gl.constexpr = ql_ptr.dtype.element_ty
    t_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BLOCK_M, 16])
    q_l: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    z_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    per_row: gl.constexpr = gl.SliceLayout(0, t_l)
    per_key: gl.constexpr = gl.SliceLayout(1, t_l)

    b, tile, split, q_start, q_len, seq_len = _request_tile(qsl_ptr, lens_ptr, tiles)
    if tile * BLOCK_M >= q_len * heads:
        return

    q_smem, qr_smem = _queries(ql_ptr, qr_ptr, q_start, q_len, tile, heads, stride_qt,
                               stride_qh, stride_rt, stride_rh, dt, BLOCK_M, R, P, q_l)
    kv_smem = gl.allocate_shared_memory(kd.dtype, [STAGES, BLOCK_N, R], kd.layout)
    kr_smem = gl.allocate_shared_memory(rd.dtype, [STAGES, BLOCK_N, P], rd.layout)
    pt_smem = gl.allocate_shared_memory(
        dt, [BLOCK_N, BLOCK_M], gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dt))
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()
    gl.thread_barrier()

    m_r = tile * BLOCK_M + gl.arange(0, BLOCK_M, layout=per_row)
    hi = _extents(m_r // heads, q_len, seq_len, draft, CAUSAL, HAS_DRAFT)
    s_lo, n_tiles = _split_tiles(hi, split, num_splits, BLOCK_N)
    table_row = table_ptr + b.to(gl.int64) * stride_tb
    gl.static_assert(STAGES == 2)  # the block ids of the two tiles in the ring ride along
    page_a, page_b = _ring_start(kd, rd, kv_smem, kr_smem, bars, table_row, s_lo, n_tiles,
                                 block_size, num_blocks, BLOCK_N, R)

    qk_scale = scale * lscale * 1.4426950408889634
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=per_row)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=per_row)
    acc = gl.zeros([R, BLOCK_M], gl.float32, layout=t_l)
    s0 = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=t_l)
    kn = gl.arange(0, BLOCK_N, layout=per_key)
    for it in range(n_tiles):
        stage = it % STAGES
        n0 = s_lo + it * BLOCK_N
        # block ids are read two tiles ahead (the one this slot takes next, here), so no
        # table read sits between a tile's arrival and its use or its slot's refill
        page = page_a
        refill = it + STAGES < n_tiles
        page_next = gl.load(table_row + (n0 + STAGES * BLOCK_N) // block_size, mask=refill,
                            other=0)
        bad = _flag_bad(page, num_blocks, flag_ptr)
        mbarrier.wait(bars.index(stage), (it // STAGES) & 1)
        kv = kv_smem.index(stage)
        kr = kr_smem.index(stage)
        if n0 + BLOCK_N > seq_len:  # the sequence's last, partly written tile
            _zero_past_end(kv, n0, seq_len, BLOCK_N, R, z_l)
        s = warpgroup_mma(kv, q_smem.permute((1, 0)), s0, use_acc=False, is_async=True)
        s = warpgroup_mma(kr, qr_smem.permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(0, deps=[s])
        keys = n0 + kn
        seen = (keys[:, None] < hi[None, :]) & (bad == 0)
        s = gl.where(seen, s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 0))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s - m_use[None, :])
        alpha = gl.exp2(m_i - m_use)
        l_i = l_i * alpha + gl.sum(p, 0)
        m_i = m_new
        pt_smem.store(p.to(dt))
        fence_async_shared()
        gl.thread_barrier()
        acc = warpgroup_mma(kv.permute((1, 0)), pt_smem, acc * alpha[None, :], is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])
        gl.thread_barrier()  # every warp is done with this slot and P
        _issue(kd, rd, kv_smem, kr_smem, bars, page_next, n0 + STAGES * BLOCK_N, stage,
               block_size, num_blocks, refill, R)
        page_a = page_b
        page_b = page_next

    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    base = _ws_rows(m_r, q_start, heads, num_splits, split)
    rmask = m_r // heads < q_len
    gl.store(ws_m + base, m_i, mask=rmask)
    gl.store(ws_l + base, l_i, mask=rmask)
    co = gl.arange(0, R, layout=per_key)
    gl.store(ws_o + base[None, :] * R + co[:, None], acc * lscale, mask=rmask[None, :])


def descriptors(cache: torch.Tensor, latent_box: int = RANK):
    """(latent, rope) Gluon tensor descriptors over the cache seen as one row per slot:
    [64, latent_box] (512, or 256 for the half-tile slots of ``mla_gluon_pph``) and [64, 64] boxes,
    128-byte swizzle."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    num_blocks, block_size, width = cache.shape
    dt = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16,
          torch.float8_e4m3fn: gl.float8e4nv}[cache.dtype]
    rows = num_blocks * block_size
    flat = cache.view(rows, width) if cache.is_contiguous() else cache.as_strided(
        (rows, width), (cache.stride(1), 1))
    kd = TensorDescriptor(flat, [rows, width], [cache.stride(1), 1], [BLOCK_N, latent_box],
                          gl.NVMMASharedLayout.get_default_for([BLOCK_N, latent_box], dt))
    rd = TensorDescriptor(flat, [rows, width], [cache.stride(1), 1], [BLOCK_N, ROPE],
                          gl.NVMMASharedLayout.get_default_for([BLOCK_N, ROPE], dt))
    return kd, rd


def supported(q_latent, q_rope, cache, mask, latent_scale, rows: int = 1) -> str | None:
    """Why the Gluon kernel cannot take this call (None: it can); ``rows``: query rows per
    request (q_len x heads). Device checks last."""
    if cache.dtype == torch.uint8:  # fp8_ds_mla: its own kernel
        from pagedkv.ops.triton import mla_gluon_ds

        return mla_gluon_ds.supported(q_latent, q_rope, cache, mask, rows)
    fp8 = cache.dtype == torch.float8_e4m3fn
    if fp8:
        if rows > SWAP_ROWS:
            return f"an fp8 cache with {rows} rows per request (the <= {SWAP_ROWS}-row kernel only)"
        if not isinstance(latent_scale, float | int):
            return "an fp8 cache needs a Python float latent scale here (a tensor scale: Triton)"
        if q_latent.dtype not in (torch.bfloat16, torch.float16) or (
                q_rope is not None and q_rope.dtype != q_latent.dtype):
            return f"{q_latent.dtype} queries for an fp8 cache (bf16/fp16 only)"
    elif latent_scale is not None or cache.dtype not in (torch.bfloat16, torch.float16):
        return f"a {cache.dtype} cache (bf16/fp16, or per-tensor e4m3 fp8)"
    elif q_latent.dtype != cache.dtype or (q_rope is not None and q_rope.dtype != cache.dtype):
        return f"{q_latent.dtype} queries for a {cache.dtype} cache"
    if q_rope is None or q_latent.shape[-1] != RANK or q_rope.shape[-1] != ROPE:
        rope = 0 if q_rope is None else q_rope.shape[-1]
        return f"rank {q_latent.shape[-1]} + rope {rope} (512 + 64 only)"
    if cache.shape[1] % BLOCK_N or cache.shape[-1] != RANK + ROPE:
        return f"block size {cache.shape[1]}, entry {cache.shape[-1]} (multiples of 64, 576)"
    if cache.stride(2) != 1 or cache.stride(0) != cache.shape[1] * cache.stride(1) or (
            cache.stride(1) * cache.element_size()) % 16 or cache.data_ptr() % 16:
        return "cache entries not page-contiguous and 16-byte aligned"
    if mask.window is not None or mask.chunk is not None:
        return "sliding-window / chunked masks"
    if cache.device.type != "cuda" or torch.cuda.get_device_capability(cache.device) != (9, 0):
        return "not a Hopper (sm_90) device"
    return None


def tile_rows(rows_per_request: int) -> int:
    """Rows per program: <= 16 (decode with <= 16 heads) take the transposed one-warpgroup
    kernel, more the 64-row tiles."""
    return SWAP_ROWS if rows_per_request <= SWAP_ROWS else BLOCK_M


# 64-row kernel variants (``paged_mla_latent(gluon=...)`` names one): "serial" is
# ``_mla_gluon_fwd`` (each tile's steps in sequence), "pingpong_halves"
# ``mla_gluon_pph._mla_gluon_pph`` (warp-specialized, half-tile slots)
ROWS_VARIANTS = ("serial", "pingpong_halves")
ROWS_DEFAULT = "pingpong_halves"
# the <= 16-row kernel of a per-tensor e4m3 cache, by name: "e4m3" is
# ``mla_gluon_e4m3._mla_gluon_e4m3`` (both products on e4m3 MMAs, warp-specialized), the
# only one since the widening kernel (bf16 MMAs on tiles widened in shared memory, 2.1x its
# time on the H200, docs/kernels-log.md) was deleted
FP8_VARIANTS = ("e4m3",)


class Plan:
    """One Gluon MLA call's launches, fixed by shapes, strides, dtypes, the cache's address
    and the options (``plan``): the kernel and the combine as ``pagedkv.launch.Launch``es,
    the workspace shape, and the two TMA descriptors, which embed the cache's base address
    and keep the cache alive while the plan is cached (so no other tensor can take that
    address and meet a stale descriptor)."""

    __slots__ = ("kernel", "combine", "ws_shape", "descriptors")

    def __init__(self, kernel, combine_, ws_shape, descs):
        self.kernel, self.combine, self.ws_shape, self.descriptors = kernel, combine_, ws_shape, descs

    def __call__(self, ql, qr, query_start_loc, seq_lens, table, flag, out) -> None:
        ws = workspace(*self.ws_shape, ql.device, reuse=True)
        self.kernel(ql, qr, query_start_loc, seq_lens, table, *ws, flag)
        self.combine(*ws, out, query_start_loc, ws[1])


def plan(ql, qr, cache, query_start_loc, seq_lens, table, out, *, scale: float, mask,
         tiles: int, splits: int, block_m: int, variant: str | None = None,
         latent_scale: float | None = None) -> Plan:
    """Grid (batch x tiles, splits), each program writing its split of a workspace of
    ``splits`` splits that the combine merges into ``out``. Tensor values are not read."""
    if cache.dtype == torch.uint8:  # fp8_ds_mla (``mla_gluon_ds``)
        from pagedkv.ops.triton import mla_gluon_ds

        return mla_gluon_ds.plan(ql, qr, cache, query_start_loc, seq_lens, table, out,
                                 scale=scale, mask=mask, tiles=tiles, splits=splits)
    swap = block_m == SWAP_ROWS
    e4m3 = swap and cache.dtype == torch.float8_e4m3fn
    variant = variant or ROWS_DEFAULT
    halves = variant == "pingpong_halves" and not swap
    kd, rd = descriptors(cache, RANK // 2 if halves else RANK)
    num_blocks, block_size = cache.shape[:2]
    rows, heads = ql.shape[:2]
    consts = dict(R=RANK, P=ROPE, BLOCK_M=block_m, BLOCK_N=BLOCK_N, STAGES=STAGES,
                  CAUSAL=mask.causal, HAS_DRAFT=mask.draft_block is not None, num_warps=8)
    scalars, ws_splits = (), splits
    if e4m3:
        from pagedkv.ops.triton import mla_gluon_e4m3

        fn = mla_gluon_e4m3._mla_gluon_e4m3
        consts.update(num_warps=4, maxnreg=mla_gluon_e4m3.MAXNREG, STAGES=mla_gluon_e4m3.STAGES)
        ws_splits = splits * mla_gluon_e4m3.SPLITS_PER_PROGRAM
        scalars = (float(latent_scale),)
    elif swap:
        fn, consts["num_warps"] = _mla_gluon_swap, 4
        scalars = (1.0,)
    elif halves:
        from pagedkv.ops.triton.mla_gluon_pph import PPH_MAXNREG, _mla_gluon_pph

        fn, consts["num_warps"], consts["maxnreg"] = _mla_gluon_pph, 4, PPH_MAXNREG
    else:
        fn = _mla_gluon_fwd
    kernel = Launch(fn,
                    (seq_lens.shape[0] * tiles, splits), (
                        kd, rd, ql.stride(0), ql.stride(1), qr.stride(0), qr.stride(1),
                        table.stride(0), num_blocks, block_size, heads, scale,
                        mask.draft_block or 0, tiles, splits, *scalars), consts)
    ws_shape = (rows, heads, ws_splits, RANK)
    return Plan(kernel, combine_launch(ws_shape, out, query_start_loc, None), ws_shape, (kd, rd))


def launch(ql, qr, cache, query_start_loc, seq_lens, table, out, flag, *, scale: float, mask,
           tiles: int, splits: int, block_m: int, variant: str | None = None,
           latent_scale: float | None = None) -> Plan:
    """``plan`` for these arguments, run once; returned for the caller to keep."""
    made = plan(ql, qr, cache, query_start_loc, seq_lens, table, out, scale=scale, mask=mask,
                tiles=tiles, splits=splits, block_m=block_m, variant=variant,
                latent_scale=latent_scale)
    made(ql, qr, query_start_loc, seq_lens, table, flag, out)
    return made
