"""fp8 formats: per-tensor scaled fp8 round trips and the fp8_ds_mla byte layout."""

from __future__ import annotations

import struct

import pytest

torch = pytest.importorskip("torch")

from dense_reference import decode_ds_mla_entry, e4m3_to_float, test_device  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from pagedkv.errors import InvalidArgumentError  # noqa: E402
from pagedkv.ops import (  # noqa: E402
    dequantize_fp8,
    ds_mla_entry_bytes,
    fp8_scale,
    pack_fp8_ds_mla,
    quantize_fp8,
    unpack_fp8_ds_mla,
)

DEVICE = test_device()
E4M3_MAX = 448.0  # (1 + 6/8) * 2^8, the largest finite e4m3fn value
E4M3_MIN_NORMAL = 2.0**-6
E5M2_MAX = 57344.0  # (1 + 3/4) * 2^15


def _within_format_error(x, back, scale, mantissa_bits, min_normal):
    """Round-to-nearest error: half an ulp, i.e. 2^-(m+1) relative for normal values and half
    the subnormal step (min_normal * 2^-m / 2) absolute below them (all after scaling)."""
    x, back = x.double().cpu(), back.double().cpu()
    err = (back - x).abs()
    rel_bound = 2.0 ** -(mantissa_bits + 1) * x.abs()
    abs_bound = min_normal * 2.0 ** -(mantissa_bits + 1) * scale
    return bool((err <= torch.maximum(rel_bound, torch.full_like(err, abs_bound)) * (1 + 1e-6)).all())


finite = st.floats(-1e4, 1e4, allow_nan=False, width=32)


@settings(max_examples=40, deadline=None)
@given(st.lists(finite, min_size=1, max_size=64), st.floats(0.5, 4.0))
def test_per_tensor_e4m3_round_trip_within_format_error(values, headroom):
    x = torch.tensor(values, dtype=torch.float32, device=DEVICE)
    scale = float(fp8_scale(x)) * headroom  # headroom >= 0.5 may saturate; handled below
    back = dequantize_fp8(quantize_fp8(x, scale), scale)
    clipped = x.clamp(-E4M3_MAX * scale, E4M3_MAX * scale)
    assert _within_format_error(clipped, back, scale, 3, E4M3_MIN_NORMAL)
    # the brief's bound: relative error <= 2^-3 for every value that is normal after scaling
    normal = clipped.abs() >= E4M3_MIN_NORMAL * scale
    rel = ((back - clipped).abs() / clipped.abs().clamp_min(1e-30))[normal]
    assert bool((rel <= 2.0**-3).all())


@settings(max_examples=20, deadline=None)
@given(st.lists(finite, min_size=1, max_size=64))
def test_per_tensor_e5m2_round_trip_within_format_error(values):
    x = torch.tensor(values, dtype=torch.float32, device=DEVICE)
    scale = max(float(x.abs().max()) / E5M2_MAX, 2.0**-100)  # keep the scale a normal float32
    back = dequantize_fp8(quantize_fp8(x, scale, torch.float8_e5m2), scale)
    assert _within_format_error(x, back, scale, 2, 2.0**-14)


def test_fp8_scale_maps_amax_to_format_max_and_zero_to_one():
    x = torch.tensor([0.5, -3.0, 2.0], device=DEVICE)
    assert float(fp8_scale(x)) == pytest.approx(3.0 / 448)
    assert float(fp8_scale(torch.zeros(4, device=DEVICE))) == 1.0
    assert float(fp8_scale(torch.tensor([1e-45], device=DEVICE))) > 0  # no underflow to 0
    q = quantize_fp8(x, fp8_scale(x))
    assert float(q.float().abs().max()) == 448.0


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
def test_bad_scale_raises(bad):
    with pytest.raises(InvalidArgumentError):
        quantize_fp8(torch.ones(2, device=DEVICE), bad)


def test_quantize_saturates_instead_of_overflowing():
    q = quantize_fp8(torch.tensor([1e6, -1e6], device=DEVICE), 1.0)
    assert q.float().tolist() == [448.0, -448.0]


def test_ds_mla_entry_is_656_bytes_for_deepseek_geometry():
    # 512 fp8 latent + 4 fp32 scales + 64 bf16 rope (model-facts.md)
    assert ds_mla_entry_bytes(512, 64) == 512 + 4 * 4 + 64 * 2 == 656
    with pytest.raises(InvalidArgumentError):
        ds_mla_entry_bytes(500, 64)


def test_ds_mla_byte_order_decoded_by_hand():
    gen = torch.Generator().manual_seed(0)
    latent = torch.randn(3, 512, generator=gen) * torch.tensor([1.0, 10.0, 0.01])[:, None]
    latent[2, 128:256] = 0.0  # an all-zero group
    rope = torch.randn(3, 64, generator=gen)
    packed = pack_fp8_ds_mla(latent.to(DEVICE), rope.to(DEVICE)).cpu()
    assert packed.dtype == torch.uint8 and tuple(packed.shape) == (3, 656)
    for t in range(3):
        entry = bytes(packed[t].tolist())
        scales = struct.unpack("<4f", entry[512:528])
        for g in range(4):
            amax = float(latent[t, 128 * g : 128 * (g + 1)].abs().max())
            want = amax / 448 if amax > 0 else 1.0
            assert scales[g] == pytest.approx(want, rel=1e-6)
        got_latent, got_rope = decode_ds_mla_entry(entry, 512)
        for i in range(512):
            x, y = float(latent[t, i]), got_latent[i]
            bound = max(2.0**-4 * abs(x), 2.0**-10 * scales[i // 128]) * (1 + 1e-6)
            assert abs(y - x) <= bound, (t, i, x, y)
        for i in range(64):
            x = float(rope[t, i])
            assert got_rope[i] == pytest.approx(x, rel=2.0**-8, abs=1e-30)
        if t == 2:
            assert scales[1] == 1.0 and all(v == 0.0 for v in got_latent[128:256])


def test_ds_mla_unpack_inverts_pack_and_keeps_leading_dims():
    gen = torch.Generator().manual_seed(1)
    latent = torch.randn(2, 5, 256, generator=gen)
    rope = torch.randn(2, 5, 8, generator=gen)
    packed = pack_fp8_ds_mla(latent.to(DEVICE), rope.to(DEVICE))
    assert tuple(packed.shape) == (2, 5, ds_mla_entry_bytes(256, 8))
    back, back_rope = unpack_fp8_ds_mla(packed, 256)
    assert tuple(back.shape) == (2, 5, 256) and tuple(back_rope.shape) == (2, 5, 8)
    # per-value bound, using the scales as stored in the entry
    groups = latent.reshape(2, 5, 2, 128)
    scale = (groups.abs().amax(-1, keepdim=True) / 448).expand_as(groups).reshape(2, 5, 256)
    err = (back.cpu() - latent).abs()
    assert bool((err <= torch.maximum(2.0**-4 * latent.abs(), 2.0**-10 * scale) * 1.000001).all())
    assert torch.equal(back_rope.cpu(), rope.to(torch.bfloat16).float())


def test_e4m3_decoder_agrees_with_torch_on_every_byte():
    # guards the test's own decoder, which the byte-order test above relies on
    raw = torch.arange(256, dtype=torch.uint8)
    ours = torch.tensor([e4m3_to_float(b) for b in range(256)], dtype=torch.float64)
    theirs = raw.view(torch.float8_e4m3fn).double()
    same = (ours == theirs) | (ours.isnan() & theirs.isnan())
    assert bool(same.all())


def test_unpack_rejects_a_size_that_does_not_fit_the_rank():
    with pytest.raises(InvalidArgumentError):
        unpack_fp8_ds_mla(torch.zeros(4, 601, dtype=torch.uint8), 512)  # odd rope bytes
    with pytest.raises(InvalidArgumentError):
        unpack_fp8_ds_mla(torch.zeros(4, 500, dtype=torch.uint8), 512)  # shorter than 528
    with pytest.raises(InvalidArgumentError):
        unpack_fp8_ds_mla(torch.zeros(4, 656, dtype=torch.int8), 512)
