"""Groups that share one pool: a request's prefix hit in every group is adopted before any
group allocates new blocks, so a group's allocation never evicts the cached blocks
another group's hit is about to take (which left one block in two groups' tables: the
engine's gpt-oss found it, window and full layers in one pool, a checked manager)."""

from __future__ import annotations

import pytest
from block_groups import group

from pagedkv.blocks import KVCacheManager
from pagedkv.kvspec import Full, SlidingWindow


@pytest.mark.parametrize("checked", [True, False])
@pytest.mark.parametrize("window_first", [True, False])
def test_new_blocks_never_evict_another_groups_hit(checked, window_first):
    window, full = SlidingWindow(4), Full()
    kinds = [window, full] if window_first else [full, window]
    groups = [group(i, r, 1, 57, max_model_len=64, max_batched_tokens=64)
              for i, r in enumerate(kinds)]
    m = KVCacheManager(groups, pools={0: ((0, 1), 57)}, checked=checked, max_model_len=64,
                       max_batched_tokens=64)
    a = list(range(100, 112))  # 12 tokens: 24 blocks over both groups at block size 1
    c = list(range(200, 216))  # 16 tokens: 32 blocks, cached after a's (newer in the LRU)
    for rid, prompt in (("a", a), ("c", c)):
        m.add_request(rid, prompt)
        assert m.find_cached_prefix(rid) == 0
        assert m.allocate(rid, len(prompt))
        m.commit(rid, len(prompt), [1])
        m.free(rid)
    # b: a's prompt and 14 more tokens. Its hit is every full block of a and the window's
    # last 4; each group needs 14 new blocks, and no block is free but the cached ones:
    # the new blocks must come from the other 40 cached ones, never from the hit
    m.add_request("b", a + list(range(300, 314)))
    assert m.find_cached_prefix("b") == 12
    assert m.allocate("b", 14)
    tables = m.block_tables("b")
    held = [[b for b in t if b != 0] for t in tables]  # (0: the window's null block)
    assert len(held[0]) + len(held[1]) == len(set(held[0]) | set(held[1]))
    full_table = tables[kinds.index(full)]
    assert len(full_table) == 26 and len(set(full_table)) == 26
    m.check_invariants()
