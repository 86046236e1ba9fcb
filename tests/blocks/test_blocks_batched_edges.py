"""``allocate_batch`` / ``commit_batch`` take a decode step's boundary work on short paths
(``_grow`` called directly; ``_commit_edges``: the step's newly full blocks hashed and
cached after its plain commits). Differential: the same random decode-heavy runs driven
once through the batched calls and once through one ``allocate`` / ``commit`` per request
(the general paths) make the same decisions, block tables, hits, evictions, events and
page ops."""

from __future__ import annotations

import random

import pytest
from block_groups import group
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.blocks import KVCacheManager
from pagedkv.blocks.hashing import DEFAULT_HASH, FAST_HASH
from pagedkv.errors import InvalidArgumentError
from pagedkv.kvspec import Full, SlidingWindow

KIB = 1024


def _manager(bs: int, offset: int, budget_pages: int | None, algo: str, events: bool,
             checked: bool, windowed: bool = False) -> KVCacheManager:
    groups = [group(0, Full(), bs, 48, offset=offset, max_model_len=16)]  # floors: 16 tokens
    if windowed:
        groups.append(group(1, SlidingWindow(8), bs, 48, max_model_len=16))
    kw = {} if budget_pages is None else {"budget_bytes": budget_pages * 32 * KIB,
                                          "page_bytes": 32 * KIB}
    return KVCacheManager(groups, max_model_len=64, max_batched_tokens=64, hash_algo=algo,
                          events=events, checked=checked, **kw)


def _run(m: KVCacheManager, seed: int, batched: bool, lookahead: int) -> list:
    """Requests sharing prompt prefixes (hits, some ending inside a block) decode together
    one token per step, the newest preempted when a step does not fit; every decision,
    table, hit, event and page op in order."""
    rng = random.Random(seed)
    base = [rng.randrange(5) for _ in range(40)]
    out: list = []
    running: list = []
    waiting: list = []
    for step in range(rng.randrange(15, 40)):
        if len(waiting) < 3:
            prompt = base[:rng.randrange(1, 30)] + [rng.randrange(5) for _ in range(rng.randrange(3))]
            m.add_request(step, prompt)
            waiting.append(step)
        i = 0
        while i < len(running):  # this step's decodes, preempting the newest when short
            if batched:
                i += m.allocate_batch(running[i:], 1, lookahead)
            else:
                while i < len(running) and m.allocate(running[i], 1, lookahead):
                    i += 1
            if i < len(running):
                victim = running.pop()
                m.preempt(victim)
                waiting.insert(0, victim)
                out.append(("preempt", victim))
        if waiting and len(running) < 6:
            rid = waiting[0]
            hit = m.find_cached_prefix(rid)
            n = m.num_tokens(rid) - hit
            ok = m.allocate(rid, n)
            out.append(("admit", rid, hit, ok))
            if ok:
                waiting.pop(0)
                m.commit(rid, n, [rng.randrange(5)])
            else:
                m.free(rid)
                waiting.pop(0)
        decoding = [r for r in running if m.num_computed(r) + 1 == m.num_tokens(r)]
        toks = [rng.randrange(5) for _ in decoding]
        if batched:
            m.commit_batch(decoding, toks)
        else:
            for r, t in zip(decoding, toks):
                m.commit(r, 1, [t])
        if out and out[-1][0] == "admit" and out[-1][3]:
            running.append(out[-1][1])
        out.append(("tables", [(r, [list(t) for t in m.block_tables(r)], m.num_computed(r))
                               for r in running]))
        out.append(("events", m.drain_events()))
        out.append(("pages", m.drain_page_ops(), m.drain_copy_ops()))
        for r in list(running):
            if m.num_tokens(r) > 36 or rng.random() < 0.06:
                running.remove(r)
                m.free(r)
    out.append(("end", m.metrics()))
    return out


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), bs=st.sampled_from([2, 4]), offset=st.sampled_from([0, 1]),
       budget=st.sampled_from([None, 6, 9, 64]), algo=st.sampled_from([FAST_HASH, DEFAULT_HASH]),
       events=st.booleans(), lookahead=st.sampled_from([0, 0, 1]))
def test_batched_decode_calls_decide_as_per_request_calls(seed, bs, offset, budget, algo,
                                                          events, lookahead):
    ref = _run(_manager(bs, offset, budget, algo, events, checked=False), seed, False, lookahead)
    got = _run(_manager(bs, offset, budget, algo, events, checked=True), seed, True, lookahead)
    assert got == ref


@pytest.mark.parametrize("budget", [None, 64])
@pytest.mark.parametrize("seed", range(4))
def test_batched_calls_with_a_window_group_take_the_general_path_alike(seed, budget):
    ref = _run(_manager(4, 0, budget, FAST_HASH, False, False, windowed=True), seed, False, 0)
    got = _run(_manager(4, 0, budget, FAST_HASH, False, True, windowed=True), seed, True, 0)
    assert got == ref


def test_a_block_filled_in_a_batched_step_is_a_hit_for_the_next_request():
    m = _manager(4, 0, None, DEFAULT_HASH, False, checked=True)
    m.add_request("a", [1, 2, 3, 4, 5, 6])
    assert m.find_cached_prefix("a") == 0
    assert m.allocate("a", 6)
    m.commit("a", 6, [7])
    for tok in (8, 9):  # then tokens 1..8 are computed: block [5, 6, 7, 8] is full
        assert m.allocate_batch(["a"]) == 1
        m.commit_batch(["a"], [tok])
    m.add_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert m.find_cached_prefix("b") == 8
    assert m.allocate("b", 1)
    assert m.block_tables("b")[0][:2] == m.block_tables("a")[0][:2]


def test_a_failing_commit_batch_still_commits_the_earlier_boundaries():
    m = _manager(4, 0, None, FAST_HASH, False, checked=False)
    for rid in ("a", "b"):
        m.add_request(rid, [1, 2, 3] if rid == "a" else [9, 9, 9, 9])
        m.find_cached_prefix(rid)
        assert m.allocate(rid, m.num_tokens(rid))
        m.commit(rid, m.num_tokens(rid), [4 if rid == "a" else 9])
    assert m.allocate("a", 1)  # "b" gets no slot for its next token
    with pytest.raises(InvalidArgumentError, match="cannot commit"):
        m.commit_batch(["a", "b"], [5, 6])
    assert m.num_computed("a") == 4
    assert m.requests["a"].ncached[0] == 1  # its full block was cached before the error
    assert m.metrics().groups[0].blocks_cached == 2  # and "b"'s prompt block


@pytest.mark.parametrize("budget", [None, 64])
def test_allocate_batch_with_a_request_listed_twice_or_an_unknown_one_acts_as_one_by_one(budget):
    """Growing requests are served together (one pool call) at the end of the batch or
    before a request that needs the general path: a request listed twice still grows
    once, and an unknown id raises after the requests before it got their slots, as
    per-request calls do."""
    def fresh():
        m = _manager(4, 0, budget, FAST_HASH, False, checked=True)
        for rid in ("a", "b", "c"):
            m.add_request(rid, [1, 2, 3] if rid != "b" else [5, 6, 7])
            m.find_cached_prefix(rid)
            assert m.allocate(rid, 3)
            m.commit(rid, 3, [4])  # 4 tokens, 3 computed: the next token fills block 0
            assert m.allocate(rid, 1)
            m.commit(rid, 1, [9])  # the next one opens block 1
        return m

    one, batch = fresh(), fresh()
    for rid in ("a", "b", "a", "c"):
        assert one.allocate(rid, 1)
    assert batch.allocate_batch(["a", "b", "a", "c"]) == 4
    assert [batch.block_tables(r) for r in "abc"] == [one.block_tables(r) for r in "abc"]
    assert batch.blocks_used() == one.blocks_used()

    one, batch = fresh(), fresh()
    assert one.allocate("a", 1) and one.allocate("b", 1)
    with pytest.raises(InvalidArgumentError, match="unknown request 'zz'"):
        batch.allocate_batch(["a", "b", "zz", "c"])
    assert [batch.block_tables(r) for r in "abc"] == [one.block_tables(r) for r in "abc"]
