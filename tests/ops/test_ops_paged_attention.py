"""Paged GQA/MHA attention against float64 dense attention with explicit masks."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest

torch = pytest.importorskip("torch")

from dense_reference import (  # noqa: E402
    dense_attention,
    dense_mask,
    place_blocks,
    slots_of,
    test_device,
)
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from kernel_cases import EXACT, INTERPRETER_WARNINGS, only_on_gpu  # noqa: E402

from pagedkv.errors import InvalidArgumentError, MetadataError  # noqa: E402
from pagedkv.kvspec import Attention  # noqa: E402
from pagedkv.ops import Mask, fill_nan_, paged_attention, write_kv  # noqa: E402

DEVICE = test_device()
pytestmark = INTERPRETER_WARNINGS
PAD_ROWS = 2  # query rows past query_start_loc[-1]


@dataclass
class Scenario:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    qsl: torch.Tensor
    seq_lens: torch.Tensor
    table: torch.Tensor
    keys: list[torch.Tensor]  # per sequence, every position, as stored (dtype-rounded)
    values: list[torch.Tensor]
    seqs: list[tuple[int, int]]  # (seq_len, q_len); a trailing (0, 0) is a padding batch row


def make_scenario(
    seqs, block_size, heads, kv_heads, *, dim=8, vdim=None, dtype=torch.bfloat16, seed=0
) -> Scenario:
    """NaN-filled caches, blocks from a shuffled free list, every position written once."""
    vdim = vdim or dim
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-s // block_size) for s, _ in seqs]
    num_blocks = sum(needed) + 3
    table = place_blocks(needed, num_blocks, rng)
    k_cache = fill_nan_(torch.empty(num_blocks, block_size, kv_heads, dim, dtype=dtype, device=DEVICE))
    v_cache = fill_nan_(torch.empty(num_blocks, block_size, kv_heads, vdim, dtype=dtype, device=DEVICE))
    keys, values, slots = [], [], []
    for b, (seq_len, _) in enumerate(seqs):
        keys.append(torch.randn(seq_len, kv_heads, dim, generator=gen).to(dtype))
        values.append(torch.randn(seq_len, kv_heads, vdim, generator=gen).to(dtype))
        slots += slots_of(table[b], range(seq_len), block_size)
    write_kv(torch.cat(keys).to(DEVICE), torch.cat(values).to(DEVICE), k_cache, v_cache,
             torch.tensor(slots, dtype=torch.int64, device=DEVICE))
    q_lens = [q for _, q in seqs]
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32)
    q = torch.randn(sum(q_lens) + PAD_ROWS, heads, dim, generator=gen)
    return Scenario(q.to(DEVICE), k_cache, v_cache, qsl.to(DEVICE),
                    torch.tensor([s for s, _ in seqs], dtype=torch.int32, device=DEVICE),
                    table.to(DEVICE), keys, values, list(seqs))


def reference(sc: Scenario, mask: Mask, *, scale, soft_cap=None, sinks=None) -> torch.Tensor:
    out = torch.zeros(sc.q.shape[0], sc.q.shape[1], sc.values[0].shape[-1], dtype=torch.float64)
    start = 0
    for b, (seq_len, q_len) in enumerate(sc.seqs):
        explicit = dense_mask(seq_len, q_len, causal=mask.causal, draft_block=mask.draft_block,
                              window=mask.window, chunk=mask.chunk)
        out[start : start + q_len] = dense_attention(
            sc.q[start : start + q_len], sc.keys[b], sc.values[b], explicit,
            scale=scale, soft_cap=soft_cap, sinks=sinks)
        start += q_len
    return out


def run(sc: Scenario, mask: Mask, **kw) -> torch.Tensor:
    if kw.get("compute_dtype") == torch.float64:
        kw["out_dtype"] = torch.float64  # keep the float64 result for tight comparisons
    return paged_attention(sc.q, sc.k_cache, sc.v_cache, sc.qsl, sc.seq_lens, sc.table,
                           mask=mask, **kw)


# decode (seq 1 and long), full prefill, chunked prefill, short prefill, padding batch row
MIXED = [(1, 1), (37, 1), (20, 20), (70, 13), (9, 3), (0, 0)]
# non-causal draft blocks of 4 rows: query lengths are multiples of 4
DRAFT = [(4, 4), (23, 8), (70, 4), (0, 0)]
MASKS = {
    "causal": (Mask(), MIXED),
    "window": (Mask(window=5), MIXED),
    "chunk": (Mask(chunk=8), MIXED),
    "draft_block": (Mask(causal=False, draft_block=4), DRAFT),
    "bidirectional": (Mask(causal=False), MIXED),
}


@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("kind", sorted(MASKS))
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (4, 2), (4, 1)])
def test_every_mask_kind_matches_dense_reference(block_size, kind, heads, kv_heads, ops_backend):
    only_on_gpu(ops_backend, keep=(heads, kv_heads) == (4, 2) and (block_size == 16 or kind == "causal"))
    mask, seqs = MASKS[kind]
    sc = make_scenario(seqs, block_size, heads, kv_heads, seed=block_size + heads)
    scale = 1 / math.sqrt(8)
    got = run(sc, mask, compute_dtype=torch.float64)
    assert not bool(got.isnan().any())
    want = reference(sc, mask, scale=scale)
    torch.testing.assert_close(got.cpu().double(), want, **EXACT[ops_backend])
    assert bool((got[-PAD_ROWS:] == 0).all())  # padding rows are never computed


def test_masks_differ_from_each_other(ops_backend):
    only_on_gpu(ops_backend)
    # guards the test above: the mask kinds give different outputs on the same scenario
    sc = make_scenario(MIXED[:-1], 4, 2, 1, seed=9)
    outs = {k: run(sc, m) for k, (m, seqs) in MASKS.items() if seqs is MIXED}
    names = sorted(outs)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            assert not torch.allclose(outs[a], outs[b]), (a, b)


@pytest.mark.parametrize("block_size", [1, 16])
def test_sinks_soft_cap_scale_and_value_dim(block_size, ops_backend):
    only_on_gpu(ops_backend, keep=block_size == 16)
    # gpt-oss-like: sliding window with per-head sinks; plus Gemma-like soft-cap, custom scale
    sc = make_scenario(MIXED, block_size, 4, 2, dim=8, vdim=6, dtype=torch.float16, seed=4)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], device=DEVICE)
    mask = Mask(window=6)
    got = run(sc, mask, scale=0.3, soft_cap=2.5, sinks=sinks, compute_dtype=torch.float64)
    want = reference(sc, mask, scale=0.3, soft_cap=2.5, sinks=sinks)
    torch.testing.assert_close(got.cpu().double(), want, **EXACT[ops_backend])
    plain = run(sc, mask, scale=0.3, compute_dtype=torch.float64)
    assert not torch.allclose(plain, got)  # sinks and soft-cap changed something


def test_default_float32_compute_is_close_to_float64_reference(ops_backend):
    sc = make_scenario(MIXED, 16, 4, 2, seed=8)
    got = run(sc, Mask())
    assert got.dtype == sc.q.dtype == torch.float32
    torch.testing.assert_close(got.cpu().double(), reference(sc, Mask(), scale=8**-0.5),
                               rtol=2e-5, atol=2e-5)


def test_fp8_kv_cache_reads_with_its_scales(ops_backend):
    only_on_gpu(ops_backend, why="it decodes fp8 loads wrongly")
    seqs = [(30, 5), (7, 1)]
    sc = make_scenario(seqs, 16, 2, 1, dtype=torch.float32, seed=6)
    k_scale, v_scale = 2.0**-7, 2.0**-6  # exact in float32, so both sides scale alike
    k8 = torch.empty(sc.k_cache.shape, dtype=torch.float8_e4m3fn, device=DEVICE)
    v8 = torch.empty(sc.v_cache.shape, dtype=torch.float8_e4m3fn, device=DEVICE)
    fill_nan_(k8), fill_nan_(v8)
    slots = []
    for b, (seq_len, _) in enumerate(seqs):
        slots += slots_of(sc.table[b].cpu(), range(seq_len), 16)
    write_kv(torch.cat(sc.keys).to(DEVICE), torch.cat(sc.values).to(DEVICE), k8, v8,
             torch.tensor(slots, device=DEVICE), k_scale=k_scale, v_scale=v_scale)
    got = paged_attention(sc.q, k8, v8, sc.qsl, sc.seq_lens, sc.table, k_scale=k_scale,
                          v_scale=v_scale, compute_dtype=torch.float64, out_dtype=torch.float64)
    # exact against the dequantized values (torch's fp8 decode x scale) ...
    sc8 = Scenario(**{**sc.__dict__})
    sc8.keys = [(k / k_scale).to(torch.float8_e4m3fn).double() * k_scale for k in sc.keys]
    sc8.values = [(v / v_scale).to(torch.float8_e4m3fn).double() * v_scale for v in sc.values]
    torch.testing.assert_close(got.cpu().double(), reference(sc8, Mask(), scale=8**-0.5),
                               **EXACT[ops_backend])
    # ... and near the unquantized attention, within what 3 mantissa bits allow
    exact = reference(sc, Mask(), scale=8**-0.5)
    assert float((got.cpu().double() - exact).abs().max()) < 0.1


def test_out_of_window_blocks_are_never_read(ops_backend):
    block_size, window = 4, 5
    seqs = [(60, 2), (13, 1)]
    sc = make_scenario(seqs, block_size, 2, 1, seed=2)
    mask = Mask(window=window)
    before = run(sc, mask)
    # free every block wholly before the first query row's window: NaN it, drop its entry
    first_seen = 60 - 2 - window + 1
    for j in range(first_seen // block_size):
        fill_nan_(sc.k_cache, [int(sc.table[0, j])])
        fill_nan_(sc.v_cache, [int(sc.table[0, j])])
        sc.table[0, j] = -1
    after = run(sc, mask)
    assert torch.equal(before, after)
    assert not bool(after.isnan().any())
    with pytest.raises(MetadataError, match="block id -1"):
        run(sc, Mask())  # a causal read of the same table must refuse the freed entries


def test_rows_without_a_position_see_nothing(ops_backend):
    # position-offset layers: 5 query rows, but the group has only 3 positions
    sc = make_scenario([(3, 3)], 16, 2, 2, seed=1)
    sc.q = torch.cat([torch.randn(2, 2, 8, device=DEVICE), sc.q])
    sc.qsl = torch.tensor([0, 5], dtype=torch.int32, device=DEVICE)
    sc.seqs = [(3, 5)]
    got = run(sc, Mask(), compute_dtype=torch.float64)
    assert bool((got[:2] == 0).all()) and not bool(got.isnan().any())
    torch.testing.assert_close(got.cpu().double(), reference(sc, Mask(), scale=8**-0.5))


def test_nan_in_a_read_slot_shows_up(ops_backend):
    # the debug aid works: an unwritten (NaN) slot that is read poisons the output
    sc = make_scenario([(10, 2)], 4, 2, 2, seed=3)
    fill_nan_(sc.v_cache, [int(sc.table[0, 1])])  # positions 4..7
    got = run(sc, Mask())
    assert bool(got[:2].isnan().all())


SEQ = st.tuples(st.integers(0, 40), st.integers(1, 9))  # (context, new tokens)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seqs=st.lists(SEQ, min_size=1, max_size=4),
    block_size=st.sampled_from([1, 16, 64]),
    gqa=st.sampled_from([(1, 1), (3, 1), (4, 2), (6, 3)]),
    kind=st.sampled_from(["causal", "window", "chunk", "draft", "bidirectional"]),
    extra=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
def test_property_random_batches(seqs, block_size, gqa, kind, extra, seed, ops_backend):
    only_on_gpu(ops_backend, why="the exhaustive cases above cover it")
    if kind == "draft":
        seqs = [(c, 3 * ((q + 2) // 3)) for c, q in seqs]
    mask = {"causal": Mask(), "window": Mask(window=extra), "chunk": Mask(chunk=extra),
            "draft": Mask(causal=False, draft_block=3), "bidirectional": Mask(causal=False)}[kind]
    sc = make_scenario([(c + q, q) for c, q in seqs], block_size, gqa[0], gqa[1], dim=4, seed=seed)
    got = run(sc, mask, compute_dtype=torch.float64)
    assert not bool(got.isnan().any())
    torch.testing.assert_close(got.cpu().double(), reference(sc, mask, scale=0.5),
                               **EXACT[ops_backend])


def test_mask_from_layer_attention_and_per_call_override(ops_backend):
    drafter = Attention(causal=False, draft_block=7)
    assert Mask.of(drafter) == Mask(causal=False, draft_block=7)
    assert Mask.of(drafter, causal=True) == Mask()
    assert Mask.of(Attention(window=128, sinks=True)) == Mask(window=128)


@pytest.mark.parametrize(
    "kwargs",
    [dict(causal=True, draft_block=3), dict(window=4, chunk=8), dict(window=0), dict(chunk=True)],
)
def test_bad_masks_raise(kwargs, ops_backend):
    with pytest.raises(InvalidArgumentError):
        Mask(**kwargs)


def test_bad_calls_raise(ops_backend):
    sc = make_scenario([(8, 3)], 4, 4, 2, seed=0)
    with pytest.raises(InvalidArgumentError, match="multiple"):
        run(sc, Mask(causal=False, draft_block=2))
    with pytest.raises(InvalidArgumentError, match="query heads"):
        paged_attention(sc.q[:, :3], sc.k_cache, sc.v_cache, sc.qsl, sc.seq_lens, sc.table)
    with pytest.raises(InvalidArgumentError, match="sinks"):
        run(sc, Mask(), sinks=torch.zeros(2, device=DEVICE))
    with pytest.raises(MetadataError, match="columns"):
        paged_attention(sc.q, sc.k_cache, sc.v_cache, sc.qsl, sc.seq_lens, sc.table[:, :1])
    with pytest.raises(MetadataError, match="query_start_loc"):
        paged_attention(sc.q, sc.k_cache, sc.v_cache, sc.qsl[:1], sc.seq_lens, sc.table)
    # index tensors of another dtype or rank: one error, not a truncation or a kernel's
    # type error (the Triton backend took float ones to the kernel)
    for bad in ("qsl", "seq_lens", "table"):
        args = {"qsl": sc.qsl, "seq_lens": sc.seq_lens, "table": sc.table}
        for broken in (args[bad].float(), args[bad][0]):
            args[bad] = broken
            with pytest.raises(MetadataError, match="int32 or int64"):
                paged_attention(sc.q, sc.k_cache, sc.v_cache, args["qsl"], args["seq_lens"],
                                args["table"])


def test_sequence_with_no_position_yet_outputs_zeros_even_with_sinks(ops_backend):
    # an EAGLE-style layer on a request's first token: one query row, zero positions
    sc = make_scenario([(0, 1), (6, 2)], 4, 2, 1, seed=12)
    sinks = torch.tensor([1.0, -0.5], device=DEVICE)
    got = run(sc, Mask(), sinks=sinks, compute_dtype=torch.float64)
    assert bool((got[0] == 0).all()) and not bool(got.isnan().any())
    torch.testing.assert_close(got.cpu().double(), reference(sc, Mask(), scale=8**-0.5, sinks=sinks))


@pytest.mark.parametrize("splits,swap,fused,heads_first,block_m", [
    (1, False, None, True, None), (3, False, False, False, None), (3, True, True, True, None),
    (1, True, None, False, 16), (3, False, True, False, 16), (3, False, False, True, 16)])
def test_triton_launch_overrides_and_no_host_read_path(splits, swap, fused, heads_first, block_m,
                                                       ops_backend):
    # the decode kernel with one split writes the output itself (sinks, padding rows), with
    # several the last split merges them (fused) or the combine launch does; swap = keys on
    # the MMA's M side; bounds given = no host validation or flag read
    if ops_backend != "triton":
        pytest.skip("launch overrides exist on the triton backend only")
    from pagedkv.ops.triton.attention import paged_attention as triton_attention

    seqs = [(37, 1), (9, 3), (0, 0), (70, 2)]
    sc = make_scenario(seqs, 16, 4, 2, seed=20 + splits)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], device=DEVICE)
    mask = Mask(window=30)
    sc.q[-PAD_ROWS:] = float("nan")  # padding rows are never read
    got = triton_attention(sc.q, sc.k_cache, sc.v_cache, sc.qsl, sc.seq_lens, sc.table,
                           mask=mask, soft_cap=3.0, sinks=sinks, max_query_len=3,
                           max_seq_len=70, splits=splits, block_n=16, swap=swap, fused=fused,
                           heads_first=heads_first, block_m=block_m)
    want = reference(sc, mask, scale=8**-0.5, soft_cap=3.0, sinks=sinks)
    torch.testing.assert_close(got.cpu().double(), want, **EXACT["triton"])
    assert bool((got[-PAD_ROWS:] == 0).all())


def fp8_caches(sc, seqs, dtype, k_scale, v_scale):
    """NaN-filled fp8 K/V caches of the scenario's shape holding its keys and values (block
    size 16), written through the slot mapping with per-tensor scales."""
    k8 = fill_nan_(torch.empty(sc.k_cache.shape, dtype=dtype, device=DEVICE))
    v8 = fill_nan_(torch.empty(sc.v_cache.shape, dtype=dtype, device=DEVICE))
    slots = []
    for b, (seq_len, _) in enumerate(seqs):
        slots += slots_of(sc.table[b].cpu(), range(seq_len), 16)
    write_kv(torch.cat(sc.keys).to(DEVICE), torch.cat(sc.values).to(DEVICE), k8, v8,
             torch.tensor(slots, device=DEVICE), k_scale=k_scale, v_scale=v_scale)
    return k8, v8


def test_bf16_queries_over_fp8_caches(ops_backend):
    # the fast path: fp8 K/V tiles widened once, 16-bit dot products, float32 accumulation
    only_on_gpu(ops_backend, why="it decodes fp8 loads wrongly")
    seqs = [(300, 1), (77, 1), (129, 7)]
    sc = make_scenario(seqs, 16, 8, 2, dim=64, dtype=torch.float32, seed=31)
    k_scale, v_scale = 2.0**-6, 2.0**-5
    k8, v8 = fp8_caches(sc, seqs, torch.float8_e4m3fn, k_scale, v_scale)
    q16 = sc.q.to(torch.bfloat16)
    got = paged_attention(q16, k8, v8, sc.qsl, sc.seq_lens, sc.table, k_scale=k_scale,
                          v_scale=v_scale)
    assert got.dtype == torch.bfloat16
    sc8 = Scenario(**{**sc.__dict__})
    sc8.q = q16.double()
    sc8.keys = [(k / k_scale).to(torch.float8_e4m3fn).double() * k_scale for k in sc.keys]
    sc8.values = [(v / v_scale).to(torch.float8_e4m3fn).double() * v_scale for v in sc.values]
    want = reference(sc8, Mask(), scale=64**-0.5)
    err = float((got.cpu().double() - want).norm() / want.norm())
    assert err < 1e-2, err  # bf16 output and 16-bit probabilities


@pytest.mark.parametrize("q_len", [1, 7])
@pytest.mark.parametrize("swap,fused,block_m", [(False, True, None), (True, True, None),
                                                (True, False, None), (False, False, 16),
                                                (False, True, 16)])
def test_triton_bf16_decode_variants_on_the_benchmark_geometry(q_len, swap, fused, block_m,
                                                               ops_backend):
    # the variants the benchmark sweeps, with bf16 tensor-core dots: head dim 128, 4 query
    # heads per KV head, decode rows or a 7-token non-causal draft block (28-row tiles)
    if ops_backend != "triton":
        pytest.skip("launch overrides exist on the triton backend only")
    only_on_gpu(ops_backend, why="the bf16 dot path runs on a GPU only")
    from pagedkv.ops.triton.attention import paged_attention as triton_attention

    seqs = [(700, q_len), (q_len + 40, q_len), (333, q_len)]
    sc = make_scenario(seqs, 16, 8, 2, dim=128, seed=40 + q_len + 2 * swap + fused + 5 * bool(block_m))
    mask = Mask() if q_len == 1 else Mask(causal=False, draft_block=q_len)
    got = triton_attention(sc.q, sc.k_cache, sc.v_cache, sc.qsl, sc.seq_lens, sc.table,
                           mask=mask, max_query_len=q_len, max_seq_len=700, splits=3,
                           swap=swap, fused=fused, block_m=block_m)
    want = reference(sc, mask, scale=128**-0.5)
    err = float((got.cpu().double() - want).norm() / want.norm())
    assert err < 1e-2, err  # bf16 output and 16-bit probabilities


@pytest.mark.parametrize("heads,q_len,splits,fused", [(8, 7, 3, False), (8, 7, 1, None),
                                                      (64, 1, 2, True)])
def test_triton_decode_row_tiles(heads, q_len, splits, fused, ops_backend):
    # block_m below a sequence's (row, head) pairs per KV head: several row tiles per KV head
    # (7 rows x 4 heads in two 16-row tiles; 32 heads of one KV head in two), padding rows zero
    if ops_backend != "triton":
        pytest.skip("launch overrides exist on the triton backend only")
    from pagedkv.ops.triton.attention import paged_attention as triton_attention

    seqs = [(30, q_len), (q_len + 2, q_len), (0, 0)]
    sc = make_scenario(seqs, 16, heads, 2, seed=50 + heads + splits)
    sc.q[-PAD_ROWS:] = float("nan")
    mask = Mask() if q_len == 1 else Mask(causal=False, draft_block=q_len)
    got = triton_attention(sc.q, sc.k_cache, sc.v_cache, sc.qsl, sc.seq_lens, sc.table,
                           mask=mask, max_query_len=q_len, max_seq_len=30, splits=splits,
                           block_n=16, block_m=16, fused=fused)
    want = reference(sc, mask, scale=8**-0.5)
    torch.testing.assert_close(got.cpu().double(), want, **EXACT["triton"])
    assert bool((got[-PAD_ROWS:] == 0).all())


@pytest.mark.parametrize("block_size,block_n,q_len,heads", [(16, 16, 1, 4), (16, 64, 1, 4),
                                                           (4, 32, 3, 8), (64, 32, 2, 4),
                                                           (64, 64, 7, 4)])
@pytest.mark.parametrize("masked", ["window", "draft"])
@pytest.mark.parametrize("page_tiles", [True, False])
def test_triton_decode_page_tiles(block_size, block_n, q_len, heads, masked, page_tiles,
                                  ops_backend):
    # one block id per page of the tile (block_n a multiple of the block size) or per tile
    # (the page holds the tile), or per key: fresh NaN pages, shuffled tables, and entries
    # freed (-1, NaN-filled) before every row's window are never read; a read is reported
    if ops_backend != "triton":
        pytest.skip("launch overrides exist on the triton backend only")
    from pagedkv.ops.triton.attention import paged_attention as triton_attention

    seqs = [(150, q_len), (q_len + 5, q_len), (0, 0), (97, q_len)]
    sc = make_scenario(seqs, block_size, heads, 2, seed=60 + block_size + block_n + q_len)
    sc.q[-PAD_ROWS:] = float("nan")
    mask = Mask(window=40) if masked == "window" else Mask(causal=False, draft_block=q_len)
    if masked == "window":  # free the pages wholly before the first row's window
        for j in range((150 - q_len - 40 + 1) // block_size):
            fill_nan_(sc.k_cache, [int(sc.table[0, j])])
            fill_nan_(sc.v_cache, [int(sc.table[0, j])])
            sc.table[0, j] = -1
    kw = dict(mask=mask, block_n=block_n, page_tiles=page_tiles,
              block_m=16 if q_len == 7 else None)
    got = triton_attention(sc.q, sc.k_cache, sc.v_cache, sc.qsl, sc.seq_lens, sc.table,
                           max_query_len=q_len, max_seq_len=150, splits=3, **kw)
    want = reference(sc, mask, scale=8**-0.5)
    torch.testing.assert_close(got.cpu().double(), want, **EXACT["triton"])
    assert bool((got[-PAD_ROWS:] == 0).all())
    checked = triton_attention(sc.q, sc.k_cache, sc.v_cache, sc.qsl, sc.seq_lens, sc.table, **kw)
    torch.testing.assert_close(checked, got)
    if masked == "window":
        with pytest.raises(MetadataError, match="block id -1"):
            triton_attention(sc.q, sc.k_cache, sc.v_cache, sc.qsl, sc.seq_lens, sc.table,
                             mask=Mask(), block_n=block_n, page_tiles=page_tiles)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("page_tiles", [False, True])
def test_triton_fp8_widened_tiles(fmt, page_tiles, ops_backend):
    # fp8 tiles loaded as 32-bit words and widened to fp16 in registers (inline PTX: GPU only)
    only_on_gpu(ops_backend, why="the widening is inline PTX")
    if ops_backend != "triton":
        pytest.skip("launch overrides exist on the triton backend only")
    from pagedkv.ops.triton.attention import paged_attention as triton_attention

    dt = torch.float8_e4m3fn if fmt == "e4m3" else torch.float8_e5m2
    seqs = [(300, 1), (77, 1), (129, 1), (0, 0)]
    sc = make_scenario(seqs, 16, 32, 8, dim=128, dtype=torch.float32, seed=70 + page_tiles)
    k_scale, v_scale = 2.0**-6, 2.0**-5
    k8, v8 = fp8_caches(sc, seqs, dt, k_scale, v_scale)
    q16 = sc.q.to(torch.bfloat16)
    kw = dict(k_scale=k_scale, v_scale=v_scale, max_query_len=1, max_seq_len=300, splits=2,
              page_tiles=page_tiles)
    got = triton_attention(q16, k8, v8, sc.qsl, sc.seq_lens, sc.table, widen=True, **kw)
    plain = triton_attention(q16, k8, v8, sc.qsl, sc.seq_lens, sc.table, widen=False, **kw)
    sc8 = Scenario(**{**sc.__dict__})
    sc8.q = q16.double()
    sc8.keys = [(k / k_scale).to(dt).double() * k_scale for k in sc.keys]
    sc8.values = [(v / v_scale).to(dt).double() * v_scale for v in sc.values]
    want = reference(sc8, Mask(), scale=128**-0.5)
    err = float((got.cpu().double() - want).norm() / want.norm())
    assert err < 1e-2, err
    assert float((got.float() - plain.float()).abs().max()) < 1e-2  # the same products


def test_triton_refuses_sinks_on_another_device():
    """Sinks on the host with the rest on the GPU reached the kernel as a host pointer: a
    Triton ValueError from its launcher (fuzz/triton_attention.py on an H100). Every tensor
    of a Triton call is on one device, or the call says which two differ."""
    pytest.importorskip("triton")
    from pagedkv.ops.triton.attention import paged_attention as triton_attention

    sc = make_scenario([(9, 1), (20, 1)], 4, 4, 2, dtype=torch.float32, seed=5)
    elsewhere = "cpu" if sc.q.device.type == "cuda" else "meta"
    sinks = torch.zeros(4, device=elsewhere)
    with pytest.raises(InvalidArgumentError, match="on one device"):
        triton_attention(sc.q, sc.k_cache, sc.v_cache, sc.qsl, sc.seq_lens, sc.table,
                         sinks=sinks)
