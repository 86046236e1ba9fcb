"""Continuous batching over the block manager (standard library only).

Each step: running requests first, oldest first — a decode computes its last token (plus
drafts with speculative decoding), a prefill its next chunk — and when a pool runs short
the newest running request is preempted (its blocks freed, recomputed later, usually
from the prefix cache). Then waiting requests are admitted in order while the step's
token budget and ``max_running`` allow: cache lookup, then the first chunk.

After the forward, :meth:`Scheduler.update` commits every scheduled request, appends the
tokens it sampled and finishes requests (length, stop token, ``max_model_len``). The
engine and the simulator (``pagedkv.sim``) share this class, so they schedule alike.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat

from pagedkv.blocks import KVCacheManager, lookahead_tokens
from pagedkv.engine.request import FINISHED, RUNNING, WAITING, Request
from pagedkv.errors import InvalidArgumentError


@dataclass(slots=True)
class Chunk:
    """One request's share of a step: ``num_new_tokens`` rows from ``num_computed``.
    ``samples``: the rows reach the request's last known token, so it samples;
    ``num_lookahead`` draft positions ride along on a speculative decode. Not frozen, but
    nothing changes one once made: a frozen dataclass's ``__init__`` sets every field
    through ``object.__setattr__``, and making the chunks was most of a 256-request step's
    ``schedule`` (``benchmarks/engine_metadata.py --breakdown``: 356 -> 178 us with this
    class, docs/engine.md)."""

    request: Request
    num_computed: int
    num_new_tokens: int
    samples: bool
    num_lookahead: int = 0


class Chunks(tuple):
    """A step's chunks (a tuple of :class:`Chunk`), with what the metadata build reads of
    every chunk, kept as the scheduler makes them: ``rids`` (each chunk's
    ``request.rid``), ``computed`` and ``new`` (its ``num_computed`` / ``num_new_tokens``),
    tuples in chunk order. The build then makes no pass over the chunks of its own (three
    at ~12 us each at 256 chunks on this project's CPU); in checked mode it compares them."""

    def __new__(cls, chunks: Iterable[Chunk], rids: Sequence[object], computed: Sequence[int],
                new: Sequence[int]) -> Chunks:
        self = super().__new__(cls, chunks)
        if not len(self) == len(rids) == len(computed) == len(new):
            raise InvalidArgumentError(
                f"{len(self)} chunks with {len(rids)} ids, {len(computed)} computed and "
                f"{len(new)} new counts")
        self.rids, self.computed, self.new = tuple(rids), tuple(computed), tuple(new)
        return self


@dataclass(frozen=True)
class StepPlan:
    chunks: tuple[Chunk, ...]
    preempted: tuple[Request, ...]

    @property
    def num_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)


class Scheduler:
    """Continuous batching for one :class:`KVCacheManager` (its token budget per step).
    ``batch_decode``: plain decodes go through ``allocate_batch`` / ``commit_batch``, one
    call per run of them (False: one call per request; the same decisions)."""

    batch_decode = True

    def __init__(self, manager: KVCacheManager, *, max_running: int = 256,
                 spec_tokens: int = 0, eos_token_ids: Iterable[int] = (),
                 max_model_len: int | None = None) -> None:
        if max_running <= 0:
            raise InvalidArgumentError(f"max_running must be > 0, got {max_running}")
        if spec_tokens < 0:
            raise InvalidArgumentError(f"spec_tokens must be >= 0, got {spec_tokens}")
        self.mgr = manager
        self.max_running = max_running
        self.spec_tokens = spec_tokens
        self.lookahead = lookahead_tokens(manager.groups, spec_tokens) if spec_tokens else 0
        if spec_tokens and 1 + self.lookahead > manager.max_batched_tokens:
            raise InvalidArgumentError(
                f"a speculative step needs {1 + self.lookahead} tokens, over the step budget "
                f"{manager.max_batched_tokens}")
        self.eos = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.prompt_tokens = 0  # prompt tokens of first admissions
        self.hit_tokens = 0  # of which were cached

    # --- requests --------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Queue a request; the manager raises RequestTooLargeError if it can never fit."""
        self.mgr.add_request(request.rid, request.prompt,
                             max_new_tokens=request.sampling.max_new_tokens)
        request.status = WAITING
        self.waiting.append(request)

    def abort(self, rid: object) -> Request | None:
        """Drop a waiting or running request (its blocks go back); None if unknown."""
        for queue in (self.waiting, self.running):
            for req in queue:
                if req.rid == rid:
                    queue.remove(req)
                    self._finish(req, "abort")
                    return req
        return None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def prefix_hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    # --- one step ----------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        mgr = self.mgr
        budget = mgr.max_batched_tokens
        chunks: list[Chunk] = []
        rids: list[object] = []  # the Chunks' columns, made alongside
        done_at: list[int] = []
        new: list[int] = []
        preempted: list[Request] = []
        idx = 0
        running = self.running
        states = mgr.requests
        while idx < len(running) and budget > 0:
            if self.batch_decode and not self.spec_tokens:
                # a run of plain decodes (one known token to compute each): their slots in
                # one allocate_batch call, which stops where one does not fit; that one
                # takes the per-request path below (preempting the newest)
                j = idx
                stop = min(len(running), idx + budget)
                while j < stop:
                    st = states[running[j].rid]
                    if len(st.tokens) - st.num_computed != 1:
                        break
                    j += 1
                if j > idx:
                    run = running[idx:j]
                    ids = [r.rid for r in run]
                    k = mgr.allocate_batch(ids)
                    del ids[k:]
                    at = [states[rid].num_computed for rid in ids]
                    chunks += map(Chunk, run[:k], at, repeat(1, k), repeat(True, k))
                    rids += ids
                    done_at += at
                    new += repeat(1, k)
                    budget -= k
                    idx += k
                    if k == len(run):
                        continue
            req = running[idx]
            rid = req.rid
            done, known = mgr.num_computed(rid), mgr.num_tokens(rid)
            todo = known - done
            # a speculative decode takes lookahead slots past its token; within
            # max_model_len only (past it the plan promises no room: the last tokens decode
            # one at a time, and a drafter never gets fewer slots than its block needs)
            spec = (todo == 1 and self.spec_tokens > 0 and budget >= 1 + self.lookahead
                    and (self.max_model_len is None
                         or known + self.lookahead <= self.max_model_len))
            n = 1 if spec else min(todo, budget)
            look = self.lookahead if spec else 0
            while not mgr.allocate(rid, n, look):
                victim = self.running.pop()
                mgr.preempt(victim.rid)
                victim.status = WAITING
                self.waiting.appendleft(victim)
                preempted.append(victim)
                if victim is req:
                    break
            else:
                chunks.append(Chunk(req, done, n, done + n == known, look))
                rids.append(rid)
                done_at.append(done)
                new.append(n)
                budget -= n + look
                idx += 1
                continue
            break  # the request preempted itself: nothing older left to take from
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            req = self.waiting[0]
            rid = req.rid
            hit = mgr.find_cached_prefix(rid)
            known = mgr.num_tokens(rid)
            n = min(known - hit, budget)
            if not mgr.allocate(rid, n):
                break
            self.waiting.popleft()
            if req.first_admit:
                req.first_admit = False
                req.hit_tokens = min(hit, len(req.prompt))
                self.prompt_tokens += len(req.prompt)
                self.hit_tokens += req.hit_tokens
            req.status = RUNNING
            self.running.append(req)
            chunks.append(Chunk(req, hit, n, hit + n == known))
            rids.append(rid)
            done_at.append(hit)
            new.append(n)
            budget -= n
        return StepPlan(Chunks(chunks, rids, done_at, new), tuple(preempted))

    def update(self, plan: StepPlan, sampled: Mapping[object, Sequence[int]]) -> list[Request]:
        """Commit the step: ``sampled[rid]`` are the tokens a sampling request produced
        (one, or accepted drafts plus a bonus token). Returns the requests that finished.

        Most chunks of a decode step sample one token that stops nothing: a few cheap tests
        find them and keep it; every other case goes to :meth:`_kept`, the one place that
        decides stop tokens and length limits (its copies and loop cost more than those
        tests on each of a step's requests)."""
        mgr = self.mgr
        states = mgr.requests
        eos, limit = self.eos, self.max_model_len
        batch = self.batch_decode
        done: list[Request] = []
        # plain decodes (one computed token, one kept) commit in one commit_batch call per
        # run of them, in plan order: flushed before any other commit and at the end
        batch_ids: list[object] = []
        batch_toks: list[int] = []
        for chunk in plan.chunks:
            req = chunk.request
            rid = req.rid
            sp = req.sampling
            output = req.output
            left = sp.max_new_tokens - len(output)  # req.remaining, kept as it changes
            if not chunk.samples or left <= 0:
                if batch_ids:
                    mgr.commit_batch(batch_ids, batch_toks)
                    batch_ids, batch_toks = [], []
                mgr.commit(rid, chunk.num_new_tokens)  # a prefill chunk or a recompute
            else:
                toks = sampled[rid]
                # one token in no stop set (eos even where ignored: _kept decides that),
                # two or more positions short of max_model_len: _kept would keep it and
                # give no reason to stop (max_new_tokens: the common test below)
                if (batch and len(toks) == 1 and chunk.num_new_tokens == 1
                        and (tok := toks[0]) not in eos and tok not in sp.stop_token_ids
                        and (limit is None or limit - len(states[rid].tokens) > 1)):
                    batch_ids.append(rid)
                    batch_toks.append(tok)
                    output.append(tok)
                    left -= 1
                else:
                    tokens, reason = self._kept(req, toks, left, len(states[rid].tokens))
                    computed = len(tokens) if chunk.num_lookahead else chunk.num_new_tokens
                    if computed == 1 and len(tokens) == 1 and batch:
                        batch_ids.append(rid)
                        batch_toks.append(tokens[0])
                    else:
                        if batch_ids:
                            mgr.commit_batch(batch_ids, batch_toks)
                            batch_ids, batch_toks = [], []
                        mgr.commit(rid, computed, tokens)
                    output += tokens
                    left -= len(tokens)
                    if reason is not None:
                        req.finish_reason = reason
            if req.finish_reason is not None or left <= 0:
                done.append(req)
        if batch_ids:
            mgr.commit_batch(batch_ids, batch_toks)
        for req in done:
            self.running.remove(req)
            self._finish(req, req.finish_reason or "length")
        return done

    def _kept(self, req: Request, sampled: Sequence[int], left: int, known: int
              ) -> tuple[list[int], str | None]:
        """The tokens a request keeps of those it ``sampled`` and why it then stops (None:
        it goes on): at most ``left`` (``max_new_tokens``), up to its first stop token, and
        no further than ``max_model_len`` from the ``known`` tokens it has."""
        sp = req.sampling
        tokens = list(sampled)[:left]
        reason = None
        for i, tok in enumerate(tokens):
            if tok in self.eos and not sp.ignore_eos or tok in sp.stop_token_ids:
                tokens, reason = tokens[: i + 1], "stop"
                break
        if self.max_model_len is not None:
            room = self.max_model_len - known
            if len(tokens) >= room:
                tokens, reason = tokens[:room], reason or "length"
        return tokens, reason

    def _finish(self, req: Request, reason: str) -> None:
        self.mgr.free(req.rid)
        req.status = FINISHED
        req.finish_reason = reason
