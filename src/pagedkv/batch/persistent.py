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

``derive_on_device=True``: a steady decode step (the previous step's rows in the same order,
its shape, every row one new token and no draft, no block-table entry rewritten since, each
row at most one block more) sends a small delta instead and one kernel derives the step's
arrays in the same device buffer (:mod:`.ondevice`); any other step takes the full path.
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Sequence

import numpy as np
import torch

from pagedkv.batch.buffers import Layout, StepBuffers
from pagedkv.batch.incremental import MetadataBuilder, _max, _repeated, _sum
from pagedkv.batch.metadata import StepMetadata
from pagedkv.batch.ondevice import DeltaBuffers, delta_ints, descriptor
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
        derive_on_device: bool = False,
        derive_kernel: str | None = None,
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
        # steady decode steps derived on the device: the delta's buffers, each shape's
        # descriptor, and how many steps took that path
        self._delta = DeltaBuffers(self.device, self.batch_buckets[-1], len(self.groups),
                                   kernel=derive_kernel) if derive_on_device else None
        self._descriptors: dict[object, np.ndarray] = {}
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

        def shape(num_reqs: int, num_tokens: int) -> tuple[int, int, int]:
            return (self.bucket(num_reqs, self.batch_buckets, "requests"),
                    self.bucket(num_tokens, self.token_buckets, "tokens"), self.max_blocks)

        if self._delta is not None and self._steady is not None and not (
                self.checked if checked is None else checked):
            out = self._derived(req_ids, num_computed_tokens, num_new_tokens, num_draft_tokens,
                                shape)
            if out is not None:
                return out
        self._derived_last = False
        return self._step(req_ids, num_computed_tokens, num_new_tokens, num_draft_tokens,
                          checked, shape)

    def _derived(self, req_ids, num_computed_tokens, num_new_tokens, num_draft_tokens, shape):
        """A steady decode step derived on the device (see the module doc), or None, with
        nothing changed, when the step is not one."""
        entry, rows, held = self._steady  # type: ignore[misc]
        ids = req_ids if type(req_ids) is tuple else tuple(req_ids)
        n = len(ids)
        if self._lookup(ids) is not rows:
            return None
        computed, _ = self._counts("num_computed_tokens", num_computed_tokens, n)
        new, least = self._counts("num_new_tokens", num_new_tokens, n)
        if least != 1 or int(_sum(new)) != n:
            return None
        if num_draft_tokens is not None:
            drafts, _ = self._counts("num_draft_tokens", num_draft_tokens, n)
            if int(_max(drafts)):
                return None
        batch, tokens, width = shape(n, n)
        if self._buffers.shape(batch, tokens, (width,) * len(self.groups)) is not entry:
            return None
        tables = self._tables.values()
        total = computed + 1
        split: dict = {}
        plans = []
        for table, (edits, old) in zip(tables, held, strict=True):
            if table.edits != edits:
                return None
            plan = self._plan(table, rows, total, width, ids, computed, split)
            if int(_max((plan[4] - old).view(np.uint64))) > 1:  # (a shrunk row reads huge)
                return None
            plans.append(plan)

        delta = self._delta.host()  # type: ignore[union-attr]
        head = self._descriptors.get(entry)
        if head is None:
            head = self._descriptors[entry] = descriptor(
                entry.layout, tuple(g.block_size for g in self.groups),
                tuple(g.position_offset for g in self.groups))
        at = head.shape[0]
        delta[:at] = head
        delta[0] = n
        delta[at : at + n] = computed
        at += batch
        nnz = []
        for table, plan in zip(tables, plans, strict=True):
            lens = plan[4]
            cols = delta[at : at + n]
            np.subtract(lens, 1, out=cols, casting="unsafe")  # each row's last held block
            flat = table.ids.reshape(-1)
            flat.take(rows * table.ids.shape[1] + cols, 0, delta[at + batch : at + batch + n], "clip")
            nnz.append(int(_sum(plan[2])))
            at += 2 * batch
        groups = len(self.groups)
        self._delta.send(delta_ints(batch, groups))  # type: ignore[union-attr]
        self._delta.derive(self._buffers.device_buffer, batch, groups)  # type: ignore[union-attr]
        qsl_dev, views, page_lists = self._buffers.views(entry, nnz)
        self._carry = None  # the host buffers do not hold this step's page lists
        self._steady = (entry, rows, [(t.edits, p[4]) for t, p in zip(tables, plans, strict=True)])
        self._derived_last = True
        self.derived_steps += 1
        return self._metadata(ids, n, n, True, new, _repeated(0, n), plans, qsl_dev, views,
                              page_lists, False)
