"""Incremental per-step metadata: host block tables that live across steps.

``build_metadata`` flattens every request's block-id lists on every step; for hundreds of
running requests that Python work dominates the host time of a decode step. A
:class:`MetadataBuilder` keeps one host block table per group with a row per live request,
changed only where a request changed (:meth:`~MetadataBuilder.add`,
:meth:`~MetadataBuilder.append_blocks`, :meth:`~MetadataBuilder.set_blocks`,
:meth:`~MetadataBuilder.remove`); :meth:`~MetadataBuilder.step` gathers the scheduled rows
with numpy and makes the same arrays as ``build_metadata`` (same values, shapes and dtypes,
the same single host-to-device copy) from per-step length arrays.

Rows past a request's block count are kept at 0, so a gathered row is already the padded
block-table row. Block ids are range-checked once, when they enter the table.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

import numpy as np
import torch

from pagedkv.batch.builder import _check_groups, _padded
from pagedkv.batch.checked import checked_mode, validate_group_arrays
from pagedkv.batch.derived import fill_derived
from pagedkv.batch.inputs import ScheduledRequest
from pagedkv.batch.metadata import GroupMetadata, StepMetadata
from pagedkv.batch.staging import Staging
from pagedkv.errors import InvalidArgumentError, MetadataError
from pagedkv.plan.types import Group

_INT32_MAX = 2**31 - 1
_PER_GROUP = (
    "block_table", "slot_mapping", "seq_lens", "positions",
    "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len",
)


class _Table:
    """One group's host block table: int32 [rows, width] (grown by doubling) + lengths."""

    def __init__(self, group: Group, rows: int, width: int) -> None:
        self.group = group
        self.limit = group.num_blocks if group.num_blocks > 0 else _INT32_MAX + 1
        self.ids = np.zeros((rows, width), dtype=np.int32)
        self.lens = np.zeros(rows, dtype=np.int64)

    def grow_rows(self, rows: int) -> None:
        ids = np.zeros((rows, self.ids.shape[1]), dtype=np.int32)
        ids[: self.ids.shape[0]] = self.ids
        lens = np.zeros(rows, dtype=np.int64)
        lens[: self.lens.shape[0]] = self.lens
        self.ids, self.lens = ids, lens

    def _checked(self, req_id: Hashable, ids: Sequence[int]) -> Sequence[int] | np.ndarray:
        if len(ids) <= 8:  # a step's appends are a block or two: plain Python is faster
            for x in ids:
                if not 0 <= x < self.limit:
                    raise MetadataError(
                        f"group {self.group.id}: request {req_id!r} was given block id "
                        f"{int(x)}, outside the group's {self.limit} blocks"
                    )
            return ids
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)
        if arr.size:
            bad = np.nonzero((arr < 0) | (arr >= self.limit))[0]
            if bad.size:
                raise MetadataError(
                    f"group {self.group.id}: request {req_id!r} was given block id "
                    f"{int(arr[bad[0]])}, outside the group's {self.limit} blocks"
                )
        return arr

    def write(self, row: int, req_id: Hashable, ids: Sequence[int], start: int) -> None:
        """Blocks ``ids`` at columns ``start``..; the row's length becomes start + len(ids)."""
        arr = self._checked(req_id, ids)
        end = start + len(arr)
        if end > self.ids.shape[1]:
            width = max(end, 2 * self.ids.shape[1])
            wider = np.zeros((self.ids.shape[0], width), dtype=np.int32)
            wider[:, : self.ids.shape[1]] = self.ids
            self.ids = wider
        old = int(self.lens[row])
        self.ids[row, start:end] = arr
        if old > end:
            self.ids[row, end:old] = 0
        self.lens[row] = end

    def clear(self, row: int) -> None:
        self.ids[row, : int(self.lens[row])] = 0
        self.lens[row] = 0


class MetadataBuilder:
    """Live requests' block tables on the host; one :meth:`step` per invocation.

    ``device`` is where step metadata goes; ``rows`` / ``width`` are initial capacities
    (requests, blocks per request), grown as needed.
    """

    def __init__(
        self,
        groups: Sequence[Group],
        *,
        device: torch.device | str = "cpu",
        rows: int = 64,
        width: int = 16,
    ) -> None:
        _check_groups(groups)
        if rows < 1 or width < 1:
            raise InvalidArgumentError(f"rows ({rows}) and width ({width}) must be >= 1")
        self.groups = tuple(groups)
        self.device = torch.device(device)
        self._tables = {g.id: _Table(g, rows, width) for g in self.groups}
        self._rows: dict[Hashable, int] = {}
        self._version = 0  # bumped by add/remove: a cached row lookup is valid while equal
        self._last_ids: tuple[Hashable, ...] | None = None
        self._last_version = -1
        self._last_rows = np.zeros(0, dtype=np.intp)
        self._free = list(range(rows - 1, -1, -1))

    # -- request lifecycle ---------------------------------------------------------------
    def __contains__(self, req_id: object) -> bool:
        return req_id in self._rows

    def __len__(self) -> int:
        return len(self._rows)

    def add(self, req_id: Hashable, block_ids: Mapping[int, Sequence[int]] | None = None) -> None:
        """Admit a request (also a preempted one coming back) with its blocks so far."""
        if req_id in self._rows:
            raise InvalidArgumentError(f"request {req_id!r} is already in the builder")
        block_ids = block_ids or {}
        self._known_groups(req_id, block_ids)
        if not self._free:
            old = next(iter(self._tables.values())).ids.shape[0] if self._tables else len(self._rows)
            new = max(2 * old, 1)
            for table in self._tables.values():
                table.grow_rows(new)
            self._free = list(range(new - 1, old - 1, -1))
        row = self._free.pop()
        try:
            for gid, ids in block_ids.items():
                self._tables[gid].write(row, req_id, ids, 0)
        except MetadataError:
            for table in self._tables.values():
                table.clear(row)
            self._free.append(row)
            raise
        self._rows[req_id] = row
        self._version += 1

    def append_blocks(self, req_id: Hashable, block_ids: Mapping[int, Sequence[int]]) -> None:
        """Blocks newly allocated to a request, appended per group in logical order."""
        row = self._row(req_id)
        self._known_groups(req_id, block_ids)
        for gid, ids in block_ids.items():
            table = self._tables[gid]
            table.write(row, req_id, ids, int(table.lens[row]))

    def set_blocks(self, req_id: Hashable, block_ids: Mapping[int, Sequence[int]]) -> None:
        """Replace the block lists of the groups named (rollback of lookahead blocks, a
        window group's freed blocks, any change that is not an append)."""
        row = self._row(req_id)
        self._known_groups(req_id, block_ids)
        for gid, ids in block_ids.items():
            self._tables[gid].write(row, req_id, ids, 0)

    def remove(self, req_id: Hashable) -> None:
        """A finished or preempted request leaves; its row is reused."""
        row = self._row(req_id)
        for table in self._tables.values():
            table.clear(row)
        del self._rows[req_id]
        self._version += 1
        self._free.append(row)

    def blocks(self, req_id: Hashable, group_id: int) -> tuple[int, ...]:
        """The request's block ids of one group, as the builder holds them."""
        table = self._tables[group_id]
        row = self._row(req_id)
        return tuple(table.ids[row, : int(table.lens[row])].tolist())

    def _row(self, req_id: Hashable) -> int:
        try:
            return self._rows[req_id]
        except KeyError:
            raise InvalidArgumentError(f"request {req_id!r} is not in the builder") from None

    def _known_groups(self, req_id: Hashable, block_ids: Mapping[int, Sequence[int]]) -> None:
        unknown = [gid for gid in block_ids if gid not in self._tables]
        if unknown:
            raise InvalidArgumentError(
                f"request {req_id!r}: block ids for groups {unknown}, builder has "
                f"{sorted(self._tables)}"
            )

    # -- one invocation ------------------------------------------------------------------
    def step(
        self,
        req_ids: Sequence[Hashable],
        num_computed_tokens: Sequence[int] | np.ndarray,
        num_new_tokens: Sequence[int] | np.ndarray,
        num_draft_tokens: Sequence[int] | np.ndarray | None = None,
        *,
        checked: bool | None = None,
        pad_batch_to: int | None = None,
        pad_tokens_to: int | None = None,
        max_blocks: int | None = None,
    ) -> StepMetadata:
        """This invocation's metadata for the requests ``req_ids`` in batch-row order.

        Equal to ``build_metadata`` of the same requests (block ids as the builder holds
        them) with the same keyword arguments; one host-to-device copy.
        """
        ids_tuple = tuple(req_ids)
        num_reqs = len(ids_tuple)
        if ids_tuple == self._last_ids and self._version == self._last_version:
            rows = self._last_rows  # the same batch order as last step: no lookups
        else:
            try:
                rows = np.fromiter(map(self._rows.__getitem__, ids_tuple), dtype=np.intp, count=num_reqs)
            except KeyError as e:
                raise InvalidArgumentError(f"request {e.args[0]!r} is not in the builder") from None
            self._last_ids, self._last_version, self._last_rows = ids_tuple, self._version, rows
        computed = self._counts("num_computed_tokens", num_computed_tokens, num_reqs)
        new = self._counts("num_new_tokens", num_new_tokens, num_reqs)
        if num_draft_tokens is None:
            drafts = (0,) * num_reqs
        else:
            d = self._counts("num_draft_tokens", num_draft_tokens, num_reqs)
            over = np.nonzero(d > new)[0]
            if over.size:
                i = int(over[0])
                raise InvalidArgumentError(
                    f"request {req_ids[i]!r}: {int(d[i])} draft tokens but only {int(new[i])} "
                    "new tokens (drafts are counted among the new tokens)"
                )
            drafts = tuple(d.tolist())
        if max_blocks is not None and max_blocks < 0:
            raise InvalidArgumentError(f"max_blocks must be >= 0, got {max_blocks}")
        batch = _padded("pad_batch_to", pad_batch_to, num_reqs)
        num_tokens = int(new.sum())
        tokens = _padded("pad_tokens_to", pad_tokens_to, num_tokens)

        staging = Staging()
        staging.add("query_start_loc", "int32", (batch + 1,))
        plans = [self._plan(t, rows, computed, new, max_blocks, req_ids) for t in self._tables.values()]
        for gid, width, _, _, _, nnz in plans:
            for name, dtype, shape in (
                ("slot_mapping", "int64", (tokens,)), ("positions", "int64", (tokens,)),
                ("block_table", "int32", (batch, width)), ("seq_lens", "int32", (batch,)),
                ("paged_kv_indptr", "int32", (batch + 1,)), ("paged_kv_indices", "int32", (nnz,)),
                ("paged_kv_last_page_len", "int32", (batch,)),
            ):
                staging.add(f"{gid}.{name}", dtype, shape)
        staging.allocate(self.device)

        qsl = staging.host("query_start_loc")
        qsl[0] = 0
        qsl[1 : num_reqs + 1] = np.cumsum(new)
        qsl[num_reqs + 1 :] = num_tokens
        row_req: np.ndarray | None = None  # None: one token row per request (pure decode)
        row_in_req: np.ndarray | None = None
        if num_tokens != num_reqs or (num_reqs > 0 and int(new.min()) != 1):
            row_req = np.repeat(np.arange(num_reqs), new)
            row_in_req = np.arange(num_tokens) - qsl[row_req]
        for gid, width, seq_lens, pages, _, _ in plans:
            def host(name: str, gid: int = gid) -> np.ndarray:
                return staging.host(f"{gid}.{name}")
            ids = self._tables[gid].ids
            table = host("block_table")
            kept = min(width, ids.shape[1])
            table[:num_reqs, :kept] = ids[rows, :kept]
            if kept < width:
                table[:num_reqs, kept:] = 0
            if num_reqs < batch:
                table[num_reqs:] = 0
            fill_derived(host, self._tables[gid].group, seq_lens, pages, computed, row_req, row_in_req)

        if checked_mode(checked):
            reqs = self._requests(req_ids, computed, new, drafts)
            for gid, *_ in plans:
                arrays = {name: staging.host(f"{gid}.{name}") for name in _PER_GROUP}
                arrays["query_start_loc"] = qsl
                validate_group_arrays(arrays, self._tables[gid].group, reqs, num_tokens)

        views = staging.to(self.device)
        query_lens = tuple(new.tolist())
        out = {}
        for gid, _, seq_lens, _, _, _ in plans:
            group = self._tables[gid].group
            out[gid] = GroupMetadata(
                group_id=gid,
                block_size=group.block_size,
                position_offset=group.position_offset,
                layer_names=group.layer_names,
                num_reqs=num_reqs,
                num_tokens=num_tokens,
                query_start_loc=views["query_start_loc"],
                **{name: views[f"{gid}.{name}"] for name in _PER_GROUP},
                req_ids=ids_tuple,
                query_lens_host=query_lens,
                seq_lens_host=tuple(seq_lens.tolist()),
                num_draft_tokens_host=drafts,
            )
        return StepMetadata(out)

    @staticmethod
    def _counts(name: str, values: Sequence[int] | np.ndarray, n: int) -> np.ndarray:
        if isinstance(values, np.ndarray) and values.dtype == np.int64 and values.ndim == 1:
            arr = values
        else:
            arr = np.asarray(values, dtype=np.int64).reshape(-1)
        if arr.shape[0] != n:
            raise InvalidArgumentError(f"{name} has {arr.shape[0]} entries for {n} requests")
        if n and int(arr.min()) < 0:
            raise InvalidArgumentError(f"{name} must be >= 0, got {int(arr.min())}")
        return arr

    @staticmethod
    def _plan(table: _Table, rows, computed, new, max_blocks, req_ids):
        """(group id, table width, seq_lens, pages, lens, nnz) of one group's step."""
        group, bs = table.group, table.group.block_size
        seq_lens = np.maximum(computed + new - group.position_offset, 0)
        pages = -(-seq_lens // bs)
        lens = table.lens[rows]
        short = np.nonzero(lens < pages)[0]
        if short.size:
            i = int(short[0])
            raise MetadataError(
                f"group {group.id}: request {req_ids[i]!r} (row {i}) needs {int(pages[i])} "
                f"blocks of {bs} for {int(seq_lens[i])} positions but has {int(lens[i])} allocated"
            )
        need = int(pages.max(initial=0))
        width = int(lens.max(initial=0)) if max_blocks is None else max_blocks
        if width < need:
            raise InvalidArgumentError(
                f"group {group.id}: max_blocks={width} but a request reads {need} blocks"
            )
        return group.id, width, seq_lens, pages, lens, int(pages.sum())

    def _requests(self, req_ids, computed, new, drafts) -> list[ScheduledRequest]:
        """The step as ScheduledRequests (checked mode only: slow)."""
        return [
            ScheduledRequest(rid, int(c), int(n), {gid: self.blocks(rid, gid) for gid in self._tables}, d)
            for rid, c, n, d in zip(req_ids, computed, new, drafts, strict=True)
        ]
