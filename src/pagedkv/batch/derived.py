"""Every array of a group's metadata that follows from its block table and the step's
lengths: shared by the stateless builder and the incremental one, so both write the same
values by construction (see :mod:`.metadata` for the conventions).

Whole-array numpy only, no per-request Python: the host time of a step must not grow with
the batch faster than a memory copy does.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache

import numpy as np

from pagedkv.plan.types import Group


@lru_cache(maxsize=64)
def prefix_masks(width: int) -> np.ndarray:
    """bool [width + 1, width]: row k is True on its first k columns (the used pages of a
    block-table row that reads k blocks), so a batch's page mask is one row gather."""
    masks = np.tri(width + 1, width, -1, dtype=bool)
    masks.flags.writeable = False
    return masks


def fill_derived(
    arrays: Mapping[str, np.ndarray],
    group: Group,
    seq_lens: np.ndarray,
    pages: np.ndarray,
    computed: np.ndarray,
    row_req: np.ndarray | None,
    row_in_req: np.ndarray | None,
    fresh: bool = True,
    pages_list: bool = True,
    cols: tuple[np.ndarray, np.ndarray] | None = None,
) -> int:
    """Write seq_lens, last-page lengths, CSR pages, slots and positions of the ``n`` real
    rows (``len(seq_lens)``) and zero/-1 the padding; ``arrays["block_table"]`` is filled
    and ``arrays["paged_kv_indices"]`` holds at least ``pages.sum()`` entries (its first
    ones are written). Returns that count (nnz).
    Token row t belongs to request ``row_req[t]`` and is its ``row_in_req[t]``-th new token;
    both None: one token row per request (a pure decode step). ``fresh=False``: the arrays
    were last filled for a step of the same shape, row count and kind, so what depends on
    those alone (``indptr[0]``, padding rows but the indptr tail) is already written.
    ``pages_list=False``: the caller has written the CSR page list itself (left untouched).
    ``cols``: a decode step of a group without position offset, ``divmod(computed,
    block_size)`` (``pages`` is its first + 1): last-page lengths and slots follow from it in
    fewer whole-array operations."""
    bs, n = group.block_size, seq_lens.shape[0]
    offset = group.position_offset
    decode = row_req is None or row_in_req is None
    table = arrays["block_table"]
    width = table.shape[1]
    seq = arrays["seq_lens"]
    last = arrays["paged_kv_last_page_len"]
    indptr = arrays["paged_kv_indptr"]
    seq[:n] = seq_lens
    if fresh:
        indptr[0] = 0
    indptr[1 : n + 1] = np.add.accumulate(pages)  # (cumsum with an int32 out= is slower)
    nnz = int(indptr[n])
    # seq - (pages - 1) * bs; 0 on an empty row, which a decode step without offset has not
    if cols is not None:  # the new token's offset + 1 (an assignment casts fastest)
        part = last[:n]
        part[:] = cols[1]
        part += 1
    elif decode and offset == 0:
        tail = pages * -bs
        tail += seq_lens
        np.add(tail, bs, out=last[:n], casting="unsafe")  # values in [1, bs]
    else:
        tail = pages * -bs
        tail += seq_lens
        tail += bs
        np.minimum(seq_lens, tail, out=last[:n], casting="unsafe")
    if seq.shape[0] > n:  # padding rows
        if fresh:
            seq[n:] = 0
            last[n:] = 0
        indptr[n + 1 :] = nnz
    if nnz and pages_list:
        used = width
        if width > 64:  # a fixed-width table (CUDA graphs) may be far wider than any row reads
            used = int(pages.max())
        # (mode="clip": the indices are in range by construction, and numpy's default mode
        # checks them and, with out=, writes through a temporary copy)
        mask = prefix_masks(used).take(pages, 0, None, "clip")
        if used == width:  # flat boolean index of a contiguous table: the fastest form
            arrays["paged_kv_indices"][:nnz] = table[:n].reshape(-1)[mask.reshape(-1)]
        else:
            arrays["paged_kv_indices"][:nnz] = table[:n, :used][mask]

    slots, positions = arrays["slot_mapping"], arrays["positions"]
    if decode:
        m = n
        pos = computed - offset if offset else computed
        base = row_starts(n, width)
    else:
        m = row_req.shape[0]  # type: ignore[union-attr]
        pos = computed[row_req] + row_in_req - offset
        base = row_req * width
    if fresh and slots.shape[0] > m:  # padding token rows
        slots[m:] = -1
        positions[m:] = 0
    if m == 0:
        return nnz
    # (take without an axis reads the table flat)
    if cols is not None:
        block = table.take(base + cols[0], None, None, "clip")
        out = slots[:m]
        np.multiply(block, bs, out=out, dtype=np.int64)
        out += cols[1]
        positions[:m] = pos
        return nnz
    if offset == 0:  # every row has a position (computed >= 0)
        col = pos // bs
        block = table.take(base + col, None, None, "clip")
        # block * bs + pos % bs == (block - col) * bs + pos
        out = slots[:m]
        np.subtract(block, col, out=out, dtype=np.int64)
        out *= bs
        out += pos
        positions[:m] = pos
        return nnz
    valid = pos >= 0
    safe = np.where(valid, pos, 0)
    block = np.zeros(m, dtype=np.int64)
    block[valid] = table.take(base[valid] + safe[valid] // bs, None, None, "clip")
    slots[:m] = np.where(valid, block * bs + safe % bs, -1)
    positions[:m] = safe
    return nnz


@lru_cache(maxsize=64)
def row_starts(n: int, width: int) -> np.ndarray:
    """Flat index of each row's first entry in an [n, width] table (read-only)."""
    starts = np.arange(n, dtype=np.int64) * width
    starts.flags.writeable = False
    return starts
