"""pagedkv.batch metadata against a naive per-row rebuild written here, independently."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("numpy")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from pagedkv.batch import ScheduledRequest, build_metadata  # noqa: E402
from pagedkv.kvspec import Attention, Full, LayerSpec, MLALatent, SlidingWindow  # noqa: E402
from pagedkv.plan.types import Group  # noqa: E402


def make_group(gid: int, block_size: int, offset: int = 0, num_blocks: int = 0, retention=None) -> Group:
    retention = retention or Full()
    attention = Attention(window=retention.window) if isinstance(retention, SlidingWindow) else Attention()
    layer = LayerSpec(f"g{gid}.l0", MLALatent(), retention, attention, position_offset=offset)
    return Group(
        id=gid, layers=(layer,), retention=retention, block_size=block_size,
        position_offset=offset, models=("target",), bytes_per_token=1152, bytes_per_request=0,
        num_blocks=num_blocks, blocks_per_request=0, step_blocks=0,
    )


def naive(requests, group, pad_batch=None, pad_tokens=None):
    """Per-row rebuild in plain Python lists, straight from the conventions."""
    bs, k = group.block_size, group.position_offset
    batch = pad_batch or len(requests)
    width = max((len(r.blocks(group.id)) for r in requests), default=0)
    table = [[0] * width for _ in range(batch)]
    qsl, seq, slots, positions = [0], [], [], []
    indptr, indices, last = [0], [], []
    for i in range(batch):
        if i >= len(requests):
            qsl.append(qsl[-1])
            seq.append(0)
            indptr.append(indptr[-1])
            last.append(0)
            continue
        r = requests[i]
        ids = list(r.blocks(group.id))
        table[i][: len(ids)] = ids
        total = max(0, r.num_computed_tokens + r.num_new_tokens - k)
        seq.append(total)
        qsl.append(qsl[-1] + r.num_new_tokens)
        npages = (total + bs - 1) // bs
        indices += ids[:npages]
        indptr.append(indptr[-1] + npages)
        last.append(0 if total == 0 else total - (npages - 1) * bs)
        for t in range(r.num_computed_tokens, r.num_computed_tokens + r.num_new_tokens):
            p = t - k
            if p < 0:
                slots.append(-1)
                positions.append(0)
            else:
                slots.append(ids[p // bs] * bs + p % bs)
                positions.append(p)
    while len(slots) < (pad_tokens or 0):
        slots.append(-1)
        positions.append(0)
    return dict(
        block_table=table, query_start_loc=qsl, seq_lens=seq, slot_mapping=slots,
        positions=positions, paged_kv_indptr=indptr, paged_kv_indices=indices,
        paged_kv_last_page_len=last,
    )


@st.composite
def steps(draw):
    block_size = draw(st.sampled_from([1, 2, 3, 16]))
    offset = draw(st.sampled_from([0, 0, 1, 2]))
    n = draw(st.integers(0, 6))
    free = list(range(400))  # 6 requests x (49 positions + 2 lookahead) at block size 1
    random.Random(draw(st.integers(0, 2**32 - 1))).shuffle(free)
    requests = []
    for i in range(n):
        computed = draw(st.integers(0, 40))
        new = draw(st.integers(0 if computed else 1, 9))
        drafts = draw(st.integers(0, new))
        need = -(-max(0, computed + new - offset) // block_size)
        extra = draw(st.integers(0, 2))  # lookahead blocks beyond what is read
        ids = [free.pop() for _ in range(need + extra)]
        requests.append(ScheduledRequest(f"r{i}", computed, new, {7: ids}, num_draft_tokens=drafts))
    pad_batch = draw(st.one_of(st.none(), st.integers(n, n + 3)))
    tokens = sum(r.num_new_tokens for r in requests)
    pad_tokens = draw(st.one_of(st.none(), st.integers(tokens, tokens + 5)))
    return make_group(7, block_size, offset, num_blocks=400), requests, pad_batch, pad_tokens


@settings(max_examples=150, deadline=None)
@given(steps(), st.booleans())
def test_metadata_matches_naive_rebuild(step, checked):
    group, requests, pad_batch, pad_tokens = step
    meta = build_metadata(
        requests, [group], checked=checked, pad_batch_to=pad_batch, pad_tokens_to=pad_tokens
    )[7]
    want = naive(requests, group, pad_batch, pad_tokens)
    for name, value in want.items():
        got = getattr(meta, name)
        assert got.tolist() == value, name
    int32 = ("block_table", "query_start_loc", "seq_lens", "paged_kv_indptr",
             "paged_kv_indices", "paged_kv_last_page_len")
    for name in int32:
        assert getattr(meta, name).dtype == torch.int32, name
    assert meta.slot_mapping.dtype == torch.int64 and meta.positions.dtype == torch.int64
    assert meta.num_reqs == len(requests)
    assert meta.num_tokens == sum(r.num_new_tokens for r in requests)
    assert meta.query_lens_host == tuple(r.num_new_tokens for r in requests)
    assert meta.seq_lens_host == tuple(want["seq_lens"][: len(requests)])
    assert meta.num_draft_tokens_host == tuple(r.num_draft_tokens for r in requests)


def test_hand_worked_example():
    # block size 4; request a: prompt of 5 in blocks [7, 3]; b: decode at position 6 in [1, 2]
    group = make_group(0, 4)
    reqs = [
        ScheduledRequest("a", 0, 5, {0: [7, 3]}),
        ScheduledRequest("b", 6, 1, {0: [1, 2]}),
    ]
    meta = build_metadata(reqs, [group], checked=True)[0]
    assert meta.slot_mapping.tolist() == [28, 29, 30, 31, 12, 10]  # 7*4+0..3, 3*4+0, 2*4+2
    assert meta.positions.tolist() == [0, 1, 2, 3, 4, 6]
    assert meta.query_start_loc.tolist() == [0, 5, 6]
    assert meta.seq_lens.tolist() == [5, 7]
    assert meta.paged_kv_indptr.tolist() == [0, 2, 4]
    assert meta.paged_kv_indices.tolist() == [7, 3, 1, 2]
    assert meta.paged_kv_last_page_len.tolist() == [1, 3]
    assert meta.max_query_len == 5 and meta.max_seq_len == 7


def test_position_offset_shifts_positions_and_slots():
    # offset 1: tokens 0..4 of a fresh prompt fill positions -1..3; the first row writes nothing
    group = make_group(0, 4, offset=1)
    meta = build_metadata([ScheduledRequest("a", 0, 5, {0: [9]})], [group], checked=True)[0]
    assert meta.seq_lens.tolist() == [4]
    assert meta.slot_mapping.tolist() == [-1, 36, 37, 38, 39]
    assert meta.positions.tolist() == [0, 0, 1, 2, 3]
    assert meta.query_start_loc.tolist() == [0, 5]  # rows still line up with the target's


def test_groups_share_one_buffer_and_query_start_loc():
    groups = [make_group(0, 4), make_group(1, 16, offset=1)]
    reqs = [ScheduledRequest("a", 3, 9, {0: [5, 6, 7], 1: [2]}), ScheduledRequest("b", 20, 1, {0: [1, 2, 3, 4, 8, 9], 1: [0, 3]})]
    step = build_metadata(reqs, groups)
    assert sorted(step) == [0, 1] and len(step) == 2
    storages = {
        getattr(m, name).untyped_storage().data_ptr()
        for m in step.values()
        for name in ("block_table", "slot_mapping", "positions", "seq_lens", "paged_kv_indices")
    }
    assert len(storages) == 1  # one staging buffer for every array of every group
    assert step[0].query_start_loc.data_ptr() == step[1].query_start_loc.data_ptr()
    assert step[0].seq_lens.tolist() == [12, 21] and step[1].seq_lens.tolist() == [11, 20]


def test_fixed_block_table_width():
    group = make_group(0, 2)
    reqs = [ScheduledRequest("a", 0, 3, {0: [4, 5, 6]})]  # a lookahead block beyond the 2 read
    meta = build_metadata(reqs, [group], max_blocks=8)[0]
    assert meta.block_table.tolist() == [[4, 5, 6, 0, 0, 0, 0, 0]]
    narrow = build_metadata(reqs, [group], max_blocks=2)[0]
    assert narrow.block_table.tolist() == [[4, 5]]
    assert narrow.slot_mapping.tolist() == [8, 9, 10]


def test_empty_step():
    meta = build_metadata([], [make_group(0, 16)], checked=True, pad_batch_to=2, pad_tokens_to=3)[0]
    assert meta.query_start_loc.tolist() == [0, 0, 0]
    assert meta.slot_mapping.tolist() == [-1, -1, -1]
    assert meta.block_table.shape == (2, 0)
    assert meta.paged_kv_indices.numel() == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_device_matches_cpu():
    group = make_group(0, 16)
    reqs = [ScheduledRequest("a", 10, 30, {0: [3, 1, 2]}), ScheduledRequest("b", 0, 1, {0: [0]})]
    cpu = build_metadata(reqs, [group])[0]
    gpu = build_metadata(reqs, [group], device="cuda")[0]
    assert gpu.slot_mapping.is_cuda
    for name in ("block_table", "slot_mapping", "query_start_loc", "seq_lens", "positions",
                 "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len"):
        assert getattr(gpu, name).cpu().tolist() == getattr(cpu, name).tolist(), name
