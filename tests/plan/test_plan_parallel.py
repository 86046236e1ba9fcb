"""Tensor and pipeline parallelism: per-rank bytes are the sharded bytes, block counts the
minimum over ranks. Expected shards and stages are written out here, not taken from spec."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from test_plan_builders import GiB, deepseek_v3, full_layer, kimi_k3, llama3_8b
from test_plan_properties import check_invariants

from pagedkv.kvspec import (
    AttentionKV,
    Full,
    LayerSpec,
    Recurrent,
    RecurrentState,
    SlidingWindow,
    StateTensor,
)
from pagedkv.plan import PlanOptions, make_plan


def _kv_layers(heads: int, n: int = 8) -> list[LayerSpec]:
    return [full_layer(i, AttentionKV(heads, 128)) for i in range(n)]


@settings(max_examples=40, deadline=None)
@given(
    heads=st.sampled_from([1, 2, 4, 8, 16]),
    tp=st.sampled_from([1, 2, 4, 8]),
    budget=st.integers(GiB, 64 * GiB),
)
def test_tp_splits_kv_heads_or_replicates(heads, tp, budget):
    per_rank_heads = heads // tp if heads >= tp else 1  # replicated when fewer heads than ranks
    plan = make_plan(_kv_layers(heads), PlanOptions(budget, 4096, tp=tp))
    by_hand = make_plan(_kv_layers(per_rank_heads), PlanOptions(budget, 4096))
    assert [g.num_blocks for g in plan.groups] == [g.num_blocks for g in by_hand.groups]
    assert plan.groups[0].bytes_per_token == 8 * 2 * per_rank_heads * 128 * 2
    assert plan.capacity.max_concurrency == by_hand.capacity.max_concurrency
    assert plan.capacity.tokens == by_hand.capacity.tokens
    assert len(plan.ranks) == tp
    assert {(r.tp_rank, r.pp_rank) for r in plan.ranks} == {(t, 0) for t in range(tp)}
    for rank in plan.ranks:
        assert sum(v.nbytes for v in rank.views) == (
            plan.num_blocks * 16 * 8 * 2 * per_rank_heads * 128 * 2
        )
        assert {v.shape for v in rank.views} == {(plan.num_blocks, 16, per_rank_heads, 128)}
    check_invariants(plan, _kv_layers(heads), PlanOptions(budget, 4096, tp=tp))


def test_tp_replicates_mla_and_splits_recurrent_shard_dim():
    mla = make_plan(deepseek_v3(), PlanOptions(40 * GiB, 32768, tp=8))
    assert mla.groups[0].bytes_per_token == 61 * 1152  # the latent is replicated
    assert mla.num_blocks == make_plan(deepseek_v3(), PlanOptions(40 * GiB, 32768)).num_blocks
    plan = make_plan(kimi_k3(), PlanOptions(40 * GiB, 131072, tp=4))
    state = plan.groups[0]
    # conv [3, 36864] split on dim 1, ssm [96, 128, 128] split on dim 0
    assert state.bytes_per_request == 69 * (3 * (36864 // 4) * 4 + (96 // 4) * 128 * 128 * 4)
    shapes = {v.tensor: v.shape for v in plan.ranks[3].views if v.pool == state.id}
    assert shapes == {"conv": (state.num_blocks, 3, 9216), "ssm": (state.num_blocks, 24, 128, 128)}


def _stage_sizes(num_layers: int, pp: int) -> list[int]:
    return [num_layers // pp + (1 if s < num_layers % pp else 0) for s in range(pp)]


def test_pp_spreads_the_remainder_to_first_stages_and_drafter_to_last():
    layers = [full_layer(i) for i in range(5)] + [
        full_layer(i, model="draft", prefix="draft") for i in range(2)
    ]
    plan = make_plan(layers, PlanOptions(10 * GiB, 4096, pp=2, tp=2))
    assert len(plan.ranks) == 4
    assert {(r.tp_rank, r.pp_rank) for r in plan.ranks} == {(0, 0), (1, 0), (0, 1), (1, 1)}
    stage0 = next(r for r in plan.ranks if r.pp_rank == 0)
    stage1 = next(r for r in plan.ranks if r.pp_rank == 1)
    assert stage0.layers == tuple(f"model.layers.{i}.self_attn" for i in range(3))
    assert stage1.layers == (
        "model.layers.3.self_attn",
        "model.layers.4.self_attn",
        "draft.layers.0.self_attn",
        "draft.layers.1.self_attn",
    )
    # the last stage holds 4 layers of 4 KV heads (8 split over tp=2) x 128 x 2 x bf16
    per_layer = 2 * 4 * 128 * 2
    (group,) = plan.groups
    assert group.bytes_per_token == 4 * per_layer  # the rank with the most bytes
    assert group.num_blocks == 10 * GiB // (16 * 4 * per_layer)  # min over ranks
    assert stage0.used_bytes == group.num_blocks * 16 * 3 * per_layer
    assert plan.capacity.limited_by.endswith("on pipeline stage 1.")


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(4, 40),
    drafts=st.integers(0, 3),
    pp=st.integers(1, 4),
    tp=st.sampled_from([1, 2]),
    budget=st.integers(GiB, 16 * GiB),
)
def test_pp_block_count_is_the_min_over_ranks(n, drafts, pp, tp, budget):
    layers = [full_layer(i) for i in range(n)] + [
        full_layer(i, model="draft", prefix="draft") for i in range(drafts)
    ]
    sizes = _stage_sizes(n, pp)
    sizes[-1] += drafts
    per_layer = 2 * (8 // tp) * 128 * 2
    plan = make_plan(layers, PlanOptions(budget, 2048, tp=tp, pp=pp))
    assert plan.num_blocks == min(budget // (16 * s * per_layer) for s in sizes)
    for rank in plan.ranks:
        assert len(rank.layers) == sizes[rank.pp_rank]
        assert sum(v.nbytes for v in rank.views) == plan.num_blocks * 16 * len(rank.layers) * (
            per_layer
        )
    check_invariants(plan, layers, PlanOptions(budget, 2048, tp=tp, pp=pp))


def test_pp_with_groups_on_different_stages_fits_every_rank():
    # stage 0: four windowed layers; stage 1: four full layers and a state layer
    state = RecurrentState((StateTensor("ssm", (8, 64, 64), "fp32", 0),), "mamba2")
    layers = [
        LayerSpec(f"w{i}", AttentionKV(8, 128), SlidingWindow(1024), index=i) for i in range(4)
    ] + [full_layer(i) for i in range(4, 8)] + [LayerSpec("s", state, Recurrent(), index=7)]
    options = PlanOptions(4 * GiB, 16384, pp=2)
    plan = make_plan(layers, options)
    check_invariants(plan, layers, options)
    window, full, slots = plan.groups
    # stage 1 binds (full layers at 16K): its N = (budget) / (16384 x 4 x 4096 + state)
    per_request = 16384 * 4 * 4096 + 8 * 64 * 64 * 4
    assert slots.num_blocks in (int(4 * GiB / per_request), int(4 * GiB / per_request) + 1)
    assert full.num_blocks * 16 * 4 * 4096 + slots.num_blocks * 8 * 64 * 64 * 4 <= 4 * GiB
    assert window.num_blocks >= window.step_blocks + window.blocks_per_request


def test_default_single_rank():
    plan = make_plan(llama3_8b(), PlanOptions(GiB, 4096))
    assert [(r.tp_rank, r.pp_rank) for r in plan.ranks] == [(0, 0)]
    assert plan.groups[0].retention == Full()
