"""Stateful property tests: random add / admit / step (prefill chunks, decodes,
speculative steps with random acceptance) / preempt / finish / launch-a-step sequences, in
checked mode (every call ends with the full invariant sweep), over real plans of catalog
models (elastic pools over one budget, as ``from_plan`` builds them), hand-built fixed
pools with small blocks, and hand-built elastic pools of mixed retentions (full + sliding
window + recurrent + an MTP drafter) over small pages and a tight budget, with steps
finishing at once or later (``sync_steps=False``), and full + sliding-window pools whose
blocks straddle pages differently (as Gemma-3's do) under a budget a few pages above the
floors, where prefix hits take cached blocks back while other pools must give pages up. At the end every block must be back,
and after a prefix-cache reset the mapped bytes are the floors."""

from __future__ import annotations

import pytest
from block_groups import (
    _layer,
    deepseek_mtp_like,
    full_only,
    gpt_oss_like,
    group,
    kimi_dspark_like,
)
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedkv.blocks import KVCacheManager, lookahead_tokens
from pagedkv.errors import RequestTooLargeError
from pagedkv.kvspec import Attention, AttentionKV, Full, LayerSpec, Recurrent, SlidingWindow

BASES = [tuple((i * 7 + j) % 5 for i in range(200)) for j in range(3)]


def _real_plan(model, draft, budget):
    from pagedkv.models import load_model
    from pagedkv.plan import PlanOptions, make_plan

    spec = load_model(model, draft)
    return make_plan(spec.layers, PlanOptions(budget_bytes=budget, max_model_len=512,
                                              block_size=16, max_batched_tokens=64))


def mixed_groups(max_model_len=64, bs=4):
    """Full + sliding window 8 + recurrent (checkpoints) + an MTP drafter (offset 1)."""
    kw = {"max_model_len": max_model_len, "max_batched_tokens": 64}
    return [group(0, Full(), bs, 1, **kw),
            group(1, SlidingWindow(8), bs, 1, **kw),
            group(2, Recurrent(2), bs, 1, **kw),
            group(3, Full(), bs, 1, offset=1, models=("mtp",), **kw,
                  layers=(_layer("mtp.0", Full(), model="mtp", offset=1),))]


def _elastic(sync_steps, **kw):
    # attention blocks of 16 KiB, state slots of 1 KiB, pages of 32 KiB; floors: full 16
    # blocks (8 pages), window 3 + 16 + null (10 pages), slot 1 (1 page), MTP 16 (8
    # pages) = 27 of the 32 pages the budget holds: pools take pages from each other
    groups = mixed_groups()
    assert [g.page_bytes for g in groups] == [16384, 16384, 1024, 16384]
    return KVCacheManager(groups, budget_bytes=32 * 32768, page_bytes=32768,
                          max_model_len=64, sync_steps=sync_steps,
                          recurrent_checkpoint_every=1, **kw)


def _uneven(**kw):
    # full blocks of 40 KiB (1.25 pages of 32 KiB), window blocks of 10 KiB (3.2 a page);
    # floors 27 pages of a 34-page budget: the regression shape of
    # `pagedkv simulate gemma-3-27b --memory 40GiB --max-model-len 16384 --workload
    # shared-prefix --requests 300`, which raised OutOfBlocksError mid-run
    def layer(name, retention):
        att = Attention(window=retention.window) if isinstance(retention, SlidingWindow) \
            else Attention()
        return LayerSpec(name, AttentionKV(5, 128), retention, att, "target", 0)

    lim = {"max_model_len": 64, "max_batched_tokens": 64}
    groups = [group(0, Full(), 4, 1, layers=tuple(layer(f"f{i}", Full()) for i in range(4)),
                    **lim),
              group(1, SlidingWindow(8), 4, 1, layers=(layer("w", SlidingWindow(8)),), **lim)]
    assert [g.page_bytes for g in groups] == [40960, 10240]
    return KVCacheManager(groups, budget_bytes=34 * 32768, page_bytes=32768, max_model_len=64,
                          **kw)


def _manager(kind):
    kw = {"checked": True, "sweep_every": 1, "events": True, "max_batched_tokens": 64}
    if kind in ("elastic", "elastic-async"):
        return _elastic(kind == "elastic", **kw)
    if kind == "elastic-uneven":
        return _uneven(**kw)
    if kind == "full":
        return KVCacheManager(full_only(num_blocks=40, bs=4), **kw)
    if kind == "window":
        return KVCacheManager(gpt_oss_like(num_blocks=40, bs=4, window=8), **kw)
    if kind == "window-shared":  # one fixed pool under both groups, short of blocks: a
        # group's new blocks evict cached ones the other group's hit is about to take
        return KVCacheManager(gpt_oss_like(num_blocks=40, bs=4, window=8),
                              pools={0: ((0, 1), 40)}, **kw)
    if kind == "kimi":
        return KVCacheManager(kimi_dspark_like(num_blocks=40, bs=4, slots=6), **kw)
    if kind == "mtp":
        return KVCacheManager(deepseek_mtp_like(num_blocks=40, bs=4), **kw)
    model, draft, budget = {
        "real-llama": ("llama-3-8b", None, 100 << 20),
        "real-gpt-oss": ("gpt-oss-20b", None, 40 << 20),
        "real-kimi-dspark": ("kimi-k3", "kimi-k3-dspark", 3 << 30),
        "real-deepseek-mtp": ("deepseek-v3", "mtp", 200 << 20),
    }[kind]
    kw["sweep_every"] = 8  # their ceilings are large: incremental checks, a sweep every 8
    plan = _real_plan(model, draft, budget)
    if kind == "real-gpt-oss":  # window and full layers pair up: one shared pool
        (pool,) = plan.ranks[0].pools
        assert pool.group_ids == (0, 1) and pool.reserved_pages == 1
    return KVCacheManager.from_plan(plan, recurrent_checkpoint_every=1, **kw)


class BlockMachine(RuleBasedStateMachine):
    kind = "full"

    @initialize(spec_tokens=st.integers(0, 3))
    def setup(self, spec_tokens):
        self.m = _manager(self.kind)
        self.la = lookahead_tokens(self.m.groups, spec_tokens) if spec_tokens else 0
        self.spec = spec_tokens
        self.waiting: list[int] = []
        self.running: list[int] = []
        self.next_id = 0
        self.max_new: dict[int, int] = {}
        self.made: dict[int, int] = {}

    @rule(base=st.integers(0, 2), cut=st.integers(1, 90), suffix=st.lists(st.integers(0, 4), max_size=12),
          max_new=st.integers(0, 30))
    def add(self, base, cut, suffix, max_new):
        rid = self.next_id
        self.next_id += 1
        try:
            self.m.add_request(rid, BASES[base][:cut] + tuple(suffix), max_new_tokens=max_new)
        except RequestTooLargeError:
            return
        self.waiting.append(rid)
        self.max_new[rid] = max_new
        self.made[rid] = 0

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), chunk=st.integers(1, 64))
    def admit(self, data, chunk):
        rid = data.draw(st.sampled_from(self.waiting))
        hit = self.m.find_cached_prefix(rid)
        todo = self.m.num_tokens(rid) - hit
        assert 0 <= hit < self.m.num_tokens(rid)
        n = min(todo, chunk)
        if self.m.allocate(rid, n):
            self.waiting.remove(rid)
            self.running.append(rid)
            self._finish_step(rid, n, False, 0)

    def _finish_step(self, rid, n, spec, accepted):
        m = self.m
        if m.num_computed(rid) + n < m.num_tokens(rid):
            m.commit(rid, n)
            return
        room = self.max_new[rid] - self.made[rid]
        if room <= 0:
            m.commit(rid, n)
            return
        take = min(accepted + 1 if spec else 1, room)
        m.commit(rid, n + (take - 1 if spec else 0), [3] * take)
        self.made[rid] += take

    @precondition(lambda self: self.running)
    @rule(data=st.data(), chunk=st.integers(1, 64), accepted=st.integers(0, 3))
    def step(self, data, chunk, accepted):
        rid = data.draw(st.sampled_from(self.running))
        m = self.m
        todo = m.num_tokens(rid) - m.num_computed(rid)
        if todo == 0:
            return
        spec = todo == 1 and self.spec > 0
        n = 1 if spec else min(todo, chunk)
        while not m.allocate(rid, n, self.la if spec else 0):
            # as a scheduler does: preempt the newest other running request; alone, the
            # request must fit (the floors promise it), so a False here is a deadlock
            others = [r for r in self.running if r != rid]
            assert others, f"request {rid} alone cannot take {n} tokens"
            m.preempt(others[-1])
            self.running.remove(others[-1])
            self.waiting.append(others[-1])
        self._finish_step(rid, n, spec, min(accepted, self.spec))

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data):
        rid = data.draw(st.sampled_from(self.running))
        self.m.preempt(rid)
        assert self.m.num_computed(rid) == 0
        assert all(not t for t in self.m.block_tables(rid))
        self.running.remove(rid)
        self.waiting.append(rid)

    @precondition(lambda self: self.running or self.waiting)
    @rule(data=st.data())
    def finish(self, data):
        rid = data.draw(st.sampled_from(self.running + self.waiting))
        self.m.free(rid)
        (self.running if rid in self.running else self.waiting).remove(rid)

    @rule(finish=st.booleans())
    def launch(self, finish):
        """The engine takes the step's page and copy ops (launching it) and, for an
        asynchronous engine, maybe learns that every launched step has finished."""
        m = self.m
        for op in m.drain_page_ops():
            assert op.pool_id in {p.pool_id for p in m.pools}
        m.drain_copy_ops()
        if finish and m.ledger is not None and not m.sync_steps:
            m.step_finished(m.ledger.launched)

    @invariant()
    def within_pools(self):
        if not hasattr(self, "m"):
            return
        for pool in self.m.pools:
            assert (sum(pool.used.values()) + pool.num_plain_free() + len(pool.evictable)
                    == pool.usable)
        if self.m.ledger is not None:
            assert self.m.floor_bytes() <= self.m.mapped_bytes() <= self.m.ledger.budget_bytes

    def teardown(self):
        if not hasattr(self, "m"):
            return
        for rid in self.running + self.waiting:
            self.m.free(rid)
        assert self.m.blocks_used() == [0] * len(self.m.groups)
        self.m.check_invariants()
        assert self.m.reset_prefix_cache()
        if self.m.ledger is not None:
            if self.m.ledger.launched > self.m.ledger.finished:
                self.m.step_finished(self.m.ledger.launched)
            assert self.m.mapped_bytes() == self.m.floor_bytes() > 0
        self.m.check_invariants()


KINDS = ["full", "window", "window-shared", "kimi", "mtp", "elastic", "elastic-async", "elastic-uneven",
         "real-llama",
         "real-gpt-oss", "real-kimi-dspark", "real-deepseek-mtp"]


@pytest.mark.parametrize("kind", KINDS)
def test_random_operation_sequences_keep_every_invariant(kind):
    machine = type(f"Machine_{kind}", (BlockMachine,), {"kind": kind})
    run = settings(max_examples=25, stateful_step_count=40, deadline=None,
                   suppress_health_check=[HealthCheck.too_slow])(machine).TestCase
    run().runTest()
