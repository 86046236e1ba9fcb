"""Persistent, bucketed metadata: same arrays as build_metadata, fixed device addresses, one
host-to-device copy per step, and a CUDA-graph-captured decode step that replays correctly
with changed block tables."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("numpy")

from test_batch import make_group  # noqa: E402

from pagedkv.batch import ScheduledRequest, build_metadata  # noqa: E402
from pagedkv.batch.persistent import PersistentMetadata  # noqa: E402
from pagedkv.errors import InvalidArgumentError  # noqa: E402

ARRAYS = ("block_table", "slot_mapping", "query_start_loc", "seq_lens", "positions",
          "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len")


def decode_requests(n, block_size, width, rng, num_blocks):
    ids = rng.sample(range(num_blocks), n * width)
    out = []
    for i in range(n):
        ctx = rng.randrange(1, width * block_size)  # the new token makes ctx + 1 <= width * bs
        blocks = ids[i * width : i * width + -(-(ctx + 1) // block_size)]
        out.append(ScheduledRequest(f"r{i}", ctx, 1, {0: blocks}))
    return out


def test_persistent_step_equals_build_metadata_and_keeps_its_addresses():
    rng = random.Random(0)
    group = make_group(0, 4, num_blocks=200)
    pm = PersistentMetadata([group], max_blocks=6, batch_buckets=[4, 8], device="cpu")
    first = pm.step_requests(decode_requests(7, 4, 6, rng, 200))[0]
    first_ptrs = {name: getattr(first, name).data_ptr() for name in ARRAYS}
    for n, bucket in ((5, 8), (3, 4), (8, 8)):
        reqs = decode_requests(n, 4, 6, rng, 200)
        got = pm.step_requests(reqs)[0]
        want = build_metadata(reqs, [group], pad_batch_to=bucket, pad_tokens_to=bucket, max_blocks=6)[0]
        for name in ARRAYS:
            assert torch.equal(getattr(got, name), getattr(want, name)), (n, name)
        assert got.block_table.shape == (bucket, 6)
        if bucket == 8:  # every step of one bucket reads the same addresses
            for name in ARRAYS:
                assert getattr(got, name).data_ptr() == first_ptrs[name], name
    assert pm.copies == 0  # a CPU target needs no host-to-device copy


def test_too_many_requests_for_the_largest_bucket_raises():
    group = make_group(0, 4, num_blocks=64)
    pm = PersistentMetadata([group], max_blocks=2, batch_buckets=[2], device="cpu")
    reqs = [ScheduledRequest(i, 1, 1, {0: [i]}) for i in range(3)]
    with pytest.raises(InvalidArgumentError, match="largest bucket"):
        pm.step_requests(reqs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-graph capture needs a GPU")
def test_cuda_graph_decode_step_replays_with_changed_block_tables():
    pytest.importorskip("triton")
    from pagedkv.ops import fill_nan_
    from pagedkv.ops.paged_attention import paged_attention as reference
    from pagedkv.ops.triton import paged_attention

    rng = random.Random(1)
    bs, width, num_blocks, heads, kv_heads, dim = 16, 8, 256, 8, 2, 64
    group = make_group(0, bs, num_blocks=num_blocks)
    pm = PersistentMetadata([group], max_blocks=width, batch_buckets=[8], device="cuda")
    k = fill_nan_(torch.empty(num_blocks, bs, kv_heads, dim, dtype=torch.bfloat16, device="cuda"))
    v = fill_nan_(torch.empty_like(k))
    meta = pm.step_requests(decode_requests(5, bs, width, rng, num_blocks))[0]

    def fill_cache(m):  # write every position the step reads, the rest stays NaN
        for b, seq in enumerate(m.seq_lens.tolist()):
            for p in range(seq):
                blk, off = int(m.block_table[b, p // bs]), p % bs
                k[blk, off] = torch.randn(kv_heads, dim, device="cuda").bfloat16()
                v[blk, off] = torch.randn(kv_heads, dim, device="cuda").bfloat16()

    fill_cache(meta)
    q = torch.randn(8, heads, dim, device="cuda", dtype=torch.bfloat16)
    kw = dict(max_query_len=1, max_seq_len=width * bs, splits=2)

    def step():
        return paged_attention(q, k, v, meta.query_start_loc, meta.seq_lens, meta.block_table, **kw)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    copies = pm.copies
    outputs = []
    for _ in range(2):  # new requests, new block tables and lengths, same bucket
        meta2 = pm.step_requests(decode_requests(rng.randrange(3, 9), bs, width, rng, num_blocks))[0]
        assert meta2.block_table.data_ptr() == meta.block_table.data_ptr()
        fill_cache(meta2)
        q.copy_(torch.randn_like(q))
        graph.replay()
        torch.cuda.synchronize()
        want = reference(q, k, v, meta2.query_start_loc, meta2.seq_lens, meta2.block_table)
        assert not bool(out.isnan().any())
        torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2)
        outputs.append(out.clone())
    assert pm.copies == copies + 2  # one host-to-device copy per step
    assert not torch.allclose(outputs[0].float(), outputs[1].float())
