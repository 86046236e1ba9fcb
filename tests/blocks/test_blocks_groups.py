"""The hand-built groups of tests/block_groups.py follow the planner's own arithmetic."""

from __future__ import annotations

from block_groups import gpt_oss_like, group

from pagedkv.kvspec import ChunkedLocal, Cross


def test_helper_groups_use_planner_arithmetic():
    g = gpt_oss_like(bs=4, window=8)[1]
    # window 8: 7 earlier keys + the current token, unaligned: ceil(7/4) + 1 = 3 blocks
    assert g.blocks_per_request == 3
    assert g.step_blocks == 64  # 256 step tokens / 4


def test_chunked_and_cross_groups_build():
    assert group(0, ChunkedLocal(8), 4, 16).blocks_per_request == 2
    assert group(0, Cross(10), 4, 16).blocks_per_request == 3
