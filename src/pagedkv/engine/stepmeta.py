"""The runner's attention metadata through one persistent builder, fed from the block
manager's tables by what changed since each request's last step.

The block manager's tables are the truth. A :class:`~pagedkv.batch.persistent.
PersistentMetadata` keeps a host copy of the scheduled requests' rows; each step
:class:`TableSync` tells it only what changed since a request's previous step:

- blocks appended at a row's end (a decode opening a block, a prefill chunk's blocks):
  ``append_each`` (one block per request, one call per group) or ``append_blocks``;
- any other change rewrites the row (``set_blocks``). The manager changes a table other
  than by appending in three ways, each seen here without reading the whole table: it
  gives the group a new list (a prefix hit adopted; free and preemption empty the
  request), a window group nulls blocks that left its window (``first_live`` moves), or a
  commit gives back the blocks past the committed tokens (rejected drafts' lookahead
  blocks, which a later allocation may replace by others at the same columns). A commit
  keeps at least ``ceil((computed + 1) / block_size)`` blocks of a request computed to
  ``computed`` at its last step, so only the entries sent from there on can have been
  given back: they are kept and compared (none in a plain decode step);
- a request not in this step leaves the builder (``remove``: finished, preempted, or not
  scheduled), so no row outlives the step it was sent for, and a request coming back is
  added afresh; a request object the manager replaced (the same id re-added after it
  finished) is removed and added too.

A steady decode step (the same requests in the same order, a block opened here and there)
so changes rows by appends only, and the builder takes its fast path (on CUDA, by
default, the arrays derived on the device). Such a step is also checked batch-wide: when
the requests and their order are the last step's and no request keeps entries to compare,
a few C-level passes over the batch (each group's list objects, window starts, lengths
no shorter and none past ``ceil((computed + 1) / block_size)``) replace the per-request
checks; anything else there sends the step through them. Window starts are read only for
groups with a null block (a window's): no other group drops blocks, so its ``first_live``
stays 0. The counts go to the builder as int64 arrays (which it takes without a copy),
and no draft counts when there are none. Instead of ``build_metadata``'s copy of every
block list, a step costs a few operations per request.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from operator import attrgetter, getitem, is_, itemgetter

import numpy as np
import torch

from pagedkv.batch import StepMetadata
from pagedkv.batch.persistent import PersistentMetadata
from pagedkv.blocks import KVCacheManager
from pagedkv.engine.scheduler import Chunk
from pagedkv.errors import InvalidArgumentError
from pagedkv.plan.types import Group


def buckets(cap: int) -> list[int]:
    """1, 2, 4, ... below ``cap``, then ``cap``: a step pads to at most twice its size."""
    out = [1]
    while out[-1] * 2 < cap:
        out.append(out[-1] * 2)
    return sorted({*out, cap})


class _Sent:
    """What the builder holds of one request: the manager's request object, and per group
    the table list, its length, the window's first live block and the entries from the
    first block a commit may give back (``tail_from``)."""

    __slots__ = ("state", "lists", "lens", "lives", "tail_from", "tails", "tails_any")

    def __init__(self, state, lists, lens, lives, tail_from, tails) -> None:
        self.state = state
        self.lists = lists
        self.lens = lens
        self.lives = lives
        self.tail_from = tail_from
        self.tails = tails
        self.tails_any = any(tails)


_lists, _lens, _lives, _tails_any = (attrgetter(a) for a in (
    "lists", "lens", "lives", "tails_any"))
_tables, _first_live = attrgetter("tables"), attrgetter("first_live")
_rid, _computed, _new = (attrgetter(a) for a in (
    "request.rid", "num_computed", "num_new_tokens"))


class TableSync:
    """One :class:`PersistentMetadata` over ``groups`` (the plan's attention groups),
    kept in step with ``manager``'s tables; :meth:`build` makes a step's metadata.

    ``max_batch`` / ``max_tokens``: the most requests / query rows of a step (the largest
    buckets); ``max_model_len`` (lookahead included) sets the block-table width.
    ``derive_on_device``: the builder's steady decode steps derived on the device (None: on
    CUDA when Triton is installed). Counters for tests: ``added``, ``removed``,
    ``rewritten`` (rows set anew), ``appended`` (rows that only grew)."""

    def __init__(self, groups: Sequence[Group], manager: KVCacheManager, gids: Sequence[int], *,
                 device, max_batch: int, max_tokens: int, max_model_len: int,
                 derive_on_device: bool | None = None) -> None:
        self.mgr = manager
        width = max(-(-max_model_len // g.block_size) for g in groups)
        if derive_on_device is None:  # the builder's default (CUDA), where Triton is there
            derive_on_device = (torch.device(device).type == "cuda"
                                and importlib.util.find_spec("triton") is not None)
        self.builder = PersistentMetadata(
            groups, max_blocks=width, batch_buckets=buckets(max_batch),
            token_buckets=buckets(max_tokens), device=device,
            derive_on_device=derive_on_device)
        # per attention group: (group id, index in the manager's tables, block size)
        self.groups = [(g.id, list(gids).index(g.id), g.block_size) for g in groups]
        self._index = [(i, bs) for _, i, bs in self.groups]
        # per group: whether its window start can move. Only a group with a null block to
        # put where a dropped one was (a window) moves it; others keep first_live 0
        self._moves = [g.retention.null_blocks > 0 for g in groups]
        self.sent: dict[object, _Sent] = {}
        self._last_ids: tuple = ()
        self._aligned = None  # the last step's records in batch order (see _steady)
        self.added = self.removed = self.rewritten = self.appended = 0

    def build(self, chunks: Sequence[Chunk], extra: Sequence[int]) -> StepMetadata:
        """The step's metadata (valid until the next :meth:`build`); ``extra[i]``: draft
        rows riding on chunk i."""
        ids = tuple(map(_rid, chunks))
        n = len(ids)
        if len(extra) != n:
            raise InvalidArgumentError(f"{len(extra)} draft counts for {n} chunks")
        aligned = self._aligned if ids == self._last_ids else None
        if ids != self._last_ids:
            for rid in self.sent.keys() - set(ids):
                self.drop(rid)
            self._last_ids = ids
        # the counts as int64 arrays, which the builder takes without a copy
        computed = np.fromiter(map(_computed, chunks), np.int64, n)
        new = np.fromiter(map(_new, chunks), np.int64, n)
        drafts = None  # none: the builder's own zeros, no array to check
        if any(extra):
            drafts = np.fromiter(extra, np.int64, n)
            new += drafts
        states = self.mgr.requests
        single = self._steady(ids, computed, states, aligned) if aligned is not None else None
        if single is None:
            single = self._each(ids, computed.tolist(), states)
        for j, (rids, blocks) in single.items():
            self.builder.append_each(rids, {self.groups[j][0]: blocks})
        return self.builder.step(ids, computed, new, drafts)

    def _each(self, ids, computed, states) -> dict[int, tuple[list, list]]:
        """Every request's changes, one request at a time; what :meth:`_steady` needs for
        the next step. Returns the single-block appends by group index."""
        get = self.sent.get
        index = self._index
        single: dict[int, tuple[list, list]] = {}  # group j -> (rids, blocks): one block
        for rid, done in zip(ids, computed):
            state = states[rid]
            sent = get(rid)
            if sent is None or sent.state is not state or sent.tails_any:
                self._sync(rid, state, done, single)
                continue
            # the common case, inline: every group's table the same list, its window where
            # it was, and at most one block more, within the blocks no commit gives back
            tables, lives, lens = state.tables, state.first_live, sent.lens
            grown = None
            for j, (i, bs) in enumerate(index):
                table = tables[i]
                d = len(table) - lens[j]
                if (d and (d != 1 or len(table) > -(-(done + 1) // bs))
                        or table is not sent.lists[j] or lives[i] != sent.lives[j]):
                    grown = False
                    break
                if d:
                    grown = [j] if grown is None else [*grown, j]
            if grown is False:
                self._sync(rid, state, done, single)
            elif grown:
                for j in grown:
                    entry = single.get(j)
                    if entry is None:
                        entry = single[j] = ([], [])
                    entry[0].append(rid)
                    entry[1].append(tables[index[j][0]][lens[j]])
                    lens[j] += 1
                self.appended += 1
        self._aligned = self._align(ids)
        return single

    def _align(self, ids):
        """The records of ``ids`` as batch-ordered lists, for :meth:`_steady` (None when a
        record keeps entries to compare: that request needs the per-request path)."""
        recs = list(map(self.sent.__getitem__, ids))
        if any(map(_tails_any, recs)):
            return None
        per_group = []
        for j in range(len(self.groups)):
            at = itemgetter(j)
            per_group.append((list(map(at, map(_lists, recs))), list(map(at, map(_lives, recs))),
                              np.fromiter(map(at, map(_lens, recs)), np.int64, len(recs))))
        # the batch's request states in one C call (itemgetter of one key gives no tuple)
        get = itemgetter(*ids) if len(ids) > 1 else (lambda states: tuple(map(states.__getitem__, ids)))
        return recs, per_group, get

    def _steady(self, ids, computed, states, aligned):
        """The same requests as the last step, each group's table at most one block longer
        and nothing else changed, checked in a few C-level passes over the batch; None,
        with nothing changed, when that is not so (the per-request path then runs)."""
        recs, per_group, get = aligned
        objs_now = get(states)  # (a replaced request has new lists)
        grown = []
        for (i, bs), moves, (lists, lives, lens) in zip(self._index, self._moves, per_group):
            at = itemgetter(i)
            tables = list(map(at, map(_tables, objs_now)))
            if not all(map(is_, tables, lists)) or (
                    moves and list(map(at, map(_first_live, objs_now))) != lives):
                return None
            now = np.fromiter(map(len, tables), np.int64, len(tables))
            d = now - lens
            # a row no shorter, and none past ceil((done + 1) / bs): so at most one block
            # more, and nothing to keep for comparing (a lookahead block is)
            if ids and (int(d.min()) < 0 or bool((now > (computed + bs) // bs).any())):
                return None
            rows = np.flatnonzero(d)
            # each grown row's new block: the entry at its old length
            grown.append((rows.tolist(), lens[rows].tolist(), tables, now))
        single = {}
        touched = None
        for j, ((rows, ends, tables, now), (_, _, lens)) in enumerate(zip(grown, per_group)):
            if rows:
                single[j] = (list(map(ids.__getitem__, rows)),
                             list(map(getitem, map(tables.__getitem__, rows), ends)))
                for r in rows:
                    recs[r].lens[j] += 1
                touched = rows if touched is None else sorted({*touched, *rows})
            lens[:] = now
        if touched:
            self.appended += len(touched)
        return single

    def drop(self, rid) -> None:
        """The request's row leaves the builder (no-op for one it does not hold)."""
        if self.sent.pop(rid, None) is not None:
            self._aligned = None
            self.builder.remove(rid)
            self.removed += 1

    def _sync(self, rid, state, done: int, single) -> None:
        tables = state.tables
        sent = self.sent.get(rid)
        if sent is None or sent.state is not state:
            if sent is not None:
                self.builder.remove(rid)
                self.removed += 1
            self.builder.add(rid, {gid: tables[i] for gid, i, _ in self.groups})
            self.sent[rid] = self._record(state, done)
            self.added += 1
            return
        lives = state.first_live
        rewrite = {}
        grew = False
        for j, (gid, i, _) in enumerate(self.groups):
            table = tables[i]
            n = sent.lens[j]
            m = len(table)
            if (table is not sent.lists[j] or m < n or lives[i] != sent.lives[j]
                    or (sent.tails[j] and tuple(table[sent.tail_from[j] : n]) != sent.tails[j])):
                rewrite[gid] = table
            elif m == n + 1:
                entry = single.get(j)
                if entry is None:
                    entry = single[j] = ([], [])
                entry[0].append(rid)
                entry[1].append(table[n])
                grew = True
            elif m > n:
                self.builder.append_blocks(rid, {gid: table[n:]})
                grew = True
        if rewrite:
            self.builder.set_blocks(rid, rewrite)
            self.rewritten += 1
        elif grew:
            self.appended += 1
        if rewrite or grew or sent.tails_any:
            self.sent[rid] = self._record(state, done)

    def _record(self, state, done: int) -> _Sent:
        tables = state.tables
        lists = [tables[i] for _, i, _ in self.groups]
        tail_from = [-(-(done + 1) // bs) for _, _, bs in self.groups]
        return _Sent(state, lists, [len(t) for t in lists],
                     [state.first_live[i] for _, i, _ in self.groups], tail_from,
                     [tuple(t[f:]) for t, f in zip(lists, tail_from)])
