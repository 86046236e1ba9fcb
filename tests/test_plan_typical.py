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
from pagedkv.plan import PlanOptions, make_plan, plan_to_dict
from pagedkv.spec import (
    Attention,
    AttentionKV,
    LayerSpec,
    Recurrent,
    SlidingWindow,
    blocks_per_request,
    cdiv,
    step_blocks,
)

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


def test_gpt_oss_like_typical_2048_of_131072_by_hand():
    plan = make_plan(gpt_oss_like(), PlanOptions(40 * GiB, 131072, typical_len=2048))
    window, full = plan.groups
    # both groups: 12 layers x 2 x 8 x 64 x 2 B = 24576 B/token, pages of 16 tokens
    page = 16 * 24576
    pages = 40 * GiB // page
    assert pages == 109226 and 40 * GiB % page == 40 * GiB - pages * page
    # at 2048 tokens: window b = cdiv(127, 16) + 1 = 9 blocks, step 2048 / 16 = 128 once,
    # 1 null block; full b = 128, no step. Floors (one request of 131072 alone): window
    # 9 + 128 = 137, full 8192. x requests: 1 + max(128 + ceil(9x), 137)
    # + max(ceil(128x), 8192) <= 109226; above the floors ceil(9x) + ceil(128x) <= 109097.
    room = pages - 1 - 128
    assert room == 109097
    # on the grid x = k/128: k = 101930 -> ceil(9k/128) = 7167, 7167 + 101930 = 109097 fits;
    # k = 101931 needs 7168 + 101931 > 109097
    assert math.ceil(9 * 101930 / 128) + 101930 == room
    assert math.ceil(9 * 101931 / 128) + 101931 > room
    # on the grid x = j/9 the best is lower: j = 7167 needs 7167 + 101931 > room
    assert 7167 + math.ceil(128 * 7167 / 9) > room
    assert 7166 + math.ceil(128 * 7166 / 9) <= room and Fraction(7166, 9) < Fraction(101930, 128)
    assert full.num_blocks == 101930 and full.reserved_blocks == 0
    assert window.num_blocks == 1 + 128 + 7167 and window.reserved_blocks == 1
    assert plan.capacity.typical.len == 2048
    assert plan.capacity.typical.max_concurrency == pytest.approx(101930 / 128)  # 796.33
    assert plan.capacity.typical.tokens == 101930 * 16
    # at 131072: full holds 101930 / 8192 = 12.44 requests, window (7296 - 1 - 128) / 9 more
    assert plan.capacity.max_model_len == 131072
    assert plan.capacity.max_concurrency == pytest.approx(101930 / 8192)
    assert plan.capacity.tokens == 101930 * 16
    assert plan.ranks[0].used_bytes == (7296 + 101930) * page <= 40 * GiB
    # the plan for 131072 (as without typical_len): window b = 9, step 128, null 1; full
    # 8192: ceil(9k/8192) + k <= 109097 -> k = 108977 (120 + 108977); k = 108978 does not fit
    assert math.ceil(9 * 108977 / 8192) + 108977 == room
    assert math.ceil(9 * 108978 / 8192) + 108978 > room
    longest = _alt(plan, "pagedkv-max-len")
    assert longest.num_blocks == (1 + 128 + 120) + 108977
    assert longest.capacity.max_concurrency == pytest.approx(108977 / 8192)  # 13.30
    # ... whose window pool holds only 120 / 9 = 13.3 requests of 2048 tokens
    assert longest.capacity.typical.max_concurrency == pytest.approx(120 / 9)
    assert longest.capacity.typical.tokens == math.floor(Fraction(120, 9) * 2048)
    without = make_plan(gpt_oss_like(), PlanOptions(40 * GiB, 131072))
    assert longest.capacity.max_concurrency == without.capacity.max_concurrency
    assert longest.num_blocks == without.num_blocks
    assert longest.padding_bytes == without.padding_bytes
    text = plan.capacity.limited_by
    assert "12.44 requests of 131072 tokens" in text and "796.33 requests of 2048" in text


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
    """Requests of ``length`` tokens that a plan's pools hold at once, from its groups."""
    mbt = plan.options.max_batched_tokens
    held = []
    for g in plan.groups:
        if g.is_recurrent:
            held.append(Fraction(g.num_blocks))
            continue
        bs = g.block_size
        b = blocks_per_request(g.retention, length, bs)
        s = 0 if b >= cdiv(length, bs) else step_blocks(g.retention, mbt, bs)
        held.append(Fraction(g.num_blocks - g.reserved_blocks - s, b))
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
