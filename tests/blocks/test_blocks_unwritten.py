"""Blocks cached at allocation, before the forward that writes them ("unwritten" until the
request's commit): another request of the same step may share them whole (the forward
writes every request's KV of a layer before any of them attends), but never copy one as
the partly hit last block of its hit, because copies run before the step's forward.
Every expected number is worked out by hand (block size 4)."""

from __future__ import annotations

from block_groups import deepseek_mtp_like, full_only, gpt_oss_like

from pagedkv.blocks import KVCacheManager


def make(groups, **kw):
    return KVCacheManager(groups, checked=True, sweep_every=1, events=True,
                          max_batched_tokens=64, **kw)


def admit(m, rid, prompt):
    """Look up and allocate the rest of the prompt, as a scheduler admits a request (no
    forward yet): returns the hit."""
    m.add_request(rid, prompt)
    hit = m.find_cached_prefix(rid)
    assert m.allocate(rid, len(prompt) - hit)
    return hit


def copies(m):
    return [(op.group_id, op.position) for op in m.drain_copy_ops() if op.kind == "copy"]


def test_same_step_partial_hit_backs_off_to_the_block_boundary():
    m = make(full_only())
    a = list(range(12))
    assert admit(m, "a", a) == 0  # caches blocks 0..2 at allocation: unwritten
    # "b" is a's 12 tokens: at most 11 may hit, inside a's block 2, which this step writes.
    # Copying it now would copy NaN: the hit stops at 8 and b computes 8..11 itself.
    assert admit(m, "b", a) == 8
    assert copies(m) == []
    tables = m.block_tables("a")[0], m.block_tables("b")[0]
    assert tables[1][:2] == tables[0][:2] and tables[1][2] != tables[0][2]
    m.commit("a", 12, [100])
    m.commit("b", 4, [100])
    # a's commit says its forward ran: a later request copies the partly hit block
    assert admit(m, "c", a) == 11
    assert copies(m) == [(0, 11)]


def test_same_step_whole_block_hit_is_shared():
    m = make(full_only())
    a = list(range(12))
    admit(m, "a", a)
    assert admit(m, "b", a + [50, 51]) == 12  # three whole blocks, written before b reads
    assert copies(m) == []
    assert m.block_tables("b")[0][:3] == m.block_tables("a")[0]


def test_offset_group_same_step_hit_ends_on_a_block_boundary_in_every_group():
    m = make(deepseek_mtp_like())
    a = list(range(13))
    admit(m, "a", a)
    # target: 3 blocks; MTP (offset 1): positions 0..11 final from tokens 1..12, 3 blocks
    # minus the offset -> 11, inside block 2 of both groups; both unwritten -> 8
    assert admit(m, "b", a[:12] + [90]) == 8
    assert copies(m) == []
    m.commit("a", 13, [100])
    m.commit("b", 5, [100])
    assert admit(m, "d", a[:12] + [91]) == 11  # written now: partly hit blocks are copied
    assert sorted(copies(m)) == [(0, 11), (1, 11)]


def test_window_group_same_step_partial_hit_backs_off():
    m = make(gpt_oss_like(window=8))
    a = list(range(12))
    admit(m, "a", a)
    assert admit(m, "b", a) == 8  # full and window groups both stop at block 2's start
    assert copies(m) == []


def test_blocks_freed_before_their_commit_leave_the_cache():
    """A request dropped between allocation and commit never had its KV written: the
    blocks it cached at allocation are uncached, not served later."""
    m = make(full_only())
    a = list(range(12))
    admit(m, "a", a)
    assert m.metrics().groups[0].blocks_cached == 3
    m.free("a")
    assert m.metrics().groups[0].blocks_cached == 0
    assert admit(m, "b", a) == 0
