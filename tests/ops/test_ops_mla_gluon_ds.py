"""The fp8_ds_mla Gluon kernel (``mla_gluon_ds``): its arithmetic emulated in torch on the CPU
against float64 attention over the unpacked cache, its sm_90 compile (no GPU needed), its
dispatch, and on an H200 (PAGEDKV_TEST_DEVICE=cuda) its output against float64, the Triton
fp8_ds_mla kernel and the emulation."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
ds_mod = pytest.importorskip("pagedkv.ops.triton.mla_gluon_ds")

from dense_reference import dense_mask, place_blocks, slots_of, test_device  # noqa: E402
from kernel_cases import INTERPRETER_WARNINGS  # noqa: E402

from pagedkv.errors import InvalidArgumentError, MetadataError  # noqa: E402
from pagedkv.ops import Mask, fill_nan_, write_mla_latent  # noqa: E402
from pagedkv.ops.fp8 import pack_fp8_ds_mla, unpack_fp8_ds_mla  # noqa: E402
from pagedkv.ops.masks import CAUSAL  # noqa: E402
from pagedkv.ops.triton import mla_gluon  # noqa: E402
from pagedkv.ops.triton.mla import paged_mla_latent  # noqa: E402

DEVICE = test_device()
pytestmark = INTERPRETER_WARNINGS
RANK, ROPE, ENTRY, TILE = 512, 64, 656, 64
E4M3 = torch.float8_e4m3fn
SHARED_LIMIT = 227 * 1024  # bytes of shared memory one H100/H200 block may use
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "mla_gluon_compile.py"
FP8_BAR = dict(rtol=1e-2, atol=1e-2)  # the fp8 Gluon tests' bar against float64


def assert_fp8_close(got, want, rel=2e-3, bar=FP8_BAR["atol"]):
    """The fp8 bar ``bar`` element by element on outputs measured in units of max(1, their
    RMS) (with keys of very different sizes outputs reach ~40, where even a bf16 kernel is
    0.2 off), and the relative Frobenius error under ``rel`` (which tiny outputs need)."""
    unit = max(1.0, float(want.pow(2).mean().sqrt()))
    torch.testing.assert_close(got, want, rtol=bar, atol=bar * unit)
    err = float((got - want).norm() / want.norm())
    assert err < rel, err


# ---------------------------------------------------------------- the kernel's arithmetic
def _e4(x: torch.Tensor) -> torch.Tensor:
    """Round to e4m3 and back (round to nearest even; |x| <= 448 here, as in the kernel)."""
    return x.to(E4M3).float()


def _extents(rows: int, heads: int, q_len: int, seq_len: int, mask: Mask) -> torch.Tensor:
    """Key bound hi per tile row (row m = query row m // heads): ``gluon_common.extents``."""
    r = torch.arange(rows) // heads
    first = seq_len - q_len
    pos = first + r
    if mask.causal:
        hi = pos + 1
    elif mask.draft_block is not None:
        hi = first + (r // mask.draft_block) * mask.draft_block + mask.draft_block
    else:
        hi = torch.full_like(r, seq_len)
    return torch.where((r < q_len) & (pos >= 0), hi.clamp(max=seq_len), 0)


def emulate_ds_kernel(q_lat, q_rope, entries, seq_len, mask, scale, splits=1, *, p_lo=True,
                      group_max=True):
    """``_mla_gluon_ds_ws`` step by step in float32 torch, for one request's <= 16 (query row,
    head) rows: q_lat [q_len, H, 512], q_rope [q_len, H, 64] (bf16 or fp16), entries uint8
    [n, 656] in key order (n >= seq_len rounded up to 64 keys; slots past seq_len may hold
    anything, NaN bytes included, as unwritten cache slots do). Returns o [q_len, H, 512].

    Mirrored: e4m3 hi + lo queries with one scale per row (amax / 448 over the latent),
    the rope query rounded to bf16, per-group score products scaled per key and summed,
    masking by select, P x 256, P scaled per group by s_g / (the tile's max s_g), its e4m3
    hi + lo, a fresh product per tile multiplied back by that max, row sums of the
    unscaled P, the splits with each split's tiles alternating between two running states
    (the two MMA warpgroups: workspace splits 2 split and 2 split + 1), the combine. Not
    mirrored: the tensor cores' accumulation order and precision (fp32 here) and exp2's
    last-bit error. ``p_lo`` / ``group_max`` False: P without its lo part / P x s_g without
    the normalisation (what the kernel does not do, to show the test can fail)."""
    q_len, heads, _ = q_lat.shape
    rows = q_len * heads
    x = q_lat.reshape(rows, RANK).float()
    y = q_rope.reshape(rows, ROPE).to(torch.bfloat16).float()
    amax = x.abs().amax(1)
    sq = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    xs = x / sq[:, None]
    qh = _e4(xs)
    ql = _e4(xs - qh)
    raw = entries.contiguous()
    lat8 = raw[:, :RANK].contiguous().view(E4M3).float()
    scales = raw[:, RANK:RANK + 16].contiguous().view(torch.float32)
    rope = raw[:, RANK + 16:].contiguous().view(torch.bfloat16).float()
    qk_scale = scale * 1.4426950408889634
    hi = _extents(rows, heads, q_len, seq_len, mask)
    kv_hi = int(hi.max())
    per = math.ceil(math.ceil(kv_hi / splits) / TILE) * TILE  # ``_split_tiles``
    parts = []
    for split, group in ((s, g) for s in range(splits) for g in range(2)):
        s_lo = split * per
        n_tiles = max(-(-(min(s_lo + per, kv_hi) - s_lo) // TILE), 0)
        m_i = torch.full((rows,), float("-inf"))
        l_i = torch.zeros(rows)
        acc = torch.zeros(4, 128, rows)
        for it in range(group, n_tiles, 2):  # MMA warpgroup ``group``'s tiles
            keys = s_lo + it * TILE + torch.arange(TILE)
            valid = keys < seq_len
            k8, kr = lat8[keys], rope[keys]
            sc = torch.where(valid[:, None], scales[keys], torch.zeros(()))  # select, not multiply
            s = torch.zeros(TILE, rows)
            for g in range(4):
                c = slice(128 * g, 128 * g + 128)
                a_g = k8[:, c] @ qh[:, c].T + k8[:, c] @ ql[:, c].T  # hi and lo halves summed
                s = s + a_g * sc[:, g:g + 1]
            s = s * (sq * qk_scale)[None, :] + (kr @ y.T) * qk_scale
            s = torch.where(keys[:, None] < hi[None, :], s, float("-inf"))
            m_new = torch.maximum(m_i, s.amax(0))
            m_use = torch.where(m_new == float("-inf"), torch.zeros(()), m_new)
            p = torch.exp2(s - m_use[None, :]) * 256.0
            alpha = torch.exp2(m_i - m_use)
            m_i = m_new
            l_i = l_i * alpha + p.sum(0)
            smax = sc.amax(0) if group_max else torch.ones(4)
            fac = sc * torch.where(smax > 0, 1.0 / smax, torch.zeros(()))[None, :]
            v8 = torch.where(valid[:, None], k8, torch.zeros(()))  # zeroed in the transpose
            for g in range(4):
                pg = p * fac[:, g:g + 1]
                ph = _e4(pg)
                pl = _e4(pg - ph) if p_lo else torch.zeros_like(ph)
                vg = v8[:, 128 * g:128 * g + 128].T
                acc[g] = acc[g] * alpha[None, :] + (vg @ ph + vg @ pl) * smax[g]
        parts.append((m_i, l_i / 256.0, acc.reshape(RANK, rows).T / 256.0))
    m = torch.stack([p[0] for p in parts])  # combine: ``combine._combine``
    mx = m.amax(0)
    w = torch.exp2(m - torch.where(mx == float("-inf"), torch.zeros(()), mx)[None, :])
    denom = (torch.stack([p[1] for p in parts]) * w).sum(0)
    o = (torch.stack([p[2] for p in parts]) * w[:, :, None]).sum(0)
    o = torch.where((denom > 0)[:, None], o / torch.where(denom > 0, denom, 1.0)[:, None], 0.0)
    return o.reshape(q_len, heads, RANK)


def float64_over_unpacked(q_lat, q_rope, entries, seq_len, mask, scale):
    """softmax(scale (q_lat . c + q_rope . k_rope)) @ c in float64 over the cache's own
    values (the entries unpacked), masked as dense_mask says."""
    lat, rope = unpack_fp8_ds_mla(entries[:seq_len], RANK, torch.float64)
    q_len = q_lat.shape[0]
    s = (torch.einsum("thd,kd->thk", q_lat.double(), lat)
         + torch.einsum("thd,kd->thk", q_rope.double(), rope)) * scale
    seen = dense_mask(seq_len, q_len, causal=mask.causal, draft_block=mask.draft_block)
    s = s.masked_fill(~seen[:, None, :], float("-inf"))
    return torch.softmax(s, -1) @ lat


def _entries(seq_len, gen, spread=0.0, size=0.5):
    """Packed entries of seq_len random keys (latent ~ N(0, size)), NaN bytes up to the next
    tile; ``spread``: per-key magnitudes log-uniform over 10**spread (scales far apart
    within a tile)."""
    lat = torch.randn(seq_len, RANK, generator=gen) * size
    if spread:
        lat = lat * 10 ** (spread * (torch.rand(seq_len, 1, generator=gen) - 0.5))
    rope = torch.randn(seq_len, ROPE, generator=gen) * 0.5
    n = -(-seq_len // TILE) * TILE
    out = torch.full((n, ENTRY), 0xFF, dtype=torch.uint8)
    out[:seq_len] = pack_fp8_ds_mla(lat, rope)
    return out


EMULATED = [  # (heads, q_len, seq_len, mask, splits, dtype, spread, size)
    (16, 1, 1, CAUSAL, 1, torch.bfloat16, 0.0, 0.5),
    (16, 1, 63, CAUSAL, 1, torch.bfloat16, 0.0, 0.5),
    (16, 1, 64, Mask(causal=False), 1, torch.float16, 0.0, 0.5),
    (16, 1, 65, CAUSAL, 2, torch.bfloat16, 0.0, 0.5),
    (16, 1, 1000, CAUSAL, 3, torch.bfloat16, 0.0, 0.5),
    (8, 2, 777, CAUSAL, 1, torch.float16, 0.0, 0.5),
    (8, 2, 300, Mask(causal=False, draft_block=2), 2, torch.bfloat16, 0.0, 0.5),
    (16, 1, 500, CAUSAL, 1, torch.bfloat16, 3.0, 0.5),  # per-key magnitudes 1000x apart
    (8, 2, 640, Mask(causal=False), 2, torch.bfloat16, 3.0, 0.5),
    (16, 1, 300, CAUSAL, 1, torch.bfloat16, 0.0, 1e-3),  # scales ~1e-5: P x s_g underflows
    (16, 1, 300, CAUSAL, 2, torch.bfloat16, 1.0, 0.05),  # without the normalisation
]


def _emulated_case(heads, q_len, seq_len, dtype, spread, seed, size=0.5):
    gen = torch.Generator().manual_seed(seed)
    entries = _entries(seq_len, gen, spread, size)
    q_lat = (torch.randn(q_len, heads, RANK, generator=gen) / 8).to(dtype)
    q_rope = (torch.randn(q_len, heads, ROPE, generator=gen) / 8).to(dtype)
    return entries, q_lat, q_rope


@pytest.mark.parametrize("heads,q_len,seq_len,mask,splits,dtype,spread,size", EMULATED)
def test_emulated_kernel_arithmetic_is_within_the_fp8_bar(heads, q_len, seq_len, mask, splits,
                                                          dtype, spread, size):
    """The kernel's scaling scheme (e4m3 hi + lo queries, per-group scores scaled per key, P
    scaled by s_g / max_g in e4m3 hi + lo) against float64 over the unpacked cache, NaN
    bytes past the sequence: within the fp8 bar and well inside it (relative Frobenius
    error < 2e-3; the e4m3 rounding of K itself is in both)."""
    entries, q_lat, q_rope = _emulated_case(heads, q_len, seq_len, dtype, spread, seq_len, size)
    scale = 1 / math.sqrt(192)
    got = emulate_ds_kernel(q_lat, q_rope, entries, seq_len, mask, scale, splits).double()
    want = float64_over_unpacked(q_lat, q_rope, entries, seq_len, mask, scale)
    assert not bool(got.isnan().any())
    assert_fp8_close(got, want)


@pytest.mark.parametrize("size", [0.5, 0.05, 1e-3])
def test_emulation_fails_without_p_lo_or_the_group_max(size):
    """The check can fail: without P's e4m3 lo part the error is ~10x; without the per-group
    normalisation (P x s_g into e4m3 as is) small latents (scales ~1e-4 and below) push P
    into e4m3's subnormals and to zero, while the kernel's error does not move with size."""
    entries, q_lat, q_rope = _emulated_case(16, 1, 500, torch.bfloat16, 0.0, 7, size)
    scale = 1 / math.sqrt(192)
    want = float64_over_unpacked(q_lat, q_rope, entries, 500, CAUSAL, scale)

    def err(**form):
        got = emulate_ds_kernel(q_lat, q_rope, entries, 500, CAUSAL, scale, **form).double()
        return float((got - want).norm() / want.norm())

    kept, no_lo, no_max = err(), err(p_lo=False), err(group_max=False)
    assert kept < 2e-3 and no_lo > 5 * kept, (kept, no_lo)
    if size < 0.1:
        assert no_max > 5 * kept, (kept, no_max)


# ---------------------------------------------------------------- compile for sm_90 (CPU)
def compiled_for_sm90(mask: str, dtype: str, stages: str | None = None) -> dict:
    """benchmarks/mla_gluon_compile.py's report for the ds kernel, compiled by the real
    compiler (no GPU), in a process without TRITON_INTERPRET."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    out = subprocess.run([sys.executable, str(SCRIPT), mask, dtype, "ds", *([stages] if stages else [])],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mask,dtype,stages", [("causal", "bf16", None), ("draft", "fp16", None),
                                               ("full", "bf16", "2")])
def test_ds_kernel_compiles_for_sm90_without_spills(mask, dtype, stages):
    """The warp-specialized kernel: ring (latent, rope and scale boxes, 2 slots), queries,
    two V^T buffer pairs and each MMA warpgroup's four P_g buffers fit in 227 KB; nothing in
    local memory but what the MMA warpgroups (232 registers, set by ``setmaxnreg``) keep
    there, at most 6 words a tile in any loop (4 in the causal and full forms; H200: 150 us
    against the deleted, spill-free one-warpgroup kernel's 195, docs/kernels-log.md); the latent's MMAs are e4m3,
    m64n32k32 (hi and lo as N = 32): scores 4 groups x 4 k-steps, values 4 groups x 2
    M-tiles x 2 k-steps; the rope's alone bf16 (64 keys x 16 rows over 64 columns: 4
    m64n16k16); all of it in each of the two MMA warpgroups; the copies are TMA; the
    transpose on the 8 x 8 matrix instructions, masked tiles too (4 chunks x 4 loads in
    each branch)."""
    use = compiled_for_sm90(mask, dtype, stages)
    assert use["ptx"].get("setmaxnreg.dec.sync.aligned.u32", 0) > 0, use  # warp-specialized
    assert 0 < use["shared"] <= SHARED_LIMIT, use
    assert use["loop_spills"] <= 6 and use["LOCAL"] == 0, use
    mma = {k: n for k, n in use["ptx"].items() if k.startswith("wgmma")}
    assert mma == {"wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3": 64,
                   "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16": 8}, use
    assert sum(n for k, n in use["ptx"].items() if k.startswith("cp.async.bulk.tensor")) > 0, use
    assert use["ptx"].get("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16") == 32, use


# ---------------------------------------------------------------- dispatch (CPU)
def _cpu_args(**over):
    gen = torch.Generator().manual_seed(3)
    args = dict(q_latent=torch.randn(1, 16, RANK, generator=gen).bfloat16(),
                q_rope=torch.randn(1, 16, ROPE, generator=gen).bfloat16(),
                cache=torch.zeros(2, 64, ENTRY, dtype=torch.uint8), mask=Mask(), rows=16)
    args.update(over)
    return args


def test_supported_names_what_it_refuses():
    assert not hasattr(ds_mod, "ENABLED")  # no switch: on wherever it can run
    assert "Hopper" in ds_mod.supported(**_cpu_args())  # a CPU tensor: everything else fits
    assert "Hopper" in mla_gluon.supported(latent_scale=None, **_cpu_args())  # routed here
    assert "17 rows" in ds_mod.supported(**_cpu_args(rows=17))
    assert "queries" in ds_mod.supported(**_cpu_args(q_latent=torch.zeros(1, 16, RANK)))
    assert "queries" in ds_mod.supported(**_cpu_args(q_rope=None))
    assert "entry 600" in ds_mod.supported(**_cpu_args(
        cache=torch.zeros(2, 64, 600, dtype=torch.uint8)))
    assert "block size 32" in ds_mod.supported(**_cpu_args(
        cache=torch.zeros(4, 32, ENTRY, dtype=torch.uint8)))
    assert "window" in ds_mod.supported(**_cpu_args(mask=Mask(window=128)))
    every_other_page = torch.zeros(4, 64, ENTRY, dtype=torch.uint8)[::2]
    assert "page-contiguous" in ds_mod.supported(**_cpu_args(cache=every_other_page))


def test_plan_launches_the_ds_kernel_over_three_boxes_of_the_entry():
    """``mla_gluon.plan`` on a uint8 cache: the warp-specialized kernel with the module's
    ring depth, two workspace splits a program, and TMA boxes over the entry's bytes: latent
    [64, 512] e4m3 at column 0, rope [64, 64] bf16, scales [64, 4] fp32, rows of 656 bytes
    in every view."""
    from pagedkv.ops.triton.mla_gluon_e4m3 import MAXNREG

    cache = torch.zeros(3, 64, ENTRY, dtype=torch.uint8)
    ql = torch.zeros(2, 16, RANK).bfloat16()
    qr = torch.zeros(2, 16, ROPE).bfloat16()
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32)

    made = mla_gluon.plan(ql, qr, cache, qsl, torch.tensor([70, 100], dtype=torch.int32),
                          torch.tensor([[2, 0], [1, 0]], dtype=torch.int32),
                          torch.empty(2, 16, RANK), scale=0.1, mask=CAUSAL, tiles=1, splits=2,
                          block_m=16)
    assert made.kernel.kernel is ds_mod._mla_gluon_ds_ws
    assert made.kernel.consts == dict(R=RANK, P=ROPE, BLOCK_M=16, BLOCK_N=TILE, STAGES=2,
                                      CAUSAL=True, HAS_DRAFT=False, num_warps=4,
                                      maxnreg=MAXNREG)
    assert ds_mod.STAGES == 2
    assert made.kernel.grid == (2, 2, 1) and made.ws_shape == (2, 16, 4, RANK)
    kd, rd, sd = made.descriptors
    assert [(d.base.dtype, d.shape, d.strides, d.block_shape) for d in (kd, rd, sd)] == [
        (E4M3, [192, 656], [656, 1], [64, 512]), (torch.bfloat16, [192, 328], [328, 1], [64, 64]),
        (torch.float32, [192, 164], [164, 1], [64, 4])]
    assert ds_mod._ROPE_COL == 264 and ds_mod._SCALE_COL == 128  # bytes 528 and 512
    assert made.kernel.scalars[0] is kd and made.kernel.scalars[2] is sd


def test_gluon_true_on_a_ds_cache_off_hopper_says_why(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # CPU tensors pass the device check
    cache = torch.zeros(2, 64, ENTRY, dtype=torch.uint8)
    args = (torch.zeros(1, 16, RANK).bfloat16(), torch.zeros(1, 16, ROPE).bfloat16(), cache,
            torch.tensor([0, 1], dtype=torch.int32), torch.tensor([70], dtype=torch.int32),
            torch.tensor([[0, 1]], dtype=torch.int32))
    with pytest.raises(InvalidArgumentError, match="Hopper"):
        paged_mla_latent(*args, scale=0.1, gluon=True)
    with pytest.raises(InvalidArgumentError, match="e4m3 caches"):
        paged_mla_latent(*args, scale=0.1, gluon="e4m3")


class _Launched(Exception):
    pass


class _Spy:
    """Stands in for a Triton kernel: launching it raises ``_Launched("triton")``."""

    def __getitem__(self, grid):
        def launch(*a, **k):
            raise _Launched("triton")
        return launch


def test_default_ds_call_takes_gluon_on_hopper_and_triton_elsewhere(monkeypatch):
    """Which kernel a fp8_ds_mla call launches, outside the interpreter (launch spies, so no
    GPU is needed; "on Hopper" stands for ``supported``'s device check passing): the Gluon
    kernel by default on Hopper; the Triton kernel off Hopper, with ``gluon=False``, a
    Triton launch override, more than 16 rows per request, blocks of 32, float32 queries."""
    from pagedkv.ops.triton import mla as triton_mla

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(triton_mla, "check_device", lambda *t: None)  # CPU tensors, no launch
    monkeypatch.setattr(triton_mla, "_paged_mla_fwd", _Spy())
    monkeypatch.setattr(triton_mla, "_paged_mla_tma", _Spy())
    monkeypatch.setattr(mla_gluon, "launch", lambda *a, **k: (_ for _ in ()).throw(
        _Launched("gluon")))
    real = ds_mod.supported
    hopper = [True]

    def supported(*a, **k):
        why = real(*a, **k)
        return None if hopper[0] and why is not None and "Hopper" in why else why

    monkeypatch.setattr(ds_mod, "supported", supported)

    def launched(q_len=1, block_size=64, dtype=torch.bfloat16, **kw):
        cache = torch.zeros(4, block_size, ENTRY, dtype=torch.uint8)
        args = (torch.zeros(q_len, 16, RANK, dtype=dtype), torch.zeros(q_len, 16, ROPE, dtype=dtype),
                cache, torch.tensor([0, q_len], dtype=torch.int32),
                torch.tensor([70], dtype=torch.int32), torch.tensor([[0, 1, 2]], dtype=torch.int32))
        with pytest.raises(_Launched) as got:
            paged_mla_latent(*args, scale=0.1, splits=2, **kw)
        return str(got.value)

    assert launched() == "gluon"
    assert launched(gluon=True) == "gluon"
    assert launched(gluon=False) == "triton"
    assert launched(num_warps=4) == "triton"
    assert launched(q_len=2) == "triton"  # 32 rows per request
    assert launched(block_size=32) == "triton"
    assert launched(dtype=torch.float32) == "triton"
    hopper[0] = False  # the real device check: CPU tensors are not on a Hopper GPU
    assert launched() == "triton"


def test_kept_plan_key_follows_the_ring_depth(monkeypatch):
    from pagedkv.ops.triton import mla as triton_mla

    cache = torch.zeros(2, 64, ENTRY, dtype=torch.uint8)
    keys = set()
    for stages in (2, 3):
        monkeypatch.setattr(ds_mod, "STAGES", stages)
        keys.add(triton_mla._ds_settings(cache))
    assert len(keys) == 2
    assert triton_mla._ds_settings(torch.zeros(2, 64, 576, dtype=torch.bfloat16)) is None


# ---------------------------------------------------------------- on an H200
def _needs_hopper():
    if DEVICE.type != "cuda" or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernel runs on Hopper (sm_90) only")


def _ds_case(seq_lens, q_lens, heads, block_size, dtype, seed, spread=0.0):
    """A NaN-filled uint8 cache with shuffled tables; each request's entries (key order,
    NaN bytes to the next 64 keys) for the float64 reference and the emulation."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-s // block_size) for s in seq_lens]
    table = place_blocks(needed, sum(needed) + 3, rng)
    cache = fill_nan_(torch.empty(sum(needed) + 3, block_size, ENTRY, dtype=torch.uint8,
                                  device=DEVICE))
    per_request = []
    for b, s in enumerate(seq_lens):
        lat = torch.randn(s, RANK, generator=gen) * 0.5
        if spread:
            lat = lat * 10 ** (spread * (torch.rand(s, 1, generator=gen) - 0.5))
        rope = torch.randn(s, ROPE, generator=gen) * 0.5
        write_mla_latent(lat.to(DEVICE), rope.to(DEVICE), cache,
                         torch.tensor(slots_of(table[b], range(s), block_size), device=DEVICE))
        n = -(-s // TILE) * TILE
        slots = slots_of(table[b], range(n), block_size)
        per_request.append(cache.view(-1, ENTRY)[torch.tensor(slots, device=DEVICE)].cpu())
    rows = sum(q_lens)
    q_lat = (torch.randn(rows, heads, RANK, generator=gen) / 8).to(dtype)
    q_rope = (torch.randn(rows, heads, ROPE, generator=gen) / 8).to(dtype)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return cache, table, per_request, q_lat, q_rope, qsl, torch.tensor(seq_lens, dtype=torch.int32)


def _run(case, mask, scale, **kw):
    cache, table, _, q_lat, q_rope, qsl, lens = case
    return paged_mla_latent(q_lat.to(DEVICE), q_rope.to(DEVICE), cache, qsl.to(DEVICE),
                            lens.to(DEVICE), table.to(DEVICE), scale=scale, mask=mask,
                            **kw).double().cpu()


def _check(got, case, q_lens, seq_lens, mask, scale, splits=None):
    """Per request: float64 over the unpacked cache (the fp8 bar; relative error < 3e-3,
    the emulation's worst is 1.4e-3) and, given the splits, the emulation (its arithmetic:
    closer; the MMAs' accumulation and exp2 are not emulated)."""
    _, _, per_request, q_lat, q_rope, *_ = case
    assert not bool(got.isnan().any())
    start = 0
    for b, (seq_len, q_len) in enumerate(zip(seq_lens, q_lens)):
        rows = slice(start, start + q_len)
        want = float64_over_unpacked(q_lat[rows], q_rope[rows], per_request[b], seq_len, mask,
                                     scale)
        assert_fp8_close(got[rows], want, rel=3e-3)
        if splits is not None:
            emu = emulate_ds_kernel(q_lat[rows], q_rope[rows], per_request[b], seq_len, mask,
                                    scale, splits).double()
            assert_fp8_close(got[rows], emu, rel=1e-3, bar=2e-3)
        start += q_len


GPU_CASES = [  # (heads, q_lens, seq_lens, mask, block size, splits)
    (16, [1] * 6, [130, 64, 1000, 2113, 1, 500], Mask(), 64, None),
    (16, [1] * 4, [4097, 63, 640, 2000], Mask(), 128, 3),
    (16, [1] * 3, [8191, 65, 3000], Mask(causal=False), 64, 5),
    (16, [1] * 3, [900, 2113, 65], Mask(), 64, 1),
    (8, [2, 1, 2, 2], [300, 64, 1500, 129], Mask(), 64, None),
    (8, [2] * 3, [200, 2, 1025], Mask(causal=False, draft_block=2), 128, 2),
    (8, [2] * 3, [200, 3, 1025], Mask(causal=False), 64, 4),
]


@pytest.mark.parametrize("heads,q_lens,seq_lens,mask,block_size,splits", GPU_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ds_kernel_matches_float64_triton_and_emulation(monkeypatch, heads, q_lens, seq_lens,
                                                        mask, block_size, splits, dtype):
    """NaN-filled unused pages, shuffled tables, lengths off multiples of 64, splits, masks,
    8 / 16 heads, q_len 1-2; the Triton fp8_ds_mla kernel on the same cache agrees too."""
    _needs_hopper()
    case = _ds_case(seq_lens, q_lens, heads, block_size, dtype, seed=len(seq_lens) + heads)
    sm = 1 / math.sqrt(192)
    got = _run(case, mask, sm, gluon=True, splits=splits)
    _check(got, case, q_lens, seq_lens, mask, sm, splits)
    tri = _run(case, mask, sm, gluon=False, splits=splits)
    assert_fp8_close(got, tri, rel=1e-2)


def test_ds_kernel_keys_of_far_apart_scales(monkeypatch):
    """Per-key magnitudes 10^2-10^3 apart inside a tile: the per-group normalisation of P."""
    _needs_hopper()
    for spread, seed in ((3.0, 1), (2.0, 2)):
        case = _ds_case([777, 2000], [1, 1], 16, 64, torch.bfloat16, seed, spread)
        got = _run(case, Mask(), 0.07, gluon=True, splits=2)
        _check(got, case, [1, 1], [777, 2000], Mask(), 0.07, 2)


def test_ds_kernel_is_the_default_and_keeps_its_plan(monkeypatch):
    """A default call (no ``gluon``) takes the kernel (a CPU-side spy on the launch) and a
    kept plan serves fresh queries right."""
    from pagedkv.ops.triton import mla as triton_mla

    _needs_hopper()
    monkeypatch.setattr(triton_mla, "_GLUON_PLANS", {})
    made = []
    real_plan = ds_mod.plan
    monkeypatch.setattr(ds_mod, "plan", lambda *a, **k: made.append(1) or real_plan(*a, **k))
    seq_lens, sm = [900, 2113, 65], 0.07
    case = _ds_case(seq_lens, [1] * 3, 16, 64, torch.bfloat16, seed=1)
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):  # fresh queries, same cache: one plan
        q_lat = (torch.randn(3, 16, RANK, generator=gen) / 8).bfloat16()
        q_rope = (torch.randn(3, 16, ROPE, generator=gen) / 8).bfloat16()
        case = (*case[:3], q_lat, q_rope, *case[5:])
        got = _run(case, Mask(), sm, max_query_len=1, max_seq_len=max(seq_lens))
        _check(got, case, [1] * 3, seq_lens, Mask(), sm)
    assert len(made) == 1


def test_ds_kernel_flags_a_block_id_outside_the_cache(monkeypatch):
    _needs_hopper()
    cache, table, *_ = case = _ds_case([300], [1], 16, 64, torch.bfloat16, seed=9)
    table[0, 2] = cache.shape[0] + 5
    with pytest.raises(MetadataError, match="outside the cache"):
        _run(case, Mask(), 0.07, gluon=True)
    got = _run(case, Mask(), 0.07, gluon=True, check_blocks=False)  # its tile masked out
    assert bool(got.isfinite().all())
