"""The Triton kernel of a steady decode step's metadata (see :mod:`.ondevice` for the delta
layout it reads and the numpy reference it must equal).

One program per (group, block of ROWS batch rows). Every program recomputes the whole
batch's page counts (at most a few thousand rows: one vector) for its rows' CSR offsets,
so programs need no communication. A row's new block-table entry is merged in registers
where the row's pages and slot are read, and stored once: no program reads an entry
another writes, so no barrier. All per-step values are read from device memory (the
delta buffer), none from launch arguments: the launch is the same every step of a shape
(CUDA-graph capturable, and its arguments are cheap to pass).

Imports triton: :mod:`.ondevice` imports this module only when a Triton launch is asked for.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pagedkv.batch import ondevice

# the delta's header (n, batch, groups, unused) and ints per group descriptor
HEADER = tl.constexpr(ondevice.HEADER)
DESC = tl.constexpr(ondevice.DESC)


@triton.jit
def derive_decode_kernel(delta, buf32, buf64, BLOCK_B: tl.constexpr, ROWS: tl.constexpr,
                         BLOCK_W: tl.constexpr):
    g = tl.program_id(0)
    first = tl.program_id(1) * ROWS
    n = tl.load(delta)
    batch = tl.load(delta + 1)
    groups = tl.load(delta + 2)
    desc = delta + HEADER + g * DESC
    bt_at = tl.load(desc)
    seq_at = tl.load(desc + 1)
    indptr_at = tl.load(desc + 2)
    last_at = tl.load(desc + 3)
    pages_at = tl.load(desc + 4)
    slot_at = tl.load(desc + 5)
    pos_at = tl.load(desc + 6)
    width = tl.load(desc + 7)
    bs = tl.load(desc + 8)
    k = tl.load(desc + 9)
    computed_at = HEADER + groups * DESC
    new_at = computed_at + batch + g * 2 * batch  # held block counts, then last ids

    # every row's page count: the CSR offset of this program's first row, and nnz
    everyone = tl.arange(0, BLOCK_B)
    live = everyone < n
    c_all = tl.load(delta + computed_at + everyone, mask=live, other=0)
    pages_all = tl.where(live, (tl.maximum(c_all + 1 - k, 0) + bs - 1) // bs, 0)
    nnz = tl.sum(pages_all, 0)
    before = tl.sum(tl.where(everyone < first, pages_all, 0), 0)

    r = first + tl.arange(0, ROWS)
    in_batch = r < batch
    real = r < n
    c = tl.load(delta + computed_at + r, mask=real, other=0)
    seq = tl.where(real, tl.maximum(c + 1 - k, 0), 0)
    pages = (seq + bs - 1) // bs
    end = before + tl.cumsum(pages, 0)
    start = end - pages
    tl.store(buf32 + indptr_at + 1 + r, tl.where(real, end, nnz), mask=in_batch)
    tl.store(buf32 + seq_at + r, seq, mask=real)
    tl.store(buf32 + last_at + r, tl.minimum(seq, seq - pages * bs + bs), mask=real)

    col_new = tl.load(delta + new_at + r, mask=real, other=0) - 1  # the row's last held block
    id_new = tl.load(delta + new_at + batch + r, mask=real, other=0)
    row_at = bt_at + r * width
    tl.store(buf32 + row_at + col_new, id_new, mask=real & (col_new >= 0) & (col_new < width))

    # the page list: the first `pages` entries of each row, the new entry merged in
    widest = tl.max(pages, 0)
    for c0 in range(0, widest, BLOCK_W):
        cols = c0 + tl.arange(0, BLOCK_W)
        used = cols[None, :] < pages[:, None]
        fresh = cols[None, :] == col_new[:, None]
        old = tl.load(buf32 + row_at[:, None] + cols[None, :], mask=used & ~fresh, other=0)
        ids = tl.where(fresh, id_new[:, None], old)
        tl.store(buf32 + pages_at + start[:, None] + cols[None, :], ids, mask=used)

    # the new token: its position's slot (-1 without a position) and the position
    pos = c - k
    has = real & (pos >= 0)
    safe = tl.where(has, pos, 0)
    col = safe // bs
    block = tl.load(buf32 + row_at + col, mask=has & (col != col_new), other=0)
    block = tl.where(col == col_new, id_new, block)
    slot = tl.where(has, block.to(tl.int64) * bs + (safe % bs), -1)
    tl.store(buf64 + slot_at + r, slot, mask=real)
    tl.store(buf64 + pos_at + r, safe.to(tl.int64), mask=real)
