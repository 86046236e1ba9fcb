"""Per-step metadata of one block-table group (built once per invocation, read by every
attention group whose layers live in that block table).

Conventions shared with ``pagedkv.ops``:

- batch row i is the i-th scheduled request; rows past ``num_reqs`` are padding
  (``pad_batch_to``): query length 0, sequence length 0, block-table row of zeros;
- ``block_table`` int32 [batch, max_blocks]: logical block j of row i holds positions
  [j * block_size, (j + 1) * block_size); unused entries are 0 and never read, because
  ``seq_lens`` says how many positions are valid;
- ``slot_mapping`` int64 [tokens]: slot = block_id * block_size + offset_in_block of the
  position a token row writes; -1 = do not write (padding rows, and rows with no position in
  a group with ``position_offset``);
- ``query_start_loc`` int32 [batch + 1]: rows of request i are
  [query_start_loc[i], query_start_loc[i + 1]); token rows past ``query_start_loc[-1]``
  (= ``num_tokens``) are padding (``pad_tokens_to``);
- ``seq_lens`` int32 [batch]: positions valid after this invocation's writes (computed + new);
  query rows are the LAST q_len positions of each sequence (bottom-right alignment);
- ``positions`` int64 [tokens]: each row's position (RoPE); 0 for padding rows;
- FlashInfer-style CSR page table: ``paged_kv_indptr`` int32 [batch + 1],
  ``paged_kv_indices`` int32 [indptr[-1]] (the first ceil(seq_len / block_size) entries of
  each block-table row, concatenated), ``paged_kv_last_page_len`` int32 [batch] in
  [1, block_size] (0 for an empty sequence).

``position_offset`` k (EAGLE-style layers: KV at position p is computed from token p + k):
this invocation's token rows stand for tokens [computed, computed + new) of the target
sequence and fill this group's positions [computed - k, computed + new - k); ``seq_lens`` is
max(0, computed + new - k). Rows whose position would be negative (the first k tokens of a
sequence) keep their place in ``query_start_loc`` (rows line up across groups), write
nothing (slot -1), see no key, and carry position 0.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class GroupMetadata:
    """Block table, CSR pages, slots, lengths and positions of one block-table group.

    Tensors live on the target device (views into one buffer shared by every group of the
    step). The ``*_host`` tuples are the same lengths on the host, so that splits and
    checks never synchronise with the device.
    """

    group_id: int
    block_size: int
    position_offset: int
    layer_names: tuple[str, ...]
    num_reqs: int
    num_tokens: int
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    positions: torch.Tensor
    paged_kv_indptr: torch.Tensor
    paged_kv_indices: torch.Tensor
    paged_kv_last_page_len: torch.Tensor
    req_ids: tuple[str | int, ...]
    query_lens_host: tuple[int, ...]
    seq_lens_host: tuple[int, ...]
    num_draft_tokens_host: tuple[int, ...]
    # (shortest, longest) query and the longest sequence of the real rows, when the builder
    # already has them from its arrays: saves Python passes over the tuples each step
    query_len_bounds: tuple[int, int] | None = None
    max_seq_len_host: int | None = None

    @property
    def batch_size(self) -> int:
        """Rows of the batch, padding included."""
        return int(self.seq_lens.shape[0])

    @property
    def min_query_len(self) -> int:
        if self.query_len_bounds is not None:
            return self.query_len_bounds[0]
        return min(self.query_lens_host, default=0)

    @property
    def max_query_len(self) -> int:
        if self.query_len_bounds is not None:
            return self.query_len_bounds[1]
        return max(self.query_lens_host, default=0)

    @property
    def max_seq_len(self) -> int:
        if self.max_seq_len_host is not None:
            return self.max_seq_len_host
        return max(self.seq_lens_host, default=0)


@dataclass(frozen=True, eq=False)
class StepMetadata(Mapping[int, GroupMetadata]):
    """Every block-table group's metadata of one invocation, keyed by group id."""

    groups: Mapping[int, GroupMetadata]

    def __getitem__(self, group_id: int) -> GroupMetadata:
        return self.groups[group_id]

    def __iter__(self) -> Iterator[int]:
        return iter(self.groups)

    def __len__(self) -> int:
        return len(self.groups)


def group_metadata(parts: tuple[Mapping[str, object], ...], *, checked: bool) -> GroupMetadata:
    """A GroupMetadata from field mappings merged in order (later ones win).

    Unchecked: the instance dict is filled directly, skipping the generated frozen
    ``__init__`` (one ``object.__setattr__`` per field: most of the cost on the decode fast
    path); the caller passes exactly the fields. Checked: the real constructor, which
    rejects a missing or unknown field."""
    if checked:
        merged: dict[str, object] = {}
        for part in parts:
            merged.update(part)
        return GroupMetadata(**merged)  # type: ignore[arg-type]
    meta = object.__new__(GroupMetadata)
    d = meta.__dict__
    for part in parts:
        d.update(part)
    return meta
