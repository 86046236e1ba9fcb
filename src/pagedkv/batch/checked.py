"""Checked mode: re-derive every row and slot of a group's metadata from the requests, in
plain Python and independently of the vectorised builder, and name the first bad row.

On by argument or by env ``PAGEDKV_DEBUG=1``. Slow (a Python loop per token row): for
tests and debugging, not for serving.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from pagedkv.batch.inputs import ScheduledRequest
from pagedkv.batch.metadata import GroupMetadata
from pagedkv.errors import MetadataError
from pagedkv.plan.types import Group


def checked_mode(checked: bool | None) -> bool:
    """An explicit argument wins; otherwise env ``PAGEDKV_DEBUG=1`` turns checks on."""
    if checked is not None:
        return checked
    return os.environ.get("PAGEDKV_DEBUG", "") == "1"


def validate_group_metadata(
    meta: GroupMetadata, group: Group, requests: Sequence[ScheduledRequest]
) -> None:
    """Validate built metadata (tensors on any device) against the requests it came from."""
    if meta.group_id != group.id:
        raise MetadataError(f"metadata of group {meta.group_id} checked against group {group.id}")
    names = (
        "block_table", "slot_mapping", "query_start_loc", "seq_lens", "positions",
        "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len",
    )
    host = {name: getattr(meta, name).cpu() for name in names}
    validate_group_arrays(host, group, requests, meta.num_tokens)


def validate_group_arrays(
    arrays: Mapping[str, Any], group: Group, requests: Sequence[ScheduledRequest], num_tokens: int
) -> None:
    """Raise :class:`MetadataError` on the first inconsistency; ``arrays`` are host arrays
    (numpy or torch) named as the fields of :class:`GroupMetadata`."""
    a = {name: _as_list(value) for name, value in arrays.items()}
    gid, bs, k = group.id, group.block_size, group.position_offset

    def fail(msg: str) -> None:
        raise MetadataError(f"group {gid}: {msg}")

    table, qsl, seq = a["block_table"], a["query_start_loc"], a["seq_lens"]
    slots, positions = a["slot_mapping"], a["positions"]
    indptr, indices, last = a["paged_kv_indptr"], a["paged_kv_indices"], a["paged_kv_last_page_len"]
    batch = len(seq)
    if len(requests) > batch or len(qsl) != batch + 1 or len(table) != batch:
        fail(
            f"{len(requests)} requests but seq_lens has {batch} rows, query_start_loc "
            f"{len(qsl)}, block_table {len(table)}"
        )
    if len(indptr) != batch + 1 or len(last) != batch or len(slots) != len(positions):
        fail(f"shapes: indptr {len(indptr)}, last_page_len {len(last)}, batch {batch}")
    if qsl[0] != 0 or indptr[0] != 0:
        fail(f"query_start_loc[0]={qsl[0]}, paged_kv_indptr[0]={indptr[0]} (must be 0)")
    if num_tokens > len(slots):
        fail(f"{num_tokens} token rows but slot_mapping has {len(slots)}")

    written: dict[int, tuple[int, int]] = {}
    for i in range(batch):
        req = requests[i] if i < len(requests) else None
        who = f"row {i} (request {req.req_id!r})" if req else f"padding row {i}"
        q_len = qsl[i + 1] - qsl[i]
        want_q = req.num_new_tokens if req else 0
        want_seq = max(0, req.num_tokens - k) if req else 0
        if q_len != want_q:
            fail(f"{who}: query length {q_len} (query_start_loc {qsl[i]}..{qsl[i + 1]}), want {want_q}")
        if seq[i] != want_seq:
            fail(f"{who}: seq_len {seq[i]}, want {want_seq} (computed + new - offset {k})")
        ids = req.blocks(gid) if req else ()
        pages = -(-want_seq // bs)
        if pages > len(ids):
            fail(f"{who}: {want_seq} positions need {pages} blocks, {len(ids)} allocated")
        if pages > len(table[i]):
            fail(f"{who}: reads {pages} blocks, block table has {len(table[i])} columns")
        for j in range(min(len(ids), len(table[i]))):
            if table[i][j] != ids[j]:
                fail(f"{who}: block_table[{i}][{j}]={table[i][j]}, allocated block is {ids[j]}")
        for j in range(pages):
            if group.num_blocks > 0 and not 0 <= ids[j] < group.num_blocks:
                fail(f"{who}: block {ids[j]} outside the group's {group.num_blocks} blocks")
        if indptr[i + 1] - indptr[i] != pages:
            fail(f"{who}: CSR holds {indptr[i + 1] - indptr[i]} pages, want {pages}")
        if indices[indptr[i] : indptr[i + 1]] != list(ids[:pages]):
            fail(f"{who}: CSR pages {indices[indptr[i]:indptr[i + 1]]}, want {list(ids[:pages])}")
        want_last = want_seq - (pages - 1) * bs if pages else 0
        if last[i] != want_last:
            fail(f"{who}: last_page_len {last[i]}, want {want_last}")
        for j in range(q_len):
            row = qsl[i] + j
            pos = req.num_computed_tokens + j - k  # req exists: q_len is 0 on padding rows
            if pos < 0:
                if slots[row] != -1 or positions[row] != 0:
                    fail(f"token row {row} of {who} has no position yet writes slot {slots[row]}")
                continue
            if positions[row] != pos:
                fail(f"token row {row} of {who}: position {positions[row]}, want {pos}")
            block = ids[pos // bs]
            if slots[row] != block * bs + pos % bs:
                fail(
                    f"token row {row} of {who}: slot {slots[row]} for position {pos}; its own "
                    f"block {pos // bs} is {block}, so slot {block * bs + pos % bs}"
                )
            if slots[row] in written:
                other = written[slots[row]]
                fail(f"token row {row} of {who} and token row {other[0]} write slot {slots[row]}")
            written[slots[row]] = (row, i)
    if qsl[batch] != num_tokens or indptr[batch] != len(indices):
        fail(
            f"query_start_loc ends at {qsl[batch]} for {num_tokens} tokens, indptr at "
            f"{indptr[batch]} for {len(indices)} pages"
        )
    for row in range(num_tokens, len(slots)):
        if slots[row] != -1:
            fail(f"padding token row {row} writes slot {slots[row]} (must be -1)")


def _as_list(value: Any) -> list:
    return value.tolist() if hasattr(value, "tolist") else list(value)
