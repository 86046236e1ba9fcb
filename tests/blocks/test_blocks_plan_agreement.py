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
    chunks of the step budget, one decode step; every allocation succeeds (fixed pools
    and elastic ones alike)."""
    for elastic in (False, True):
        _run_one(KVCacheManager.from_plan(plan, checked=False, elastic=elastic), plan, length)


def _run_one(mgr, plan, length: int) -> None:
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
    """Per pool: the manager's usable blocks are the plan's; a pool keeps one null block
    when any of its groups is windowed; every group of a pool reports the pool's pages.
    Elastic pools can grow past the plan's fixed sizes (their ceilings) but never less."""
    mgr = KVCacheManager.from_plan(plan, checked=False, elastic=False)
    usable = _usable(mgr)
    elastic = _usable(KVCacheManager.from_plan(plan, checked=False))
    assert all(elastic[g] >= usable[g] for g in usable)
    groups = {g.id: g for g in plan.groups}
    for pool in plan.ranks[0].pools:
        members = [groups[gid] for gid in pool.group_ids]
        expected_reserved = int(any(g.retention.kind in WINDOWED for g in members))
        assert pool.reserved_pages == expected_reserved
        for g in members:
            assert g.pool in (None, pool.id)
            assert g.reserved_blocks == expected_reserved
            assert pool.num_pages == g.num_blocks
            assert usable[g.id] == g.num_blocks - expected_reserved == g.usable_blocks
        if not members[0].is_recurrent:  # the plan's worst case for one request fits
            need = sum(g.blocks_per_request + g.step_blocks for g in members)
            assert pool.num_pages - pool.reserved_pages >= need


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


def _admit_4096(mgr: KVCacheManager) -> int:
    """Requests of 4096 tokens (4095 prompt + 1 decoded) admitted one after the other and
    kept: each prefills in chunks of 2048 and decodes one token; the count that ran before
    an allocation was refused."""
    n = 0
    while True:
        mgr.add_request(n, list(range(1, 4096)), max_new_tokens=1)
        done = 0
        while done < 4095:
            c = min(2048, 4095 - done)
            if not mgr.allocate(n, c):
                return n
            done += c
            mgr.commit(n, c, [7] if done == 4095 else [])
        assert mgr.allocate(n, 1)
        mgr.commit(n, 1, [8])
        n += 1


def test_shared_pool_admits_far_more_short_requests_than_separate_pools():
    import dataclasses

    layers = load_model("gpt-oss-20b").layers
    page = 16 * 24 // 2 * 2 * 8 * 64 * 2  # 12 layers x K and V x 8 heads x 64 x bf16
    pages = 3000
    plan = make_plan(layers, PlanOptions(pages * page, 16384))
    window, full = plan.groups
    assert window.retention.kind == "sliding_window" and full.retention.kind == "full"
    assert window.pool == full.pool and window.num_blocks == full.num_blocks == pages
    # the old separate pools at 16384 tokens: window b = 9, step 128, null 1; full b = 1024;
    # room = 3000 - 129 = 2871 pages; full k with ceil(9k / 1024) + k <= 2871: k = 2845
    room = pages - 1 - 128
    k = room
    while -(-9 * k // 1024) + k > room:
        k -= 1
    assert k == 2845 and -(-9 * k // 1024) == 26
    old_groups = [dataclasses.replace(window, num_blocks=1 + 128 + 26, pool=None),
                  dataclasses.replace(full, num_blocks=k, reserved_blocks=0, pool=None)]
    old = KVCacheManager(old_groups, max_model_len=16384, checked=True, sweep_every=1)
    new = KVCacheManager.from_plan(plan, checked=True, sweep_every=1)
    # a request that ran holds its 256 full blocks and, until its next block boundary
    # (window frees run there), the window blocks of its last chunk: 2047 tokens at
    # 2048..4094 = blocks 128..255, plus the 8 blocks 120..127 of the 127 keys before:
    # 136. The separate window pool (154 usable) holds one such request, the shared pool
    # (2999 usable) floor(2999 / (256 + 136)) = 7.
    per_request = 256 + 8 + 128
    assert old.pools[0].usable == 154 and 154 // (8 + 128) == 1
    assert _admit_4096(old) == 1
    assert _admit_4096(new) == (pages - 1) // per_request == 7
