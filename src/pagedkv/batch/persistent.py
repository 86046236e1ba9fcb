"""Persistent, bucketed metadata buffers so that decode steps can be captured in CUDA graphs.

A captured graph replays kernels with the device addresses and shapes it saw at capture,
so every step of one bucket must land in the same device memory with the same shapes.
``PersistentMetadata`` is a :class:`~pagedkv.batch.incremental.MetadataBuilder` (host block
tables kept across steps, the same fast path and the same single host-to-device copy) whose
buffers are sized once, up front, for the largest bucket and never move: each step is padded
to the smallest batch bucket and token bucket that hold it, block tables are ``max_blocks``
wide, and the views of a bucket always point at the same device addresses, so a graph
captured for a bucket replays correctly with changed block tables, lengths and slots.

``paged_kv_indices`` keeps its true length (nnz) as a prefix of a fixed-capacity region:
kernels that take it are not captured at a fixed shape.

``derive_on_device`` (default: on for CUDA devices): a steady decode step (the previous
step's rows in the same order, its shape, every row one new token and no draft, no
block-table entry rewritten since, each row at most one block more) sends a small delta
instead and one kernel derives the step's arrays in the same device buffer
(:mod:`.ondevice`); any other step takes the full path. ``derive_graphs`` (default: on
with it on CUDA): the delta's copy and that kernel's launch are replayed from a CUDA graph
captured once per host staging buffer and step shape (one host call instead of two).
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Sequence

import numpy as np
import torch

from pagedkv.batch.buffers import Layout, StepBuffers
from pagedkv.batch.incremental import MetadataBuilder, _any, _max, _sum, decode_counts
from pagedkv.batch.metadata import StepMetadata
from pagedkv.batch.ondevice import DeltaBuffers, descriptor
from pagedkv.errors import InvalidArgumentError
from pagedkv.plan.types import Group


class PersistentMetadata(MetadataBuilder):
    """Fixed buffers for steps of up to ``batch_buckets[-1]`` requests and
    ``token_buckets[-1]`` query rows (default: the batch buckets); block tables
    ``max_blocks`` wide in every group. ``rows``: initial host-table capacity in requests
    (live requests, scheduled or not; grown as needed)."""

    def __init__(
        self,
        groups: Sequence[Group],
        *,
        max_blocks: int,
        batch_buckets: Sequence[int],
        token_buckets: Sequence[int] | None = None,
        device: torch.device | str = "cuda",
        rows: int | None = None,
        checked: bool | None = None,
        derive_on_device: bool | None = None,
        derive_kernel: str | None = None,
        derive_graphs: bool | None = None,
    ) -> None:
        buckets = list(batch_buckets)
        tokens = list(token_buckets) if token_buckets is not None else buckets
        if not buckets or not tokens or any(b <= 0 for b in buckets + tokens) or max_blocks <= 0:
            raise InvalidArgumentError(
                f"need positive batch_buckets, token_buckets and max_blocks, got {buckets}, "
                f"{tokens}, {max_blocks}"
            )
        self.batch_buckets = sorted(set(buckets))
        self.token_buckets = sorted(set(tokens))
        self.max_blocks = max_blocks
        super().__init__(groups, device=device, rows=rows or self.batch_buckets[-1], width=max_blocks,
                         checked=checked)
        largest = Layout.of(self.batch_buckets[-1], self.token_buckets[-1], (max_blocks,) * len(self.groups))
        self._buffers = StepBuffers(self.device, capacity=largest.nbytes)
        # steady decode steps derived on the device (by default on CUDA: measured on the
        # H200, docs/kernels-log.md): the delta's buffers, each shape's descriptor, and how
        # many steps took that path
        if derive_on_device is None:
            derive_on_device = self.device.type == "cuda"
        # and their copy + launch replayed from CUDA graphs (by default on CUDA with the
        # Triton kernel: 0.72x the host time of the eager calls on the H200, docs/kernels-log.md)
        if derive_graphs is None:
            derive_graphs = self.device.type == "cuda" and derive_kernel in (None, "triton")
        self._delta = DeltaBuffers(self.device, self.batch_buckets[-1], len(self.groups),
                                   kernel=derive_kernel, graphs=derive_graphs
                                   ) if derive_on_device else None
        self._derives = self._delta is not None  # (the full path keeps what it needs)
        self._sizes: dict[tuple[int, int], tuple[int, int, int]] = {}  # see _shape
        self._descriptors: dict[object, np.ndarray] = {}
        self._geometry = [(g.block_size, g.position_offset) for g in self.groups]
        self._starts: dict[int, tuple] = {}
        self._derived_last = False
        self.derived_steps = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the device buffer (and of each host staging buffer)."""
        return self._buffers.nbytes

    @property
    def copies(self) -> int:
        """Host-to-device copies issued so far (one per step on a non-CPU device)."""
        return self._buffers.copies + (self._delta.copies if self._delta is not None else 0)

    @property
    def copy_bytes(self) -> int:
        """Bytes the last step's one copy covered (a derived step's: its delta's)."""
        if self._derived_last:
            return self._delta.copy_bytes  # type: ignore[union-attr]
        return self._buffers.copy_bytes

    def bucket(self, n: int, buckets: list[int], what: str) -> int:
        i = bisect.bisect_left(buckets, n)
        if i == len(buckets):
            raise InvalidArgumentError(f"{n} {what} exceed the largest bucket {buckets[-1]}")
        return buckets[i]

    def step(  # type: ignore[override]
        self,
        req_ids: Sequence[Hashable],
        num_computed_tokens: Sequence[int] | np.ndarray,
        num_new_tokens: Sequence[int] | np.ndarray,
        num_draft_tokens: Sequence[int] | np.ndarray | None = None,
        *,
        checked: bool | None = None,
    ) -> StepMetadata:
        """This step's metadata in the persistent device buffer, padded to its buckets
        (one host-to-device copy); valid until the next step."""
        if self._delta is not None and self._steady is not None and not (
                self.checked if checked is None else checked):
            out = self._derived(req_ids, num_computed_tokens, num_new_tokens, num_draft_tokens)
            if out is not None:
                return out
        self._derived_last = False
        return self._step(req_ids, num_computed_tokens, num_new_tokens, num_draft_tokens,
                          checked, self._shape)

    def _shape(self, num_reqs: int, num_tokens: int) -> tuple[int, int, int]:
        """(batch bucket, token bucket, max_blocks) of a step's size, remembered per size."""
        out = self._sizes.get((num_reqs, num_tokens))
        if out is None:
            if len(self._sizes) >= 1024:  # (a long run of odd sizes)
                self._sizes.clear()
            out = self._sizes[(num_reqs, num_tokens)] = (
                self.bucket(num_reqs, self.batch_buckets, "requests"),
                self.bucket(num_tokens, self.token_buckets, "tokens"), self.max_blocks)
        return out

    def _derived(self, req_ids, num_computed_tokens, num_new_tokens, num_draft_tokens):
        """A steady decode step derived on the device (see the module doc), or None, with
        nothing changed, when the step is not one (or would fail: the full path then raises
        the error). Lean on purpose: this is the step whose host time the target is about."""
        entry, rows, held = self._steady  # type: ignore[misc]
        ids = req_ids if type(req_ids) is tuple else tuple(req_ids)
        if self._lookup(ids) is not rows:  # not the previous step's rows (nor its shape)
            return None
        n = len(ids)
        ones = num_new_tokens is decode_counts(n)  # (known: no pass over them)
        # without position offsets a negative count shows in the page check below (read as
        # unsigned): no reduction for it here
        computed, _ = self._counts("num_computed_tokens", num_computed_tokens, n,
                                   not (ones and self._no_offset))
        if not ones:
            new, least = self._counts("num_new_tokens", num_new_tokens, n)
            if least != 1 or int(_max(new)) != 1:
                return None
        if num_draft_tokens is not None:
            drafts, _ = self._counts("num_draft_tokens", num_draft_tokens, n)
            if int(_max(drafts)):
                return None
        longest = int(_max(computed))
        seqs: dict[int, np.ndarray] = {}  # by position offset
        # by (offset, block size): (pages, or pages - 1 without offset; nnz)
        counts: dict[tuple[int, int], tuple[np.ndarray, int]] = {}
        plans = []
        held_now = []
        for table, (edits, old), (bs, k) in zip(self._tables.values(), held, self._geometry,
                                                strict=True):
            if table.edits != edits or (longest + bs - k) // bs > self.max_blocks:
                return None
            seq = seqs.get(k)
            if seq is None:
                seq = seqs[k] = computed + 1 if not k else np.maximum(computed + (1 - k), 0)
            count = counts.get((k, bs))
            if count is None:
                if k:
                    pages = seq + (bs - 1)
                    pages //= bs
                    count = counts[(k, bs)] = (pages, int(_sum(pages)))
                else:  # seq = computed + 1 >= 1: pages = computed // bs + 1
                    last = computed // bs
                    count = counts[(k, bs)] = (last, int(_sum(last)) + n)
            lens = table.lens.take(rows)
            # every page held (pages - 1 < lens without offset, or a negative count, read as
            # huge); at most one block more than the device holds (a shrunk row, which
            # needs an edit, would read huge)
            short = (count[0].view(np.uint64) >= lens.view(np.uint64) if not k
                     else count[0] > lens)
            if _any(short) or int(_max((lens - old).view(np.uint64))) > 1:
                return None
            plans.append((seq, count[1], lens))  # per group: seq_lens, nnz, block counts
            held_now.append((edits, lens))

        delta, at = self._delta.host(entry, n, self._head)  # type: ignore[union-attr]
        batch = entry.layout.batch
        delta[at : at + n] = computed
        at += batch
        nnz = []
        for table, (_, group_nnz, lens) in zip(self._tables.values(), plans, strict=True):
            delta[at : at + n] = lens
            ids_at = at + batch  # each row's last block: (an empty row's is never stored)
            table.ids.take(self._last_entries(table, rows) + lens, None,
                           delta[ids_at : ids_at + n], "clip")
            nnz.append(group_nnz)
            at = ids_at + batch
        self._delta.send(at)  # type: ignore[union-attr]
        self._delta.derive(self._buffers.device_buffer, batch, len(plans))  # type: ignore[union-attr]
        qsl_dev, views, page_lists = self._buffers.views(entry, nnz)
        self._carry = None  # the host buffers do not hold this step's page lists
        self._steady = (entry, rows, held_now)
        self._derived_last = True
        self.derived_steps += 1
        lengths: dict[int, dict] = {}  # by position offset
        for (_, k), (seq, _, _) in zip(self._geometry, plans, strict=True):
            if k not in lengths:
                lengths[k] = {"seq_lens_host": tuple(seq.tolist()),
                              "max_seq_len_host": max(longest + 1 - k, 0)}
        return self._decode_metadata(ids, n, rows, entry, qsl_dev, views, page_lists, lengths)

    def _head(self, entry) -> np.ndarray:
        """The delta's header and descriptors for a step shape (made once per shape)."""
        head = self._descriptors.get(entry)
        if head is None:
            head = self._descriptors[entry] = descriptor(
                entry.layout, tuple(g.block_size for g in self.groups),
                tuple(g.position_offset for g in self.groups))
        return head

    def _last_entries(self, table, rows: np.ndarray) -> np.ndarray:
        """Flat index, in the table's host array, of the entry before each batch row's
        first: + the row's block count gives its last block (cached while the batch rows
        and the array's width are unchanged)."""
        width = table.ids.shape[1]
        cached = self._starts.get(table.group.id)
        if cached is None or cached[0] is not rows or cached[1] != width:
            cached = self._starts[table.group.id] = (rows, width, rows * width - 1)
        return cached[2]
