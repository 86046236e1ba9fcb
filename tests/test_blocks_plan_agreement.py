"""The block manager and the plan agree to the block: the null block a window pool keeps is
counted by the planner, so the manager's usable blocks per group are the plan's, and a
request the plan says fits (one of max_model_len) is admitted and runs on an empty manager.
"""

from __future__ import annotations

import pytest

from pagedkv.blocks import KVCacheManager
from pagedkv.errors import DoesNotFitError
from pagedkv.models import load_model
from pagedkv.plan import PlanOptions, make_plan

GiB = 2**30
MODELS = ("gpt-oss-20b", "gemma-3-27b", "llama-4-scout", "mistral-7b")
MAX_LEN = 32768
WINDOWED = ("sliding_window", "chunked_local")


@pytest.fixture(scope="module", params=MODELS)
def layers(request):
    return load_model(request.param).layers


def _usable(mgr: KVCacheManager) -> dict[int, int]:
    return {g.group_id: g.blocks_total for g in mgr.metrics().groups}


def _run_one_request(plan, length: int) -> None:
    """A request of ``length`` tokens alone on an empty manager: admitted, prefilled in
    chunks of the step budget, one decode step; every allocation succeeds."""
    mgr = KVCacheManager.from_plan(plan, checked=False)
    mgr.check_fits(length)
    prompt = list(range(1, length))  # the last token is decoded
    mgr.add_request("r", prompt, max_new_tokens=1)
    assert mgr.find_cached_prefix("r") == 0
    step = plan.options.max_batched_tokens
    done = 0
    while done < len(prompt):
        n = min(step, len(prompt) - done)
        assert mgr.allocate("r", n), f"prefill chunk at {done} refused"
        done += n
        mgr.commit("r", n, [7] if done == len(prompt) else [])
    assert mgr.allocate("r", 1)
    mgr.commit("r", 1, [8])
    mgr.free("r")


def _check_agreement(plan) -> None:
    mgr = KVCacheManager.from_plan(plan, checked=False)
    usable = _usable(mgr)
    for g in plan.groups:
        expected_reserved = 1 if g.retention.kind in WINDOWED else 0
        assert g.reserved_blocks == expected_reserved
        assert usable[g.id] == g.num_blocks - expected_reserved == g.usable_blocks
        if not g.is_recurrent:  # the plan's worst case for one request fits its own pool
            assert g.usable_blocks >= g.blocks_per_request + g.step_blocks
    for pool in plan.ranks[0].pools:
        (gid,) = pool.group_ids
        assert pool.num_pages == plan.groups[gid].num_blocks
        assert pool.reserved_pages == plan.groups[gid].reserved_blocks


@pytest.mark.parametrize("typical_len", [None, 1024])
def test_manager_usable_blocks_equal_the_plan_at_40gib(layers, typical_len):
    plan = make_plan(layers, PlanOptions(40 * GiB, MAX_LEN, typical_len=typical_len))
    assert any(g.retention.kind in WINDOWED for g in plan.groups)  # the case that matters
    _check_agreement(plan)
    _run_one_request(plan, MAX_LEN)


def _smallest_budget(layers, **kw) -> int:
    """Bisection: the least budget whose plan holds one request of MAX_LEN."""
    lo, hi = 1, 40 * GiB  # lo does not fit, hi does
    make_plan(layers, PlanOptions(hi, MAX_LEN, **kw))
    while hi - lo > 1:
        mid = (lo + hi) // 2
        try:
            make_plan(layers, PlanOptions(mid, MAX_LEN, **kw))
            hi = mid
        except DoesNotFitError:
            lo = mid
    return hi


@pytest.mark.parametrize("typical_len", [None, 1024])
def test_a_request_the_tightest_plan_admits_runs_on_an_empty_manager(layers, typical_len):
    # with the least budget that fits, the plan holds one request of MAX_LEN and not a
    # block more in some group: the one the manager's null block used to take away
    budget = _smallest_budget(layers, typical_len=typical_len)
    plan = make_plan(layers, PlanOptions(budget, MAX_LEN, typical_len=typical_len))
    assert 1 <= plan.capacity.max_concurrency < 1.01
    _check_agreement(plan)
    _run_one_request(plan, MAX_LEN)
    with pytest.raises(DoesNotFitError):
        make_plan(layers, PlanOptions(budget - 1, MAX_LEN, typical_len=typical_len))


def test_from_plan_refuses_pools_that_do_not_reserve_the_null_block(layers):
    import dataclasses

    from pagedkv.errors import InvalidArgumentError

    plan = make_plan(layers, PlanOptions(40 * GiB, MAX_LEN))
    rank = plan.ranks[0]
    stale = tuple(dataclasses.replace(p, reserved_pages=0) for p in rank.pools)
    old = dataclasses.replace(plan, ranks=(dataclasses.replace(rank, pools=stale),))
    with pytest.raises(InvalidArgumentError, match="reserves 0 pages"):
        KVCacheManager.from_plan(old)
