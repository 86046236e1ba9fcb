"""PlanOptions.typical_len: pools sized for the most requests of a typical length, one
request of max_model_len still fitting. Expected numbers are worked out in the comments."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from test_plan_builders import KDA, full_layer, kimi_k3, layer_specs, llama3_8b

from pagedkv.errors import DoesNotFitError, InvalidArgumentError
from pagedkv.kvspec import (
    Attention,
    AttentionKV,
    LayerSpec,
    Recurrent,
    SlidingWindow,
    blocks_per_request,
    cdiv,
    step_blocks,
)
from pagedkv.plan import PlanOptions, make_plan, plan_to_dict

GiB = 2**30


def gpt_oss_like() -> list[LayerSpec]:
    """12 sliding-window (128) + 12 full layers, 8 KV heads x 64, bf16 (gpt-oss-20b)."""
    layers = []
    for i in range(24):
        if i % 2 == 0:
            layers.append(LayerSpec(f"l.{i}", AttentionKV(8, 64), SlidingWindow(128),
                                    Attention(window=128), index=i))
        else:
            layers.append(full_layer(i, AttentionKV(8, 64)))
    return layers


def _alt(plan, name):
    (alt,) = [a for a in plan.alternatives if a.name == name]
    return alt


def _separate_full_blocks(room: int, b_window: int, b_full: int) -> int:
    """The largest k (full blocks, c = k / b_full) whose separate pools fit ``room`` pages:
    ceil(c b_window) + k <= room; the old one-pool-per-group arithmetic, by brute force."""
    k = room
    while -(-b_window * k // b_full) + k > room:
        k -= 1
    return k


@pytest.mark.parametrize("typical_len", [None, 2048, 4096])
def test_gpt_oss_like_shares_one_pool_by_hand(typical_len):
    plan = make_plan(gpt_oss_like(), PlanOptions(40 * GiB, 131072, typical_len=typical_len))
    window, full = plan.groups
    # both groups: 12 layers x 2 x 8 x 64 x 2 B = 24576 B/token, pages of 16 tokens: the
    # layers pair up (same count, same shapes), so one pool serves both groups
    page = 16 * 24576
    pages = 40 * GiB // page
    assert pages == 109226
    (pool,) = plan.ranks[0].pools
    assert pool.group_ids == (0, 1) and window.pool == full.pool == pool.id == 0
    assert pool.num_pages == window.num_blocks == full.num_blocks == pages
    assert pool.reserved_pages == window.reserved_blocks == full.reserved_blocks == 1
    assert pool.nbytes == plan.ranks[0].used_bytes == pages * page
    # one null block, the window's 2048 / 16 = 128 step blocks once; every other page holds
    # requests: 9 window + 8192 full pages per request of 131072 tokens
    room = pages - 1 - 128
    assert room == 109097
    assert plan.capacity.max_concurrency == pytest.approx(room / (9 + 8192))  # 13.30
    assert plan.capacity.tokens == math.floor(Fraction(room, 9 + 8192) * 131072)
    # the separate pools gave the full group k of those pages, the window ceil(9k / 8192):
    # the same pages, so the same capacity up to the ceiling (one full block at most)
    k = _separate_full_blocks(room, 9, 8192)
    assert k == 108977 and math.ceil(9 * k / 8192) == 120
    assert 0 <= Fraction(room, 8201) - Fraction(k, 8192) < Fraction(1, 8192)
    assert plan.capacity.tokens - k * 16 < 16
    # requests of 4096 tokens: 9 window + 256 full pages each (the step still counts once);
    # the separate window pool held (120 / 9) = 13.3 of them, the shared pool room / 265
    shared_4k = Fraction(room, 9 + 256)
    assert shared_4k > 411 and Fraction(120, 9) < Fraction(14)
    assert shared_4k >= 30 * Fraction(120, 9)
    # layer j of the window group aliases layer j of the full group: same offset and shape
    views = {(v.layer, v.tensor): v for v in plan.ranks[0].views}
    for j in range(12):
        for t in ("k", "v"):
            w, f = views[(f"l.{2 * j}", t)], views[(f"model.layers.{2 * j + 1}.self_attn", t)]
            assert (w.offset, w.shape, w.pool) == (f.offset, f.shape, f.pool)
            assert w.shape == (pages, 16, 8, 64)
    if typical_len is None:
        assert plan.capacity.typical is None
        return
    # sized for typical requests the pool is the same: every page is in it already
    b_t = 9 + cdiv(typical_len, 16)
    assert plan.capacity.typical.max_concurrency == pytest.approx(room / b_t)
    assert plan.capacity.typical.tokens == math.floor(Fraction(room, b_t) * typical_len)
    longest = _alt(plan, "pagedkv-max-len")
    assert longest.num_blocks == pages
    assert longest.capacity.max_concurrency == plan.capacity.max_concurrency
    assert longest.capacity.typical.max_concurrency == plan.capacity.typical.max_concurrency


def test_recurrent_slots_follow_the_typical_length():
    # Kimi-K3 + DSpark at 40 GiB: 9 slots at 131072; at 8192 many more requests, each an
    # MLA request of 128 blocks plus a state slot; the slots count is an integer
    plan = make_plan(kimi_k3(), PlanOptions(40 * GiB, 131072, typical_len=8192))
    state, mla = plan.groups
    without = make_plan(kimi_k3(), PlanOptions(40 * GiB, 131072))
    assert state.num_blocks > without.groups[0].num_blocks == 9
    assert mla.num_blocks >= 2048  # one request of 131072 still fits
    typical = plan.capacity.typical.max_concurrency
    assert typical <= state.num_blocks and typical <= mla.num_blocks / 128
    assert plan.capacity.max_concurrency >= 1


def test_without_typical_len_nothing_changes():
    plan = make_plan(llama3_8b(), PlanOptions(40 * GiB, 8192))
    assert plan.capacity.typical is None
    assert [a.name for a in plan.alternatives] == ["vllm"]
    data = plan_to_dict(plan)
    assert data["capacity"]["typical"] is None


def test_full_attention_only_is_the_same_plan_either_way():
    # no window, no state: every pool grows with tokens alike, so the typical length
    # cannot change the split
    a = make_plan(llama3_8b(), PlanOptions(40 * GiB, 8192))
    b = make_plan(llama3_8b(), PlanOptions(40 * GiB, 8192, typical_len=512))
    assert [g.num_blocks for g in a.groups] == [g.num_blocks for g in b.groups] == [20480]
    assert b.capacity.max_concurrency == a.capacity.max_concurrency == 40.0
    assert b.capacity.typical.max_concurrency == 20480 * 16 / 512


@pytest.mark.parametrize("typical_len", [0, -5, 8193, True, 2.5])
def test_bad_typical_len_is_refused(typical_len):
    with pytest.raises(InvalidArgumentError, match="typical_len"):
        make_plan(llama3_8b(), PlanOptions(40 * GiB, 8192, typical_len=typical_len))


def test_max_model_len_must_still_fit():
    one_request = 8192 * 131072  # llama-3-8b: 1 GiB at 8K
    with pytest.raises(DoesNotFitError, match="8192 tokens"):
        make_plan(llama3_8b(), PlanOptions(one_request - 1, 8192, typical_len=128))
    plan = make_plan(llama3_8b(), PlanOptions(one_request, 8192, typical_len=128))
    assert plan.capacity.max_concurrency == 1.0 and plan.capacity.typical.max_concurrency == 64


def _held_at(plan, length):
    """Requests of ``length`` tokens that a plan's pools hold at once, from its groups: a
    pool shared by several groups gives each request sum b_g pages, the step sum s_g."""
    mbt = plan.options.max_batched_tokens
    pools: dict[int, list] = {}
    for g in plan.groups:
        pools.setdefault(g.id if g.pool is None else g.pool, []).append(g)
    held = []
    for members in pools.values():
        first = members[0]
        if first.is_recurrent:
            held.append(Fraction(first.num_blocks))
            continue
        b = s = 0
        for g in members:
            bs = g.block_size
            bg = blocks_per_request(g.retention, length, bs)
            b += bg
            s += 0 if bg >= cdiv(length, bs) else step_blocks(g.retention, mbt, bs)
        held.append(Fraction(first.num_blocks - first.reserved_blocks - s, b))
    return min(held)


SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(
    layers=layer_specs(max_layers=16),
    budget=st.integers(2**33, 2**37),
    max_len=st.integers(1, 32768),
    share=st.floats(0.001, 1.0),
    block_size=st.sampled_from([None, 16, 64]),
    mbt=st.sampled_from([256, 2048]),
)
def test_typical_plan_holds_at_least_as_many_typical_requests(
    layers, budget, max_len, share, block_size, mbt
):
    typical = max(1, int(max_len * share))
    base = PlanOptions(budget, max_len, block_size, mbt)
    try:
        longest = make_plan(layers, base)
    except DoesNotFitError:
        with pytest.raises(DoesNotFitError):
            make_plan(layers, PlanOptions(budget, max_len, block_size, mbt, typical_len=typical))
        assume(False)
    plan = make_plan(layers, PlanOptions(budget, max_len, block_size, mbt, typical_len=typical))
    # at least as many typical requests as the max-len plan's pools hold
    at_typical = _held_at(plan, typical)
    assert at_typical >= _held_at(longest, typical)
    assert plan.capacity.typical.max_concurrency == pytest.approx(float(at_typical))
    # one request of max_model_len still fits, and capacity reports the built pools
    assert plan.capacity.max_concurrency >= 1
    assert plan.capacity.max_concurrency == pytest.approx(float(_held_at(plan, max_len)))
    for g in plan.groups:
        if not g.is_recurrent:
            assert g.usable_blocks >= g.blocks_per_request + g.step_blocks
    # never over the budget; pool bytes are the views' pages
    for rank in plan.ranks:
        assert sum(p.nbytes for p in rank.pools) == rank.used_bytes <= budget
    assert 0 <= plan.padding_bytes <= budget
    # the max-len plan is reported as it is built without typical_len
    alt = _alt(plan, "pagedkv-max-len")
    assert alt.capacity.max_concurrency == longest.capacity.max_concurrency
    assert alt.num_blocks == longest.num_blocks and alt.padding_bytes == longest.padding_bytes
    assert alt.capacity.typical.max_concurrency == pytest.approx(float(_held_at(longest, typical)))


def test_state_only_model_counts_whole_slots():
    layers = [LayerSpec(f"s{i}", KDA, Recurrent(), index=i) for i in range(2)]
    per_request = 2 * sum(t.nbytes for t in KDA.request_tensors())
    plan = make_plan(layers, PlanOptions(5 * per_request // 2, 8192, typical_len=100))
    assert plan.groups[0].num_blocks == 2
    assert plan.capacity.typical.max_concurrency == plan.capacity.max_concurrency == 2.0
