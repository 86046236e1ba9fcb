"""Recurrent state (Mamba, GatedDeltaNet, KDA...): one state slot per request.

With prefix caching a hit can resume only where a request saved its state (a checkpoint,
at a block boundary, cached under that block's chained hash). Where to save is a
:class:`CheckpointPolicy`. The default saves where later requests are likely to branch:
the end of the prefix the token groups already had cached when the request was looked up
(another request shares it) and the last block boundary the request computes (the next
turn of a conversation extends its prompt and answer; without ``max_new_tokens``, the
newest boundary while decoding, each replacing the request's previous one).
docs/blocks.md has the measurements behind this choice. A fixed interval of ``every``
blocks is the alternative (``Recurrent(checkpoint_every)`` or a forced interval).

Checkpoints never cost a running request its state: a save takes a slot only when one
is free (evicting the least recently used checkpoint), a save not yet handed to the
engine (``drain_copy_ops``) is cancelled when an allocation needs its slot, and a cached
checkpoint is evictable. A hit copies the checkpoint into the request's own slot (copy on
branch), or takes it over when no other slot is free. Saves and restores are listed for
the engine as :class:`CopyOp`, to run before the step's forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from pagedkv.blocks.base import GroupManager
from pagedkv.blocks.events import CopyOp, EventLog
from pagedkv.blocks.ids import GroupIndex
from pagedkv.blocks.pool import BlockPool
from pagedkv.blocks.request import INF, Checkpoint, RequestState, Save
from pagedkv.errors import InvalidArgumentError
from pagedkv.plan.types import Group


@dataclass(frozen=True)
class CheckpointPolicy:
    """Where a recurrent group saves its state (only with prefix caching).

    ``every``: every that many blocks (0: none; a retention's own interval wins).
    ``branch``: at the end of the token groups' cached prefix found at lookup.
    ``prompt_end``: at the last full block of the prompt.
    ``decode``: at the last block boundary the request computes (its ``max_new_tokens``
    known), else at the newest one while decoding (rolling: one per request).
    """

    every: int = 0
    branch: bool = True
    prompt_end: bool = False  # measured: costs more slots than it earns (docs/blocks.md)
    decode: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.every, int) or self.every < 0:
            raise InvalidArgumentError(f"checkpoint interval must be >= 0 blocks, got {self.every!r}")

    @classmethod
    def interval(cls, every: int) -> CheckpointPolicy:
        """Every ``every`` blocks and nowhere else (0: no checkpoints at all)."""
        return cls(every, False, False, False)


class OpenSave(NamedTuple):
    """A save not yet handed to the engine: cancelling it gives ``slot`` back."""

    req: RequestState
    position: int
    slot: int
    op: CopyOp


class OpenRestore(NamedTuple):
    """A restore not yet handed to the engine: it can become a take-over."""

    req: RequestState
    op: CopyOp


DEFAULT_POLICY = CheckpointPolicy()
NO_CHECKPOINTS = CheckpointPolicy.interval(0)


class RecurrentManager(GroupManager):
    holds_tokens = False

    def __init__(self, index: GroupIndex, group: Group, pool: BlockPool, caching: bool,
                 events: EventLog, policy: CheckpointPolicy = DEFAULT_POLICY) -> None:
        every = group.retention.checkpoint_every or policy.every  # type: ignore[union-attr]
        self.policy = policy
        self.can_cache = bool(every or policy.branch or policy.prompt_end or policy.decode)
        super().__init__(index, group, pool, caching, events)
        self.interval = every * group.block_size if every else 0
        # not yet handed to the engine, so they can give a slot back: saves (cancelled)
        # and restores (turned into a take-over of their checkpoint)
        self.open: list[OpenSave] = []
        self.open_restores: list[OpenRestore] = []
        # checkpoints turned into a working state this step -> the request that took it
        # over: its forward writes the slot only after the step's copies have read it
        self.taken: dict[int, RequestState] = {}

    # --- hits ------------------------------------------------------------------------
    def find_hit(self, req: RequestState, max_tokens: int) -> tuple[int, list[int]]:
        if not self.caching:
            return 0, []
        get = self.cache.get
        hashes = req.hashes[self.bs]
        j = min(max_tokens // self.bs, len(hashes))
        while j > 0:  # checkpoints sit at block boundaries only
            b = get(hashes[j - 1])
            if b is not None:
                return j * self.bs, [b]
            j -= 1
        return 0, []

    def plan_marks(self, req: RequestState, hit: int, branch: int) -> None:
        """After a lookup that found ``hit``: the positions this request saves besides the
        interval (``branch``: the token groups' cached prefix, where requests diverge)."""
        if not self.caching:
            return
        bs = self.bs
        marks = set()
        if self.policy.branch:
            marks.add(branch // bs * bs)
        if self.policy.prompt_end:
            marks.add(req.num_prompt // bs * bs)
        req.marks[self.index] = sorted(p for p in marks if p > hit)

    # --- allocation ------------------------------------------------------------------
    def spare(self) -> int:
        """Slots that unsent saves and restores can give back."""
        return len(self.open) + len(self._convertible()) if self.open_restores else len(self.open)

    def _convertible(self) -> list[int]:
        """Checkpoints held only by unsent restores: one of them can take it over."""
        count: dict[int, int] = {}
        for o in self.open_restores:
            op = o.op
            count[op.src] = count.get(op.src, 0) + 1
        ref = self.pool.ref
        return [src for src, k in count.items() if ref[src] == k]

    def blocks_needed(self, req: RequestState, end: int, hit: list[int] | None) -> int:
        if req.tables[self.index]:
            return 0
        if hit and self.pool.ref[hit[0]] == 0:
            return 2 if self.pool.num_free() + self.spare() >= 2 else 1
        return 1

    def new_and_revived(self, req: RequestState, end: int, hit: list[int] | None
                        ) -> tuple[int, list[int]]:
        """A restore from a cached checkpoint takes it out of the LRU and one slot anew;
        a take-over (the pool is short) frees the checkpoint and takes one slot."""
        k = self.blocks_needed(req, end, hit)
        if k == 2:
            return 1, [hit[0]]  # type: ignore[index]
        return k, []

    def adopt(self, req: RequestState, hit: list[int] | None) -> None:
        """Nothing to adopt ahead: :meth:`allocate` handles the hit itself."""

    def allocate(self, req: RequestState, end: int, hit: list[int] | None) -> None:
        i = self.index
        if req.tables[i]:
            return
        self.changed.append(req)
        pool = self.pool
        if hit:
            src = hit[0]
            if src in self.taken:  # copy it before its new owner's forward: no hold
                req.tables[i] = slot = pool.allocate(1, self.gid)
                self.ops.append(CopyOp("restore", self.gid, src, slot[0], req.pending.tokens))
            elif pool.ref[src] == 0 and pool.num_free() < 2:
                pool.uncache(src)  # take the checkpoint over: it becomes this request's state
                req.tables[i] = pool.allocate(1, self.gid)
            else:
                pool.touch([src], self.gid)
                req.tables[i] = slot = pool.allocate(1, self.gid)
                req.set_copy_src(i, src)
                op = CopyOp("restore", self.gid, src, slot[0], req.pending.tokens)
                self.ops.append(op)
                self.open_restores.append(OpenRestore(req, op))
        else:
            req.tables[i] = pool.allocate(1, self.gid)

    def cancel_open(self, want_free: int) -> None:
        """Give back the newest not yet handed out saves until the pool has ``want_free``
        free slots (or none is left)."""
        pool = self.pool
        while self.open and pool.num_free() < want_free:
            o = self.open.pop()
            o.req.saves[self.index].remove(Save(o.position, o.slot))
            self._drop_op(o.op)
            pool.release([o.slot], self.gid)
        if not self.open_restores:
            return
        i = self.index
        for src in reversed(self._convertible()):
            if pool.num_free() >= want_free:
                break
            holders = [o for o in self.open_restores if o.op.src == src]
            self.open_restores = [o for o in self.open_restores if o.op.src != src]
            # the newest restorer takes the checkpoint over instead of copying it (one
            # slot back); the others still copy it, before that request's forward
            req, op = holders.pop()  # (request, op)
            pool.uncache(src)
            req.tables[i] = [src]
            self.changed.append(req)
            req.copy_src[i] = None
            self.taken[src] = req
            self._drop_op(op)
            pool.release([op.dst], self.gid)
            for other in (o.req for o in holders):
                other.copy_src[i] = None
                pool.release([src], self.gid)

    def _drop_op(self, op: CopyOp) -> None:
        for k in range(len(self.ops) - 1, -1, -1):
            if self.ops[k] is op:
                del self.ops[k]
                return

    def handed_out(self) -> None:
        """The engine took the copy ops: they can no longer give slots back."""
        self.open.clear()
        self.open_restores.clear()
        self.taken.clear()

    def _points(self, req: RequestState, start: int, end: int) -> list[int]:
        """Checkpoint positions in (start, end], longest first."""
        bs = self.bs
        points = set()
        interval = self.interval
        if interval:
            points.update(range((start // interval + 1) * interval, end + 1, interval))
        for p in req.marks[self.index]:
            if start < p <= end:
                points.add(p)
        if self.policy.decode:
            last = self._last_boundary(req)
            p = end // bs * bs if last is None else last
            if start < p <= end and p > req.num_prompt:
                points.add(p)
        return sorted(points, reverse=True)

    def reserve_checkpoints(self, req: RequestState, start: int, end: int) -> None:
        """Before a step over positions [start, end): a slot for the state after each
        checkpoint position the step reaches (its forward writes them; a position of a
        draft token is cached only if the draft is accepted), when one is free.
        Opportunistic: never fails an allocation, never counts toward admission."""
        if not self.caching or not req.tables[self.index]:
            return
        pool = self.pool
        hashes = req.hashes[self.bs]
        saves = req.saves[self.index]
        working = req.tables[self.index][0]
        for position in self._points(req, start, end):
            if pool.num_free() == 0:
                break
            j = position // self.bs
            if j <= len(hashes) and hashes[j - 1] in self.cache:
                continue  # someone saved it already
            if any(sv.position == position for sv in saves):
                continue
            slot = pool.allocate(1, self.gid)[0]
            saves.append(Save(position, slot))
            op = CopyOp("save", self.gid, working, slot, position)
            self.ops.append(op)
            self.open.append(OpenSave(req, position, slot, op))

    def commit(self, req: RequestState) -> int:
        """Cache the saved states of committed positions; drop those of rejected drafts."""
        self.release_copy_source(req)  # the restore ran with the step that just finished
        self._forget_restore(req)
        saves = req.saves[self.index]
        if saves:
            pool = self.pool
            for position, slot in saves:  # Save(position, slot)
                if position <= req.num_computed:
                    h = self.key(req, position // self.bs - 1)
                    if pool.cache(self.gid, slot, h):
                        if self.events.enabled:
                            self.events.emit("stored", self.gid, (h,), (slot,))
                        if position > req.num_prompt and self.policy.decode:
                            self._replace_rolling(req, slot, h)
                else:  # a rejected draft reached it: try again on the next step
                    req.fast_limit = min(req.fast_limit, req.num_computed)
                pool.release([slot], self.gid)  # cached: evictable; otherwise plain free
            saves.clear()
            if self.open:
                self.open = [o for o in self.open if o.req is not req]
        return INF

    def _replace_rolling(self, req: RequestState, slot: int, h: int) -> None:
        """A request keeps only its newest decode checkpoint (unless someone holds one)."""
        prev = req.rolling[self.index]
        req.rolling[self.index] = Checkpoint(slot, h)
        if prev is not None:
            pool = self.pool
            if pool.block_hash[prev.slot] == prev.key and pool.ref[prev.slot] == 0:
                pool.uncache(prev.slot)

    def _forget_restore(self, req: RequestState) -> None:
        if self.open_restores:
            self.open_restores = [o for o in self.open_restores if o.req is not req]
        if self.taken:
            self.taken = {b: r for b, r in self.taken.items() if r is not req}

    def free(self, req: RequestState) -> None:
        if self.open_restores:
            for o in self.open_restores:
                if o.req is req:
                    self._drop_op(o.op)
            self._forget_restore(req)
        saves = req.saves[self.index]
        if saves:
            if self.open:
                for o in self.open:
                    if o.req is req:
                        self._drop_op(o.op)
                self.open = [o for o in self.open if o.req is not req]
            self.pool.release([sv.slot for sv in saves], self.gid)
            saves.clear()
        super().free(req)

    def fast_limit(self, req: RequestState, end: int) -> int:
        """Steps ending before the next checkpoint position need no call to this group."""
        if not self.caching:
            return INF
        nxt = (end // self.interval + 1) * self.interval if self.interval else INF
        for p in req.marks[self.index]:
            if p > end:
                nxt = min(nxt, p)
                break
        if self.policy.decode:
            last = self._last_boundary(req)
            if last is None:
                nxt = min(nxt, max(end // self.bs + 1, req.num_prompt // self.bs + 1) * self.bs)
            elif last > end and last > req.num_prompt:
                nxt = min(nxt, last)
        return nxt - 1

    def _last_boundary(self, req: RequestState) -> int | None:
        """The last block boundary the request computes, when its length is known."""
        if req.max_new_tokens is None:
            return None
        return (req.num_prompt + req.max_new_tokens - 1) // self.bs * self.bs

    def trim(self, req: RequestState) -> None:
        """Nothing: a rejected token's state change is the engine's to roll back."""

    def admission_blocks(self, num_tokens: int, max_batched_tokens: int) -> int:
        return 1
