"""KVCacheManager on hand-built groups; every expected number is worked out by hand in
the comments (block size 4 unless said)."""

from __future__ import annotations

import pytest
from block_groups import (
    deepseek_mtp_like,
    full_only,
    gpt_oss_like,
    group,
    kimi_dspark_like,
)

from pagedkv.blocks import KVCacheManager, lookahead_tokens
from pagedkv.blocks.hashing import hash_extender, root_hash
from pagedkv.errors import (
    CacheCorruptedError,
    InvalidArgumentError,
    RequestTooLargeError,
)
from pagedkv.kvspec import ChunkedLocal, Cross, Full, SlidingWindow


def make(groups, **kw):
    kw.setdefault("checked", True)
    kw.setdefault("sweep_every", 1)  # the full sweep after every call
    kw.setdefault("events", True)
    kw.setdefault("max_batched_tokens", 64)
    return KVCacheManager(groups, **kw)


def prefill(m, rid, prompt, first_token=1000, **kw):
    m.add_request(rid, prompt, **kw)
    hit = m.find_cached_prefix(rid)
    assert m.allocate(rid, len(prompt) - hit)
    m.commit(rid, len(prompt) - hit, [first_token])
    return hit


def decode(m, rid, tokens):
    for t in tokens:
        assert m.allocate(rid, 1)
        m.commit(rid, 1, [t])


def tokens(n, start=0):
    return list(range(start, start + n))


# --- full attention ---------------------------------------------------------------------

def test_full_hit_is_the_cached_full_blocks_at_most_all_tokens_but_one():
    m = make(full_only())
    a = tokens(10)
    assert prefill(m, "a", a) == 0
    m.free("a")
    # a cached blocks [0..3] and [4..7]; its last 2 prompt tokens fill no block
    assert prefill(m, "b", a[:8] + [50, 51]) == 8
    assert prefill(m, "c", a[:6] + [60, 61, 62]) == 4
    m.free("b")
    m.free("c")
    assert m.metrics().prefix_hits == 12 and m.metrics().prefix_queries == 29


def test_hit_ending_inside_a_block_copies_that_block_instead_of_writing_it():
    m = make(full_only())
    a = tokens(8)
    prefill(m, "a", a)
    table_a = list(m.block_tables("a")[0])
    m.drain_copy_ops()
    # "d" is exactly a's 8 tokens: at most 7 may hit, inside a's second block
    m.add_request("d", a)
    assert m.find_cached_prefix("d") == 7
    assert m.allocate("d", 1)
    (op,) = m.drain_copy_ops()
    table_d = m.block_tables("d")[0]
    assert table_d[0] == table_a[0]
    assert op.kind == "copy" and op.src == table_a[1] and op.dst == table_d[1] != table_a[1]
    assert op.position == 7
    m.commit("d", 1, [5])
    assert m.metrics().groups[0].blocks_used == 3  # a's two + d's copy


@pytest.mark.parametrize("algo", ["fast-single-tenant", "sha256", "xxh3_128"])
def test_extra_keys_and_multimodal_ids_separate_cache_entries(algo):
    if algo == "xxh3_128":
        pytest.importorskip("xxhash")
    m = make(full_only(), hash_algo=algo)
    p = tokens(12)
    prefill(m, "a", p, extra_keys=("tenant-1",), mm_spans=[(4, 6, 98)])
    assert prefill(m, "b", p + [1], extra_keys=("tenant-2",), mm_spans=[(4, 6, 98)]) == 0
    # same tenant, other image in block 1: only block 0 matches
    assert prefill(m, "c", p + [1], extra_keys=("tenant-1",), mm_spans=[(4, 6, 99)]) == 4
    assert prefill(m, "e", p + [1], extra_keys=("tenant-1",), mm_spans=[(4, 6, 98)]) == 12


def test_a_deployment_secret_keys_every_block_and_must_be_bytes():
    a = make(full_only(), hash_secret=b"deployment-a")
    b = make(full_only(), hash_secret=b"deployment-b")
    prefill(a, "r", tokens(8))
    prefill(b, "r", tokens(8))
    ka, kb = a.requests["r"].hashes[4], b.requests["r"].hashes[4]
    assert len(ka) == len(kb) == 2 and not set(ka) & set(kb)
    assert prefill(a, "s", tokens(8) + [3]) == 8  # hits still work under one secret
    with pytest.raises(InvalidArgumentError, match="hash_secret"):
        make(full_only(), hash_secret="not bytes")


# --- position offset (EAGLE / MTP) ------------------------------------------------------

def test_offset_group_backs_off_by_its_offset_not_by_a_block():
    m = make(deepseek_mtp_like())
    a = tokens(16)
    prefill(m, "a", a)
    # the MTP layer's KV at p needs token p+1: after 16 computed tokens its first 3 blocks
    # (positions 0..11) are final, the 4th (12..15) waits for token 16
    b = a[:12] + [90, 91, 92, 93]
    # target hits 12 tokens; MTP hits 3 blocks = 12 positions, minus offset 1 -> 11
    assert prefill(m, "b", b) == 11
    ops = [op for op in m.drain_copy_ops() if op.kind == "copy"]
    assert sorted(op.group_id for op in ops) == [0, 1] and all(op.position == 11 for op in ops)


def test_offset_group_caches_a_block_once_the_next_token_is_computed():
    m = make(deepseek_mtp_like())
    a = tokens(16)
    prefill(m, "a", a)
    assert m.metrics().groups[1].blocks_cached == 3
    decode(m, "a", [500])  # computes position 16 (token 1000): block 3 of the MTP group is final
    assert m.metrics().groups[1].blocks_cached == 4
    assert m.metrics().groups[0].blocks_cached == 4


# --- sliding window ---------------------------------------------------------------------

def test_window_blocks_leave_while_the_request_runs():
    m = make(gpt_oss_like(window=8))
    prefill(m, "a", tokens(20))
    decode(m, "a", tokens(4, 100))  # computed 24 when the 5th decode allocates block 6
    assert m.allocate("a", 1)
    # a query at 24 reads from position 17 (window 8): blocks 0..3 (positions 0..15) go
    window_table = m.block_tables("a")[1]
    assert window_table[:4] == [0, 0, 0, 0] and 0 not in window_table[4:]
    assert len(window_table) == 7
    assert m.metrics().groups[1].blocks_used == 3
    assert m.metrics().groups[0].blocks_used == 7


def test_window_hit_needs_only_the_window_before_the_hit_point():
    m = make(gpt_oss_like(window=8))
    a = tokens(20)
    prefill(m, "a", a)
    win_a = list(m.block_tables("a")[1])
    m.free("a")
    b = a + [9, 9, 9, 9]
    pool = m.managers[1].pool
    pool.uncache(win_a[0])  # the oldest blocks may go: a hit at 20 reads 13..19 only
    m.add_request("b", b)
    assert m.find_cached_prefix("b") == 20
    m.free("b")
    pool.uncache(win_a[3])
    # 20 needs blocks 3,4; 16 needs 2,3; 12 needs blocks 1,2 (positions 5..11): all there
    m.add_request("c", b)
    assert m.find_cached_prefix("c") == 12
    assert m.allocate("c", 12)
    assert m.block_tables("c")[1][:3] == [0, win_a[1], win_a[2]]


def test_chunked_local_hit_at_a_chunk_boundary_needs_no_earlier_block():
    groups = [group(0, Full(), 4, 64), group(1, ChunkedLocal(8), 4, 64)]
    m = make(groups)
    a = tokens(20)
    prefill(m, "a", a)
    chunk_blocks = list(m.block_tables("a")[1])
    m.free("a")
    for b in chunk_blocks:
        if b:
            m.managers[1].pool.uncache(b)
    # full group hits 16 (4 blocks); position 16 starts a chunk and reads nothing before it
    assert prefill(m, "b", a[:18] + [7, 7]) == 16


# --- recurrent --------------------------------------------------------------------------

def test_recurrent_hit_only_at_a_checkpoint_and_restores_a_copy():
    m = make(kimi_dspark_like(checkpoint_every=2))  # checkpoint every 8 tokens
    a = tokens(20)
    prefill(m, "a", a)
    saves = [op for op in m.drain_copy_ops() if op.kind == "save"]
    assert sorted(op.position for op in saves) == [8, 16]  # reserved longest first
    slot_16 = next(op.dst for op in saves if op.position == 16)
    # b: full group hits 16 (block 4 differs), the state checkpoint at 16 exists
    m.add_request("b", a[:19] + [77])
    assert m.find_cached_prefix("b") == 16
    assert m.allocate("b", 4)
    (restore,) = [op for op in m.drain_copy_ops() if op.kind == "restore"]
    assert restore.src == slot_16 and restore.dst == m.block_tables("b")[1][0] != slot_16
    assert restore.position == 16
    pool = m.managers[1].pool
    assert pool.ref[slot_16] == 1  # held until the step that runs the copy is over
    m.commit("b", 4, [1])
    assert pool.ref[slot_16] == 0 and slot_16 in pool.evictable
    # c diverges at 12: full could hit 12 but the state only exists at 8
    assert prefill(m, "c", a[:12] + [5] * 8) == 8


def test_recurrent_without_checkpoints_never_hits():
    m = make(kimi_dspark_like(checkpoint_every=None))
    a = tokens(20)
    prefill(m, "a", a)
    assert prefill(m, "b", a + [1]) == 0


# --- speculative decoding ---------------------------------------------------------------

def test_draft_scratch_blocks_are_released_and_never_cached():
    groups = kimi_dspark_like(draft_block=3)
    m = make(groups)
    k = lookahead_tokens(groups, 2)
    assert k == 2  # max(2 drafts, draft block 3 - 1)
    prefill(m, "a", tokens(6), first_token=6)
    pool = m.managers[0].pool
    assert m.allocate("a", 1, k)  # positions 6..8: three blocks
    third = m.block_tables("a")[0][2]
    m.commit("a", 1, [7])  # every draft rejected: 7 committed, block 2 held only scratch
    assert len(m.block_tables("a")[0]) == 2
    assert third in pool.free and pool.block_hash[third] is None
    assert m.allocate("a", 1, k)
    m.commit("a", 3, [8, 9, 10])  # two drafts accepted: 10 committed
    committed = tokens(10)
    expected: list[int] = []
    hash_extender("sha256")(committed, 0, 2, 4, root_hash(()), expected)
    cached = {pool.block_hash[b] for b in m.block_tables("a")[0] if pool.block_hash[b]}
    assert cached == set(expected)  # exactly the two blocks full of committed tokens


def test_lookahead_counts_drafts_when_no_draft_block():
    assert lookahead_tokens(full_only(), 4) == 4
    assert lookahead_tokens(full_only(), 0) == 0


# --- admission, preemption --------------------------------------------------------------

def test_requests_that_can_never_fit_are_refused_with_the_planner_arithmetic():
    m = make(full_only(num_blocks=10), max_model_len=100)  # full pool: no null block, 10 x 4
    with pytest.raises(RequestTooLargeError):
        m.add_request("x", tokens(41))
    with pytest.raises(RequestTooLargeError):
        m.add_request("y", tokens(30), max_new_tokens=11)
    m.add_request("z", tokens(40))
    with pytest.raises(RequestTooLargeError):
        make(full_only(num_blocks=64), max_model_len=20).add_request("w", tokens(21))


def test_window_admission_counts_window_plus_step_blocks_capped_by_all_tokens():
    # window 8, blocks of 4, step budget 16: a request of n tokens holds at most
    # min(ceil(n/4), 3) window blocks plus ceil(min(n, 16) / 4) for its step's tokens,
    # and never more than ceil(n/4); the window pool has 7 - 1 null block = 6
    m = make([group(0, SlidingWindow(8), 4, 7)], max_batched_tokens=16)
    m.add_request("a", tokens(12))  # min(3 + 3, 3) = 3
    m.add_request("b", tokens(24))  # min(3 + 4, 6) = 6
    with pytest.raises(RequestTooLargeError):
        m.add_request("c", tokens(25))  # min(3 + 4, 7) = 7
    # and the 24-token request really runs in 6 blocks: chunks of 16 then 8 tokens
    m.find_cached_prefix("b")
    assert m.allocate("b", 16)
    m.commit("b", 16)
    assert m.allocate("b", 8)
    m.commit("b", 8, [1])


def test_admission_agrees_with_the_plan_for_a_request_at_max_model_len():
    from pagedkv.models import load_model
    from pagedkv.plan import PlanOptions, make_plan

    for model, draft in (("gpt-oss-20b", None), ("gemma-3-27b", None), ("kimi-k3", "kimi-k3-dspark"),
                         ("llama-4-scout", None), ("deepseek-v3", "mtp")):
        spec = load_model(model, draft)
        plan = make_plan(spec.layers, PlanOptions(budget_bytes=40 << 30, max_model_len=32768))
        m = KVCacheManager.from_plan(plan)
        m.check_fits(32768)
        for mgr, g in zip(m.managers, plan.groups):
            assert mgr.admission_blocks(32768, 2048) <= g.blocks_per_request + g.step_blocks


def test_growing_request_that_outgrows_the_pool_raises_instead_of_waiting():
    m = make(full_only(num_blocks=3), checked=False)
    prefill(m, "a", tokens(4))
    decode(m, "a", tokens(7, 10))  # 11 tokens computed (3 blocks of 4)
    assert m.allocate("a", 1)  # position 11 is in block 2
    m.commit("a", 1, [3])
    with pytest.raises(RequestTooLargeError):
        m.allocate("a", 1)  # position 12 needs a 4th block: never possible


def test_failed_allocation_changes_nothing_and_preemption_frees_for_recompute():
    groups = [group(0, Full(), 4, 6), group(1, SlidingWindow(8), 4, 64)]
    m = make(groups)
    prefill(m, "a", tokens(12))  # 3 full blocks
    prefill(m, "b", tokens(8, 100))  # 2 full blocks; 1 left
    before = m.blocks_used()
    m.add_request("c", tokens(8, 200))
    assert m.find_cached_prefix("c") == 0
    assert not m.allocate("c", 8)  # needs 2 full blocks, 1 free
    assert m.blocks_used() == before and m.block_tables("c") == ([], [])
    m.preempt("b")
    assert m.allocate("c", 8)
    m.commit("c", 8, [1])
    # b keeps its 8 prompt tokens and the sampled one, and nothing computed
    assert m.num_tokens("b") == 9 and m.num_computed("b") == 0
    assert m.metrics().preemptions == 1


def test_preempted_request_hits_its_own_cached_blocks_on_readmission():
    m = make(full_only(num_blocks=64))
    prefill(m, "a", tokens(10))
    decode(m, "a", [1, 2, 3])  # 13 tokens computed, 14 known
    m.preempt("a")
    assert m.blocks_used() == [0]
    n = m.num_tokens("a")
    assert n == 14
    # full blocks of committed tokens: 13 computed -> 3 blocks (12 tokens)
    assert m.find_cached_prefix("a") == 12
    assert m.allocate("a", n - 12)


def test_state_only_recurrent_and_window_groups_write_is_shared_only_without_them():
    # full attention only: saves/marks/rolling/first_live are one immutable tuple for all
    m = make(full_only(num_blocks=64))
    prefill(m, "a", tokens(10))
    prefill(m, "b", tokens(10, 100))
    a, b = m.requests["a"], m.requests["b"]
    assert type(a.saves) is tuple and a.saves is b.saves and a.first_live is b.first_live
    m.preempt("a")  # reset keeps the shared form
    assert a.saves is b.saves and a.rolling is b.rolling
    # recurrent + window groups: every request owns lists those groups write, also after
    # a preemption, and a preempted request still saves and restores checkpoints
    m = make(kimi_dspark_like(checkpoint_every=2))
    prefill(m, "a", tokens(20))
    prefill(m, "b", tokens(20, 100))
    a, b = m.requests["a"], m.requests["b"]
    assert type(a.saves) is list and a.saves is not b.saves and a.marks is not b.marks
    m.preempt("b")
    assert type(b.saves) is list and type(b.rolling) is list and b.saves is not a.saves
    assert m.find_cached_prefix("b") == 16  # its own checkpoint at 16 survived
    assert m.allocate("b", m.num_tokens("b") - 16)
    m = make(gpt_oss_like(window=8))
    prefill(m, "a", tokens(12))
    prefill(m, "b", tokens(12, 100))
    assert type(m.requests["a"].first_live) is list
    assert m.requests["a"].first_live is not m.requests["b"].first_live


def test_a_preempted_request_keeps_one_rolling_decode_checkpoint():
    # the newest decode checkpoint survives a preemption, so the next one replaces it (and
    # drops it from the cache) instead of leaving two for one request
    m = make(kimi_dspark_like())
    prefill(m, "a", tokens(20))
    decode(m, "a", range(40))
    old = m.requests["a"].rolling[1]
    pool = m.managers[1].pool
    assert old is not None and pool.block_hash[old.slot] == old.key
    m.preempt("a")
    assert m.requests["a"].rolling[1] == old
    hit = m.find_cached_prefix("a")
    assert hit == 60  # restored from that checkpoint
    assert m.allocate("a", m.num_tokens("a") - hit)
    m.commit("a", m.num_tokens("a") - hit, [7])
    decode(m, "a", range(40))
    new = m.requests["a"].rolling[1]
    assert new != old and pool.block_hash[old.slot] != old.key


# --- cross, shared pools, events, metrics -------------------------------------------------

def test_cross_group_holds_fixed_blocks_and_never_limits_hits():
    groups = [group(0, Full(), 4, 64), group(1, Cross(10), 4, 16)]
    m = make(groups)
    prefill(m, "a", tokens(12))
    assert len(m.block_tables("a")[1]) == 3
    assert prefill(m, "b", tokens(12) + [3]) == 12
    assert m.blocks_used()[1] == 6


def test_groups_sharing_a_pool_draw_from_it_together():
    groups = [group(0, Full(), 4, 10), group(1, Full(), 4, 10, offset=1)]
    m = make(groups, pools={0: ((0, 1), 10)})
    assert len(m.pools) == 1
    prefill(m, "a", tokens(16))  # 4 blocks per group = 8 of 10
    assert m.blocks_used() == [4, 4]
    m.add_request("b", tokens(8, 50))
    m.find_cached_prefix("b")
    assert not m.allocate("b", 8)  # needs 2 + 2


def test_pools_must_cover_every_group_once():
    with pytest.raises(InvalidArgumentError):
        KVCacheManager(gpt_oss_like(), pools={0: ((0,), 10)})


def test_events_report_stored_and_removed_blocks_with_parents_and_sequence():
    m = make(full_only(num_blocks=4))
    prefill(m, "a", tokens(8))
    events = m.drain_events()
    stored = [e for e in events if e.kind == "stored"]
    assert sum(len(e.block_hashes) for e in stored) == 2
    assert stored[0].parent_hash is None and stored[0].group_id == 0
    m.free("a")
    # 4 usable blocks (no null block without a window): a's 2 cached ones sit in the LRU,
    # 2 are plain free; b's 3 blocks take both plain ones and evict a's oldest
    prefill(m, "b", tokens(12, 100))
    removed = [e for e in m.drain_events() if e.kind == "removed"]
    assert len(removed) == 1
    seqs = [e.seq for e in events]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)


def test_metrics_count_hits_preemptions_and_blocks():
    m = make(full_only(num_blocks=20))
    prefill(m, "a", tokens(9))
    prefill(m, "b", tokens(9) + [4])
    met = m.metrics()
    assert met.prefix_queries == 19 and met.prefix_hits == 8
    assert met.prefix_hit_rate == pytest.approx(8 / 19)
    # a: 3 blocks (0-3, 4-7, 8); b shares a's first two and adds one for tokens 8, 9
    assert met.groups[0].blocks_used == 4
    m.preempt("b")
    assert m.metrics().preemptions == 1


def test_reset_prefix_cache_only_when_idle():
    m = make(full_only())
    prefill(m, "a", tokens(8))
    assert not m.reset_prefix_cache()
    m.free("a")
    assert m.reset_prefix_cache()
    assert prefill(m, "b", tokens(9)) == 0


# --- checked mode -----------------------------------------------------------------------

def test_checked_mode_names_the_invariant_and_then_refuses_every_call():
    m = make(full_only())
    prefill(m, "a", tokens(8))
    b = m.block_tables("a")[0][0]
    m.managers[0].pool.ref[b] += 1  # corrupt: a reference nobody owns
    with pytest.raises(CacheCorruptedError, match="reference counts equal owners"):
        m.allocate("a", 1)
    m.managers[0].pool.ref[b] -= 1  # even after "repair", the manager stays closed
    with pytest.raises(CacheCorruptedError, match="refuses"):
        m.num_tokens("a")


def test_checked_mode_catches_a_hash_that_does_not_match_the_block_contents():
    m = make(full_only())
    prefill(m, "a", tokens(8))
    pool = m.managers[0].pool
    b = m.block_tables("a")[0][1]
    h = pool.block_hash[b]
    del pool.caches[0][h]
    pool.block_hash[b] = h + 1
    pool.caches[0][h + 1] = b
    with pytest.raises(CacheCorruptedError, match="consistent with block contents"):
        m.check_invariants()


def test_env_variable_turns_checked_mode_on(monkeypatch):
    monkeypatch.setenv("PAGEDKV_DEBUG", "1")
    assert KVCacheManager(full_only()).checked
    monkeypatch.setenv("PAGEDKV_DEBUG", "0")
    assert not KVCacheManager(full_only()).checked


def test_bad_calls_raise_explicit_errors():
    m = make(full_only())
    with pytest.raises(InvalidArgumentError):
        m.add_request("e", [])
    m.add_request("a", tokens(5))
    with pytest.raises(InvalidArgumentError):
        m.add_request("a", tokens(5))
    with pytest.raises(InvalidArgumentError):
        m.allocate("nope", 1)
    with pytest.raises(InvalidArgumentError):
        m.allocate("a", 6)  # only 5 known tokens
    assert m.allocate("a", 5)
    with pytest.raises(InvalidArgumentError):
        m.commit("a", 6)


@pytest.mark.parametrize("bad", [1.5, float("nan"), "1", None])
def test_counts_and_tokens_that_are_not_integers_raise_and_change_nothing(bad):
    """A fractional or NaN count passed every range check and corrupted the request
    (found by random calls); strings and None were TypeErrors. Now each is refused up
    front, the manager unchanged (checked mode sweeps its invariants after every call)."""
    np = pytest.importorskip("numpy")
    m = make(full_only())
    prefill(m, "a", tokens(5))
    before = (m.block_tables("a"), m.num_computed("a"), m.num_tokens("a"))
    calls = [lambda: m.commit("a", bad, [7]), lambda: m.commit("a", 1, [bad]),
             lambda: m.commit_batch(["a"], [bad]), lambda: m.allocate("a", bad),
             lambda: m.allocate("a", 1, bad), lambda: m.allocate_batch(["a"], bad),
             lambda: m.add_request("b", [1, bad])]
    if bad is not None:  # (None: no limit)
        calls.append(lambda: m.add_request("c", [1], max_new_tokens=bad))
    for call in calls:
        with pytest.raises(InvalidArgumentError, match="integer|token ids"):
            call()
        assert (m.block_tables("a"), m.num_computed("a"), m.num_tokens("a")) == before
    assert "b" not in m.requests and "c" not in m.requests
    m.check_invariants()
    # numpy integers are integers
    assert m.allocate("a", np.int64(1))
    m.commit("a", np.int64(1), [np.int32(9)])
    m.commit_batch([], [])
    assert m.num_computed("a") == before[1] + 1 and m.num_tokens("a") == before[2] + 1


def test_batch_calls_match_per_request_calls():
    one, batch = make(gpt_oss_like()), make(gpt_oss_like())
    for m in (one, batch):
        prefill(m, "a", tokens(9))
        prefill(m, "b", tokens(9) + [5, 6])
    for step in range(10):
        assert one.allocate("a", 1) and one.allocate("b", 1)
        one.commit("a", 1, [step])
        one.commit("b", 1, [step + 50])
        assert batch.allocate_batch(["a", "b"]) == 2
        batch.commit_batch(["a", "b"], [step, step + 50])
    for rid in ("a", "b"):
        assert one.block_tables(rid) == batch.block_tables(rid)
        assert one.num_computed(rid) == batch.num_computed(rid) == one.num_tokens(rid) - 1
    assert one.metrics() == batch.metrics()
    with pytest.raises(InvalidArgumentError):
        batch.commit_batch(["a"], [1, 2])


def test_allocate_batch_stops_at_the_first_request_that_does_not_fit():
    m = make(full_only(num_blocks=5))
    prefill(m, "a", tokens(8, 0))  # 2 blocks, full
    prefill(m, "b", tokens(7, 20))  # 2 blocks, one slot left in the second
    prefill(m, "c", tokens(3, 40))  # 1 block: the pool is full
    # a needs a new block for position 8 (none free); b's next position 7 has a slot
    assert m.allocate_batch(["b", "a", "c"]) == 1
