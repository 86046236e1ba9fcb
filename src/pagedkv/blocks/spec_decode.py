"""Speculative decoding arithmetic: how many slots past the committed tokens a step needs.

Per step a request computes its last sampled token plus k draft tokens, so it asks for
1 + k new slots. DSpark/DFlash drafters also write scratch KV for a whole draft block of B
positions (anchor + B-1 masks) at those same positions, so the step needs at least B - 1
look-ahead slots. After verification the manager's ``commit`` keeps the accepted
tokens and releases every block that only rejected (or scratch) positions used; scratch
KV never enters the prefix cache, because only blocks full of committed tokens do.
"""

from __future__ import annotations

from collections.abc import Iterable

from pagedkv.plan.types import Group


def draft_block_size(groups: Iterable[Group]) -> int:
    """Largest DSpark/DFlash draft block over every layer (0 without such drafters)."""
    size = 0
    for g in groups:
        for layer in g.layers:
            att = layer.attention
            if att is not None and att.draft_block:
                size = max(size, att.draft_block)
    return size


def lookahead_tokens(groups: Iterable[Group], num_spec_tokens: int) -> int:
    """Slots a step needs past its one known new token: the drafts to verify, or a
    draft block's scratch positions, whichever is more."""
    return max(num_spec_tokens, draft_block_size(groups) - 1, 0)
