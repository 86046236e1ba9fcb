"""Paged GQA decode over fp8 (e4m3/e5m2, per-tensor scaled) caches in Gluon for Hopper (sm_90),
with both products on the 8-bit tensor cores.

Why: the ``tl.dot`` decode kernels widen fp8 K/V to fp16 before their MMAs (byte permutes,
200+ registers, 2 programs per SM: 1.2x the bf16 kernel, docs/kernels-log.md), and e4m3 scores
alone left P x V 16-bit. 8-bit wgmma operands from shared memory must be K-major: K
([keys, dims], dims contiguous) is, V is not, so V is transposed once per tile through
registers into a K-major buffer.

- A copy warp (``warp_specialize``) brings 64-key tiles by TMA, one 16-slot box of K and of
  V per 16 keys from the cache seen as [slots, kv_heads * dim] (bad block ids read page
  0), into a ring of ``STAGES`` slots with ready / empty mbarriers.
- The compute warpgroup, keys on the MMA's M side so the (query row, head) pairs of a KV
  head are the MMA's N (8 at q_len 1, group 4): the query split into two e4m3 tiles (hi +
  lo, one scale per pair: about bf16's 8 significant bits) stacked side by side as one
  operand, so S^T = K [Q_hi Q_lo]^T is one MMA of twice the N (each K tile read once by the
  tensor cores; the hi + lo column halves added in registers, ``gluon_common.half_sum``);
  while it runs, V -> registers -> V^T as key pairs (``_transpose_pairs``;
  only a split's last tile or a tile behind a bad block id goes through a masked byte
  shuffle: NaN-filled slots would survive a zero probability); the online softmax; P x 256
  as e4m3 hi + lo (one e4m3 tile alone: 1-2.5% relative error, ``benchmarks/fp8_probs.py``)
  stacked the same way; O^T += V^T [P_hi P_lo]^T. The sums add the e4m3 values the MMA
  multiplies.
- Every program writes its split of the (o, m, l) workspace; ``combine`` merges the splits
  (and zeroes padding rows).

Scope (``supported``): Hopper, fp8 K and V of one format, bf16/fp16 queries, head dim 128
for K and V, blocks of a multiple of 16 slots, heads packed in an entry, float or
device-memory scales, sinks (in the combine), causal, non-causal and draft-block masks, up
to 32 (row, head) pairs per KV head; no window/chunk/soft-cap.
The default for the fp8 calls it takes (``decode.GLUON_FP8``; 7-token non-causal blocks: 1.27-1.29x
the Triton fp8 kernel, H200 18:00 UTC). H200, 2026-12-04 17:12-17:15
UTC (docs/kernels-log.md, "GQA fp8, lean V^T"): 1.77-1.86x the bf16 kernel's throughput at B32-128,
context 8K-32K, page 16 (91-98% of device copy at B64-128), against 1.42-1.48x for the form
that zeroed every tile and 1.26-1.30x for two MMA chains (both deleted since).
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

from pagedkv.ops.fp8 import is_fp8
from pagedkv.ops.triton.gluon_common import e4m3_softmax as _e4m3_softmax
from pagedkv.ops.triton.gluon_common import extents as _extents
from pagedkv.ops.triton.gluon_common import half_sum as _half_sum

BLOCK_N, BOX, DIM = 64, 16, 128
# ring slots: 2 (4 programs per SM) beat 3 (3 per SM) by 15% on the H200 (docs/kernels-log.md)
STAGES = 2
LOADER_REGS = gl.constexpr(40)  # the copy warp's register request (worker_num_regs)
# registers per thread of the launch (256 threads: the copy warp is padded to a warpgroup,
# whose registers mostly go to the compute warpgroup: 104 of them at 64) by the MMA's N:
# the smallest without spills in the sm_90 compile (64: 4 programs per SM)
MAXNREG = {8: 64, 16: 128, 32: 128}
MAX_PAIRS = 32  # (query row, query head) pairs of one KV head per program (the MMA's N)


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
    """A landed [64 keys, R] e4m3 tile -> V^T (K-major for the value MMA; its first ``ROWS``
    rows into ``vt16``, the rest into ``vt16_b``, both the e4m3 buffers seen as [rows, 32]
    int16), 128 columns at a time through registers (``v_l``: 2 keys x 16 columns a
    thread), each thread's two adjacent keys joined per column by ``_pair_keys``."""
    for c in gl.static_range(R // 128):
        x = kv.slice(c * 128, 128, dim=1).load(v_l)
        a, b = gl.split(gl.permute(gl.reshape(x, [32, 2, 128]), (0, 2, 1)))
        h = gl.permute(_pair_keys(a, b), (1, 0))
        if c * 128 < ROWS:
            vt16.slice(c * 128, 128, dim=0).store(h)
        else:
            vt16_b.slice(c * 128 - ROWS, 128, dim=0).store(h)


@gluon.jit
def _key_ok(table_row, keys, s_hi, num_blocks, PAGE: gl.constexpr):
    """Keys of the tile that are in the split and behind a block id inside the cache."""
    inside = keys < s_hi
    page = gl.load(table_row + keys // PAGE, mask=inside, other=0)
    return inside & (page >= 0) & (page < num_blocks), page


@gluon.jit
def _masked_vt(v_tile, vt_smem, ok, v_l: gl.constexpr):
    """V^T of a landed tile through registers (the compiler's byte shuffle), keys not ``ok``
    (past the split, behind a bad block id) zeroed."""
    vx = v_tile.load(v_l)
    vx = gl.where(ok[:, None], vx, gl.zeros_like(vx))
    vt_smem.store(gl.permute(vx, (1, 0)))


@gluon.jit
def _loader(args, PAGE: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """One warp: the TMA copies of tile t (one 16-slot box of K and of V per 16 keys) into
    ring slot t % STAGES once the compute warpgroup has released it; bad block ids read
    page 0 (their keys are masked)."""
    (qh_smem, k_ring, v_ring, vt_smem, pt_smem, ready, empty, kd, vd,
     table_row, s_lo, s_hi, n_tiles, num_blocks, col) = args[:15]
    for t in range(n_tiles):
        stage = t % STAGES
        n0 = s_lo + t * BLOCK_N
        mbarrier.wait(empty.index(stage), ((t // STAGES) & 1) ^ 1)
        bar = ready.index(stage)
        mbarrier.expect(bar, kd.block_type.nbytes * (BLOCK_N // 8))
        for j in gl.static_range(BLOCK_N // 16):
            key = n0 + j * 16
            page = gl.load(table_row + key // PAGE, mask=key < s_hi, other=0)
            page = gl.where((page < 0) | (page >= num_blocks), 0, page)
            row = page * PAGE + key % PAGE
            tma.async_copy_global_to_shared(kd, [row, col], bar,
                                            k_ring.index(stage).slice(j * 16, 16, dim=0))
            tma.async_copy_global_to_shared(vd, [row, col], bar,
                                            v_ring.index(stage).slice(j * 16, 16, dim=0))


@gluon.jit
def _compute(args, GROUP: gl.constexpr, PAGE: gl.constexpr, D: gl.constexpr,
             BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
             CAUSAL: gl.constexpr, HAS_DRAFT: gl.constexpr, CHECK: gl.constexpr):
    """The warpgroup: queries to e4m3, then per tile S^T = K Q^T (keys on the MMA's M),
    V^T in shared memory, the online softmax, O^T = O^T alpha + V^T P^T (the product in a
    fresh accumulator); writes its workspace split."""
    (qh_smem, k_ring, v_ring, vt_smem, pt_smem, ready, empty, kd, vd,
     table_row, s_lo, s_hi, n_tiles, num_blocks, col, q_ptr, q_start, q_len, seq_len, kvh,
     stride_qt, stride_qh, draft, qk_scale, v_scale, flag_ptr, heads, num_splits, split,
     ws_o, ws_m, ws_l) = args
    t_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BLOCK_M, 32])
    # the accumulators of hi and lo side by side ([keys or dims, 2 x pairs])
    t2_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                   instr_shape=[16, 2 * BLOCK_M, 32])
    # a masked tile's V [keys, dims] -> registers (16 dims of 4 keys per thread) -> V^T
    v_l: gl.constexpr = gl.BlockedLayout([4, 16], [4, 8], [4, 1], [1, 0])
    # the other tiles' V^T: 2 keys x 16 dims a thread, the 64 keys across a warp's lanes (_transpose_pairs);
    # V^T seen as [D, BLOCK_N / 2] int16 key pairs (the same bytes); the tile's 16-key boxes'
    # block ids held whole by every thread (a reduction without crossing threads)
    vp_l: gl.constexpr = gl.BlockedLayout([2, 16], [32, 1], [1, 4], [1, 0])
    vt16_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=BLOCK_N, element_bitwidth=16,
                                                rank=2)
    box_l: gl.constexpr = gl.BlockedLayout([BLOCK_N // 16], [32], [4], [0])
    q_l: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    per_pair: gl.constexpr = gl.SliceLayout(0, t_l)
    per_key: gl.constexpr = gl.SliceLayout(1, t_l)
    v_key: gl.constexpr = gl.SliceLayout(1, v_l)
    e4: gl.constexpr = gl.float8e4nv

    # queries -> two e4m3 tiles with one scale per pair: y = q / sq (row maximum 448),
    # hi = e4m3(y), lo = e4m3(y - hi); hi + lo keeps about 8 significant bits (bf16's)
    mq = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, q_l))
    dq = gl.arange(0, D, layout=gl.SliceLayout(0, q_l))
    q = gl.load(q_ptr + (q_start + mq // GROUP).to(gl.int64)[:, None] * stride_qt
                + (kvh * GROUP + mq % GROUP)[:, None] * stride_qh + dq[None, :],
                mask=(mq // GROUP < q_len)[:, None], other=0.0).to(gl.float32)
    amax = gl.max(gl.abs(q), 1)
    sq = gl.where(amax > 0, amax / 448.0, 1.0)
    y = q / sq[:, None]
    qh = y.to(e4)
    # rows [0, BLOCK_M) hi, [BLOCK_M, 2 BLOCK_M) lo of one operand (P's too)
    qh_smem.slice(0, BLOCK_M, dim=0).store(qh)
    qh_smem.slice(BLOCK_M, BLOCK_M, dim=0).store((y - qh.to(gl.float32)).to(e4))
    fence_async_shared()
    gl.thread_barrier()
    pair_scale = gl.convert_layout(sq, per_pair) * qk_scale

    m_r = gl.arange(0, BLOCK_M, layout=per_pair)
    hi = _extents(m_r // GROUP, q_len, seq_len, draft, CAUSAL, HAS_DRAFT)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=per_pair)
    # row sums kept per thread and reduced once at the end: only the maxima cross the warps
    l_acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=t_l)
    s0 = gl.zeros([BLOCK_N, 2 * BLOCK_M], gl.float32, layout=t2_l)
    o0 = gl.zeros([D, 2 * BLOCK_M], gl.float32, layout=t2_l)
    acc = _half_sum(o0)  # [D, pairs] in the layout of the hi + lo sums
    kn = gl.arange(0, BLOCK_N, layout=per_key)
    kv = gl.arange(0, BLOCK_N, layout=v_key)
    gl.static_assert(BLOCK_N == 64)  # _transpose_pairs' [64 keys, 128 columns] chunks
    vt16 = vt_smem._reinterpret(gl.int16, [D, BLOCK_N // 2], vt16_l)
    boxes = gl.arange(0, BLOCK_N // 16, layout=box_l) * 16
    for it in range(n_tiles):
        stage = it % STAGES
        n0 = s_lo + it * BLOCK_N
        ok, page = _key_ok(table_row, n0 + kn, s_hi, num_blocks, PAGE)
        if CHECK:
            bad = (n0 + kn < s_hi) & ((page < 0) | (page >= num_blocks))
            gl.store(flag_ptr + kn * 0, gl.full([BLOCK_N], 1, gl.int32, layout=per_key),
                     mask=bad)
            gl.store(flag_ptr + 1 + kn * 0, page, mask=bad)
        mbarrier.wait(ready.index(stage), (it // STAGES) & 1)
        k_tile = k_ring.index(stage)
        s = warpgroup_mma(k_tile, qh_smem.permute((1, 0)), s0, use_acc=False, is_async=True)
        # while the score MMA runs: V^T of the slot, keys not read zeroed (NaN-filled slots
        # would survive a zero probability). Every key of a tile before the split's end
        # behind good block ids is written cache: only the split's last tile or one behind
        # a bad id is zeroed
        kb = n0 + boxes
        pg = gl.load(table_row + kb // PAGE, mask=kb < s_hi, other=0)
        bad = gl.max(((pg < 0) | (pg >= num_blocks)).to(gl.int32), 0)
        if (n0 + BLOCK_N > s_hi) | (bad != 0):
            ok_v, _ = _key_ok(table_row, n0 + kv, s_hi, num_blocks, PAGE)
            _masked_vt(v_ring.index(stage), vt_smem, ok_v, v_l)
        else:
            _transpose_pairs(v_ring.index(stage), vt16, vt16, D, D, vp_l)
        s = warpgroup_mma_wait(0, deps=[s])
        gl.thread_barrier()  # every warp's V read and the scores' K read: release the slot
        mbarrier.arrive(empty.index(stage), count=1)
        s = gl.convert_layout(_half_sum(s), t_l)
        seen = ((n0 + kn)[:, None] < hi[None, :]) & ok[:, None]
        s = gl.where(seen, s * pair_scale[None, :], float("-inf"))
        alpha, m_i, l_acc = _e4m3_softmax(s, m_i, l_acc, pt_smem, BLOCK_M)
        fence_async_shared()
        gl.thread_barrier()  # V^T and P stored by every warp
        # each tile's value product in a fresh accumulator, added to the running output in
        # registers: e4m3 MMAs add into their accumulator with limited precision, so a
        # running sum over thousands of keys there loses the small tiles' bits
        o = warpgroup_mma(vt_smem, pt_smem.permute((1, 0)), o0, use_acc=False, is_async=True)
        o = warpgroup_mma_wait(0, deps=[o])
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(0, acc.type.layout))[None, :] \
            + _half_sum(o)
        gl.thread_barrier()  # every warp done with V^T and P before they are rewritten

    row = m_r // GROUP
    base = ((q_start + row).to(gl.int64) * heads + kvh * GROUP + m_r % GROUP) * num_splits + split
    rmask = row < q_len
    gl.store(ws_m + base, m_i, mask=rmask)
    gl.store(ws_l + base, gl.sum(l_acc, 0) * (1.0 / 256.0), mask=rmask)
    o_l: gl.constexpr = acc.type.layout  # the output in the sums' layout
    m_o = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, o_l))
    row_o = m_o // GROUP
    base_o = ((q_start + row_o).to(gl.int64) * heads + kvh * GROUP + m_o % GROUP) \
        * num_splits + split
    co = gl.arange(0, D, layout=gl.SliceLayout(1, o_l))
    gl.store(ws_o + base_o[None, :] * D + co[:, None], acc * (v_scale / 256.0),
             mask=(row_o < q_len)[None, :])


@gluon.jit
def _paged_decode_gluon(
    q_ptr, kd, vd, qsl_ptr, lens_ptr, table_ptr, ws_o, ws_m, ws_l, scales_ptr, flag_ptr,
    stride_qt, stride_qh, stride_tb, num_blocks, heads, scale, k_scale_f, v_scale_f, draft,
    num_splits,
    GROUP: gl.constexpr, PAGE: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
    HAS_DRAFT: gl.constexpr, SCALES_IN_MEMORY: gl.constexpr, CHECK: gl.constexpr,
):
    """Program (sequence, KV head, split): this split's keys for the sequence's pairs of
    this KV head; writes split ``split`` of the workspace."""
    gl.static_assert(gl.num_warps() == 4)
    f8: gl.constexpr = kd.dtype
    e4: gl.constexpr = gl.float8e4nv
    vt_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([D, BLOCK_N], e4)
    PAIR_ROWS: gl.constexpr = 2 * BLOCK_M  # hi and lo rows
    pt_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([PAIR_ROWS, BLOCK_N], e4)
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([PAIR_ROWS, D], e4)
    r_l: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    gl.static_assert(BLOCK_M <= 32)

    b = gl.program_id(0)
    kvh = gl.program_id(1)
    split = gl.program_id(2)
    q_start = gl.load(qsl_ptr + b)
    q_len = gl.load(qsl_ptr + b + 1) - q_start
    if q_len <= 0:
        return
    seq_len = gl.load(lens_ptr + b)

    qh_smem = gl.allocate_shared_memory(e4, [PAIR_ROWS, D], q_layout)
    k_ring = gl.allocate_shared_memory(f8, [STAGES, BLOCK_N, D], kd.layout)
    v_ring = gl.allocate_shared_memory(f8, [STAGES, BLOCK_N, D], vd.layout)
    vt_smem = gl.allocate_shared_memory(f8, [D, BLOCK_N], vt_layout)
    pt_smem = gl.allocate_shared_memory(e4, [PAIR_ROWS, BLOCK_N], pt_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    fence_async_shared()
    gl.thread_barrier()

    rows = gl.arange(0, 32, layout=r_l)  # every query row a program can hold (<= 32 pairs)
    hi = _extents(rows, q_len, seq_len, draft, CAUSAL, HAS_DRAFT)
    kv_hi = gl.max(hi, 0)
    per = gl.cdiv(gl.cdiv(kv_hi, num_splits), BLOCK_N) * BLOCK_N
    s_lo = split * per
    s_hi = gl.minimum(s_lo + per, kv_hi)
    n_tiles = gl.maximum(gl.cdiv(s_hi - s_lo, BLOCK_N), 0)
    table_row = table_ptr + b.to(gl.int64) * stride_tb
    if SCALES_IN_MEMORY:
        k_scale = gl.load(scales_ptr)
        v_scale = gl.load(scales_ptr + 1)
    else:
        k_scale = k_scale_f
        v_scale = v_scale_f
    args = (qh_smem, k_ring, v_ring, vt_smem, pt_smem, ready, empty, kd, vd,
            table_row, s_lo, s_hi, n_tiles, num_blocks, kvh * D, q_ptr, q_start, q_len,
            seq_len, kvh, stride_qt, stride_qh, draft,
            scale * k_scale * 1.4426950408889634, v_scale, flag_ptr, heads, num_splits, split,
            ws_o, ws_m, ws_l)
    gl.warp_specialize([(_compute, (args, GROUP, PAGE, D, BLOCK_M, BLOCK_N, STAGES, CAUSAL,
                                    HAS_DRAFT, CHECK)),
                        (_loader, (args, PAGE, BLOCK_N, STAGES))],
                       [1], [LOADER_REGS])


def _gl_fp8(dtype: torch.dtype):
    return gl.float8e4nv if dtype == torch.float8_e4m3fn else gl.float8e5


def descriptor(cache: torch.Tensor):
    """TMA descriptor over the cache seen as [slots, kv_heads * dim]: a [16, 128] box is 16
    slots of one KV head (128-byte swizzle)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    num_blocks, block_size, kv_heads, dim = cache.shape
    rows, width = num_blocks * block_size, kv_heads * dim
    flat = cache.as_strided((rows, width), (cache.stride(1), 1))
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    return TensorDescriptor(flat, [rows, width], [cache.stride(1), 1], [BOX, dim], layout)


def supported(q, k_cache, v_cache, mask, soft_cap, max_query_len, sinks=None,
              scales_in_memory=False) -> str | None:
    """Why the Gluon kernel cannot take this call (None: it can). Device checks last.
    Pages of any multiple of 16 slots (one 16-slot TMA box per 16 keys), scales as floats
    or in device memory, sinks (added by the combine): what the H200 tests passed."""
    if not (is_fp8(k_cache.dtype) and k_cache.dtype == v_cache.dtype):
        return f"{k_cache.dtype}/{v_cache.dtype} caches (one fp8 format only)"
    if k_cache.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        return f"a {k_cache.dtype} cache (e4m3fn/e5m2 only)"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"{q.dtype} queries"
    heads, dim = q.shape[1], q.shape[2]
    num_blocks, block_size, kv_heads, kdim = k_cache.shape
    if dim != DIM or kdim != DIM or v_cache.shape[-1] != DIM or v_cache.shape[:3] != k_cache.shape[:3]:
        return f"head dims {dim}/{kdim}/{v_cache.shape[-1]} (128 only)"
    if block_size % BOX or num_blocks == 0:
        return f"block size {block_size} (multiples of {BOX} only)"
    if max(1, max_query_len) * (heads // kv_heads) > MAX_PAIRS:
        return f"{max_query_len} rows x {heads // kv_heads} heads per KV head (> {MAX_PAIRS})"
    for c in (k_cache, v_cache):
        if c.stride(3) != 1 or c.stride(2) != DIM or c.stride(1) % 16 or c.data_ptr() % 16 or (
                c.stride(0) != block_size * c.stride(1)):
            return "cache entries not head-packed and 16-byte aligned"
    if mask.window is not None or mask.chunk is not None or soft_cap is not None:
        return "sliding-window / chunked masks or a soft cap"
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device) != (9, 0):
        return "not a Hopper (sm_90) device"
    return None


def block_m(pairs: int) -> int:
    """The MMA's N: the pairs of one KV head rounded up to a power of two, at least 8."""
    return max(8, 1 << max(0, (pairs - 1).bit_length()))


class _GluonLaunch:
    """The kernel's launch with ``DecodePlan``'s kernel signature: TMA descriptors are made
    per call (a plan serves every cache of its shape and strides)."""

    __slots__ = ("launch",)

    def __init__(self, launch) -> None:
        self.launch = launch

    def __call__(self, q, k_cache, v_cache, qsl, seq_lens, table, out, ws_o, ws_m, ws_l, scales,
                 sinks, flag, counters) -> None:
        del out, sinks, counters  # the combine writes the output and adds the sinks
        self.launch(q, descriptor(k_cache), descriptor(v_cache), qsl, seq_lens, table, ws_o,
                    ws_m, ws_l, scales, flag)


def plan_args(q, k_cache, batch, table, mask, scale, k_scale, v_scale, max_query_len, splits, stages,
              in_memory, check, block_n=None, maxnreg=None):
    """(grid, scalars, constexprs) of one launch; the caller wraps them in a ``Launch``."""
    rows, heads, dim = q.shape
    num_blocks, block_size, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    grid = (batch, kv_heads, splits)
    scalars = (q.stride(0), q.stride(1), table.stride(0), num_blocks, heads, scale,
               1.0 if in_memory else float(k_scale), 1.0 if in_memory else float(v_scale),
               mask.draft_block or 0, splits)
    consts_m = block_m(max(1, max_query_len) * group)
    consts = dict(GROUP=group, PAGE=block_size, D=dim, BLOCK_M=consts_m,
                  BLOCK_N=block_n or BLOCK_N, STAGES=stages or STAGES, CAUSAL=mask.causal,
                  HAS_DRAFT=mask.draft_block is not None, SCALES_IN_MEMORY=in_memory,
                  CHECK=check,
                  num_warps=4, maxnreg=maxnreg or MAXNREG[consts_m])
    return grid, scalars, consts
