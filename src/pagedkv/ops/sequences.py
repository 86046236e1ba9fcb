"""The ragged batch of one invocation: which query rows and how many keys each sequence has.

Conventions (shared with pagedkv.batch): queries are packed [total_query_tokens, ...];
sequence b owns rows query_start_loc[b] : query_start_loc[b+1] (int32, batch + 1 entries,
starting at 0); seq_lens[b] counts its tokens including the new ones; block_table is
[batch, max_blocks] int32. Rows past query_start_loc[-1] are padding: never read, output 0. Query rows are the last
q_len positions; if q_len > seq_len the leading rows have no position, see no key and
output 0 (the position-offset convention of pagedkv.batch).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from pagedkv.errors import MetadataError


@dataclass(frozen=True)
class Sequence:
    index: int
    q_start: int
    q_len: int
    seq_len: int


_INDEX_DTYPES = (torch.int32, torch.int64)


def check_index_tensors(query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                        block_table: torch.Tensor) -> None:
    """MetadataError unless the batch's index tensors are int32/int64 of the conventions'
    ranks (a float tensor would be truncated here and read as other bits by a kernel)."""
    for name, t, dims in (("query_start_loc", query_start_loc, 1), ("seq_lens", seq_lens, 1),
                          ("block_table", block_table, 2)):
        if t.dtype not in _INDEX_DTYPES or t.dim() != dims:
            raise MetadataError(f"{name} must be a {dims}-D int32 or int64 tensor, got "
                                f"{t.dtype} of shape {tuple(t.shape)}")


def sequences(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    num_rows: int,
    block_size: int,
) -> Iterator[Sequence]:
    """Validated sequences of the batch that have at least one query row."""
    check_index_tensors(query_start_loc, seq_lens, block_table)
    starts = [int(x) for x in query_start_loc.tolist()]
    lens = [int(x) for x in seq_lens.tolist()]
    batch = len(lens)
    if len(starts) != batch + 1 or block_table.dim() != 2 or block_table.shape[0] < batch:
        raise MetadataError(
            f"query_start_loc has {len(starts)} entries, seq_lens {batch}, block_table shape "
            f"{tuple(block_table.shape)}: need batch + 1, batch and [>= batch, max_blocks]"
        )
    if starts[0] != 0 or starts[-1] > num_rows:
        raise MetadataError(
            f"query_start_loc must start at 0 and end within the {num_rows} query rows, "
            f"got {starts[0]} .. {starts[-1]}"
        )
    for b in range(batch):
        q_len = starts[b + 1] - starts[b]
        if q_len < 0 or lens[b] < 0:
            raise MetadataError(
                f"sequence {b}: {q_len} query rows, seq_len {lens[b]} (query_start_loc must "
                "not decrease, seq_lens must be >= 0)"
            )
        if -(-lens[b] // block_size) > block_table.shape[1]:
            raise MetadataError(
                f"sequence {b}: seq_len {lens[b]} needs {-(-lens[b] // block_size)} blocks of "
                f"{block_size}, the block table has {block_table.shape[1]} columns"
            )
        if q_len:
            yield Sequence(b, starts[b], q_len, lens[b])
