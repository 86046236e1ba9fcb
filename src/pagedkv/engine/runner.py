"""One forward of a scheduled step: copy ops, metadata, the model, logits.

The runner owns the cache tensors (allocated from the plan's views) and follows the
contract of :mod:`pagedkv.modeling.base`: before the forward it applies the step's
``copy`` ops (partial prefix-hit pages) and ``restore`` ops (recurrent checkpoints), then
builds one metadata object per attention group and the recurrent segments, and calls the
model with the step's rows packed request after request.

Metadata (``metadata=``): ``"persistent"`` (default) keeps one
:class:`~pagedkv.batch.persistent.PersistentMetadata` for the plan's attention groups, fed
with what changed in the block manager's tables since each request's last step
(:mod:`pagedkv.engine.stepmeta`): fixed buffers, bucketed shapes, and decode steps on the
builder's fast path. ``"stateless"`` calls ``build_metadata`` every step, from every
request's whole block lists: the reference the persistent path is tested against.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from pagedkv.batch import ScheduledRequest, StepMetadata, build_metadata
from pagedkv.blocks import CopyOp, KVCacheManager
from pagedkv.engine.cache import allocate_caches
from pagedkv.engine.scheduler import Chunk
from pagedkv.engine.stepmeta import TableSync
from pagedkv.errors import InvalidArgumentError
from pagedkv.kvspec import LayerSpec
from pagedkv.modeling.base import AttentionBackend, CausalLM, ForwardContext, reference_attention
from pagedkv.modeling.recurrent_state import RecurrentBatch, apply_restores
from pagedkv.ops import fill_nan_
from pagedkv.plan.types import Plan

METADATA_MODES = ("persistent", "stateless")


@dataclass(frozen=True)
class StepOutput:
    """Logits of the rows asked for: ``rows[i]`` are chunk i's rows in ``logits``."""

    logits: torch.Tensor  # float32 [rows, vocab]
    rows: tuple[range, ...]


class ModelRunner:
    def __init__(self, model: CausalLM, plan: Plan, specs: Sequence[LayerSpec],
                 manager: KVCacheManager, *, device: torch.device, kv_dtype: torch.dtype,
                 debug_nan: bool = False, shuffle_seed: int | None = None,
                 backend: AttentionBackend = reference_attention,
                 block_major: bool = False, metadata: str = "persistent",
                 max_batch: int | None = None, lookahead: int = 0,
                 derive_on_device: bool | None = None) -> None:
        """``max_batch``: the most requests a step schedules (default: the manager's token
        budget); ``lookahead``: the most draft positions a request may take past
        max_model_len (the scheduler's lookahead slots); ``derive_on_device``: the
        persistent builder's (None: on CUDA)."""
        if metadata not in METADATA_MODES:
            raise InvalidArgumentError(
                f"metadata must be one of {', '.join(METADATA_MODES)}, got {metadata!r}")
        self.model = model
        self.backend = backend
        self.plan = plan
        self.mgr = manager
        self.device = device
        self.debug_nan = debug_nan
        self.specs = {s.name: s for s in specs}
        self.layer_group = {name: g.id for g in plan.groups for name in g.layer_names}
        self.gids = [m.gid for m in manager.managers]
        self.caches = allocate_caches(plan, device=device, kv_dtype=kv_dtype, nan=debug_nan,
                                      block_major=block_major)
        self.group_tensors = {
            g.id: [t for name in g.layer_names for t in self.caches.get(name, {}).values()]
            for g in plan.groups}
        _check_capacity(manager, self.gids, self.group_tensors)
        self.attn_groups = [g for g in plan.groups if not g.is_recurrent]
        self.recurrent_gids = frozenset(g.id for g in plan.groups if g.is_recurrent)
        # set by engine.speculative, which restores recurrent states after a verify pass
        self.recurrent_drafts_rolled_back = False
        self.recurrent_groups = [g for g in plan.groups if g.is_recurrent]
        self.metadata_mode = metadata
        self.sync: TableSync | None = None
        if metadata == "persistent" and self.attn_groups:
            max_len = manager.max_model_len or plan.options.max_model_len
            if max_len is None:
                raise InvalidArgumentError("persistent metadata needs max_model_len (its "
                                           "block-table width); pass it, or metadata='stateless'")
            tokens = manager.max_batched_tokens
            self.sync = TableSync(self.attn_groups, manager, self.gids, device=device,
                                  max_batch=min(max_batch or tokens, tokens), max_tokens=tokens,
                                  max_model_len=max_len + lookahead, lookahead=lookahead,
                                  derive_on_device=derive_on_device)
        if shuffle_seed is not None:  # tests: block placement must not matter
            rng = random.Random(shuffle_seed)
            for pool in manager.pools:
                rng.shuffle(pool.free)

    def scheduled(self, chunk: Chunk, num_drafts: int = 0,
                  gids: frozenset[int] | None = None) -> ScheduledRequest:
        """The chunk as a ScheduledRequest with the block ids of every group (of ``gids``)."""
        tables = self.mgr.block_tables(chunk.request.rid)
        blocks = {self.gids[i]: list(t) for i, t in enumerate(tables)
                  if gids is None or self.gids[i] in gids}
        return ScheduledRequest(chunk.request.rid, chunk.num_computed,
                                chunk.num_new_tokens + num_drafts, blocks, num_drafts)

    def step_metadata(self, chunks: Sequence[Chunk], extra: Sequence[int], *,
                      stateless: bool = False) -> tuple[StepMetadata, list[ScheduledRequest]]:
        """The step's attention metadata and its requests (``extra[i]``: chunk i's draft
        rows). Persistent: the requests carry only recurrent groups' block ids (their
        segments read them; attention tables are in the metadata), and none without
        recurrent groups. ``stateless`` forces ``build_metadata`` (benchmarks/engine_metadata.py
        times both on the same steps)."""
        if self.sync is None or stateless:
            reqs = [self.scheduled(c, k) for c, k in zip(chunks, extra)]
            return build_metadata(reqs, self.attn_groups, device=self.device), reqs
        meta = self.sync.build(chunks, extra)
        reqs = [self.scheduled(c, k, self.recurrent_gids) for c, k in zip(chunks, extra)
                ] if self.recurrent_groups else []
        return meta, reqs

    def release(self, rids) -> None:
        """Requests that finished: their rows leave the persistent builder now (any request
        not in a step leaves it at that step anyway)."""
        if self.sync is not None:
            for rid in rids:
                self.sync.drop(rid)

    def execute(self, chunks: Sequence[Chunk], copy_ops: Sequence[CopyOp], *,
                all_rows: bool = False,
                drafts: Mapping[object, Sequence[int]] | None = None) -> StepOutput:
        """Run the step; logits for every row (``all_rows``) or each sampling chunk's last
        row. ``drafts[rid]``: draft tokens riding on a speculative chunk (at most its
        ``num_lookahead``), run as extra rows after its token; every row of such a chunk
        comes back (the target's verdict on each draft and the bonus token)."""
        if self.debug_nan:
            self._nan_free_pages()
        self._apply_copies(copy_ops)
        drafts = drafts or {}
        extra = []
        for c in chunks:
            k = len(drafts.get(c.request.rid, ()))
            if k > c.num_lookahead:
                raise InvalidArgumentError(
                    f"request {c.request.rid!r}: {k} draft tokens but {c.num_lookahead} "
                    "lookahead slots allocated")
            extra.append(k)
        meta, reqs = self.step_metadata(chunks, extra)
        ids: list[int] = []
        pos: list[int] = []
        for c, k in zip(chunks, extra):
            tokens = self.mgr.requests[c.request.rid].tokens
            ids += tokens[c.num_computed : c.num_computed + c.num_new_tokens]
            ids += [int(t) for t in drafts.get(c.request.rid, ())]
            pos += range(c.num_computed, c.num_computed + c.num_new_tokens + k)
        batches = {g.id: RecurrentBatch.build(reqs, g.id, copy_ops,
                                              drafts_rolled_back=self.recurrent_drafts_rolled_back)
                   for g in self.recurrent_groups}
        ctx = ForwardContext(self.layer_group, self.specs, meta, self.caches, batches=batches,
                             requests=tuple(reqs), copy_ops=tuple(copy_ops),
                             backend=self.backend)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        positions = torch.tensor(pos, dtype=torch.long, device=self.device)
        with torch.inference_mode():
            hidden = self.model(input_ids, positions, ctx)
            rows: list[range] = []
            pick: list[int] = []
            start = 0
            for c, k in zip(chunks, extra):
                end = start + c.num_new_tokens + k
                if all_rows or k:
                    want = range(start, end) if all_rows else range(end - k - 1, end)
                else:
                    want = range(end - 1, end) if c.samples else range(0)
                rows.append(range(len(pick), len(pick) + len(want)))
                pick += want
                start = end
            index = torch.tensor(pick, dtype=torch.long, device=self.device)
            logits = self.model.compute_logits(hidden[index]).float()
        return StepOutput(logits, tuple(rows))

    def _apply_copies(self, copy_ops: Sequence[CopyOp]) -> None:
        by_gid = {g.id: g for g in self.plan.groups}
        for op in copy_ops:
            if op.kind == "copy":
                keep = op.position % by_gid[op.group_id].block_size
                for t in self.group_tensors[op.group_id]:
                    t[op.dst, :keep] = t[op.src, :keep]
        apply_restores(copy_ops, {
            g.id: [self.caches[n] for n in g.layer_names if n in self.caches]
            for g in self.recurrent_groups})

    def _nan_free_pages(self) -> None:
        """Debug: NaN-fill every plainly free page (no owner, no cached content)."""
        for i, m in enumerate(self.mgr.managers):
            pages = list(m.pool.free)
            if pages:
                for t in self.group_tensors[self.gids[i]]:
                    fill_nan_(t, pages)


def _check_capacity(manager: KVCacheManager, gids: Sequence[int], group_tensors: Mapping[int, list[torch.Tensor]]
                    ) -> None:
    """Every block id the manager can hand a group indexes its cache tensors: a pool with
    more blocks than the tensors' first dimension (an elastic manager's ceiling over
    tensors of the plan's fixed size) would index past them, an IndexError on the CPU and
    out-of-bounds reads and writes in a GPU kernel."""
    for gm, gid in zip(manager.managers, gids):
        tensors = group_tensors.get(gid)
        if not tensors:
            continue
        rows = min(t.shape[0] for t in tensors)
        if gm.pool.num_blocks > rows:
            raise InvalidArgumentError(
                f"group {gid}: the block manager's pool hands out {gm.pool.num_blocks} block "
                f"ids but the cache tensors hold {rows} (an elastic manager over fixed "
                "tensors? build it with KVCacheManager.from_plan(plan, elastic=False))")
