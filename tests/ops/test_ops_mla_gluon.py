"""The Gluon (Hopper) MLA kernel: compiled for sm_90 on any machine (shared memory, spills,
the warpgroup split of both products), its dispatch, and on an H200 (PAGEDKV_TEST_DEVICE=cuda)
its output against float64 attention over the latent."""

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
triton = pytest.importorskip("triton")
gluon_mod = pytest.importorskip("pagedkv.ops.triton.mla_gluon")

from dense_reference import dense_mask, place_blocks, slots_of, test_device  # noqa: E402
from kernel_cases import INTERPRETER_WARNINGS  # noqa: E402

from pagedkv.errors import InvalidArgumentError  # noqa: E402
from pagedkv.ops import Mask, fill_nan_, write_mla_latent  # noqa: E402
from pagedkv.ops.masks import CAUSAL  # noqa: E402
from pagedkv.ops.triton.mla import launch_defaults, paged_mla_latent  # noqa: E402
from pagedkv.ops.triton.mla_gluon_pph import PPH_MAXNREG  # noqa: E402

DEVICE = test_device()
pytestmark = INTERPRETER_WARNINGS
RANK, ROPE = 512, 64
SHARED_LIMIT = 227 * 1024  # bytes of shared memory one H100/H200 block may use
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "mla_gluon_compile.py"


def compiled_for_sm90(mask: str, dtype: str, kernel: str = "rows", stages: str | None = None) -> dict:
    """benchmarks/mla_gluon_compile.py's report: the kernel compiled for sm_90 by the real
    compiler (no GPU needed), in a process without TRITON_INTERPRET (which replaces the JIT
    functions process-wide)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    extra = [stages] if stages else []
    out = subprocess.run([sys.executable, str(SCRIPT), mask, dtype, kernel, *extra], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mask,dtype,kernel", [("causal", "bf16", "rows"), ("draft", "bf16", "rows"),
                                               ("full", "fp16", "rows")])
def test_compiles_for_sm90_within_shared_memory_without_spills(mask, dtype, kernel):
    use = compiled_for_sm90(mask, dtype, kernel)
    assert 0 < use["shared"] <= SHARED_LIMIT, use
    assert use["STACK"] == 0 and use["LOCAL"] == 0 and use["loop_spills"] == 0, use
    assert 0 < use["REG"] <= 255, use
    kind = "bf16" if dtype == "bf16" else "f16"
    # scores: each warpgroup 32 keys (m64n32) over 512 + 64 columns = 36 instructions, once;
    # values: each warpgroup 256 output columns (m64n256) over 64 keys = 4 instructions
    assert use["ptx"].get(f"wgmma.mma_async.sync.aligned.m64n32k16.f32.{kind}.{kind}") == 36, use
    assert use["ptx"].get(f"wgmma.mma_async.sync.aligned.m64n256k16.f32.{kind}.{kind}") == 4, use
    assert sum(n for k, n in use["ptx"].items() if k.startswith("cp.async.bulk.tensor")) > 0, use


@pytest.mark.parametrize("mask,dtype", [("causal", "bf16"), ("draft", "fp16"), ("full", "bf16")])
def test_halves_kernel_compiles_for_sm90_without_spills(mask, dtype):
    """The ping-pong kernel over half-tile slots: queries (two latent halves + rope), two
    slots of two halves and one P buffer fit; each tile's scores once, by its owner, as
    m64n64 (36 in each consumer's loop); values m64n256 (each consumer its 256 columns: the
    other's tile in the loop and after it, its own tile); no stack, no local memory."""
    use = compiled_for_sm90(mask, dtype, "pingpong_halves")
    assert 0 < use["shared"] <= SHARED_LIMIT, use
    assert use["REG"] == PPH_MAXNREG and use["LOCAL"] == 0 and use["STACK"] == 0, use
    assert use["loop_spills"] == 0, use
    kind = "bf16" if dtype == "bf16" else "f16"
    assert use["ptx"].get(f"wgmma.mma_async.sync.aligned.m64n64k16.f32.{kind}.{kind}") == 72, use
    assert use["ptx"].get(f"wgmma.mma_async.sync.aligned.m64n256k16.f32.{kind}.{kind}") == 24, use


@pytest.mark.parametrize("mask,dtype", [("causal", "bf16"), ("draft", "fp16")])
def test_transposed_kernel_compiles_for_sm90_within_shared_memory_without_spills(mask, dtype):
    use = compiled_for_sm90(mask, dtype, "swap")
    assert 0 < use["shared"] <= SHARED_LIMIT, use
    # 255 registers: a few values are parked on the stack before the key loop and read back
    # after it; nothing spills inside the loop
    assert use["loop_spills"] == 0 and use["LOCAL"] == 0 and use["STACK"] <= 64, use
    kind = "bf16" if dtype == "bf16" else "f16"
    # scores: 64 keys x 16 rows over 576 columns = 36; values: 512 output columns (8 x m64)
    # over 64 keys (4 x k16) = 32; nothing padded to 64 rows
    assert use["ptx"].get(f"wgmma.mma_async.sync.aligned.m64n16k16.f32.{kind}.{kind}") == 68, use
    assert not [k for k in use["ptx"] if k.startswith("wgmma") and "m64n16k16" not in k], use


@pytest.mark.parametrize("mask,stages", [("causal", None), ("draft", "2"), ("full", None)])
def test_e4m3_kernel_compiles_for_sm90_without_spills(mask, stages):
    """Both products on e4m3, warp-specialized: the ring (``STAGES`` slots, 3; also 2), two
    V^T buffer pairs, hi + lo queries and two P buffers fit in shared memory; the register
    split holds (each MMA warpgroup 216, the transposer the rest): no loop keeps more than
    4 words a tile in local memory (each MMA warpgroup's loop does, at 216 to 232
    registers alike); the transpose, masked tiles too, runs on ``ldmatrix.trans`` /
    ``stmatrix`` (the 8 x 8 matrix instructions, not byte stores: 4 chunks x 4 loads, in
    the masked and the plain branch); every MMA is e4m3, hi
    and lo side by side as N = 32: m64n32k32, 18 for the scores (64 keys x 576 columns) and
    16 for the values (8 x m64 over 64 keys, two k-steps) in each of the two MMA
    warpgroups."""
    use = compiled_for_sm90(mask, "fp8", "e4m3", stages)
    assert 0 < use["shared"] <= SHARED_LIMIT, use
    assert use["loop_spills"] <= 4 and use["LOCAL"] == 0, use
    wgmma = {k.split(".")[4]: n for k, n in use["ptx"].items() if k.startswith("wgmma")}
    assert wgmma == {"m64n32k32": 68}, use
    assert not [k for k in use["ptx"] if k.startswith("wgmma") and "e4m3.e4m3" not in k], use
    assert sum(n for k, n in use["ptx"].items() if k.startswith("cp.async.bulk.tensor")) > 0, use
    assert use["ptx"].get("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16") == 32, use
    # 16 a branch; the compiler may share the branches' last chunk (28 with triton 3.6.0)
    assert 16 < use["ptx"].get("stmatrix.sync.aligned.m8n8.x4.shared.b16", 0) <= 32, use
    assert use["ptx"].get("setmaxnreg.inc.sync.aligned.u32", 0) > 0, use


def test_compile_script_refuses_an_fp8_cache_for_the_bf16_kernels():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    out = subprocess.run([sys.executable, str(SCRIPT), "causal", "fp8", "swap"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode != 0 and "e4m3 kernel takes fp8" in out.stderr, out.stderr[-3000:]


def test_rows_per_program():
    assert [gluon_mod.tile_rows(r) for r in (1, 8, 16, 17, 112, 128)] == [16, 16, 16, 64, 64, 64]


def _latent_case(seq_lens, q_lens, heads, block_size, dtype, seed):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(needed) + 3
    table = place_blocks(needed, num_blocks, rng)  # shuffled free list
    cache = fill_nan_(torch.empty(num_blocks, block_size, RANK + ROPE, dtype=dtype, device=DEVICE))
    lat = [(torch.randn(s, RANK + ROPE, generator=gen) * 0.5).to(dtype) for s in seq_lens]
    slots = [x for b, s in enumerate(seq_lens) for x in slots_of(table[b], range(s), block_size)]
    flat = torch.cat(lat).to(DEVICE)
    write_mla_latent(flat[:, :RANK], flat[:, RANK:], cache, torch.tensor(slots, device=DEVICE))
    rows = sum(q_lens)
    q_lat = (torch.randn(rows, heads, RANK, generator=gen) / 8).to(dtype)
    q_rope = (torch.randn(rows, heads, ROPE, generator=gen) / 8).to(dtype)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return cache, table, lat, q_lat, q_rope, qsl, torch.tensor(seq_lens, dtype=torch.int32)


def _float64_latent_attention(q_lat, q_rope, lat, seq_len, q_len, mask, scale):
    """softmax(scale (q_lat . c + q_rope . k_rope)) @ c in float64, masked as dense_mask says."""
    q = torch.cat([q_lat, q_rope], -1).double()  # [q_len, H, R + P]
    kv = lat.double()
    s = torch.einsum("thd,kd->thk", q, kv) * scale
    seen = dense_mask(seq_len, q_len, causal=mask.causal, draft_block=mask.draft_block)
    s = s.masked_fill(~seen[:, None, :], float("-inf"))
    return torch.softmax(s, -1) @ kv[:, :RANK]


GPU_CASES = [  # (heads, q_lens, seq_lens, mask, block size, splits)
    (16, [1] * 6, [130, 64, 1000, 2113, 1, 500], Mask(), 64, None),
    (16, [1] * 4, [4097, 63, 640, 2000], Mask(), 128, 3),
    (16, [7] * 5, [7, 71, 1000, 2113, 640], Mask(causal=False, draft_block=7), 64, None),
    (16, [7] * 5, [7, 71, 1000, 2113, 640], Mask(), 64, 2),
    (16, [7, 1, 7, 3], [900, 65, 130, 2000], Mask(causal=False), 64, None),
    (128, [1] * 4, [130, 1000, 2113, 64], Mask(), 64, None),
    (128, [7] * 3, [71, 1000, 2113], Mask(causal=False, draft_block=7), 64, 2),
    (128, [7] * 3, [71, 1000, 513], Mask(), 128, None),
    # <= 16 rows per request: the transposed kernel (16-row tiles, padded rows past q_len x H)
    (8, [2, 1, 2, 2], [300, 64, 1500, 129], Mask(), 64, None),
    (4, [3] * 3, [200, 3, 1025], Mask(causal=False, draft_block=3), 128, 2),
]


def _check_against_float64(got, q_lat, q_rope, lat, seq_lens, q_lens, mask, scale):
    assert not bool(got.isnan().any())
    start = 0
    for b, (seq_len, q_len) in enumerate(zip(seq_lens, q_lens)):
        rows = slice(start, start + q_len)
        want = _float64_latent_attention(q_lat[rows], q_rope[rows], lat[b], seq_len, q_len, mask,
                                         scale)
        torch.testing.assert_close(got[rows], want, rtol=1e-2, atol=1e-2)
        start += q_len


def _needs_hopper():
    if DEVICE.type != "cuda" or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernel runs on Hopper (sm_90) only")


# each case with both 64-row kernel variants where it takes the 64-row tiles
VARIANT_CASES = [(*case, variant) for case in GPU_CASES
                 for variant in (gluon_mod.ROWS_VARIANTS if case[0] * max(case[1]) > 16
                                 else ("serial",))]


@pytest.mark.parametrize("heads,q_lens,seq_lens,mask,block_size,splits,variant", VARIANT_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gluon_matches_float64_latent_attention(heads, q_lens, seq_lens, mask, block_size, splits,
                                                variant, dtype):
    _needs_hopper()
    cache, table, lat, q_lat, q_rope, qsl, lens = _latent_case(seq_lens, q_lens, heads, block_size,
                                                               dtype, seed=len(seq_lens) + heads)
    scale = 1 / math.sqrt(192)
    got = paged_mla_latent(q_lat.to(DEVICE), q_rope.to(DEVICE), cache, qsl.to(DEVICE),
                           lens.to(DEVICE), table.to(DEVICE), scale=scale, mask=mask, gluon=variant,
                           splits=splits).double().cpu()
    _check_against_float64(got, q_lat, q_rope, lat, seq_lens, q_lens, mask, scale)


@pytest.mark.parametrize("heads,q_len,variant", [(16, 1, "serial"), (16, 7, "serial"),
                                                 (128, 1, "serial"),
                                                 (128, 1, "pingpong_halves"),
                                                 (16, 7, "pingpong_halves")])
def test_kept_plan_matches_float64_on_every_call(heads, q_len, variant):
    """Calls with max_query_len / max_seq_len keep their plan: later calls launch through
    the compiled launcher with the cached descriptors. Fresh queries every call; a second
    cache of the same shape (another address, another plan) in between."""
    _needs_hopper()
    seq_lens, mask, scale = [900, 2113, 65], Mask(causal=False, draft_block=q_len), 0.07
    gen = torch.Generator().manual_seed(heads + q_len)
    cases = [_latent_case(seq_lens, [q_len] * 3, heads, 64, torch.bfloat16, seed=s) for s in (1, 2)]
    for cache, table, lat, _, _, qsl, lens in cases * 2:
        q_lat = (torch.randn(3 * q_len, heads, RANK, generator=gen) / 8).bfloat16()
        q_rope = (torch.randn(3 * q_len, heads, ROPE, generator=gen) / 8).bfloat16()
        got = paged_mla_latent(q_lat.to(DEVICE), q_rope.to(DEVICE), cache, qsl.to(DEVICE),
                               lens.to(DEVICE), table.to(DEVICE), scale=scale, mask=mask,
                               gluon=variant, max_query_len=q_len, max_seq_len=max(seq_lens))
        _check_against_float64(got.double().cpu(), q_lat, q_rope, lat, seq_lens, [q_len] * 3,
                               mask, scale)


FP8_CASES = [  # (heads, q_lens, seq_lens, mask, block size, splits): <= 16 rows per request
    (16, [1] * 6, [130, 64, 1000, 2113, 1, 500], Mask(), 64, None),
    (16, [1] * 4, [4097, 63, 640, 2000], Mask(), 128, 3),
    (8, [2, 1, 2, 2], [300, 64, 1500, 129], Mask(), 64, None),
    (4, [3] * 3, [200, 3, 1025], Mask(causal=False, draft_block=3), 128, 2),
    (16, [1] * 3, [65, 191, 777], Mask(causal=False), 64, 4),
    # one row per request (h1 q1), with and without splits
    (1, [1] * 4, [70, 1000, 5, 129], Mask(), 64, None),
    (1, [1] * 2, [3001, 200], Mask(), 128, 5),
    (16, [1] * 2, [8191, 4100], Mask(), 64, None),
]


@pytest.mark.parametrize("heads,q_lens,seq_lens,mask,block_size,splits", FP8_CASES)
@pytest.mark.parametrize("qdtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("variant", gluon_mod.FP8_VARIANTS)
def test_gluon_fp8_matches_float64_over_the_dequantized_latent(heads, q_lens, seq_lens, mask,
                                                               block_size, splits, qdtype,
                                                               variant):
    """A per-tensor e4m3 cache (unused pages NaN, shuffled table): the fp8 Gluon kernel
    (both products on e4m3) against float64 attention over what the cache holds (stored
    values x scale)."""
    _needs_hopper()
    seed = 7 * len(seq_lens) + heads + block_size
    _, table, lat, q_lat, q_rope, qsl, lens = _latent_case(seq_lens, q_lens, heads, block_size,
                                                           qdtype, seed=seed)
    scale_fp8 = float(torch.cat(lat).float().abs().amax()) / 448 * 1.3  # not a power of two
    cache = fill_nan_(torch.empty(int(table.max()) + 2, block_size, RANK + ROPE,
                                  dtype=torch.float8_e4m3fn, device=DEVICE))
    stored = []
    for b, s in enumerate(seq_lens):
        q8 = (lat[b].float() / scale_fp8).clamp(-448, 448).to(torch.float8_e4m3fn)
        flat = cache.view(-1, RANK + ROPE)
        flat[torch.tensor(slots_of(table[b], range(s), block_size), device=DEVICE)] = q8.to(DEVICE)
        stored.append(q8.double() * scale_fp8)  # what the cache holds, in float64
    sm = 1 / math.sqrt(192)
    got = paged_mla_latent(q_lat.to(DEVICE), q_rope.to(DEVICE), cache, qsl.to(DEVICE),
                           lens.to(DEVICE), table.to(DEVICE), scale=sm, mask=mask,
                           gluon=variant, latent_scale=scale_fp8, splits=splits).double().cpu()
    _check_against_float64(got, q_lat, q_rope, stored, seq_lens, q_lens, mask, sm)
    # the Triton fp8 kernel on the same cache agrees too
    tri = paged_mla_latent(q_lat.to(DEVICE), q_rope.to(DEVICE), cache, qsl.to(DEVICE),
                           lens.to(DEVICE), table.to(DEVICE), scale=sm, mask=mask, gluon=False,
                           latent_scale=scale_fp8, splits=splits).double().cpu()
    torch.testing.assert_close(got, tri, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("variant", [True, *gluon_mod.FP8_VARIANTS])
def test_gluon_fp8_kept_plan_matches_float64_on_every_call(variant):
    """Kept plans of the fp8 kernels: fresh queries every call, two caches, and another
    latent scale (another plan: the scale is one of its scalars)."""
    _needs_hopper()
    seq_lens, q_len, heads, sm = [900, 2113, 65], 1, 16, 0.07
    gen = torch.Generator().manual_seed(11)
    for rep in range(4):
        _, table, lat, _, _, qsl, lens = _latent_case(seq_lens, [q_len] * 3, heads, 64,
                                                      torch.bfloat16, seed=1 + rep % 2)
        s8 = 0.01 * (1 + rep)
        cache = fill_nan_(torch.empty(int(table.max()) + 2, 64, RANK + ROPE,
                                      dtype=torch.float8_e4m3fn, device=DEVICE))
        stored = []
        for b, s in enumerate(seq_lens):
            q8 = (lat[b].float() / s8).clamp(-448, 448).to(torch.float8_e4m3fn)
            cache.view(-1, RANK + ROPE)[torch.tensor(slots_of(table[b], range(s), 64),
                                                     device=DEVICE)] = q8.to(DEVICE)
            stored.append(q8.double() * s8)
        q_lat = (torch.randn(3, heads, RANK, generator=gen) / 8).bfloat16()
        q_rope = (torch.randn(3, heads, ROPE, generator=gen) / 8).bfloat16()
        got = paged_mla_latent(q_lat.to(DEVICE), q_rope.to(DEVICE), cache, qsl.to(DEVICE),
                               lens.to(DEVICE), table.to(DEVICE), scale=sm, mask=Mask(),
                               gluon=variant, latent_scale=s8, max_query_len=q_len,
                               max_seq_len=max(seq_lens))
        _check_against_float64(got.double().cpu(), q_lat, q_rope, stored, seq_lens,
                               [q_len] * 3, Mask(), sm)


@pytest.mark.parametrize("stages", [2])
def test_e4m3_other_forms_match_float64(monkeypatch, stages):
    """The e4m3 kernel's other compiled form: 2 ring slots."""
    from pagedkv.ops.triton import mla as triton_mla
    from pagedkv.ops.triton import mla_gluon_e4m3

    _needs_hopper()
    monkeypatch.setattr(mla_gluon_e4m3, "STAGES", stages)
    monkeypatch.setattr(triton_mla, "_GLUON_PLANS", {})
    test_gluon_fp8_matches_float64_over_the_dequantized_latent(
        16, [1] * 4, [4097, 63, 640, 2000], Mask(), 128, 3, torch.bfloat16, "e4m3")
    test_gluon_fp8_matches_float64_over_the_dequantized_latent(
        8, [2, 1, 2, 2], [300, 64, 1500, 129], Mask(), 64, None, torch.float16, "e4m3")


def _cpu_call(**over):
    gen = torch.Generator().manual_seed(3)
    cache = torch.randn(2, 64, RANK + ROPE, generator=gen).bfloat16()
    args = dict(q_latent=torch.randn(1, 16, RANK, generator=gen).bfloat16(),
                q_rope=torch.randn(1, 16, ROPE, generator=gen).bfloat16(), cache=cache,
                mask=Mask(), latent_scale=None)
    args.update(over)
    return gluon_mod.supported(**args)


def test_supported_names_what_it_refuses():
    assert "Hopper" in _cpu_call()  # a CPU tensor: everything else fits
    fp8 = torch.zeros(2, 64, RANK + ROPE, dtype=torch.float8_e4m3fn)
    assert "Hopper" in _cpu_call(cache=fp8, latent_scale=0.5)  # fp8 <= 16 rows: everything fits
    assert "tensor" in _cpu_call(cache=fp8, latent_scale=torch.tensor(0.5))
    assert "17 rows" in _cpu_call(cache=fp8, latent_scale=0.5, rows=17)
    assert "queries" in _cpu_call(cache=fp8, latent_scale=0.5, q_latent=torch.zeros(1, 16, RANK))
    assert "cache" in _cpu_call(cache=fp8.view(torch.float8_e5m2), latent_scale=0.5)
    assert "queries" in _cpu_call(q_latent=torch.zeros(1, 16, RANK))
    assert "512 + 64" in _cpu_call(q_rope=None)
    assert "block size 16" in _cpu_call(cache=torch.zeros(8, 16, RANK + ROPE).bfloat16())
    assert "window" in _cpu_call(mask=Mask(window=128))
    assert "scale" in _cpu_call(latent_scale=0.5) or "cache" in _cpu_call(latent_scale=0.5)
    every_other_page = torch.zeros(4, 64, RANK + ROPE).bfloat16()[::2]
    assert "page-contiguous" in _cpu_call(cache=every_other_page)


def test_gluon_by_default_for_page_tiles_bf16_or_few_row_fp8(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    # (rows per request, block size, float32 queries, fp8 cache) -> gluon by default
    assert launch_defaults(16, 64, False, False)["gluon"] is True
    assert launch_defaults(128, 128, False, False)["gluon"] is True
    assert launch_defaults(128, 32, False, False)["gluon"] is False
    assert launch_defaults(128, 64, True, False)["gluon"] is False
    # fp8 caches: the transposed (<= 16-row) kernel only, on blocks of multiples of 64
    assert launch_defaults(16, 64, False, True)["gluon"] is True
    assert launch_defaults(16, 128, False, True)["gluon"] is True
    assert launch_defaults(17, 64, False, True)["gluon"] is False
    assert launch_defaults(16, 32, False, True)["gluon"] is False
    assert launch_defaults(16, 64, True, True)["gluon"] is False


def test_gluon_true_refused_off_hopper_and_default_off_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert launch_defaults(128, 64, True, False)["gluon"] is False
    gen = torch.Generator().manual_seed(4)
    cache = torch.randn(2, 64, RANK + ROPE, generator=gen).bfloat16()
    ql = torch.randn(1, 16, RANK, generator=gen).bfloat16()
    qr = torch.randn(1, 16, ROPE, generator=gen).bfloat16()
    qsl = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(InvalidArgumentError, match="gluon=True"):
        paged_mla_latent(ql, qr, cache, qsl, torch.tensor([70], dtype=torch.int32),
                         torch.tensor([[0, 1]], dtype=torch.int32), scale=0.1, gluon=True)


def test_fp8_variants_pick_their_kernel_and_are_refused_elsewhere(monkeypatch):
    """``plan`` launches the e4m3 kernel (4 warps a partition, the module's ring depth and
    register cap, the latent scale as its last scalar, two workspace splits per grid split)
    for an e4m3 cache of <= 16 rows,
    named or not, and the bf16 kernel with scale 1 for a bf16 cache; the deleted "widen"
    name, an fp8 name on a bf16 cache, and any Gluon name off Hopper / under the
    interpreter, are refused with the reason."""
    from pagedkv.ops.triton import mla_gluon_e4m3

    gen = torch.Generator().manual_seed(8)
    cache = torch.randn(3, 64, RANK + ROPE, generator=gen).clamp(-4, 4).to(torch.float8_e4m3fn)
    ql = torch.randn(2, 16, RANK, generator=gen).bfloat16()
    qr = torch.randn(2, 16, ROPE, generator=gen).bfloat16()
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32)
    lens = torch.tensor([70, 100], dtype=torch.int32)
    table = torch.tensor([[2, 0], [1, 0]], dtype=torch.int32)
    out = torch.empty(2, 16, RANK)

    def kernel(variant, cache=cache):
        made = gluon_mod.plan(ql, qr, cache, qsl, lens, table, out, scale=0.1, mask=CAUSAL,
                              tiles=1, splits=2, block_m=16, variant=variant,
                              latent_scale=0.25)
        return made.kernel.kernel, made.kernel.consts, made.kernel.scalars

    assert gluon_mod.FP8_VARIANTS == ("e4m3",)
    monkeypatch.setattr(mla_gluon_e4m3, "STAGES", 3)
    for name in ("e4m3", None):
        made = gluon_mod.plan(ql, qr, cache, qsl, lens, table, out, scale=0.1, mask=CAUSAL,
                              tiles=1, splits=2, block_m=16, variant=name, latent_scale=0.25)
        fn, consts, scalars = made.kernel.kernel, made.kernel.consts, made.kernel.scalars
        assert fn is mla_gluon_e4m3._mla_gluon_e4m3 and consts["num_warps"] == 4
        assert consts["STAGES"] == 3 and consts["maxnreg"] == mla_gluon_e4m3.MAXNREG
        assert scalars[-1] == 0.25 and made.ws_shape[2] == 2 * 2
    fn, consts, scalars = kernel(None, cache.bfloat16())
    assert fn is gluon_mod._mla_gluon_swap and consts["STAGES"] == gluon_mod.STAGES
    assert scalars[-1] == 1.0 and "PAIRS" not in consts
    call = dict(scale=0.1, latent_scale=0.25)
    with pytest.raises(InvalidArgumentError, match="'widen'"):
        paged_mla_latent(ql, qr, cache, qsl, lens, table, gluon="widen", **call)
    with pytest.raises(InvalidArgumentError, match="e4m3 caches"):
        paged_mla_latent(ql, qr, cache.bfloat16(), qsl, lens, table, scale=0.1, gluon="e4m3")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for name in gluon_mod.FP8_VARIANTS:
        with pytest.raises(InvalidArgumentError, match="Hopper"):
            paged_mla_latent(ql, qr, cache, qsl, lens, table, gluon=name, **call)


class _Chosen(Exception):
    pass


def test_default_dispatch_takes_gluon_unless_a_triton_override_is_given(monkeypatch):
    """Where launch_defaults says gluon and the kernel accepts the call, a default call
    launches it; a Triton launch override (block_m, swap, ...) keeps the Triton kernels."""
    import pagedkv.ops.triton.mla as mla

    real = mla.launch_defaults
    monkeypatch.setattr(mla, "launch_defaults", lambda *a: dict(real(*a), gluon=True))
    monkeypatch.setattr(gluon_mod, "supported", lambda *a: None)

    def chosen(*a, **k):
        raise _Chosen(k["block_m"])

    monkeypatch.setattr(gluon_mod, "launch", chosen)
    gen = torch.Generator().manual_seed(5)
    cache = torch.randn(2, 4, 40, generator=gen).to(DEVICE)
    ql = torch.randn(1, 2, 32, generator=gen).to(DEVICE)
    qr = torch.randn(1, 2, 8, generator=gen).to(DEVICE)
    call = dict(query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=DEVICE),
                seq_lens=torch.tensor([5], dtype=torch.int32, device=DEVICE),
                block_table=torch.tensor([[1, 0]], dtype=torch.int32, device=DEVICE), scale=0.2)
    with pytest.raises(_Chosen, match="16"):  # 2 rows per request: the transposed kernel
        mla.paged_mla_latent(ql, qr, cache, **call)
    out = mla.paged_mla_latent(ql, qr, cache, **call, block_m=16)
    assert out.shape == (1, 2, 32) and bool(out.isfinite().all())
    out2 = mla.paged_mla_latent(ql, qr, cache, **call, gluon=False)
    torch.testing.assert_close(out2, out)


class _FakePlan:
    """Stands in for a Gluon plan on the CPU: counts its calls, writes its number."""

    def __init__(self, number):
        self.number, self.calls = number, 0

    def __call__(self, ql, qr, qsl, lens, table, flag, out):
        self.calls += 1
        out.fill_(self.number)


def test_kept_plans_never_serve_another_cache_shape_or_option(monkeypatch):
    """A plan is kept only for calls given max_query_len and max_seq_len, and reused only by
    calls that agree on every shape, stride, dtype, option and on the cache's address (its
    TMA descriptors embed it); the cache's values may change."""
    import pagedkv.ops.triton.mla as mla

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # CPU tensors pass the device check
    real = mla.launch_defaults
    monkeypatch.setattr(mla, "launch_defaults", lambda *a: dict(real(*a), gluon=True))
    monkeypatch.setattr(gluon_mod, "supported", lambda *a: None)
    monkeypatch.setattr(mla, "_GLUON_PLANS", {})
    made = []

    def fake_launch(ql, qr, cache, qsl, lens, table, out, flag, **options):
        made.append(_FakePlan(len(made) + 1))
        made[-1](ql, qr, qsl, lens, table, flag, out)
        return made[-1]

    monkeypatch.setattr(gluon_mod, "launch", fake_launch)
    gen = torch.Generator().manual_seed(6)
    cache = torch.randn(4, 64, RANK + ROPE, generator=gen).bfloat16()

    def call(cache=cache, rows=2, heads=16, mask=CAUSAL, max_seq_len=100, **kw):
        ql = torch.randn(rows, heads, RANK, generator=gen).bfloat16()
        qr = torch.randn(rows, heads, ROPE, generator=gen).bfloat16()
        qsl = torch.tensor([0, 1, rows], dtype=torch.int32)
        out = mla.paged_mla_latent(ql, qr, cache, qsl, torch.tensor([70, 100], dtype=torch.int32),
                                   torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), scale=0.1,
                                   mask=mask, max_query_len=rows - 1, max_seq_len=max_seq_len,
                                   check_blocks=False, **kw)
        return int(out[0, 0, 0]), len(made)

    assert call() == (1, 1)
    assert call() == (1, 1) and made[0].calls == 2  # the kept plan
    cache.copy_(torch.randn(cache.shape, generator=gen))  # new values, same address
    assert call() == (1, 1)
    assert call(max_seq_len=255) == (1, 1)  # the same splits bucket (256 keys)
    assert call(cache=cache.clone()) == (2, 2)  # same shape, another address
    assert call(cache=torch.randn(8, 64, RANK + ROPE, generator=gen).bfloat16()) == (3, 3)
    assert call(rows=3) == (4, 4)
    assert call(heads=8) == (5, 5)
    assert call(mask=Mask(causal=False)) == (6, 6)
    assert call(max_seq_len=300) == (7, 7)
    assert call(gluon="pingpong_halves") == (8, 8)  # named, not None: another key
    assert call(gluon="serial") == (9, 9)
    assert call(gluon=True) == (10, 10)
    assert call(splits=3) == (11, 11)
    assert call() == (1, 11)  # every earlier plan still kept
    out = mla.paged_mla_latent(  # no bounds given: nothing kept
        torch.zeros(1, 16, RANK).bfloat16(), torch.zeros(1, 16, ROPE).bfloat16(), cache,
        torch.tensor([0, 1], dtype=torch.int32), torch.tensor([70], dtype=torch.int32),
        torch.tensor([[0, 1]], dtype=torch.int32), scale=0.1, check_blocks=False)
    assert int(out[0, 0, 0]) == 12 and len(mla._GLUON_PLANS) == 11
    with pytest.raises(InvalidArgumentError, match="fastest"):
        mla.paged_mla_latent(torch.zeros(1, 16, RANK).bfloat16(),
                             torch.zeros(1, 16, ROPE).bfloat16(), cache,
                             torch.tensor([0, 1], dtype=torch.int32),
                             torch.tensor([70], dtype=torch.int32),
                             torch.tensor([[0, 1]], dtype=torch.int32), scale=0.1,
                             gluon="fastest")
