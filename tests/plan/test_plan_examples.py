"""Hand-worked plans: every expected number is derived in the test from public geometry
(see test_plan_builders) and the planning rules, never copied from the planner's output."""

from __future__ import annotations

import math

import pytest
from test_plan_builders import (
    KDA,
    KDA_BYTES,
    GiB,
    deepseek_v3,
    full_layer,
    gpt_oss_120b,
    kimi_k3,
    llama3_8b,
    llama4_scout,
)

from pagedkv.errors import ConfigError, DoesNotFitError, InvalidArgumentError
from pagedkv.kvspec import AttentionKV, Full, LayerSpec, MLALatent, Recurrent, SlidingWindow
from pagedkv.plan import PlanOptions, make_plan


def _vllm(plan):
    (alt,) = [a for a in plan.alternatives if a.name == "vllm"]
    return alt


def test_llama3_8b_on_40gib_fills_whole_blocks():
    plan = make_plan(llama3_8b(), PlanOptions(40 * GiB, 8192))
    (group,) = plan.groups
    expected_blocks = 40 * GiB // (32 * 2 * 8 * 128 * 2 * 16)
    assert group.num_blocks == plan.num_blocks == expected_blocks == 20480
    assert group.bytes_per_token == 32 * 2 * 8 * 128 * 2
    assert group.block_size == 16 and group.step_blocks == 0
    assert plan.capacity.tokens == expected_blocks * 16
    assert plan.capacity.max_concurrency == expected_blocks * 16 / 8192 == 40.0
    assert plan.padding_bytes == 0
    views = plan.ranks[0].views
    assert len(views) == 64  # K and V of 32 layers
    assert {v.shape for v in views} == {(expected_blocks, 16, 8, 128)}
    # the peer harness: vLLM 0.34 plans 40.0x at 8K with the same 20480 blocks
    assert _vllm(plan).num_blocks == expected_blocks
    assert _vllm(plan).capacity.max_concurrency == 40.0


def test_full_attention_tokens_equal_blocks_times_block_size():
    for max_len in (16, 4096, 50_000 // 16 * 16):
        plan = make_plan(llama3_8b(), PlanOptions(7 * GiB + 12345, max_len))
        assert plan.capacity.tokens == plan.num_blocks * 16


def test_gpt_oss_window_counts_window_per_request_and_step_once():
    plan = make_plan(gpt_oss_120b(), PlanOptions(40 * GiB, 131072, max_batched_tokens=2048))
    sliding, full = plan.groups
    assert sliding.retention == SlidingWindow(128) and full.retention == Full()
    assert sliding.bytes_per_token == full.bytes_per_token == 18 * 2 * 8 * 64 * 2
    # window: 127 earlier keys + the current token, unaligned: cdiv(127, 16) + 1 blocks
    assert sliding.blocks_per_request == math.ceil(127 / 16) + 1 == 9
    assert sliding.step_blocks == 2048 // 16 == 128  # once per step for the whole batch
    assert full.blocks_per_request == 131072 // 16 and full.step_blocks == 0
    # both groups have 18 layers of a 16 x 36864-byte page: they share one pool. 40 GiB
    # holds 72817 pages, 128 go to the step and 1 to the window's null block; a request
    # holds 9 + 8192 of the other 72688 pages
    page = 16 * 18 * 2 * 8 * 64 * 2
    assert 40 * GiB // page - 128 - 1 == 72688
    assert full.num_blocks == sliding.num_blocks == 40 * GiB // page
    assert full.pool == sliding.pool == 0
    assert full.reserved_blocks == sliding.reserved_blocks == 1
    assert plan.capacity.max_concurrency == pytest.approx(72688 / 8201)
    assert plan.capacity.tokens == 72688 * 131072 // 8201
    # separate pools (c = k/8192, ceil(9c) + ceil(8192c) <= 72688) held k = 72608: 80 +
    # 72608 = 72688 fits, k = 72609 does not; the shared pool holds as much, up to ceilings
    assert math.ceil(9 * 72608 / 8192) + 72608 == 72688
    assert math.ceil(9 * 72609 / 8192) + 72609 > 72688
    assert 0 <= 72688 / 8201 - 72608 / 8192 < 1 / 8192
    # vLLM charges each request cdiv(127 + 2 x 2048, 16) + 1 = 265 window blocks
    vllm = _vllm(plan)
    assert vllm.num_blocks == 40 * GiB // page
    assert vllm.capacity.max_concurrency == pytest.approx((40 * GiB // page) / (8192 + 265))
    assert round(vllm.capacity.max_concurrency, 2) == 8.61  # the peer harness figure
    assert plan.capacity.tokens > vllm.capacity.tokens


def test_kimi_k3_and_dspark_share_one_mla_group():
    plan = make_plan(kimi_k3(), PlanOptions(40 * GiB, 131072))
    state, mla = plan.groups
    assert len(mla.layers) == 29 and mla.models == ("target", "draft")
    assert mla.bytes_per_token == 29 * 1152 == 33408
    assert mla.block_size == 64
    assert len(state.layers) == 69 and state.is_recurrent
    assert state.bytes_per_token == 0 and state.bytes_per_request == 69 * KDA_BYTES
    # per request: 2048 MLA blocks of 64 x 33408 B + one state; 40 GiB holds 8.87 of them.
    per_request = 2048 * 64 * 33408 + 69 * KDA_BYTES
    assert 8 < 40 * GiB / per_request < 9
    # 9 slots leave room for c = blocks / 2048 > 8 requests of MLA; 8 slots would cap at 8
    blocks = (40 * GiB - 9 * 69 * KDA_BYTES) // (64 * 33408)
    assert state.num_blocks == 9
    assert mla.num_blocks == blocks
    assert plan.capacity.max_concurrency == pytest.approx(blocks / 2048)
    assert plan.capacity.max_concurrency > 8
    assert plan.padding_bytes < 64 * 33408  # less than one MLA block
    # vLLM: 5888-token blocks (92 x 64: the smallest whose MLA page holds a KDA state),
    # 69 KDA layers in 3 groups of 29 slots (18 padding layers), 218 blocks of 29 slots,
    # cdiv(131072, 5888) = 23 MLA blocks + 3 x 2 state blocks per request
    assert 91 * 64 * 1152 < KDA_BYTES <= 92 * 64 * 1152
    vllm = _vllm(plan)
    assert vllm.num_blocks == 40 * GiB // (5888 * 1152 * 29) == 218
    assert vllm.capacity.max_concurrency == pytest.approx(218 / (23 + 3 * 2))
    assert round(vllm.capacity.max_concurrency, 2) == 7.52  # the peer harness figure
    assert any("18 padding layers" in note for note in vllm.notes)
    assert vllm.block_size == 5888 and vllm.num_groups == 4


def test_kimi_limit_sentence_names_the_mla_group():
    plan = make_plan(kimi_k3(), PlanOptions(40 * GiB, 131072))
    text = plan.capacity.limited_by
    assert text.startswith("KV memory: 40.0 GiB holds 8.85 requests of 131072 tokens")
    assert "full-attention group (29 MLA layers, 33408 B/token)" in text


def test_deepseek_v3_mla_at_160k():
    plan = make_plan(deepseek_v3(), PlanOptions(40 * GiB, 163840))
    (group,) = plan.groups
    blocks = 40 * GiB // (64 * 61 * 1152)
    assert group.bytes_per_token == 61 * 1152 == 70272
    assert group.num_blocks == blocks
    assert plan.capacity.max_concurrency == pytest.approx(blocks / (163840 // 64))
    assert round(plan.capacity.max_concurrency, 2) == 3.73  # = vLLM's, the peer figure
    assert _vllm(plan).num_blocks == blocks


def test_llama4_scout_chunks():
    plan = make_plan(llama4_scout(), PlanOptions(40 * GiB, 262144))
    chunked, full = plan.groups
    assert chunked.blocks_per_request == 8192 // 16  # chunks align to blocks: no extra
    assert chunked.step_blocks == 128
    # pages: chunked 16 x 36 x 4096 = 3 units of 16 x 12 x 4096; 54613 units - 384 for the
    # step - 3 for the chunked group's null block = 54226; 3 ceil(k/32) + k <= 54226 ->
    # k = 49576 (3 x 1550 + 49576 = 54226; k = 49577 needs 54227)
    assert 40 * GiB // (16 * 12 * 4096) - 3 * 128 - 3 == 54226
    assert 3 * math.ceil(49576 / 32) + 49576 == 54226
    assert full.num_blocks == 49576
    assert chunked.num_blocks == 1 + 128 + math.ceil(49576 / 32)
    assert plan.capacity.tokens == 49576 * 16
    vllm = _vllm(plan)
    # vLLM: 4 groups of 12, cdiv(8192 + 4096, 16) = 768 blocks per chunked group
    assert vllm.num_blocks == 40 * GiB // (16 * 4096 * 12)
    assert vllm.capacity.max_concurrency == pytest.approx(vllm.num_blocks / (16384 + 3 * 768))
    assert round(vllm.capacity.max_concurrency, 2) == 2.92  # the peer harness figure


def test_window_covering_max_model_len_costs_no_step_blocks():
    layers = [LayerSpec("w", AttentionKV(2, 64), SlidingWindow(4096), index=0)]
    plan = make_plan(layers, PlanOptions(GiB, 1024, max_batched_tokens=8192))
    assert plan.groups[0].blocks_per_request == 1024 // 16
    assert plan.groups[0].step_blocks == 0


def test_drafter_with_offset_gets_its_own_group():
    eagle = LayerSpec("eagle.0", AttentionKV(8, 128), Full(), model="draft", position_offset=1)
    plan = make_plan([*llama3_8b(), eagle], PlanOptions(40 * GiB, 8192))
    assert [len(g.layers) for g in plan.groups] == [32, 1]
    assert plan.groups[1].position_offset == 1 and plan.groups[1].models == ("draft",)
    assert plan.groups[0].num_blocks == plan.groups[1].num_blocks


def test_block_size_defaults_and_override():
    assert make_plan(llama3_8b(), PlanOptions(GiB, 4096)).groups[0].block_size == 16
    assert make_plan(deepseek_v3(), PlanOptions(40 * GiB, 4096)).groups[0].block_size == 64
    mixed = [full_layer(0), full_layer(1, MLALatent())]
    assert make_plan(mixed, PlanOptions(GiB, 4096)).groups[0].block_size == 64
    plan = make_plan(llama3_8b(), PlanOptions(GiB, 4096, block_size=32))
    assert plan.groups[0].block_size == 32
    assert plan.groups[0].num_blocks == GiB // (32 * 131072)


@pytest.mark.parametrize("budget", [0, -1, -40 * GiB])
def test_budget_must_be_positive(budget):
    with pytest.raises(InvalidArgumentError, match="budget_bytes"):
        make_plan(llama3_8b(), PlanOptions(budget, 8192))


def test_budget_below_one_request_does_not_fit():
    one_request = 8192 * 131072  # 1 GiB at 8K
    with pytest.raises(DoesNotFitError) as info:
        make_plan(llama3_8b(), PlanOptions(one_request - 1, 8192))
    message = str(info.value)
    assert "8192 tokens" in message and str(one_request - 1) in message
    assert str(one_request) in message  # what it needs
    plan = make_plan(llama3_8b(), PlanOptions(one_request, 8192))
    assert plan.capacity.max_concurrency == 1.0


def test_state_only_budget_below_one_state_does_not_fit():
    layers = [LayerSpec(f"s{i}", KDA, Recurrent(), index=i) for i in range(2)]
    with pytest.raises(DoesNotFitError, match="recurrent state"):
        make_plan(layers, PlanOptions(2 * KDA_BYTES - 1, 8192))
    plan = make_plan(layers, PlanOptions(5 * KDA_BYTES, 8192))  # 2.5 requests of 2 states
    assert plan.groups[0].num_blocks == 2  # a state cannot be split
    assert plan.capacity.max_concurrency == 2.0


@pytest.mark.parametrize(
    "options, match",
    [
        (PlanOptions(GiB, 0), "max_model_len"),
        (PlanOptions(GiB, 8192, block_size=0), "block_size"),
        (PlanOptions(GiB, 8192, max_batched_tokens=0), "max_batched_tokens"),
        (PlanOptions(GiB, 8192, tp=0), "tp"),
        (PlanOptions(GiB, 8192, pp=-1), "pp"),
        (PlanOptions(GiB, 8192, strategy="vllm"), "strategy"),
        (PlanOptions(GiB, 8192, pp=33), "pp=33"),
        (PlanOptions(GiB, 8192, tp=3), "tp=3"),
        (PlanOptions(GiB, 8192, tp=8 << 40), "ranks"),  # (heads replicate: was a 2^43-rank loop)
    ],
)
def test_bad_options(options, match):
    with pytest.raises(InvalidArgumentError, match=match):
        make_plan(llama3_8b(), options)


def test_no_layers_and_duplicate_names():
    with pytest.raises(InvalidArgumentError, match="at least one layer"):
        make_plan([], PlanOptions(GiB, 8192))
    with pytest.raises(ConfigError, match="duplicate layer name"):
        make_plan([full_layer(0), full_layer(0)], PlanOptions(GiB, 8192))
