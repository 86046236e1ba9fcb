"""Absorbed paged MLA against naive (decompressed) float64 MLA, every latent format."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest

torch = pytest.importorskip("torch")

from dense_reference import (  # noqa: E402
    decode_ds_mla_entry,
    dense_mask,
    dense_mla,
    place_blocks,
    slots_of,
    test_device,
)
from kernel_cases import EXACT, INTERPRETER_WARNINGS, only_on_gpu  # noqa: E402

from pagedkv.errors import InvalidArgumentError, MetadataError  # noqa: E402
from pagedkv.ops import (  # noqa: E402
    Mask,
    absorb_query,
    fill_nan_,
    paged_mla,
    paged_mla_latent,
    project_output,
    write_mla_latent,
)

DEVICE = test_device()
pytestmark = INTERPRETER_WARNINGS
RANK, ROPE, HEADS, D_NOPE, D_V = 128, 8, 4, 8, 6
FP8_SCALE = 2.0**-6  # exact in float32
STORAGE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn,
           "fp8_ds_mla": torch.uint8}


@dataclass
class MLAScenario:
    cache: torch.Tensor
    table: torch.Tensor
    latents: list[torch.Tensor]  # per sequence [seq_len, RANK + rope], as the cache holds them
    exact: list[torch.Tensor]  # the same before storage rounding


def stored_values(cache, table_row, seq_len, block_size, fmt, rank) -> torch.Tensor:
    """What the cache holds for one sequence, decoded by the test itself."""
    host = cache.cpu()
    rows = []
    for slot in slots_of(table_row.cpu(), range(seq_len), block_size):
        entry = host[slot // block_size, slot % block_size]
        if fmt == "fp8_ds_mla":
            latent, rope = decode_ds_mla_entry(bytes(entry.tolist()), rank)
            rows.append(torch.tensor(latent + rope, dtype=torch.float64))
        elif fmt == "fp8":
            rows.append(entry.double() * FP8_SCALE)
        else:
            rows.append(entry.double())
    return torch.stack(rows) if rows else torch.zeros(0, cache.shape[-1], dtype=torch.float64)


def make_cache(seq_lens, block_size, fmt, *, rope=ROPE, rank=RANK, seed=0) -> MLAScenario:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(needed) + 2
    table = place_blocks(needed, num_blocks, rng)
    width = rank + 4 * (rank // 128) + 2 * rope if fmt == "fp8_ds_mla" else rank + rope
    cache = fill_nan_(torch.empty(num_blocks, block_size, width, dtype=STORAGE[fmt], device=DEVICE))
    exact, slots = [], []
    for b, s in enumerate(seq_lens):
        exact.append(torch.randn(s, rank + rope, generator=gen) * 0.5)
        slots += slots_of(table[b], range(s), block_size)
    allv = torch.cat(exact)
    write_mla_latent(allv[:, :rank].to(DEVICE), allv[:, rank:].to(DEVICE) if rope else None, cache,
                     torch.tensor(slots, device=DEVICE),
                     scale=FP8_SCALE if fmt == "fp8" else None)
    stored = [stored_values(cache, table[b], s, block_size, fmt, rank) for b, s in enumerate(seq_lens)]
    return MLAScenario(cache, table.to(DEVICE), stored, exact)


def weights(seed=0, rank=RANK):
    gen = torch.Generator().manual_seed(100 + seed)
    w_uk = torch.randn(HEADS, D_NOPE, rank, generator=gen) / math.sqrt(rank)
    w_uv = torch.randn(HEADS, D_V, rank, generator=gen) / math.sqrt(rank)
    return w_uk.to(DEVICE), w_uv.to(DEVICE)


def naive(q_nope, q_rope, latents, seqs, w_uk, w_uv, mask: Mask, rank=RANK):
    out = torch.zeros(q_nope.shape[0], HEADS, D_V, dtype=torch.float64)
    start = 0
    for b, (seq_len, q_len) in enumerate(seqs):
        m = dense_mask(seq_len, q_len, causal=mask.causal, draft_block=mask.draft_block)
        rows = slice(start, start + q_len)
        lat = latents[b]
        out[rows] = dense_mla(q_nope[rows], None if q_rope is None else q_rope[rows],
                              lat[:, :rank], lat[:, rank:], w_uk, w_uv, m,
                              scale=1 / math.sqrt(D_NOPE + (0 if q_rope is None else q_rope.shape[-1])))
        start += q_len
    return out


def queries(seqs, rope=ROPE, seed=0):
    gen = torch.Generator().manual_seed(200 + seed)
    rows = sum(q for _, q in seqs)
    q_nope = torch.randn(rows, HEADS, D_NOPE, generator=gen).to(DEVICE)
    q_rope = torch.randn(rows, HEADS, rope, generator=gen).to(DEVICE) if rope else None
    q_lens = [q for _, q in seqs]
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor([s for s, _ in seqs], dtype=torch.int32, device=DEVICE)
    return q_nope, q_rope, qsl, seq_lens


CTX = [0, 5, 17, 3, 40, 1, 9, 0, 22, 2, 63, 8, 0, 11, 30, 4]
ALL_LENGTHS = [(CTX[i] + i + 1, i + 1) for i in range(16)]  # query lengths 1..16
DRAFT_LENGTHS = [(CTX[i] + 7 * (1 + i % 2), 7 * (1 + i % 2)) for i in range(6)]
CASES = {
    "causal": (Mask(), ALL_LENGTHS),
    "bidirectional": (Mask(causal=False), ALL_LENGTHS),
    "draft_block_7": (Mask(causal=False, draft_block=7), DRAFT_LENGTHS),
}


@pytest.mark.parametrize("fmt", sorted(STORAGE))
@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("case", sorted(CASES))
def test_absorbed_mla_matches_naive_mla(fmt, block_size, case, ops_backend):
    only_on_gpu(ops_backend, keep=fmt in ("bf16", "fp16") and (block_size == 16 or fmt == "fp16"),
                why="fp8 loads and the full grid run on a GPU")
    mask, seqs = CASES[case]
    sc = make_cache([s for s, _ in seqs], block_size, fmt, seed=block_size)
    w_uk, w_uv = weights()
    q_nope, q_rope, qsl, seq_lens = queries(seqs)
    got = paged_mla(q_nope, q_rope, sc.cache, qsl, seq_lens, sc.table, w_uk=w_uk, w_uv=w_uv,
                    mask=mask, latent_scale=FP8_SCALE if fmt == "fp8" else None,
                    compute_dtype=torch.float64, out_dtype=torch.float64)
    assert tuple(got.shape) == (q_nope.shape[0], HEADS, D_V)
    assert not bool(got.isnan().any())
    want = naive(q_nope, q_rope, sc.latents, seqs, w_uk, w_uv, mask)
    torch.testing.assert_close(got.cpu(), want, **EXACT[ops_backend])
    # and close to attention over the unrounded latent, within the storage format's error
    exact = naive(q_nope, q_rope, sc.exact, seqs, w_uk, w_uv, mask)
    tol = {"bf16": 0.01, "fp16": 0.002, "fp8": 0.05, "fp8_ds_mla": 0.05}[fmt]
    assert float((got.cpu() - exact).abs().max()) < tol


def test_nope_target_geometry_without_rope(ops_backend):
    seqs = [(12, 1), (5, 5), (30, 8)]
    sc = make_cache([s for s, _ in seqs], 16, "bf16", rope=0, seed=3)
    w_uk, w_uv = weights(3)
    q_nope, _, qsl, seq_lens = queries(seqs, rope=0, seed=3)
    got = paged_mla(q_nope, None, sc.cache, qsl, seq_lens, sc.table, w_uk=w_uk, w_uv=w_uv,
                    compute_dtype=torch.float64, out_dtype=torch.float64)
    torch.testing.assert_close(got.cpu(), naive(q_nope, None, sc.latents, seqs, w_uk, w_uv, Mask()),
                               **EXACT[ops_backend])


def test_latent_op_plus_projection_is_the_full_op(ops_backend):
    seqs = [(9, 4), (3, 1)]
    sc = make_cache([s for s, _ in seqs], 4, "bf16", seed=4)
    w_uk, w_uv = weights(4)
    q_nope, q_rope, qsl, seq_lens = queries(seqs, seed=4)
    scale = 0.2
    o_latent = paged_mla_latent(absorb_query(q_nope, w_uk), q_rope, sc.cache, qsl, seq_lens,
                                sc.table, scale=scale)
    assert tuple(o_latent.shape) == (5, HEADS, RANK)
    full = paged_mla(q_nope, q_rope, sc.cache, qsl, seq_lens, sc.table, w_uk=w_uk, w_uv=w_uv,
                     scale=scale)
    torch.testing.assert_close(project_output(o_latent, w_uv), full, rtol=1e-5, atol=1e-5)


def test_float32_default_is_close_to_float64(ops_backend):
    mask, seqs = CASES["causal"]
    sc = make_cache([s for s, _ in seqs], 16, "bf16", seed=5)
    w_uk, w_uv = weights(5)
    q_nope, q_rope, qsl, seq_lens = queries(seqs, seed=5)
    got = paged_mla(q_nope.bfloat16(), q_rope.bfloat16(), sc.cache, qsl, seq_lens, sc.table,
                    w_uk=w_uk, w_uv=w_uv)
    assert got.dtype == torch.bfloat16
    want = naive(q_nope.bfloat16(), q_rope.bfloat16(), sc.latents, seqs, w_uk, w_uv, mask)
    torch.testing.assert_close(got.cpu().double(), want, rtol=2e-2, atol=2e-2)


def test_bad_calls_raise(ops_backend):
    seqs = [(9, 4)]
    w_uk, w_uv = weights()
    sc = make_cache([9], 4, "bf16")
    q_nope, q_rope, qsl, seq_lens = queries(seqs)
    with pytest.raises(InvalidArgumentError, match="rope"):
        paged_mla(q_nope, q_rope[..., :4], sc.cache, qsl, seq_lens, sc.table, w_uk=w_uk, w_uv=w_uv)
    with pytest.raises(InvalidArgumentError, match="scale"):
        paged_mla(q_nope, q_rope, sc.cache, qsl, seq_lens, sc.table, w_uk=w_uk, w_uv=w_uv,
                  latent_scale=1.0)
    with pytest.raises(InvalidArgumentError, match="W_UK"):
        absorb_query(q_nope, w_uk[:, :3])
    q_latent = absorb_query(q_nope, w_uk)
    for ql, qr in ((q_latent[0], q_rope), (q_latent, q_rope[0]), (q_latent[None], q_rope)):
        with pytest.raises(InvalidArgumentError, match=r"need \[T, H, R\]"):
            paged_mla_latent(ql, qr, sc.cache, qsl, seq_lens, sc.table, scale=0.1)
    with pytest.raises(MetadataError, match="int32 or int64"):
        paged_mla_latent(q_latent, q_rope, sc.cache, qsl.float(), seq_lens, sc.table, scale=0.1)
    ds = make_cache([9], 4, "fp8_ds_mla")
    with pytest.raises(InvalidArgumentError, match="fp8_ds_mla"):
        paged_mla(q_nope, q_rope, ds.cache, qsl, seq_lens, ds.table, w_uk=w_uk, w_uv=w_uv,
                  latent_scale=1.0)


LAUNCHES = [  # (cache block size, mask case, rope width, kernel launch overrides)
    (16, "causal", 16, dict(block_m=16, block_n=16, dv_splits=2, splits=3)),  # page tiles, 2 slices
    (64, "draft_block_7", ROPE, dict(block_m=32, block_n=32, dv_splits=4, splits=1)),
    (16, "bidirectional", ROPE, dict(block_m=64, block_n=32, dv_splits=1, splits=2)),  # per-key ids
    (16, "draft_block_7", 16, dict(block_m=32, block_n=16, dv_splits=1, splits=2, swap=True)),
    (16, "causal", ROPE, dict(block_m=16, block_n=16, dv_splits=2, splits=1, swap=True, tma=False)),
    # num_stages 1 with automatic TMA choice: the pointer kernel (unpipelined TMA is refused)
    (16, "draft_block_7", ROPE, dict(block_m=32, block_n=16, splits=2, num_stages=1)),
]


@pytest.mark.parametrize("block_size,case,rope,launch", LAUNCHES)
def test_triton_launch_configs_match_naive_mla(block_size, case, rope, launch):
    """Row tiles, output-column slices, page-contiguous and per-key tiles, KV splits: each
    launch computes the same attention (float32 queries, so the kernel's exact path)."""
    pytest.importorskip("triton")
    from pagedkv.ops.triton.mla import paged_mla_latent as triton_mla_latent

    mask, seqs = CASES[case]
    seqs = seqs[:8]
    sc = make_cache([s for s, _ in seqs], block_size, "bf16", rope=rope, seed=7 + block_size)
    w_uk, w_uv = weights(7)
    q_nope, q_rope, qsl, seq_lens = queries(seqs, rope=rope, seed=7)
    o_latent = triton_mla_latent(absorb_query(q_nope, w_uk), q_rope, sc.cache, qsl, seq_lens,
                                 sc.table, scale=1 / math.sqrt(D_NOPE + rope), mask=mask, **launch)
    got = project_output(o_latent, w_uv).double().cpu()
    assert not bool(got.isnan().any())
    torch.testing.assert_close(got, naive(q_nope, q_rope, sc.latents, seqs, w_uk, w_uv, mask),
                               **EXACT["triton"])


def test_triton_rejects_unpipelined_tma_tiles():
    pytest.importorskip("triton")
    from pagedkv.ops.triton.mla import paged_mla_latent as triton_mla_latent

    sc = make_cache([9], 16, "bf16")
    q_nope, q_rope, qsl, seq_lens = queries([(9, 1)])
    w_uk, _ = weights()
    with pytest.raises(InvalidArgumentError, match="num_stages >= 2"):
        triton_mla_latent(absorb_query(q_nope, w_uk), q_rope, sc.cache, qsl, seq_lens, sc.table,
                          scale=0.3, block_n=16, tma=True, num_stages=1)


def test_triton_rejects_a_bad_column_split():
    pytest.importorskip("triton")
    from pagedkv.ops.triton.mla import paged_mla_latent as triton_mla_latent

    sc = make_cache([9], 16, "bf16")
    q_nope, q_rope, qsl, seq_lens = queries([(9, 1)])
    w_uk, _ = weights()
    with pytest.raises(InvalidArgumentError, match="dv_splits"):
        triton_mla_latent(absorb_query(q_nope, w_uk), q_rope, sc.cache, qsl, seq_lens, sc.table,
                          scale=0.3, dv_splits=3)


BF16_LAUNCHES = [  # (mask case, launch overrides); heads 16, rank 512 + 64, block size 64
    ("causal", {}),  # the default: the Gluon kernels on Hopper, else the Triton ones
    ("causal", dict(gluon=False)),  # 64-row TMA tiles
    ("draft_block_7", dict(gluon=False)),
    ("causal", dict(block_m=16, swap=True, num_stages=3)),  # the decode tiles, transposed
]


@pytest.mark.parametrize("case,launch", BF16_LAUNCHES)
def test_triton_bf16_queries_match_float64_latent_attention(case, launch):
    """The tensor-core paths (bf16 queries: what an engine runs; the tests above use float32
    queries and so the kernel's exact path) against float64 attention over the latent."""
    pytest.importorskip("triton")
    if DEVICE.type != "cuda":
        pytest.skip("bf16 tensor-core kernels: a GPU run covers this case")
    from pagedkv.ops.triton.mla import paged_mla_latent as triton_mla_latent

    heads, rank, rope = 16, 512, 64
    mask, seqs = CASES[case]
    seqs = seqs[:8]
    sc = make_cache([s for s, _ in seqs], 64, "bf16", rope=rope, rank=rank, seed=11)
    gen = torch.Generator().manual_seed(12)
    rows = sum(q for _, q in seqs)
    q_lat = (torch.randn(rows, heads, rank, generator=gen) / 8).bfloat16()
    q_rope = (torch.randn(rows, heads, rope, generator=gen) / 8).bfloat16()
    _, _, qsl, seq_lens = queries(seqs, rope=rope)
    scale = 1 / math.sqrt(192)
    got = triton_mla_latent(q_lat.to(DEVICE), q_rope.to(DEVICE), sc.cache, qsl, seq_lens,
                            sc.table, scale=scale, mask=mask, **launch).double().cpu()
    assert not bool(got.isnan().any())
    eye = torch.eye(rank, dtype=torch.float64).expand(heads, rank, rank)
    start = 0
    for b, (seq_len, q_len) in enumerate(seqs):
        m = dense_mask(seq_len, q_len, causal=mask.causal, draft_block=mask.draft_block)
        lat = sc.latents[b]
        want = dense_mla(q_lat[start:start + q_len], q_rope[start:start + q_len], lat[:, :rank],
                         lat[:, rank:], eye, eye, m, scale=scale)
        torch.testing.assert_close(got[start:start + q_len], want, rtol=1e-2, atol=1e-2)
        start += q_len


def test_triton_refuses_a_rope_query_on_another_device():
    """Every tensor of a Triton call on one device: a rope query elsewhere (the host's while
    the rest is on the GPU, another GPU's) would reach the kernel as a foreign pointer."""
    pytest.importorskip("triton")
    from pagedkv.ops.triton.mla import paged_mla_latent as triton_mla_latent

    sc = make_cache([9], 16, "bf16")
    q_nope, q_rope, qsl, seq_lens = queries([(9, 1)])
    w_uk, _ = weights()
    elsewhere = "cpu" if q_rope.device.type == "cuda" else "meta"
    with pytest.raises(InvalidArgumentError, match="on one device"):
        triton_mla_latent(absorb_query(q_nope, w_uk), q_rope.to(elsewhere), sc.cache, qsl,
                          seq_lens, sc.table, scale=0.3)
