"""The vLLM-style report: its rules worked by hand on small layer sets. The figures of the
real vLLM 0.34 planner (the peer harness) are checked in test_plan_examples."""

from __future__ import annotations

import pytest
from test_plan_builders import GiB, full_layer

from pagedkv.kvspec import (
    Attention,
    AttentionKV,
    ChunkedLocal,
    Cross,
    Full,
    LayerSpec,
    MLALatent,
    Recurrent,
    RecurrentState,
    SlidingWindow,
    StateTensor,
)
from pagedkv.plan import PlanOptions, make_plan
from pagedkv.plan.vllm_model import vllm_blocks


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _sliding(i: int, heads: int = 8, window: int = 128) -> LayerSpec:
    return LayerSpec(
        f"sw.{i}", AttentionKV(heads, 64), SlidingWindow(window), Attention(window=window), index=i
    )


def _report(layers, budget=40 * GiB, max_len=131072, **kw):
    (report,) = make_plan(layers, PlanOptions(budget, max_len, **kw)).alternatives
    return report


def test_vllm_blocks_per_request():
    in_flight = 2 * 2048
    assert vllm_blocks(Full(), 16, 131072, in_flight) == 8192
    assert vllm_blocks(SlidingWindow(128), 16, 131072, in_flight) == cdiv(127 + 4096, 16) + 1
    assert vllm_blocks(SlidingWindow(128), 16, 1000, in_flight) == cdiv(1000, 16) + 1
    assert vllm_blocks(ChunkedLocal(8192), 16, 262144, in_flight) == (8192 + 4096) // 16
    assert vllm_blocks(Cross(1500), 16, 8192, in_flight) == cdiv(1500, 16)
    assert vllm_blocks(Recurrent(), 16, 8192, in_flight) == 2


def test_group_size_uses_the_larger_count_within_one_and_a_half():
    # gpt-oss-20b + EAGLE-like: 12 sliding + 13 full -> groups of 13, one padding layer
    layers = [_sliding(i) for i in range(12)] + [
        full_layer(i, AttentionKV(8, 64)) for i in range(12, 25)
    ]
    report = _report(layers)
    page = 16 * 2 * 8 * 64 * 2
    assert report.num_groups == 2 and report.block_size == 16
    assert report.num_blocks == 40 * GiB // (page * 13)
    assert any("1 padding layer" in note for note in report.notes)
    per_request = 8192 + cdiv(127 + 4096, 16) + 1
    assert report.capacity.max_concurrency == pytest.approx(report.num_blocks / per_request)


def test_group_size_is_the_smaller_count_otherwise():
    # 20 full + 30 sliding: 30 is not < 1.5 x 20 -> groups of 20; sliding split in 2 (10 pad)
    layers = [full_layer(i, AttentionKV(8, 64)) for i in range(20)] + [
        _sliding(i) for i in range(20, 50)
    ]
    report = _report(layers)
    page = 16 * 2 * 8 * 64 * 2
    assert report.num_groups == 3
    assert report.num_blocks == 40 * GiB // (page * 20)
    assert any("10 padding layers" in note for note in report.notes)
    per_request = 8192 + 2 * (cdiv(127 + 4096, 16) + 1)
    assert report.capacity.max_concurrency == pytest.approx(report.num_blocks / per_request)


def test_uniform_type_puts_different_pages_in_one_group():
    # all full attention, two geometries: one group, pages summed
    layers = [full_layer(i) for i in range(4)] + [full_layer(i, MLALatent()) for i in range(4, 6)]
    report = _report(layers, max_len=8192)
    page = 64 * (4 * 2 * 8 * 128 * 2 + 2 * 1152)  # MLA present: 64-token blocks
    assert report.num_groups == 1 and report.num_blocks == 40 * GiB // page
    assert report.capacity.max_concurrency == pytest.approx(report.num_blocks / (8192 // 64))


def test_hybrid_with_state_raises_the_block_size_and_pads_state_pages():
    # Jamba-like: attention 4096 B/token per layer; Mamba state 3 x 8192 + 8192 x 16 bf16
    state = RecurrentState(
        (StateTensor("conv", (3, 8192), "bf16", 1), StateTensor("ssm", (8192, 16), "bf16", 0)),
        "mamba1",
    )
    state_bytes = (3 * 8192 + 8192 * 16) * 2
    layers = [full_layer(i) for i in range(4)] + [
        LayerSpec(f"m.{i}", state, Recurrent(), index=i) for i in range(4, 32)
    ]
    report = _report(layers, max_len=262144)
    block = 16 * cdiv(state_bytes, 16 * 4096)  # smallest multiple of 16 holding a state
    assert block == 80 and (block - 16) * 4096 < state_bytes <= block * 4096
    assert report.block_size == block
    # 4 attention vs 28 state layers -> groups of 4: 1 + 7 groups, no padding layers
    assert report.num_groups == 8
    assert report.num_blocks == 40 * GiB // (block * 4096 * 4)
    per_request = cdiv(262144, block) + 7 * 2
    assert report.capacity.max_concurrency == pytest.approx(report.num_blocks / per_request)
    # padding: what holds no data when the pool is full of 262144-token requests
    data_per_request = cdiv(262144, block) * 4 * block * 4096 + 2 * 28 * state_bytes
    expected = 40 * GiB - report.num_blocks * data_per_request // per_request
    assert report.padding_bytes == expected


def test_page_that_divides_grows_its_block_size_and_mla_that_does_not_is_refused():
    # sliding 1 KV head x 64 (256 B/token) beside 8 x 64 full (2048 B/token): 8x the block
    layers = [full_layer(i, AttentionKV(8, 64)) for i in range(4)] + [
        _sliding(i, heads=1) for i in range(4, 8)
    ]
    report = _report(layers)
    per_request = 8192 + cdiv(127 + 4096, 16 * 8) + 1
    assert report.capacity.max_concurrency == pytest.approx(report.num_blocks / per_request)
    # fp8 MLA (576 B/token, page 36864) next to windowed 8 x 128 bf16 (page 262144): refused
    layers = [full_layer(i, MLALatent(format="fp8")) for i in range(4)] + [
        LayerSpec(f"w.{i}", AttentionKV(8, 128), SlidingWindow(4096), Attention(window=4096))
        for i in range(4)
    ]
    plan = make_plan(layers, PlanOptions(40 * GiB, 131072))
    (report,) = plan.alternatives
    assert 262144 % 36864 != 0
    assert report.capacity.max_concurrency == 0 and report.capacity.tokens == 0
    assert "refuses" in report.capacity.limited_by
    assert plan.capacity.max_concurrency > 1  # pagedkv plans it anyway


def test_pipeline_parallel_counts_in_flight_batches_and_keeps_the_worst_stage():
    layers = [_sliding(i) for i in range(0, 8, 2)] + [
        full_layer(i, AttentionKV(8, 64)) for i in range(1, 8, 2)
    ]
    layers.sort(key=lambda layer: layer.index)
    report = _report(layers, pp=2)
    # each stage: 2 sliding + 2 full; in flight (pp + 1) x 2048 tokens
    assert report.num_blocks == 40 * GiB // (16 * 2 * 8 * 64 * 2 * 2)
    per_request = 8192 + cdiv(127 + 3 * 2048, 16) + 1
    assert report.capacity.max_concurrency == pytest.approx(report.num_blocks / per_request)
