"""Cache writes through the slot mapping, and the NaN-fill debug aid."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from dense_reference import decode_ds_mla_entry, test_device  # noqa: E402
from kernel_cases import INTERPRETER_WARNINGS, only_on_gpu  # noqa: E402

from pagedkv.errors import InvalidArgumentError, MetadataError  # noqa: E402
from pagedkv.ops import (  # noqa: E402
    fill_nan_,
    write_kv,
    write_mla_latent,
    write_state,
)

DEVICE = test_device()
pytestmark = INTERPRETER_WARNINGS


def _random_slots(num_slots: int, n: int, pad: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    slots = rng.sample(range(num_slots), n)
    for i in rng.sample(range(n), pad):
        slots[i] = -1
    return slots


@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_write_kv_lands_in_its_slots_and_nowhere_else(block_size, dtype, ops_backend):
    only_on_gpu(ops_backend, keep=dtype == torch.float32, why="it rounds float32 -> bf16/fp16 wrongly")
    blocks, kv_heads, dim, vdim, n = 5, 2, 8, 4, 40
    gen = torch.Generator().manual_seed(block_size)
    key, value = torch.randn(n, kv_heads, dim, generator=gen), torch.randn(n, kv_heads, vdim, generator=gen)
    slots = _random_slots(blocks * block_size, min(n, blocks * block_size), 3, block_size)
    key, value = key[: len(slots)], value[: len(slots)]
    k_cache = fill_nan_(torch.empty(blocks, block_size, kv_heads, dim, dtype=dtype, device=DEVICE))
    v_cache = fill_nan_(torch.empty(blocks, block_size, kv_heads, vdim, dtype=dtype, device=DEVICE))
    write_kv(key.to(DEVICE), value.to(DEVICE), k_cache, v_cache,
             torch.tensor(slots, dtype=torch.int32, device=DEVICE))
    k_host, v_host = k_cache.cpu(), v_cache.cpu()
    written = set()
    for t, slot in enumerate(slots):
        if slot == -1:
            continue
        b, o = divmod(slot, block_size)  # slot = block * block_size + offset
        written.add((b, o))
        assert torch.equal(k_host[b, o], key[t].to(dtype))
        assert torch.equal(v_host[b, o], value[t].to(dtype))
    for b in range(blocks):
        for o in range(block_size):
            if (b, o) not in written:
                assert bool(k_host[b, o].isnan().all()) and bool(v_host[b, o].isnan().all())


def test_write_kv_fp8_stores_scaled_values(ops_backend):
    only_on_gpu(ops_backend, why="its fp8 rounding differs from the GPU's")
    gen = torch.Generator().manual_seed(3)
    key, value = torch.randn(6, 1, 16, generator=gen) * 5, torch.randn(6, 1, 16, generator=gen)
    k_cache = torch.zeros(2, 4, 1, 16, dtype=torch.float8_e4m3fn, device=DEVICE)
    v_cache = torch.zeros(2, 4, 1, 16, dtype=torch.float8_e4m3fn, device=DEVICE)
    slots = torch.tensor([7, 0, 1, 2, 5, 6], device=DEVICE)
    k_scale, v_scale = 0.05, 0.01
    write_kv(key.to(DEVICE), value.to(DEVICE), k_cache, v_cache, slots, k_scale=k_scale, v_scale=v_scale)
    for t, slot in enumerate(slots.tolist()):
        b, o = divmod(slot, 4)
        for cache, x, s in ((k_cache, key[t], k_scale), (v_cache, value[t], v_scale)):
            back = cache[b, o].cpu().double() * s  # torch's fp8 decode, times the scale
            x = x.double().clamp(-448 * s, 448 * s)
            assert bool(((back - x).abs() <= torch.clamp_min(x.abs() * 2.0**-4, 2.0**-10 * s) * 1.000001).all())


def test_fp8_cache_needs_its_scale_and_others_refuse_one(ops_backend):
    k8 = torch.zeros(1, 2, 1, 4, dtype=torch.float8_e4m3fn, device=DEVICE)
    kb = torch.zeros(1, 2, 1, 4, dtype=torch.bfloat16, device=DEVICE)
    x, slots = torch.ones(1, 1, 4, device=DEVICE), torch.tensor([0], device=DEVICE)
    with pytest.raises(InvalidArgumentError, match="scale"):
        write_kv(x, x, k8, k8.clone(), slots)
    with pytest.raises(InvalidArgumentError, match="scale"):
        write_kv(x, x, kb, kb.clone(), slots, k_scale=1.0)


@pytest.mark.parametrize("fmt", ["bf16", "fp16", "fp8", "fp8_ds_mla"])
def test_write_mla_latent_in_every_format(fmt, ops_backend):
    only_on_gpu(ops_backend, why="it rounds float32 -> bf16/fp16/fp8 unlike the GPU")
    rank, rope_dim, block_size, blocks, n = 256, 16, 16, 3, 20
    gen = torch.Generator().manual_seed(5)
    latent, rope = torch.randn(n, rank, generator=gen), torch.randn(n, rope_dim, generator=gen)
    width = {"fp8_ds_mla": rank + 4 * (rank // 128) + 2 * rope_dim}.get(fmt, rank + rope_dim)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn,
             "fp8_ds_mla": torch.uint8}[fmt]
    cache = fill_nan_(torch.empty(blocks, block_size, width, dtype=dtype, device=DEVICE))
    slots = _random_slots(blocks * block_size, n, 2, 11)
    scale = 0.02 if fmt == "fp8" else None
    write_mla_latent(latent.to(DEVICE), rope.to(DEVICE), cache,
                     torch.tensor(slots, device=DEVICE), scale=scale)
    host = cache.cpu()
    for t, slot in enumerate(slots):
        if slot == -1:
            continue
        entry = host[slot // block_size, slot % block_size]
        if fmt == "fp8_ds_mla":
            got_latent, got_rope = decode_ds_mla_entry(bytes(entry.tolist()), rank)
            got = torch.tensor(got_latent + got_rope, dtype=torch.float64)
            tol = torch.cat([latent[t].abs().double() * 2.0**-4 + 1e-3, rope[t].abs().double() * 2.0**-8])
        elif fmt == "fp8":
            got = entry.double() * scale
            tol = torch.cat([latent[t], rope[t]]).abs().double() * 2.0**-4 + 2.0**-10 * scale
        else:
            got = entry.double()
            tol = torch.cat([latent[t], rope[t]]).abs().double() * 2.0**-8
        want = torch.cat([latent[t], rope[t]]).double()
        assert bool(((got - want).abs() <= tol * 1.000001).all()), (fmt, t)
    untouched = set(range(blocks * block_size)) - set(slots)
    for slot in untouched:
        entry = host[slot // block_size, slot % block_size]
        assert bool((entry.view(torch.uint8) == 0xFF).all())  # still the NaN fill


def test_write_mla_latent_without_rope_for_nope_models(ops_backend):
    only_on_gpu(ops_backend, why="it rounds float32 -> bf16 unlike the GPU")
    cache = fill_nan_(torch.empty(2, 4, 128, dtype=torch.bfloat16, device=DEVICE))
    latent = torch.randn(3, 128)
    write_mla_latent(latent.to(DEVICE), None, cache, torch.tensor([5, -1, 2], device=DEVICE))
    assert torch.equal(cache[1, 1].cpu(), latent[0].bfloat16())
    assert torch.equal(cache[0, 2].cpu(), latent[2].bfloat16())
    assert int(cache.isnan().all(dim=-1).sum()) == 8 - 2


def test_write_state_by_slot_id_skips_padding(ops_backend):
    cache = fill_nan_(torch.empty(4, 2, 3, dtype=torch.float32, device=DEVICE))
    state = torch.arange(18, dtype=torch.float32).reshape(3, 2, 3)
    write_state(state.to(DEVICE), cache, torch.tensor([2, -1, 0], device=DEVICE))
    host = cache.cpu()
    assert torch.equal(host[2], state[0]) and torch.equal(host[0], state[2])
    assert bool(host[1].isnan().all()) and bool(host[3].isnan().all())


def test_write_into_a_strided_view_of_a_pool(ops_backend):
    # two layers interleaved page by page in one pool: each layer's view is not contiguous
    pool = torch.zeros(3, 2, 4, 1, 2, device=DEVICE)  # [pages, layer, block_size, heads, dim]
    k0, v0 = pool[:, 0], pool[:, 1]
    x = torch.ones(2, 1, 2, device=DEVICE)
    write_kv(x, 2 * x, k0, v0, torch.tensor([5, 8], device=DEVICE))
    assert float(pool[1, 0, 1].sum()) == 2 and float(pool[2, 0, 0].sum()) == 2
    assert float(pool[1, 1, 1].sum()) == 4 and float(pool.sum()) == 12


@pytest.mark.parametrize("slots", [[0, 8], [-2, 1], [3, 3]])
def test_bad_slots_raise(slots, ops_backend):
    cache = torch.zeros(2, 4, 1, 2, device=DEVICE)
    x = torch.ones(2, 1, 2, device=DEVICE)
    with pytest.raises(MetadataError):
        write_kv(x, x, cache, cache.clone(), torch.tensor(slots, device=DEVICE))


def test_shape_mismatch_raises(ops_backend):
    cache = torch.zeros(2, 4, 1, 2, device=DEVICE)
    with pytest.raises(InvalidArgumentError):
        write_kv(torch.ones(2, 1, 3, device=DEVICE), torch.ones(2, 1, 2, device=DEVICE), cache,
                 cache.clone(), torch.tensor([0, 1], device=DEVICE))
    x = torch.ones(2, 1, 2, device=DEVICE)
    with pytest.raises(InvalidArgumentError, match="int32 or int64"):  # (was truncated)
        write_kv(x, x, cache, cache.clone(), torch.tensor([0.0, 1.5], device=DEVICE))
    latent, rope = torch.ones(3, 8, device=DEVICE), torch.ones(3, 4, device=DEVICE)
    entries = torch.zeros(2, 4, 12, device=DEVICE)
    slots = torch.tensor([0, 1, 2], device=DEVICE)
    for lat, rp in ((latent[0], rope), (latent, rope[:2]), (latent, rope[None]),
                    (latent[None], None)):
        with pytest.raises(InvalidArgumentError, match=r"need \[T, R\] and \[T, P\]"):
            write_mla_latent(lat, rp, entries, slots)


@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2],
)
def test_fill_nan_pages_only(dtype, ops_backend):
    cache = torch.zeros(4, 2, 3, device=DEVICE).to(dtype)
    fill_nan_(cache, [1, 3])
    nan = cache.float().isnan().cpu()
    assert bool(nan[1].all()) and bool(nan[3].all())
    assert not bool(nan[0].any()) and not bool(nan[2].any())


def test_fill_nan_refuses_integer_caches_and_bad_pages(ops_backend):
    with pytest.raises(InvalidArgumentError):
        fill_nan_(torch.zeros(2, 2, dtype=torch.int32, device=DEVICE))
    with pytest.raises(InvalidArgumentError):
        fill_nan_(torch.zeros(2, 2, device=DEVICE), [2])
