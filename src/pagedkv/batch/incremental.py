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

A decode step of the previous step's rows and shape, given :func:`decode_counts` (an
engine's steady step: ``engine/stepmeta.py``), takes ``_repeat``: the same arrays from the
same functions, without the full path's generality (its Python is most of such a step's
host time).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from functools import lru_cache

import numpy as np
import torch

from pagedkv.batch.buffers import StepBuffers
from pagedkv.batch.builder import _check_groups, _padded
from pagedkv.batch.checked import checked_mode, validate_group_arrays
from pagedkv.batch.derived import fill_derived, row_starts
from pagedkv.batch.inputs import ScheduledRequest
from pagedkv.batch.metadata import GroupMetadata, StepMetadata, group_metadata
from pagedkv.errors import InvalidArgumentError, MetadataError, PagedKVError
from pagedkv.plan.types import Group

_INT32_MAX = 2**31 - 1
# append_each checks and writes a list of up to this many block ids in Python, one row at a
# time (a decode step opens a block in ~1 of block_size rows): the whole call for 16 ids
# 9.1 us against 12.2 through numpy's fancy indexing, 16.1 / 13.8 at 32, 29.7 / 16.8 at 64
# (timeit, warm; in an engine step, cold, numpy's calls cost more: 6 / 11 us for the write of
# ~15); 2-core container CPU, 2026-12-04
_SMALL_APPEND = 32
# ufunc reductions called directly: the ndarray methods add a Python-level wrapper per call
_sum, _min, _max, _any = np.add.reduce, np.minimum.reduce, np.maximum.reduce, np.logical_or.reduce



def _int64(ids) -> np.ndarray:  # noqa: ANN001
    """``ids`` as a flat int64 array; TypeError for anything but integers (numpy would
    truncate floats)."""
    arr = np.asarray(ids)
    if arr.size and arr.dtype.kind not in "iu":
        raise TypeError(f"block ids of dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False).reshape(-1)


def _not_ids(group_id, req_id, ids, exc: Exception) -> MetadataError:  # noqa: ANN001
    where = "" if group_id is None else f"group {group_id}: "
    return MetadataError(f"{where}request {req_id!r}: block ids {ids!r} are not integers ({exc})")

class _Table:
    """One group's host block table: int32 [rows, width] (grown by doubling) + lengths."""

    def __init__(self, group: Group, rows: int, width: int) -> None:
        self.group = group
        self.limit = group.num_blocks if group.num_blocks > 0 else _INT32_MAX + 1
        self.ids = np.zeros((rows, width), dtype=np.int32)
        self.lens = np.zeros(rows, dtype=np.int64)
        # bumped by every change that is not an append (an entry below a row's length
        # rewritten or cleared): a step's page list carried from the previous one is valid
        # only while it is unchanged
        self.edits = 0

    def grow_rows(self, rows: int) -> None:
        ids = np.zeros((rows, self.ids.shape[1]), dtype=np.int32)
        ids[: self.ids.shape[0]] = self.ids
        lens = np.zeros(rows, dtype=np.int64)
        lens[: self.lens.shape[0]] = self.lens
        self.ids, self.lens = ids, lens

    def widen(self, width: int) -> None:
        wider = np.zeros((self.ids.shape[0], width), dtype=np.int32)
        wider[:, : self.ids.shape[1]] = self.ids
        self.ids = wider

    def _checked(self, req_id: Hashable, ids: Sequence[int]) -> Sequence[int] | np.ndarray:
        try:
            return self._in_range(req_id, ids)
        except PagedKVError:  # (InvalidArgumentError is a ValueError too)
            raise
        except (TypeError, ValueError, OverflowError) as exc:  # not integers at all
            raise _not_ids(self.group.id, req_id, ids, exc) from None

    def _in_range(self, req_id: Hashable, ids: Sequence[int]) -> Sequence[int] | np.ndarray:
        if len(ids) <= 8 and all(type(x) is int for x in ids):  # a step's appends are a block or two: plain Python is faster
            for x in ids:
                if not 0 <= x < self.limit:
                    raise MetadataError(
                        f"group {self.group.id}: request {req_id!r} was given block id "
                        f"{int(x)}, outside the group's {self.limit} blocks"
                    )
            return ids
        arr = _int64(ids)
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
            self.widen(max(end, 2 * self.ids.shape[1]))
        old = int(self.lens[row])
        if start < old:
            self.edits += 1
        self.ids[row, start:end] = arr
        if old > end:
            self.ids[row, end:old] = 0
        self.lens[row] = end

    def clear(self, row: int) -> None:
        self.edits += 1
        self.ids[row, : int(self.lens[row])] = 0
        self.lens[row] = 0


class MetadataBuilder:
    """Live requests' block tables on the host; one :meth:`step` per invocation.

    ``device`` is where step metadata goes; ``rows`` / ``width`` are initial capacities
    (requests, blocks per request), grown as needed. ``checked``: validate every step
    (slow; default: env ``PAGEDKV_DEBUG=1``, read here, once). A step's tensors are views of
    buffers the builder reuses: valid until its next step.
    """

    _derives = False  # whether a step keeps what a derived step needs (``_steady``)

    def __init__(
        self,
        groups: Sequence[Group],
        *,
        device: torch.device | str = "cpu",
        rows: int = 64,
        width: int = 16,
        checked: bool | None = None,
    ) -> None:
        _check_groups(groups)
        self.checked = checked_mode(checked)  # the env default is read once, here
        if rows < 1 or width < 1:
            raise InvalidArgumentError(f"rows ({rows}) and width ({width}) must be >= 1")
        self.groups = tuple(groups)
        self._no_offset = not any(g.position_offset for g in self.groups)
        self.device = torch.device(device)
        self._tables = {g.id: _Table(g, rows, width) for g in self.groups}
        self._rows: dict[Hashable, int] = {}
        self._version = 0  # bumped by add/remove: a cached row lookup is valid while equal
        self._last_ids: tuple[Hashable, ...] | None = None
        self._last_version = -1
        self._last_rows = np.zeros(0, dtype=np.intp)
        self._free = list(range(rows - 1, -1, -1))
        self._buffers = StepBuffers(self.device)
        # (shape entry, batch rows, per group (table edits, pages)) of the last completed step:
        # its page lists are carried into the next step of the same rows and shape
        self._carry: tuple | None = None
        # (shape entry, batch rows, per group (table edits, row lengths)) of the last step
        # when it was a decode step (else None): see PersistentMetadata
        self._steady: tuple | None = None
        # each group's GroupMetadata fields that never change between steps
        self._constant = {
            g.id: {"group_id": g.id, "block_size": g.block_size,
                   "position_offset": g.position_offset, "layer_names": g.layer_names}
            for g in self.groups
        }
        # (batch rows, shape, each group's fields of an unchecked decode step that stay
        # with those): see _decode_metadata
        self._fields: tuple | None = None

    @property
    def copy_bytes(self) -> int:
        """Bytes the last step's one host-to-device copy covered (on a CPU device, which
        needs no copy: what a CUDA step of the same shape would copy)."""
        return self._buffers.copy_bytes

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

    def append_each(
        self, req_ids: Sequence[Hashable], block_ids: Mapping[int, Sequence[int] | np.ndarray]
    ) -> None:
        """One new block per request and group for many requests at once (a decode step's
        page openings): ``block_ids[gid][i]`` is appended to ``req_ids[i]``. One call for
        what ``append_blocks`` per request costs in Python calls: a few numpy ops, or for a
        short list (``_SMALL_APPEND``) a Python loop, cheaper than numpy's fixed costs."""
        if len(set(req_ids)) != len(req_ids):
            raise InvalidArgumentError(f"append_each: a request is named twice in {list(req_ids)}")
        if not self._tables.keys() >= block_ids.keys():
            unknown = [gid for gid in block_ids if gid not in self._tables]
            raise InvalidArgumentError(
                f"append_each: block ids for groups {unknown}, builder has {sorted(self._tables)}"
            )
        try:
            rows = list(map(self._rows.__getitem__, req_ids))
        except KeyError as e:
            raise InvalidArgumentError(f"request {e.args[0]!r} is not in the builder") from None
        try:
            checked = self._each_checked(req_ids, rows, block_ids)
        except PagedKVError:  # (InvalidArgumentError is a ValueError too)
            raise
        except (TypeError, ValueError, OverflowError) as exc:  # not integers at all
            raise _not_ids(None, req_ids, block_ids, exc) from None
        at = None
        for table, arr in checked:  # every group checked before any changes
            if type(arr) is list:  # a few: one at a time (through memoryviews, which index
                # ~3x faster than numpy's scalar indexing) beats numpy's fancy indexing
                lens, ids = memoryview(table.lens), memoryview(table.ids)
                width = table.ids.shape[1]
                for row, block in zip(rows, arr):
                    col = lens[row]
                    if col >= width:
                        table.widen(max(col + 1, 2 * width))
                        ids, width = memoryview(table.ids), table.ids.shape[1]
                    ids[row, col] = block
                    lens[row] = col + 1
                continue
            if at is None:
                at = np.array(rows, dtype=np.intp)
            cols = table.lens.take(at)
            if at.shape[0]:
                widest = int(_max(cols))
                if widest >= table.ids.shape[1]:
                    table.widen(max(widest + 1, 2 * table.ids.shape[1]))
            table.ids[at, cols] = arr
            cols += 1
            table.lens[at] = cols

    def _each_checked(self, req_ids, rows, block_ids) -> list:
        """:meth:`append_each`'s checks of every group's ids: (table, ids) pairs."""
        checked = []
        for gid, ids in block_ids.items():
            table = self._tables[gid]
            if (type(ids) is list and len(ids) <= _SMALL_APPEND
                    and all(type(x) is int for x in ids)):
                # a decode step's few openings: checked in Python, written from the list
                if len(ids) != len(rows):
                    raise InvalidArgumentError(
                        f"append_each: group {gid} has {len(ids)} block ids for "
                        f"{len(rows)} requests"
                    )
                if ids and (max(ids) >= table.limit or min(ids) < 0):
                    i = next(i for i, x in enumerate(ids) if not 0 <= x < table.limit)
                    raise MetadataError(
                        f"group {gid}: request {req_ids[i]!r} was given block id {int(ids[i])}, "
                        f"outside the group's {table.limit} blocks"
                    )
                checked.append((table, ids))
                continue
            arr = _int64(ids)
            if arr.shape[0] != len(rows):
                raise InvalidArgumentError(
                    f"append_each: group {gid} has {arr.shape[0]} block ids for "
                    f"{len(rows)} requests"
                )
            # one reduction (a negative id reads as huge unsigned); the offending entry is
            # looked for only when there is one
            if arr.shape[0] and int(_max(arr.view(np.uint64))) >= table.limit:
                i = int(np.flatnonzero((arr < 0) | (arr >= table.limit))[0])
                raise MetadataError(
                    f"group {gid}: request {req_ids[i]!r} was given block id {int(arr[i])}, "
                    f"outside the group's {table.limit} blocks"
                )
            checked.append((table, arr))
        return checked

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
        them) with the same keyword arguments; one host-to-device copy. The tensors are
        views of the builder's buffers: valid until its next step.
        """
        if max_blocks is not None and max_blocks < 0:
            raise InvalidArgumentError(f"max_blocks must be >= 0, got {max_blocks}")

        def shape(num_reqs: int, num_tokens: int) -> tuple[int, int, int | None]:
            return (_padded("pad_batch_to", pad_batch_to, num_reqs),
                    _padded("pad_tokens_to", pad_tokens_to, num_tokens), max_blocks)

        return self._step(req_ids, num_computed_tokens, num_new_tokens, num_draft_tokens,
                          checked, shape)

    def step_requests(
        self, requests: Sequence[ScheduledRequest], **kwargs: object
    ) -> StepMetadata:
        """:meth:`step` from ``ScheduledRequest`` s: unknown requests are added, known ones
        get the given block lists (every group). Per-request Python: for tests and for
        callers that hold ScheduledRequests, not the decode fast path."""
        for r in requests:
            blocks = {gid: r.blocks(gid) for gid in self._tables}
            if r.req_id in self._rows:
                self.set_blocks(r.req_id, blocks)
            else:
                self.add(r.req_id, blocks)
        return self.step(  # type: ignore[arg-type]
            [r.req_id for r in requests], [r.num_computed_tokens for r in requests],
            [r.num_new_tokens for r in requests], [r.num_draft_tokens for r in requests],
            **kwargs,
        )

    def _lookup(self, ids: tuple[Hashable, ...]) -> np.ndarray:
        if ids == self._last_ids and self._version == self._last_version:
            return self._last_rows  # the same batch order as last step: no lookups
        try:
            rows = np.fromiter(map(self._rows.__getitem__, ids), dtype=np.intp, count=len(ids))
        except KeyError as e:
            raise InvalidArgumentError(f"request {e.args[0]!r} is not in the builder") from None
        self._last_ids, self._last_version, self._last_rows = ids, self._version, rows
        return rows

    def _step(self, req_ids, num_computed_tokens, num_new_tokens, num_draft_tokens, checked, shape):
        """The fast path shared by every mode; ``shape(num_reqs, num_tokens)`` gives the
        padded batch, padded tokens and the block-table width (None: widest row)."""
        ids = req_ids if type(req_ids) is tuple else tuple(req_ids)
        n = len(ids)
        self._steady = None  # set again only when this step completes
        rows = self._lookup(ids)
        # a decode step's negative counts show in _plan's check of the pages each row reads,
        # where every group has no position offset: no reduction for them here
        lazy = num_new_tokens is decode_counts(n) and self._no_offset
        computed, _ = self._counts("num_computed_tokens", num_computed_tokens, n, not lazy)
        if lazy and num_draft_tokens is None and not (self.checked if checked is None
                                                      else checked):
            out = self._repeat(ids, rows, computed, shape)
            if out is not None:
                return out
        if num_new_tokens is decode_counts(n):  # known to be all ones
            new, num_tokens, decode = num_new_tokens, n, True
        else:
            new, shortest = self._counts("num_new_tokens", num_new_tokens, n)
            num_tokens = int(_sum(new))
            # one token row per request: no per-token index arrays (the decode fast path)
            decode = num_tokens == n and (n == 0 or shortest == 1)
        if num_draft_tokens is None:
            drafts = _repeated(0, n)
        else:
            d, _ = self._counts("num_draft_tokens", num_draft_tokens, n)
            over = np.nonzero(d > new)[0]
            if over.size:
                i = int(over[0])
                raise InvalidArgumentError(
                    f"request {ids[i]!r}: {int(d[i])} draft tokens but only {int(new[i])} "
                    "new tokens (drafts are counted among the new tokens)"
                )
            drafts = tuple(d.tolist())
        batch, tokens, max_blocks = shape(n, num_tokens)

        total = computed + new
        tables = self._tables.values()
        # a decode step's positions are the computed counts: each offset-0 group's page
        # column and in-page offset of them, one divmod per block size
        split: dict[int, tuple[np.ndarray, np.ndarray]] | None = {} if decode else None
        plans = [self._plan(table, rows, total, max_blocks, ids, computed, split)
                 for table in tables]
        widths = tuple([p[0] for p in plans])
        for table, width in zip(tables, widths, strict=True):
            if width > table.ids.shape[1]:
                table.widen(width)
        entry = self._buffers.shape(batch, tokens, widths)
        qsl, hosts = self._buffers.host(entry)

        check = self.checked if checked is None else checked
        key = (entry, n, num_tokens, decode)
        fresh = not self._buffers.refill(key) or check
        if decode:
            if fresh:
                qsl[: n + 1] = row_starts(n + 1, 1)  # 0, 1, ..., n
                if batch > n:
                    qsl[n + 1 :] = num_tokens
            row_req = row_in_req = None
        else:
            qsl[0] = 0
            qsl[1 : n + 1] = np.add.accumulate(new)
            row_req = np.repeat(np.arange(n), new)
            row_in_req = np.arange(num_tokens) - qsl[row_req]
            if batch > n:
                qsl[n + 1 :] = num_tokens
        reqs = self._requests(ids, computed, new, drafts) if check else None
        carry, self._carry = self._carry, None
        if carry is not None and (check or carry[0] is not entry or carry[1] is not rows):
            carry = None
        previous = self._buffers.previous(entry) if carry is not None else None
        nnz = []
        states = []
        for i, (table, (width, seq_lens, pages, cols, _), host) in enumerate(
                zip(tables, plans, hosts, strict=True)):
            src = table.ids if width == table.ids.shape[1] else table.ids[:, :width]
            block_table = host["block_table"]
            src.take(rows, 0, block_table[:n], "clip")  # rows are in range
            if fresh and n < batch:
                block_table[n:] = 0
            carried = previous is not None and _carry_pages(
                carry[2][i], table.edits, pages, block_table, host, previous[i])  # type: ignore[index]
            count = fill_derived(host, table.group, seq_lens, pages, computed, row_req, row_in_req,
                                 fresh, not carried, cols)
            nnz.append(count)
            states.append((table.edits, pages))
            if reqs is not None:
                arrays = dict(host, query_start_loc=qsl)
                arrays["paged_kv_indices"] = arrays["paged_kv_indices"][:count]
                validate_group_arrays(arrays, table.group, reqs, num_tokens)
        self._buffers.filled(key)

        qsl_dev, views, page_lists = self._buffers.send(entry, nnz)
        self._carry = (entry, rows, states)
        # what a step derived on the device next needs (PersistentMetadata's device mode):
        # the shape, the rows, and each table's edits and row lengths the device now holds
        if decode and self._derives:
            self._steady = (entry, rows, [(t.edits, p[4]) for t, p in zip(tables, plans,
                                                                          strict=True)])
        return self._metadata(ids, n, num_tokens, decode, new, drafts, plans, qsl_dev, views,
                              page_lists, check, rows, entry)

    def _repeat(self, ids, rows, computed, shape) -> StepMetadata | None:
        """An unchecked decode step without drafts (every group without position offset) of
        the previous step's rows and shape, each table as wide as the step's block tables:
        what the full path does for it, without its generality (the same functions fill
        the same arrays; most of a steady step's host time is such Python). None, nothing
        changed, where that is not so or a row lacks a block (the full path raises)."""
        carry = self._carry
        if carry is None or carry[1] is not rows:
            return None
        n = len(ids)
        batch, tokens, width = shape(n, n)
        if width is None:  # (block tables as wide as the widest row: the full path)
            return None
        entry = self._buffers.shape(batch, tokens, (width,) * len(self.groups))
        if entry is not carry[0]:
            return None
        tables = self._tables.values()
        split: dict[int, tuple[np.ndarray, ...]] = {}  # block size -> (page, offset, pages)
        held = []
        for table in tables:
            if table.ids.shape[1] != width:
                return None
            bs = table.group.block_size
            cols = split.get(bs)
            if cols is None:
                q, r = _divmod(computed, bs)
                cols = split[bs] = (q, r, q + 1)
            lens = table.lens.take(rows)
            # every page the row reads held (a negative count reads as huge)
            if _any(cols[0].view(np.uint64) >= lens.view(np.uint64)):
                return None
            held.append(lens)
        key = (entry, n, n, True)
        if not self._buffers.refill(key):  # padding not written for this key: the full path
            return None
        hosts = self._buffers.host(entry)[1]
        previous = self._buffers.previous(entry)
        total = computed + 1
        nnz = []
        states = []
        for i, (table, host) in enumerate(zip(tables, hosts, strict=True)):
            q, r, pages = split[table.group.block_size]
            block_table = host["block_table"]
            table.ids.take(rows, 0, block_table[:n], "clip")
            carried = _carry_pages(carry[2][i], table.edits, pages, block_table, host,
                                   previous[i])
            nnz.append(fill_derived(host, table.group, total, pages, computed, None, None,
                                    False, not carried, (q, r)))
            states.append((table.edits, pages))
        self._buffers.filled(key)
        qsl_dev, views, page_lists = self._buffers.send(entry, nnz)
        self._carry = (entry, rows, states)
        if self._derives:
            self._steady = (entry, rows, [(t.edits, lens) for t, lens in zip(tables, held)])
        lengths = {0: {"seq_lens_host": tuple(total.tolist()),
                       "max_seq_len_host": int(_max(total, initial=0))}}
        return self._decode_metadata(ids, n, rows, entry, qsl_dev, views, page_lists, lengths)

    def _metadata(self, ids, n, num_tokens, decode, new, drafts, plans, qsl_dev, views,
                  page_lists, check, rows, entry) -> StepMetadata:
        """The step's StepMetadata from its device views and host lengths."""
        tables = self._tables.values()
        seq_host: dict[int, dict[str, object]] = {}  # one offset, one set of lengths
        for table, (_, seq_lens, _, _, _) in zip(tables, plans, strict=True):
            k = table.group.position_offset
            if k not in seq_host:
                seq_host[k] = {"seq_lens_host": tuple(seq_lens.tolist()),
                               "max_seq_len_host": int(_max(seq_lens, initial=0))}
        if decode and not check and drafts is _repeated(0, n):
            return self._decode_metadata(ids, n, rows, entry, qsl_dev, views, page_lists,
                                         seq_host)
        if decode:  # (an empty step, also "decode": no query, bounds (0, 0))
            query_lens, bounds = _repeated(1, n), ((1, 1) if n else (0, 0))
        else:
            query_lens = tuple(new.tolist())
            bounds = (min(query_lens, default=0), max(query_lens, default=0))
        step_fields = {
            "num_reqs": n,
            "num_tokens": num_tokens,
            "query_start_loc": qsl_dev,
            "req_ids": ids,
            "query_lens_host": query_lens,
            "num_draft_tokens_host": drafts,
            "query_len_bounds": bounds,
        }
        out = {}
        for group, dev, page_list in zip(self.groups, views, page_lists, strict=True):
            out[group.id] = group_metadata(
                (self._constant[group.id], step_fields, dev, seq_host[group.position_offset],
                 {"paged_kv_indices": page_list}),
                checked=check,
            )
        return StepMetadata(out)

    def _decode_metadata(self, ids, n, rows, entry, qsl_dev, views, page_lists,
                         seq_host) -> StepMetadata:
        """An unchecked decode step's StepMetadata (no drafts): each group's fields that stay
        while the batch rows and the step shape do (all but the lengths and the page list)
        merged once, the objects filled through their instance dicts, as group_metadata
        does unchecked."""
        fixed = self._fields
        if fixed is None or fixed[0] is not rows or fixed[1] is not entry:
            step_fields = {
                "num_reqs": n, "num_tokens": n, "query_start_loc": qsl_dev, "req_ids": ids,
                "query_lens_host": _repeated(1, n), "num_draft_tokens_host": _repeated(0, n),
                "query_len_bounds": (1, 1) if n else (0, 0)}
            fixed = self._fields = (rows, entry, [
                {**self._constant[g.id], **step_fields, **dev}
                for g, dev in zip(self.groups, views, strict=True)])
        out = {}
        for group, merged, page_list in zip(self.groups, fixed[2], page_lists, strict=True):
            meta = object.__new__(GroupMetadata)
            fields = meta.__dict__
            fields.update(merged)
            fields.update(seq_host[group.position_offset])
            fields["paged_kv_indices"] = page_list
            out[group.id] = meta
        step = object.__new__(StepMetadata)
        step.__dict__["groups"] = out
        return step

    @staticmethod
    def _counts(name: str, values: Sequence[int] | np.ndarray, n: int,
                bound: bool = True) -> tuple[np.ndarray, int]:
        """The counts as int64 (no copy when they already are) and their minimum (``bound``
        False: neither looked for nor checked, -1 returned: the caller checks)."""
        if isinstance(values, np.ndarray) and values.dtype == np.int64 and values.ndim == 1:
            arr = values
        else:
            arr = np.asarray(values, dtype=np.int64).reshape(-1)
        if arr.shape[0] != n:
            raise InvalidArgumentError(f"{name} has {arr.shape[0]} entries for {n} requests")
        if not bound:
            return arr, -1
        least = int(_min(arr)) if n else 0
        if least < 0:
            raise InvalidArgumentError(f"{name} must be >= 0, got {least}")
        return arr, least

    @staticmethod
    def _plan(table: _Table, rows, total, max_blocks, req_ids, computed, split):
        """(block-table width, seq_lens, pages, cols, lens) of one group's step; ``cols``: the
        (page column, in-page offset) of each row's position in a decode step of an offset-0
        group (``split``: those already made this step, by block size), else None."""
        group, bs = table.group, table.group.block_size
        k = group.position_offset
        cols = None
        if split is not None and not k:
            cols = split.get(bs)
            if cols is None:
                cols = split[bs] = _divmod(computed, bs)
            seq_lens = total
            pages = cols[0] + 1  # the new token's position is `computed`: its page is the last
        else:
            seq_lens = np.maximum(total - k, 0) if k else total
            pages = (seq_lens + (bs - 1)) // bs
        lens = table.lens.take(rows)
        if cols is not None:  # pages - 1 >= lens, or a negative count (which reads as huge)
            short = cols[0].view(np.uint64) >= lens.view(np.uint64)
        else:
            short = lens < pages
        if _any(short):
            MetadataBuilder._counts("num_computed_tokens", computed, len(computed))  # (>= 0?)
            i = int(np.argmax(short))
            raise MetadataError(
                f"group {group.id}: request {req_ids[i]!r} (row {i}) needs {int(pages[i])} "
                f"blocks of {bs} for {int(seq_lens[i])} positions but has {int(lens[i])} allocated"
            )
        if max_blocks is None:
            width = int(_max(lens, initial=0))
        else:
            width = max_blocks
            # (a row reads no more blocks than it holds, nor holds more than the table is
            # wide: nothing to look for in a table no wider than max_blocks)
            need = int(_max(pages, initial=0)) if table.ids.shape[1] > width else 0
            if width < need:
                raise InvalidArgumentError(
                    f"group {group.id}: max_blocks={width} but a request reads {need} blocks"
                )
        return width, seq_lens, pages, cols, lens

    def _requests(self, req_ids, computed, new, drafts) -> list[ScheduledRequest]:
        """The step as ScheduledRequests (checked mode only: slow)."""
        return [
            ScheduledRequest(rid, int(c), int(n), {gid: self.blocks(rid, gid) for gid in self._tables}, d)
            for rid, c, n, d in zip(req_ids, computed, new, drafts, strict=True)
        ]


def _divmod(values: np.ndarray, d: int) -> tuple[np.ndarray, np.ndarray]:
    """``np.divmod(values, d)`` of int64 values: a shift and a mask where ``d`` is a power
    of two (2.3 us for np.divmod of 256 values, 0.9 + 0.9 for these, timeit, this project's
    2-core container CPU, 2026-12-04; a negative value's quotient stays negative, floored,
    as np.divmod's)."""
    if d & (d - 1):
        return np.divmod(values, d)
    return values >> (d.bit_length() - 1), values & (d - 1)


@lru_cache(maxsize=16)
def decode_counts(n: int) -> np.ndarray:
    """A read-only int64 array of ``n`` ones, made once per ``n``: a decode step's new
    counts. :meth:`MetadataBuilder.step` given this very array knows them without a
    pass (a caller's own array of ones is checked as any other)."""
    ones = np.ones(n, dtype=np.int64)
    ones.flags.writeable = False
    return ones


@lru_cache(maxsize=16)
def _repeated(value: int, n: int) -> tuple[int, ...]:
    """(value,) * n, made once per (value, n): a decode step's query lengths and drafts."""
    return (value,) * n


# a page list is carried over (opened pages inserted) only while the insertions are few: each
# costs ~0.5 us of Python, the boolean gather ~1.3 ns per page of the whole list (this machine);
# and only for lists long enough that the gather costs more than the carry's fixed ~6 us
_CARRY_PAGES_PER_INSERT = 384
_CARRY_MIN_PAGES = 8192


def _carry_pages(state, edits, pages, block_table, host, previous) -> bool:
    """Write this step's CSR page list from the previous step's (same batch rows, same
    shape), inserting the pages each row gained: a decode step opens a page in ~1/block_size
    of its rows, so the list is the previous one with a few insertions, made as that many
    memmoves through memoryviews (numpy slicing costs ~1 us per slice, a memoryview ~0.1).
    ``previous``: the previous step's host arrays (the same arrays on a CPU device, whose one
    buffer is rewritten in place). False, with nothing written, where that does not apply:
    table entries rewritten since (``edits``), a row that lost pages or gained more than one,
    or too many insertions to beat the gather."""
    old_edits, old = state
    n = pages.shape[0]
    if old_edits != edits or n == 0:
        return False
    # (memoryviews read single entries ~3x faster than numpy's scalar indexing)
    indptr = memoryview(previous["paged_kv_indptr"])
    hi = indptr[n]  # the previous list's length
    if hi < _CARRY_MIN_PAGES:
        return False
    diff = pages - old
    changed = diff.nonzero()[0].tolist()
    k = len(changed)
    if k * _CARRY_PAGES_PER_INSERT > hi:
        return False
    if k:  # each a page more (a row that lost pages or gained more: the gather)
        steps = memoryview(diff)
        for row in changed:
            if steps[row] != 1:
                return False
    dst_arr, src_arr = host["paged_kv_indices"], previous["paged_kv_indices"]
    dst = memoryview(dst_arr)
    src = dst if dst_arr is src_arr else memoryview(src_arr)
    if k:
        # each changed row's new page (staged table: at its old page count) goes after its
        # old pages, at its old end shifted by the insertions before it; from the last row
        # backwards, so that in place every old entry moves once, before anything
        # overwrites it
        table, counts = memoryview(block_table), memoryview(old)
        shift = k
        for row in reversed(changed):
            end = indptr[row + 1]
            dst[end + shift : hi + shift] = src[end:hi]
            shift -= 1
            dst[end + shift] = table[row, counts[row]]
            hi = end
    if dst_arr is not src_arr:
        dst[:hi] = src[:hi]
    return True
