"""Can a request ever fit? The planner's arithmetic, applied to one request alone.

A request whose worst case exceeds an empty pool is refused at once with
:class:`RequestTooLargeError`, instead of waiting (or preempting others) forever.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.blocks.base import GroupManager
from pagedkv.errors import RequestTooLargeError


def blocks_alone(managers: Sequence[GroupManager], num_tokens: int,
                 max_batched_tokens: int) -> dict[int, int]:
    """Blocks per pool id that one request of ``num_tokens`` tokens may hold at its peak."""
    need: dict[int, int] = {}
    for m in managers:
        pid = m.pool.pool_id
        need[pid] = need.get(pid, 0) + m.admission_blocks(num_tokens, max_batched_tokens)
    return need


def check_fits(managers: Sequence[GroupManager], num_tokens: int, max_batched_tokens: int,
               max_model_len: int | None) -> None:
    """Raise :class:`RequestTooLargeError` when ``num_tokens`` can never be served."""
    if max_model_len is not None and num_tokens > max_model_len:
        raise RequestTooLargeError(
            f"request of {num_tokens} tokens exceeds max_model_len {max_model_len}"
        )
    pools = {m.pool.pool_id: m.pool for m in managers}
    for pid, need in blocks_alone(managers, num_tokens, max_batched_tokens).items():
        usable = pools[pid].usable
        if need > usable:
            names = [f"group {m.gid} ({m.group.retention.kind})" for m in managers
                     if m.pool.pool_id == pid]
            raise RequestTooLargeError(
                f"request of {num_tokens} tokens needs {need} blocks of pool {pid} "
                f"({', '.join(names)}) but the pool has only {usable}"
            )
