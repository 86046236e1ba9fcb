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
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Sequence

import numpy as np
import torch

from pagedkv.batch.buffers import Layout, StepBuffers
from pagedkv.batch.incremental import MetadataBuilder
from pagedkv.batch.metadata import StepMetadata
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

    @property
    def nbytes(self) -> int:
        """Bytes of the device buffer (and of each host staging buffer)."""
        return self._buffers.nbytes

    @property
    def copies(self) -> int:
        """Host-to-device copies issued so far (one per step on a non-CPU device)."""
        return self._buffers.copies

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

        return self._step(req_ids, num_computed_tokens, num_new_tokens, num_draft_tokens,
                          checked, shape)
