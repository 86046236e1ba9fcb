"""Persistent, bucketed metadata buffers so that decode steps can be captured in CUDA graphs.

A captured graph replays kernels with the device addresses it saw at capture, so every
step's metadata must land in the same device memory with the same shapes. ``PersistentMetadata``
owns one pinned host buffer and one device buffer sized for the largest bucket, each array
at a fixed offset; ``step`` builds the step's metadata on the host (``build_metadata``,
padded to the batch/token bucket and a fixed block-table width), packs it into the pinned
buffer and copies it to the device in ONE host-to-device copy. The returned
``GroupMetadata`` views always point into the same device buffer, so a graph captured for a
bucket replays correctly with changed block tables, lengths and slots.

``paged_kv_indices`` keeps its true length (nnz) as a prefix of a fixed-capacity region:
kernels that take it are not captured at a fixed shape.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch

from pagedkv.batch.builder import build_metadata
from pagedkv.batch.inputs import ScheduledRequest
from pagedkv.batch.metadata import StepMetadata
from pagedkv.errors import InvalidArgumentError
from pagedkv.plan.types import Group

_ARRAYS = (
    ("slot_mapping", torch.int64), ("positions", torch.int64), ("block_table", torch.int32),
    ("seq_lens", torch.int32), ("paged_kv_indptr", torch.int32),
    ("paged_kv_indices", torch.int32), ("paged_kv_last_page_len", torch.int32),
)


def _capacity(name: str, batch: int, tokens: int, width: int) -> int:
    return {"slot_mapping": tokens, "positions": tokens, "block_table": batch * width,
            "seq_lens": batch, "paged_kv_indptr": batch + 1, "paged_kv_indices": batch * width,
            "paged_kv_last_page_len": batch}[name]


def _shape(name: str, batch: int, tokens: int, width: int, nnz: int) -> tuple[int, ...]:
    return {"slot_mapping": (tokens,), "positions": (tokens,), "block_table": (batch, width),
            "seq_lens": (batch,), "paged_kv_indptr": (batch + 1,), "paged_kv_indices": (nnz,),
            "paged_kv_last_page_len": (batch,)}[name]


class PersistentMetadata:
    """Fixed buffers for steps of up to ``batch_buckets[-1]`` requests and
    ``token_buckets[-1]`` query rows; block tables ``max_blocks`` wide per group."""

    def __init__(
        self,
        groups: Sequence[Group],
        *,
        max_blocks: int,
        batch_buckets: Sequence[int],
        token_buckets: Sequence[int] | None = None,
        device: torch.device | str = "cuda",
    ) -> None:
        if not batch_buckets or any(b <= 0 for b in batch_buckets) or max_blocks <= 0:
            raise InvalidArgumentError(
                f"need positive batch_buckets and max_blocks, got {list(batch_buckets)}, {max_blocks}")
        self.groups = tuple(groups)
        self.max_blocks = max_blocks
        self.batch_buckets = sorted(set(batch_buckets))
        self.token_buckets = sorted(set(token_buckets or batch_buckets))
        self.device = torch.device(device)
        batch, tokens = self.batch_buckets[-1], self.token_buckets[-1]
        self._layout: dict[str, tuple[int, torch.dtype]] = {}
        offset = 0

        def reserve(key: str, dtype: torch.dtype, count: int) -> None:
            nonlocal offset
            self._layout[key] = (offset, dtype)
            offset += -(-count * dtype.itemsize // 8) * 8

        reserve("query_start_loc", torch.int32, batch + 1)
        for g in self.groups:
            for name, dtype in _ARRAYS:
                reserve(f"{g.id}.{name}", dtype, _capacity(name, batch, tokens, max_blocks))
        self.nbytes = offset
        pin = self.device.type == "cuda" and torch.cuda.is_available()
        self._host = torch.zeros(offset, dtype=torch.uint8, pin_memory=pin)
        self._dev = torch.zeros(offset, dtype=torch.uint8, device=self.device)
        self.copies = 0  # host-to-device copies issued (one per step)

    def bucket(self, n: int, buckets: list[int], what: str) -> int:
        i = bisect.bisect_left(buckets, n)
        if i == len(buckets):
            raise InvalidArgumentError(f"{n} {what} exceed the largest bucket {buckets[-1]}")
        return buckets[i]

    def _view(self, buf: torch.Tensor, key: str, shape: tuple[int, ...]) -> torch.Tensor:
        offset, dtype = self._layout[key]
        count = int(np.prod(shape, dtype=np.int64))
        return buf[offset : offset + count * dtype.itemsize].view(dtype).view(shape)

    def step(self, requests: Sequence[ScheduledRequest], *, checked: bool | None = None) -> StepMetadata:
        """This step's metadata in the persistent device buffer (one host-to-device copy)."""
        batch = self.bucket(len(requests), self.batch_buckets, "requests")
        tokens = self.bucket(sum(r.num_new_tokens for r in requests), self.token_buckets, "tokens")
        host_meta = build_metadata(requests, self.groups, device="cpu", checked=checked,
                                   pad_batch_to=batch, pad_tokens_to=tokens,
                                   max_blocks=self.max_blocks)
        first = next(iter(host_meta.values()), None)
        if first is not None:
            self._view(self._host, "query_start_loc", (batch + 1,)).copy_(first.query_start_loc)
        for gid, gm in host_meta.items():
            for name, _ in _ARRAYS:
                src = getattr(gm, name)
                self._view(self._host, f"{gid}.{name}", tuple(src.shape)).copy_(src)
        if self.device.type == "cuda":
            self._dev.copy_(self._host, non_blocking=True)
            self.copies += 1
        else:
            self._dev.copy_(self._host)
        out = {}
        for gid, gm in host_meta.items():
            nnz = int(gm.paged_kv_indices.shape[0])
            views = {name: self._view(self._dev, f"{gid}.{name}",
                                      _shape(name, batch, tokens, self.max_blocks, nnz))
                     for name, _ in _ARRAYS}
            out[gid] = replace(gm, query_start_loc=self._view(self._dev, "query_start_loc", (batch + 1,)),
                               **views)
        return StepMetadata(out)

