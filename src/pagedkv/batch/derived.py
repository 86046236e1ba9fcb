"""Every array of a group's metadata that follows from its block table and the step's
lengths: shared by the stateless builder and the incremental one, so both write the same
values by construction (see :mod:`.metadata` for the conventions)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from pagedkv.plan.types import Group


def fill_derived(
    host: Callable[[str], np.ndarray],
    group: Group,
    seq_lens: np.ndarray,
    pages: np.ndarray,
    computed: np.ndarray,
    row_req: np.ndarray | None,
    row_in_req: np.ndarray | None,
) -> None:
    """Write seq_lens, last-page lengths, CSR pages, slots and positions of the ``n`` real
    rows (``len(seq_lens)``) and zero/-1 the padding; ``host("block_table")`` is filled.
    Token row t belongs to request ``row_req[t]`` and is its ``row_in_req[t]``-th new token;
    both None: one token row per request (a pure decode step)."""
    bs, n = group.block_size, seq_lens.shape[0]
    table = host("block_table")
    nnz = host("paged_kv_indices").shape[0]
    seq = host("seq_lens")
    last = host("paged_kv_last_page_len")
    indptr = host("paged_kv_indptr")
    seq[:n] = seq_lens
    last[:n] = np.where(pages > 0, seq_lens - (pages - 1) * bs, 0)
    indptr[0] = 0
    indptr[1 : n + 1] = np.cumsum(pages)
    if seq.shape[0] > n:  # padding rows
        seq[n:] = 0
        last[n:] = 0
        indptr[n + 1 :] = nnz
    used = np.arange(table.shape[1])[None, :] < pages[:, None]
    host("paged_kv_indices")[:] = table[:n][used]

    slots, positions = host("slot_mapping"), host("positions")
    if row_req is None or row_in_req is None:
        row_req = np.arange(n)
        pos = computed - group.position_offset
    else:
        pos = computed[row_req] + row_in_req - group.position_offset
    m = row_req.shape[0]
    if slots.shape[0] > m:  # padding token rows
        slots[m:] = -1
        positions[m:] = 0
    if group.position_offset == 0:  # every row has a position (computed >= 0)
        block = table[row_req, pos // bs].astype(np.int64)
        slots[:m] = block * bs + pos % bs
        positions[:m] = pos
        return
    valid = pos >= 0
    safe = np.where(valid, pos, 0)
    block = np.zeros_like(pos)
    block[valid] = table[row_req[valid], safe[valid] // bs]
    slots[:m] = np.where(valid, block * bs + safe % bs, -1)
    positions[:m] = safe
