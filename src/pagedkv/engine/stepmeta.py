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
a decode step's new counts as its shared :func:`~pagedkv.batch.incremental.decode_counts`
(which its decode paths recognise without a pass), and no draft counts when there are
none. The step's ids and counts come from the
scheduler's :class:`~pagedkv.engine.scheduler.Chunks` (made with the chunks; compared
with them in checked mode) instead of passes over the chunks, where the chunks are one. Instead of ``build_metadata``'s copy of every
block list, a step costs a few operations per request.

Over the engine's own :class:`KVCacheManager` a steady step costs O(rows that changed)
instead: the manager lists every request whose table it changes other than by appending
blocks at its end (``KVCacheManager.watch_tables``: hit adopted, window move, blocks given
back at commit, free / preemption, cross-attention and recurrent slots). A row it did not
list since the last step holds the blocks sent, at the same columns, and perhaps more
after them; the step's allocation gave a full-attention or window group
``ceil(end / block_size)`` blocks at most (``end``: the chunk's computed + new tokens +
the engine's ``lookahead``, or the draft rows where more; a cross-attention table never
grows), so only rows sent shorter than that are read (a decode step's block openings),
found by one comparison per group with a mark kept per row (``sent * block_size -
lookahead``: a decode step's ``computed >= mark``);
the listed ones are compared entry by entry with the rows the builder holds
(:meth:`TableSync._resync`: the kept entries above do not cover blocks appended on such
steps), on every step, whichever path it takes. The per-request path stays for other
managers and for steps whose requests changed. In checked mode (``check``; default: the manager's, i.e. ``PAGEDKV_DEBUG`` or
``EngineOptions.checked``) every step's rows are then compared with the manager's tables
and the per-request path's records (:class:`MetadataError` names the first that
differs): a change the manager did not list fails there.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from operator import attrgetter, getitem, is_, itemgetter

import numpy as np
import torch

from pagedkv.batch import StepMetadata
from pagedkv.batch.incremental import decode_counts
from pagedkv.batch.persistent import PersistentMetadata
from pagedkv.blocks import KVCacheManager
from pagedkv.blocks.cross import CrossManager
from pagedkv.blocks.full import FullManager
from pagedkv.blocks.window import WindowManager
from pagedkv.engine.scheduler import Chunk, Chunks
from pagedkv.errors import InvalidArgumentError, MetadataError
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


class TableSync:
    """One :class:`PersistentMetadata` over ``groups`` (the plan's attention groups),
    kept in step with ``manager``'s tables; :meth:`build` makes a step's metadata.

    ``max_batch`` / ``max_tokens``: the most requests / query rows of a step (the largest
    buckets); ``max_model_len`` (lookahead included) sets the block-table width.
    ``derive_on_device``: the builder's steady decode steps derived on the device (None: on
    CUDA when Triton is installed). ``lookahead``: the most draft positions a step
    allocates past a chunk's tokens (the scheduler's). ``check``: compare every step's
    rows with the manager's tables (None: the manager's checked mode). Counters for
    tests: ``added``, ``removed``, ``rewritten`` (rows set anew), ``appended`` (rows that
    only grew), ``tracked`` (steady steps read through the manager's list of changed
    requests) and ``listed`` (rows it listed on those steps, compared entry by entry)."""

    def __init__(self, groups: Sequence[Group], manager: KVCacheManager, gids: Sequence[int], *,
                 device, max_batch: int, max_tokens: int, max_model_len: int,
                 derive_on_device: bool | None = None, lookahead: int = 0,
                 check: bool | None = None) -> None:
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
        self.lookahead = lookahead
        self.check = bool(getattr(manager, "checked", False)) if check is None else check
        # per group: whether its table grows with the tokens (else fixed: cross-attention);
        # None when some group's growth is not known here (no tracked steps then)
        self._grows = self._growth(manager)
        self._log = manager.watch_tables() if self._grows is not None else None
        self._rows = None  # tracked steps: (row of each request id, marks per group)
        self.added = self.removed = self.rewritten = self.appended = 0
        self.tracked = self.listed = 0

    def _growth(self, manager) -> list[bool] | None:
        """Per group, whether allocation grows its tables to ``ceil(end / block_size)``
        blocks (full attention, windows) or never after the first (cross-attention); None
        for a manager that does not list its table changes or a kind of group not known
        here."""
        managers = getattr(manager, "managers", None)
        if managers is None or not hasattr(manager, "watch_tables"):
            return None
        out = []
        for _, i, _ in self.groups:
            kind = type(managers[i])
            if kind is not CrossManager and kind not in (FullManager, WindowManager):
                return None
            out.append(kind is not CrossManager)
        return out

    def build(self, chunks: Sequence[Chunk], extra: Sequence[int]) -> StepMetadata:
        """The step's metadata (valid until the next :meth:`build`); ``extra[i]``: draft
        rows riding on chunk i."""
        if type(chunks) is Chunks:  # the scheduler's: ids and counts made with the chunks
            ids, done, todo = chunks.rids, chunks.computed, chunks.new
            if self.check and (ids != tuple([c.request.rid for c in chunks])
                               or done != tuple([c.num_computed for c in chunks])
                               or todo != tuple([c.num_new_tokens for c in chunks])):
                raise MetadataError("TableSync: the step's ids or counts (Chunks.rids, "
                                    ".computed, .new) are not its chunks'")
        else:  # (comprehensions: faster than map with an attrgetter here)
            ids = tuple([c.request.rid for c in chunks])
            done = [c.num_computed for c in chunks]
            todo = [c.num_new_tokens for c in chunks]
        n = len(ids)
        if len(extra) != n:
            raise InvalidArgumentError(f"{len(extra)} draft counts for {n} chunks")
        steady = ids == self._last_ids
        aligned, rows = (self._aligned, self._rows) if steady else (None, None)
        if not steady:
            for rid in self.sent.keys() - set(ids):
                self.drop(rid)
            self._last_ids = ids
        # the counts as int64 arrays, which the builder takes without a copy; a decode
        # step's new counts (all one) as the builder's shared read-only array of ones
        computed = np.fromiter(done, np.int64, n)
        ones = todo.count(1) == n
        new = decode_counts(n) if ones else np.fromiter(todo, np.int64, n)
        drafts = None  # none: the builder's own zeros, no array to check
        # (a list's count of zeros: a C loop on identical objects, ~8x faster than any())
        if (extra.count(0) != n) if type(extra) is list else any(extra):
            drafts = np.fromiter(extra, np.int64, n)
        # what allocation was for, on a tracked step (None: a decode step's computed + 1)
        ends = None
        if rows is not None and (not ones or drafts is not None):
            ends = computed + new
            if drafts is not None:  # (a lookahead too small would miss their blocks)
                ends += np.maximum(drafts - self.lookahead, 0)
        if drafts is not None:
            new = new + drafts
        states = self.mgr.requests
        log = self._log
        if log is not None:  # every step reads (and empties) the manager's list
            listed = {req.id for req in log} if log else ()
            log.clear()
            if rows is not None:
                single = self._tracked(ids, computed, ends, states, rows, listed)
            else:
                single = {}
                if listed:  # the listed rows first, compared entry by entry
                    at = dict(zip(ids, computed.tolist()))
                    for rid in listed:
                        if rid in at and rid in self.sent:
                            self._resync(rid, states[rid], at[rid], single)
                single = self._each(ids, computed.tolist(), states, single)
                self._rows = self._positions(ids)
        else:
            single = self._steady(ids, computed, states, aligned) if aligned is not None else None
            if single is None:
                single = self._each(ids, computed.tolist(), states)
                self._aligned = self._align(ids)
        for j, (rids, blocks) in single.items():
            self.builder.append_each(rids, {self.groups[j][0]: blocks})
        meta = self.builder.step(ids, computed, new, drafts)
        if self.check:
            self._verify(ids, states)
        return meta

    def _tracked(self, ids, computed, ends, states, rows, listed) -> dict[int, tuple[list, list]]:
        """A steady step over a manager that lists its table changes: the listed rows
        through :meth:`_resync`; then, per growing group, only the rows sent shorter than
        the step's allocation may have made them (``ceil((end + lookahead) / bs)``
        blocks) are read, for their new blocks (``ends``: each row's end, None for a
        decode step's ``computed + 1``). Returns the single-block appends by group
        index."""
        pos, marks = rows
        sent = self.sent
        single: dict[int, tuple[list, list]] = {}
        dirty = {pos[rid] for rid in listed if rid in pos} if listed else ()
        for r in sorted(dirty):
            self._resync(ids[r], states[ids[r]], int(computed[r]), single)
            self._refresh(rows, r, ids[r])
        look = self.lookahead
        grown = set()
        for j, ((gid, i, bs), grows, mark) in enumerate(zip(self.groups, self._grows, marks)):
            if not grows:
                continue
            # ceil((end + lookahead) / bs) > sent, i.e. end > sent * bs - lookahead (mark)
            cand = (computed >= mark if ends is None else ends > mark).nonzero()[0]
            rids, blocks = single.setdefault(j, ([], []))  # (after the listed rows')
            row_marks = memoryview(mark)  # (sets entries ~3x faster than numpy's indexing)
            for r in cand.tolist():
                if r in dirty:
                    continue
                rid = ids[r]
                table = states[rid].tables[i]
                rec = sent[rid]
                k = rec.lens[j]
                m = len(table)
                if m == k + 1:  # a decode step's block opening
                    rids.append(rid)
                    blocks.append(table[k])
                elif m > k:
                    self.builder.append_blocks(rid, {gid: table[k:]})
                elif m < k:  # allocation left fewer blocks than sent: a change not listed
                    raise MetadataError(
                        f"TableSync: request {rid!r} group {gid}: {m} blocks, fewer than "
                        f"the {k} sent, but the block manager did not list it as changed")
                else:
                    continue
                rec.lens[j] = m
                row_marks[r] = m * bs - look
                grown.add(r)
            if not rids:
                del single[j]
        self.appended += len(grown)
        self.tracked += 1
        self.listed += len(dirty)
        return single

    def _refresh(self, rows, r: int, rid) -> None:
        """Row ``r``'s marks from its record (after :meth:`_resync`)."""
        lens = self.sent[rid].lens
        for mark, n, (_, _, bs) in zip(rows[1], lens, self.groups):
            mark[r] = n * bs - self.lookahead

    def _positions(self, ids):
        """For :meth:`_tracked`: each request's row in the batch, and per group in batch
        order ``sent * block_size - lookahead`` (``sent``: the blocks sent): a row whose
        step ends past its mark may have grown."""
        recs = list(map(self.sent.__getitem__, ids))
        marks = []
        for j, (_, _, bs) in enumerate(self.groups):
            mark = np.fromiter(map(itemgetter(j), map(_lens, recs)), np.int64, len(recs))
            mark *= bs
            mark -= self.lookahead
            marks.append(mark)
        return dict(zip(ids, range(len(ids)))), marks

    def _verify(self, ids, states) -> None:
        """Checked mode: every row of the step as the manager's tables are now, in the
        builder and in the records the per-request path compares with."""
        rows = self._rows
        for r, rid in enumerate(ids):
            state = states[rid]
            rec = self.sent.get(rid)
            if rec is None or rec.state is not state:
                raise MetadataError(f"TableSync: request {rid!r}: the builder's row is not "
                                    "the manager's request")
            for j, (gid, i, _) in enumerate(self.groups):
                table = state.tables[i]
                held = self.builder.blocks(rid, gid)
                if held != tuple(table):
                    raise MetadataError(
                        f"TableSync: request {rid!r} group {gid}: the builder holds "
                        f"{list(held)}, the block manager's table is {table} (a change "
                        "the manager did not list?)")
                if (rec.lists[j] is not table or rec.lens[j] != len(table)
                        or rec.lives[j] != state.first_live[i]
                        or (rows is not None and rows[1][j][r]
                            != len(table) * self.groups[j][2] - self.lookahead)):
                    raise MetadataError(
                        f"TableSync: request {rid!r} group {gid}: the record of what was "
                        "sent is not the manager's table")

    def _each(self, ids, computed, states, single=None) -> dict[int, tuple[list, list]]:
        """Every request's changes, one request at a time. Returns the single-block
        appends by group index (added to ``single``)."""
        get = self.sent.get
        index = self._index
        if single is None:  # group j -> (rids, blocks): one block
            single = {}
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
            self._aligned = self._rows = None
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
            changed = (table is not sent.lists[j] or len(table) < n or lives[i] != sent.lives[j]
                       or (sent.tails[j] and tuple(table[sent.tail_from[j] : sent.tail_from[j]
                                                         + len(sent.tails[j])]) != sent.tails[j]))
            grew |= self._send_row(rid, j, gid, table, n, changed, rewrite, single)
        self._count(rid, rewrite, grew)
        if rewrite or grew or sent.tails_any:
            self.sent[rid] = self._record(state, done)

    def _resync(self, rid, state, done: int, single) -> None:
        """A request the manager listed as changed: each group's table compared with the
        row the builder holds, entry by entry (the record's kept entries do not cover
        blocks appended on tracked steps), then appended to or rewritten."""
        sent = self.sent[rid]
        if sent.state is not state:
            self._sync(rid, state, done, single)  # removed, added
            return
        rewrite = {}
        grew = False
        tables = state.tables
        for j, (gid, i, _) in enumerate(self.groups):
            table = tables[i]
            n = sent.lens[j]
            changed = len(table) < n or tuple(table[:n]) != self.builder.blocks(rid, gid)
            grew |= self._send_row(rid, j, gid, table, n, changed, rewrite, single)
        self._count(rid, rewrite, grew)
        self.sent[rid] = self._record(state, done)

    def _send_row(self, rid, j: int, gid, table, n: int, changed: bool, rewrite: dict | None,
                  single) -> bool:
        """Group ``j``'s row of ``rid``, of which the builder holds ``n`` entries: noted in
        ``rewrite`` when ``changed``, else the blocks past ``n`` appended (one: gathered in
        ``single``, sent per group in one call). True when the row grew."""
        m = len(table)
        if changed:
            rewrite[gid] = table
        elif m == n + 1:
            entry = single.get(j)
            if entry is None:
                entry = single[j] = ([], [])
            entry[0].append(rid)
            entry[1].append(table[n])
            return True
        elif m > n:
            self.builder.append_blocks(rid, {gid: table[n:]})
            return True
        return False

    def _count(self, rid, rewrite: dict, grew: bool) -> None:
        """The rows noted for a rewrite sent; the counters moved."""
        if rewrite:
            self.builder.set_blocks(rid, rewrite)
            self.rewritten += 1
        elif grew:
            self.appended += 1

    def _record(self, state, done: int) -> _Sent:
        tables = state.tables
        lists = [tables[i] for _, i, _ in self.groups]
        tail_from = [-(-(done + 1) // bs) for _, _, bs in self.groups]
        return _Sent(state, lists, [len(t) for t in lists],
                     [state.first_live[i] for _, i, _ in self.groups], tail_from,
                     [tuple(t[f:]) for t, f in zip(lists, tail_from)])
