"""Build every block-table group's metadata for one invocation: one vectorised pass on the
host into one staging buffer, then one host-to-device copy (see :mod:`.metadata` for the
tensor conventions)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch

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


def build_metadata(
    requests: Sequence[ScheduledRequest],
    groups: Sequence[Group],
    *,
    device: torch.device | str = "cpu",
    checked: bool | None = None,
    pad_batch_to: int | None = None,
    pad_tokens_to: int | None = None,
    max_blocks: int | None = None,
) -> StepMetadata:
    """Metadata of every given block-table group for this invocation's requests.

    ``pad_batch_to`` / ``pad_tokens_to`` add padding rows (fixed shapes for graph capture);
    ``max_blocks`` fixes the block-table width (default: the longest block list).
    ``checked`` (default: env ``PAGEDKV_DEBUG=1``) validates every row and slot on the host
    before the copy and raises :class:`MetadataError` naming the row.
    """
    device = torch.device(device)
    _check_groups(groups)
    if max_blocks is not None and max_blocks < 0:
        raise InvalidArgumentError(f"max_blocks must be >= 0, got {max_blocks}")
    num_reqs = len(requests)
    batch = _padded("pad_batch_to", pad_batch_to, num_reqs)
    computed = np.array([r.num_computed_tokens for r in requests], dtype=np.int64)
    new = np.array([r.num_new_tokens for r in requests], dtype=np.int64)
    num_tokens = int(new.sum())
    tokens = _padded("pad_tokens_to", pad_tokens_to, num_tokens)

    staging = Staging()
    staging.add("query_start_loc", "int32", (batch + 1,))
    plans = []
    for group in groups:
        plan = _GroupPlan(group, requests, computed, new, max_blocks)
        for name, dtype, shape in plan.arrays(batch, tokens):
            staging.add(f"{group.id}.{name}", dtype, shape)
        plans.append(plan)
    staging.allocate(device)

    qsl = staging.host("query_start_loc")
    qsl[0] = 0
    qsl[1 : num_reqs + 1] = np.cumsum(new)
    qsl[num_reqs + 1 :] = num_tokens
    row_req = np.repeat(np.arange(num_reqs), new)
    row_in_req = np.arange(num_tokens) - qsl[row_req]
    hosts = {plan.group.id: {name: staging.host(f"{plan.group.id}.{name}") for name in _PER_GROUP}
             for plan in plans}
    for plan in plans:
        plan.fill(hosts[plan.group.id], row_req, row_in_req)

    if checked_mode(checked):
        for plan in plans:
            host = dict(hosts[plan.group.id], query_start_loc=qsl)
            validate_group_arrays(host, plan.group, requests, num_tokens)

    views = staging.to(device)
    out = {}
    query_lens = tuple(new.tolist())
    bounds = (min(query_lens, default=0), max(query_lens, default=0))
    drafts = tuple(r.num_draft_tokens for r in requests)
    req_ids = tuple(r.req_id for r in requests)
    for plan in plans:
        gid = plan.group.id
        out[gid] = GroupMetadata(
            group_id=gid,
            block_size=plan.group.block_size,
            position_offset=plan.group.position_offset,
            layer_names=plan.group.layer_names,
            num_reqs=num_reqs,
            num_tokens=num_tokens,
            query_start_loc=views["query_start_loc"],
            **{name: views[f"{gid}.{name}"] for name in _PER_GROUP},
            req_ids=req_ids,
            query_lens_host=query_lens,
            seq_lens_host=tuple(plan.seq_lens.tolist()),
            num_draft_tokens_host=drafts,
            query_len_bounds=bounds,
            max_seq_len_host=int(plan.seq_lens.max(initial=0)),
        )
    return StepMetadata(out)


def _check_groups(groups: Sequence[Group]) -> None:
    seen = set()
    for g in groups:
        if g.id in seen:
            raise InvalidArgumentError(f"group id {g.id} given twice")
        seen.add(g.id)
        if g.retention.kind in ("recurrent", "cross"):
            raise InvalidArgumentError(
                f"group {g.id} keeps {g.retention.kind} state: it has no per-token block table "
                "and gets no metadata from this builder"
            )
        if g.block_size <= 0 or g.position_offset < 0:
            raise InvalidArgumentError(
                f"group {g.id}: block_size {g.block_size} must be > 0 and position_offset "
                f"{g.position_offset} >= 0"
            )


def _padded(name: str, value: int | None, actual: int) -> int:
    if value is None:
        return actual
    if value < actual:
        raise InvalidArgumentError(f"{name}={value} is smaller than the {actual} rows needed")
    return value


class _GroupPlan:
    """Sizes of one group's arrays (worked out before the buffer exists), then the fill."""

    def __init__(
        self,
        group: Group,
        requests: Sequence[ScheduledRequest],
        computed: np.ndarray,
        new: np.ndarray,
        max_blocks: int | None,
    ) -> None:
        self.group = group
        bs = group.block_size
        self.ids = [r.blocks(group.id) for r in requests]
        self.seq_lens = np.maximum(computed + new - group.position_offset, 0)
        self.pages = -(-self.seq_lens // bs)
        self.lens = np.array([len(ids) for ids in self.ids], dtype=np.int64)
        short = np.nonzero(self.lens < self.pages)[0]
        if short.size:
            i = int(short[0])
            raise MetadataError(
                f"group {group.id}: request {requests[i].req_id!r} (row {i}) needs "
                f"{int(self.pages[i])} blocks of {bs} for {int(self.seq_lens[i])} positions but "
                f"has {int(self.lens[i])} allocated"
            )
        need = int(self.pages.max(initial=0))
        self.width = int(self.lens.max(initial=0)) if max_blocks is None else max_blocks
        if self.width < need:
            raise InvalidArgumentError(
                f"group {group.id}: max_blocks={self.width} but a request reads {need} blocks"
            )
        self.computed = computed
        self.nnz = int(self.pages.sum())

    def arrays(self, batch: int, tokens: int) -> list[tuple[str, str, tuple[int, ...]]]:
        return [
            ("slot_mapping", "int64", (tokens,)),
            ("positions", "int64", (tokens,)),
            ("block_table", "int32", (batch, self.width)),
            ("seq_lens", "int32", (batch,)),
            ("paged_kv_indptr", "int32", (batch + 1,)),
            ("paged_kv_indices", "int32", (self.nnz,)),
            ("paged_kv_last_page_len", "int32", (batch,)),
        ]

    def fill(self, host: dict[str, np.ndarray], row_req: np.ndarray, row_in_req: np.ndarray) -> None:
        group, n = self.group, len(self.ids)
        table = host["block_table"]
        table.fill(0)
        kept = np.minimum(self.lens, self.width)
        total = int(kept.sum())
        try:  # (a float id is truncated here: checked mode's per-row checks reject it)
            flat = np.fromiter(
                itertools.chain.from_iterable(ids[: self.width] for ids in self.ids),
                dtype=np.int64,
                count=total,
            )
        except (TypeError, ValueError, OverflowError) as exc:
            raise MetadataError(f"group {group.id}: a block id is not an integer in range "
                                f"({exc})") from None
        if total:
            limit = group.num_blocks if group.num_blocks > 0 else _INT32_MAX + 1
            bad = np.nonzero(flat >= limit)[0]
            if bad.size:
                row = int(np.searchsorted(np.cumsum(kept), bad[0], side="right"))
                raise MetadataError(
                    f"group {group.id}: row {row} holds block id {int(flat[bad[0]])}, outside "
                    f"the group's {limit} blocks"
                )
            starts = np.cumsum(kept) - kept
            rows = np.repeat(np.arange(n), kept)
            table[rows, np.arange(total) - np.repeat(starts, kept)] = flat

        fill_derived(host, group, self.seq_lens, self.pages, self.computed, row_req, row_in_req)
