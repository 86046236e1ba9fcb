"""The Gluon (Hopper) fp8 GQA decode kernel: compiled for sm_90 on any machine (shared memory,
spills, the MMA shapes), where the Triton backend dispatches it, and on an H200
(PAGEDKV_TEST_DEVICE=cuda) its output against float64 attention over the dequantized cache."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
decode_gluon = pytest.importorskip("pagedkv.ops.triton.decode_gluon")

from dense_reference import dense_attention, dense_mask, place_blocks, slots_of, test_device  # noqa: E402
from kernel_cases import INTERPRETER_WARNINGS  # noqa: E402

from pagedkv.errors import MetadataError  # noqa: E402
from pagedkv.ops import Mask, fill_nan_  # noqa: E402
from pagedkv.ops.triton.attention import paged_attention  # noqa: E402
from pagedkv.ops.triton.decode import decode_plan  # noqa: E402

DEVICE = test_device()
pytestmark = INTERPRETER_WARNINGS
SHARED_LIMIT = 227 * 1024  # bytes of shared memory one H100/H200 block may use
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "decode_gluon_compile.py"
FMT = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
ON_HOPPER = DEVICE.type == "cuda" and torch.cuda.is_available() and \
    torch.cuda.get_device_capability(DEVICE) == (9, 0)
hopper_only = pytest.mark.skipif(not ON_HOPPER, reason="the Gluon kernel runs on sm_90 only")


def compiled_for_sm90(*args: str) -> dict:
    """benchmarks/decode_gluon_compile.py's report, in a process without TRITON_INTERPRET
    (which replaces the JIT functions process-wide)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    out = subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("args,n,kind", [(("e4m3", "causal"), 8, "e4m3.e4m3"),
                                         (("e5m2", "draft", "32"), 32, "e5m2.e4m3")])
def test_compiles_for_sm90_within_shared_memory_without_spills(args, n, kind):
    fixed = ("8", "2", "16", "0", "64")  # BLOCK_M, STAGES, PAGE, MAXNREG, BLOCK_N
    use = compiled_for_sm90(*args, *fixed[len(args) - 2:])
    assert 0 < use["shared"] <= SHARED_LIMIT, use
    assert use["STACK"] == 0 and use["LOCAL"] == 0 and use["local_ops"] == 0, use
    assert use["REG"] == decode_gluon.MAXNREG[n], use
    # both products on 8-bit tensor cores (nothing widened), operands from shared memory:
    # scores 64 keys (m64) over 128 columns (4 x k32) for the query's hi and lo tiles = 8;
    # values 128 output columns (2 x m64) over 64 keys (2 x k32) for P's hi and lo = 8;
    # hi and lo side by side as one MMA's N: 4 + 4
    wg = {k: c for k, c in use["ptx"].items() if k.startswith("wgmma.mma")}
    assert wg == {f"wgmma.mma_async.sync.aligned.m64n{2 * n}k32.f32.{kind}": 8}, use
    # one 16-slot box of K and one of V per 16 keys: 8 copies per tile (the copy warp)
    assert sum(c for k, c in use["ptx"].items() if k.startswith("cp.async.bulk.tensor")) == 8
    assert use["ptx"].get("cvt.rn.satfinite.e4m3x2.f32", 0) > 0, use  # queries and P to e4m3
    # SASS of the key loop, both V^T paths in it: 606 / 978 (the common path ~316 at n = 8)
    assert 0 < use["loop"] < (700 if n == 8 else 1000), use


def _cpu_case(dtype=torch.float8_e4m3fn, block_size=16, dim=128, heads=32, kv_heads=8):
    q = torch.zeros(3, heads, dim, dtype=torch.bfloat16)
    k = torch.zeros(4, block_size, kv_heads, dim, dtype=dtype)
    return q, k, torch.zeros_like(k)


def test_supported_says_why_not():
    q, k, v = _cpu_case()
    assert decode_gluon.supported(q, k, v, Mask(), None, 1) == "not a Hopper (sm_90) device"
    qb, kb, vb = _cpu_case(torch.bfloat16)
    assert "fp8" in decode_gluon.supported(qb, kb, vb, Mask(), None, 1)
    assert "one fp8 format" in decode_gluon.supported(q, k, v.to(torch.float8_e5m2), Mask(),
                                                      None, 1)
    assert "window" in decode_gluon.supported(q, k, v, Mask(window=8), None, 1)
    assert "soft cap" in decode_gluon.supported(q, k, v, Mask(), 30.0, 1)
    assert "head dims" in decode_gluon.supported(*_cpu_case(dim=64), Mask(), None, 1)
    assert "block size 8" in decode_gluon.supported(*_cpu_case(block_size=8), Mask(), None, 1)
    assert "block size 24" in decode_gluon.supported(*_cpu_case(block_size=24), Mask(), None, 1)
    # pages of 64 slots, sinks and device-memory scales pass the format checks (only the
    # device check is left on a CPU)
    for why in (decode_gluon.supported(*_cpu_case(block_size=64), Mask(), None, 1),
                decode_gluon.supported(q, k, v, Mask(), None, 1, sinks=torch.zeros(32),
                                       scales_in_memory=True)):
        assert why == "not a Hopper (sm_90) device", why
    assert "> 32" in decode_gluon.supported(q, k, v, Mask(), None, 9)  # 9 rows x 4 heads
    wide = torch.zeros(4, 16, 8, 256, dtype=torch.float8_e4m3fn)[..., :128]  # padded entries
    assert "head-packed" in decode_gluon.supported(q, wide, wide, Mask(), None, 1)


def test_pairs_round_up_to_the_mma_n():
    assert [decode_gluon.block_m(p) for p in (1, 4, 9, 16, 17, 28)] == [8, 8, 16, 16, 32, 32]
    assert all(decode_gluon.block_m(p) in decode_gluon.MAXNREG for p in range(1, 33))


def _plan(q, k, v, **kw):
    lens = torch.tensor([40, 9], dtype=torch.int32, device=q.device)
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32, device=q.device)
    table = torch.tensor([[0, 1, 2], [3, 0, 0]], dtype=torch.int32, device=q.device)
    out = torch.empty(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype, device=q.device)
    opts = dict(mask=Mask(), scale=0.1, soft_cap=None, sinks=None, k_scale=1.0, v_scale=1.0,
                max_query_len=1, max_seq_len=40, f32=False)
    opts.update(kw)
    return decode_plan(q, k, v, qsl, lens, table, out, None, **opts)


def test_dispatch_falls_back_off_hopper_and_under_the_interpreter():
    if ON_HOPPER:
        pytest.skip("a Hopper run covers the dispatch there")
    if DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("the Triton kernels need the interpreter or a GPU")
    q, k, v = (t.to(DEVICE) for t in _cpu_case())
    for gluon in (True, None):
        plan = _plan(q, k, v, gluon=gluon)
        assert not isinstance(plan.kernel, decode_gluon._GluonLaunch)


@hopper_only
def test_dispatch_on_hopper():
    q, k, v = (t.to(DEVICE) for t in _cpu_case())
    assert isinstance(_plan(q, k, v, gluon=True).kernel, decode_gluon._GluonLaunch)
    assert not isinstance(_plan(q, k, v, gluon=False).kernel, decode_gluon._GluonLaunch)
    # the default: every call it takes (up to 32 (row, head) pairs: 8 rows at group 4),
    # 64-key tiles only
    assert isinstance(_plan(q, k, v).kernel, decode_gluon._GluonLaunch)
    assert isinstance(_plan(q, k, v, max_query_len=7).kernel, decode_gluon._GluonLaunch)
    assert not isinstance(_plan(q, k, v, max_query_len=9).kernel, decode_gluon._GluonLaunch)
    assert not isinstance(_plan(q, k, v, gluon=True, block_n=128).kernel,
                          decode_gluon._GluonLaunch)
    assert not isinstance(_plan(q, k, v, gluon=True, mask=Mask(window=8)).kernel,
                          decode_gluon._GluonLaunch)
    assert not isinstance(_plan(q, k, v, gluon=True, soft_cap=5.0).kernel,
                          decode_gluon._GluonLaunch)
    assert isinstance(_plan(q, k, v, sinks=torch.zeros(32, device=DEVICE)).kernel,
                      decode_gluon._GluonLaunch)
    assert isinstance(_plan(q, k, v, k_scale=torch.ones(1, device=DEVICE)).kernel,
                      decode_gluon._GluonLaunch)


def _fp8_case(seqs, block_size, dtype, k_scale, v_scale, seed, heads=32, kv_heads=8, dim=128):
    """NaN-filled fp8 caches, blocks from a shuffled free list; returns the tensors and the
    dequantized keys/values (float64) per sequence."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-s // block_size) for s, _ in seqs]
    num_blocks = sum(needed) + 5
    table = place_blocks(needed, num_blocks, rng)
    k8 = fill_nan_(torch.empty(num_blocks, block_size, kv_heads, dim, dtype=dtype))
    v8 = fill_nan_(torch.empty(num_blocks, block_size, kv_heads, dim, dtype=dtype))
    keys, values = [], []
    top = torch.finfo(dtype).max  # past it torch 2.11 converts to NaN (2.13 saturates)
    for b, (seq_len, _) in enumerate(seqs):
        kq = (torch.randn(seq_len, kv_heads, dim, generator=gen) / k_scale).clamp(-top, top).to(dtype)
        vq = (torch.randn(seq_len, kv_heads, dim, generator=gen) / v_scale).clamp(-top, top).to(dtype)
        slots = torch.tensor(slots_of(table[b], range(seq_len), block_size), dtype=torch.long)
        k8.view(torch.uint8).view(-1, kv_heads, dim)[slots] = kq.view(torch.uint8)
        v8.view(torch.uint8).view(-1, kv_heads, dim)[slots] = vq.view(torch.uint8)
        keys.append(kq.double() * k_scale)
        values.append(vq.double() * v_scale)
    q_lens = [ql for _, ql in seqs]
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(sum(q_lens) + 2, heads, dim, generator=gen).to(torch.bfloat16)
    q[sum(q_lens):] = float("nan")  # rows past the batch are never read
    lens = torch.tensor([s for s, _ in seqs], dtype=torch.int32)
    return [t.to(DEVICE) for t in (q, k8, v8, qsl, lens, table)], keys, values


def _reference(q, qsl, seqs, keys, values, mask, scale, sinks=None):
    q = q.cpu().double()
    out = torch.zeros(q.shape[0], q.shape[1], values[0].shape[-1], dtype=torch.float64)
    for b, (seq_len, q_len) in enumerate(seqs):
        s = int(qsl[b])
        explicit = dense_mask(seq_len, q_len, causal=mask.causal, draft_block=mask.draft_block)
        out[s:s + q_len] = dense_attention(q[s:s + q_len], keys[b], values[b], explicit,
                                           scale=scale, sinks=sinks)
    return out


@hopper_only
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("q_len,mask", [(1, Mask()), (3, Mask()),
                                        (4, Mask(causal=False, draft_block=4)),
                                        (7, Mask(causal=False, draft_block=7))])
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_matches_float64_reference(fmt, q_len, mask, splits):
    # lengths around the 64-key tile and the 16-slot page, an empty batch row
    seqs = [(1000, q_len), (q_len + 5, q_len), (130, q_len), (0, 0), (64, q_len)]
    k_scale, v_scale = 2.0**-6, 2.0**-5
    (q, k8, v8, qsl, lens, table), keys, values = _fp8_case(
        seqs, 16, FMT[fmt], k_scale, v_scale, seed=hash((fmt, q_len, splits)) % 1000)
    kw = dict(mask=mask, k_scale=k_scale, v_scale=v_scale, max_query_len=q_len,
              max_seq_len=1000, splits=splits)
    got = paged_attention(q, k8, v8, qsl, lens, table, gluon=True, **kw)
    want = _reference(q, qsl, seqs, keys, values, mask, 128**-0.5)
    rows = int(qsl[-1])
    assert not bool(got.isnan().any())
    err = float((got[:rows].cpu().double() - want[:rows]).norm() / want[:rows].norm())
    assert err < 1e-2, err  # the Triton fp8 test's bound: bf16 output, fp16 probabilities
    assert bool((got[rows:] == 0).all())  # padding rows
    plain = paged_attention(q, k8, v8, qsl, lens, table, gluon=False, **kw)
    assert float((got.float() - plain.float()).abs().max()) < 2e-2  # the same products


@hopper_only
@pytest.mark.parametrize("block_size", [32, 64])
@pytest.mark.parametrize("q_len,mask", [(1, Mask()), (4, Mask(causal=False, draft_block=4))])
@pytest.mark.parametrize("splits", [None, 2])
def test_sinks_device_scales_and_larger_pages(block_size, q_len, mask, splits):
    """Pages of 32 / 64 slots, sinks (merged by the combine) and scales in device memory
    through the Gluon kernel (this case's NaN in the 06:48 UTC run was its reference's:
    docs/kernels-log.md), against float64 attention with the sinks."""
    seqs = [(300, q_len), (77, q_len), (q_len, q_len), (0, 0), (129, q_len)]
    k_scale, v_scale = 2.0**-7, 2.0**-4
    (q, k8, v8, qsl, lens, table), keys, values = _fp8_case(
        seqs, block_size, torch.float8_e4m3fn, k_scale, v_scale,
        seed=hash((block_size, q_len, splits)) % 1000)
    sinks = torch.linspace(-1.0, 2.0, 32, device=DEVICE)
    scales = torch.tensor([k_scale, v_scale], device=DEVICE)
    kw = dict(mask=mask, k_scale=scales[:1], v_scale=scales[1:], sinks=sinks,
              max_query_len=q_len, max_seq_len=300, splits=splits)
    out = torch.empty(q.shape[0], q.shape[1], 128, dtype=q.dtype, device=DEVICE)
    plan = decode_plan(q, k8, v8, qsl, lens, table, out, None, scale=128**-0.5, soft_cap=None,
                       f32=False, gluon=True, **kw)
    assert isinstance(plan.kernel, decode_gluon._GluonLaunch)
    got = paged_attention(q, k8, v8, qsl, lens, table, gluon=True, **kw)
    want = _reference(q, qsl, seqs, keys, values, mask, 128**-0.5, sinks=sinks.cpu().double())
    rows = int(qsl[-1])
    assert not bool(got[:rows].isnan().any())
    err = float((got[:rows].cpu().double() - want[:rows]).norm() / want[:rows].norm())
    assert err < 1e-2, err
    plain = paged_attention(q, k8, v8, qsl, lens, table, gluon=False, **kw)
    assert float((got[:rows].float() - plain[:rows].float()).abs().max()) < 2e-2


@hopper_only
def test_checked_call_reports_a_bad_block_id():
    seqs = [(100, 1), (40, 1)]
    (q, k8, v8, qsl, lens, table), keys, values = _fp8_case(
        seqs, 16, torch.float8_e4m3fn, 1.0, 1.0, seed=9)
    got = paged_attention(q, k8, v8, qsl, lens, table, k_scale=1.0, v_scale=1.0, gluon=True)
    want = _reference(q, qsl, seqs, keys, values, Mask(), 128**-0.5)
    assert float((got[:2].cpu().double() - want[:2]).norm() / want[:2].norm()) < 1e-2
    table[1, 1] = -1
    with pytest.raises(MetadataError, match="block id -1"):
        paged_attention(q, k8, v8, qsl, lens, table, k_scale=1.0, v_scale=1.0, gluon=True)


@hopper_only
def test_unchecked_bad_block_ids_mask_their_keys():
    """An unchecked call (``max_query_len`` and ``max_seq_len`` given) whose tables hold a
    negative and a too-large block id in the middle of a sequence: the kernel reads page 0
    for them, here a NaN-filled page, and must leave their keys out (no NaN), so the output
    is attention over the other keys. The kernel zeroes V only on such tiles and a split's last."""
    seqs = [(300, 1), (200, 1)]
    (q, k8, v8, qsl, lens, table), keys, values = _fp8_case(
        seqs, 16, torch.float8_e4m3fn, 2.0**-6, 2.0**-5, seed=21)
    num_blocks = k8.shape[0]
    used = set(table[table >= 0].tolist())
    spare = next(b for b in range(num_blocks) if b not in used)
    for c in (k8, v8):  # page 0 unused and NaN: what a bad block id reads
        raw = c.view(torch.uint8)
        raw[spare] = raw[0]
        raw[0] = raw[1].clone().fill_(0x7F)  # e4m3 0x7F: NaN
    table[table == 0] = spare
    table[0, 5], table[1, 2] = -1, num_blocks + 7  # keys 80-95 of row 0, 32-47 of row 1
    gone = [slice(80, 96), slice(32, 48)]
    keep = [torch.ones(s, dtype=torch.bool) for s, _ in seqs]
    for b, sl in enumerate(gone):
        keep[b][sl] = False
    kw = dict(k_scale=2.0**-6, v_scale=2.0**-5, max_query_len=1, max_seq_len=300)
    got = paged_attention(q, k8, v8, qsl, lens, table, gluon=True, **kw)
    want = _reference(q, qsl, [(int(m.sum()), 1) for m in keep],
                      [k[m] for k, m in zip(keys, keep)], [v[m] for v, m in zip(values, keep)],
                      Mask(), 128**-0.5)
    assert not bool(got[:2].isnan().any())
    err = float((got[:2].cpu().double() - want[:2]).norm() / want[:2].norm())
    assert err < 1e-2, err
