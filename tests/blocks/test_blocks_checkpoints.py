"""Recurrent checkpoints: the default policy (branch points + newest decoded block), the
forced interval, turning them off, draft positions, and that checkpoints never take a
state slot a request needs. Hybrid groups: an MLA full-attention group (block size 4)
and a recurrent group (tests/block_groups.py ``kimi_dspark_like``)."""

from __future__ import annotations

import pytest
from block_groups import kimi_dspark_like
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from pagedkv.blocks import KVCacheManager
from pagedkv.errors import InvalidArgumentError
from pagedkv.sim import SimRequest, simulate


def hybrid(**kw):
    return kimi_dspark_like(checkpoint_every=None, **kw)  # the catalog's retention


def make(every=None, **kw):
    return KVCacheManager(hybrid(**kw), checked=True, sweep_every=1, max_batched_tokens=64,
                          recurrent_checkpoint_every=every)


# --- exact hit rates through the simulator ----------------------------------------------

# A chat of two turns. A: 8 prompt tokens, answers 100..105; its decode steps compute
# positions 8..12. B (later): A's prompt + A's answer + 4 new = 18 tokens, lookup <= 17.
# The full group holds A's blocks 0..2 (block 3 = 12..15 was never full of computed
# tokens) -> 12.
CHAT_A = SimRequest(tuple(range(8)), 6, 0, tuple(range(100, 106)))
CHAT_B = SimRequest(tuple(range(8)) + tuple(range(100, 106)) + (200, 201, 202, 203), 1, 30)


@pytest.mark.parametrize("every, hit", [
    # default: A's newest decoded block boundary, 12 (reached by the step computing
    # position 11), is saved; B resumes there
    (None, 12),
    # forced every 2 blocks: states at 8 only (A's prefill end; 16 is never reached)
    (2, 8),
    # off: a recurrent group without a checkpoint never hits
    (0, 0),
])
def test_chat_turn_resumes_at_the_previous_answers_last_block(every, hit):
    r = simulate(make(every), [CHAT_A, CHAT_B])
    assert r.hit_tokens == hit
    assert r.prefix_hit_rate == pytest.approx(hit / (8 + 18))
    assert r.requests_finished == 2 and r.leaked_blocks == 0 and r.preemptions == 0


# Three requests share 12 tokens, then differ (4 tokens each), one answer token each,
# arriving 10 steps apart. The first caches full blocks 0..2 but saves no state (nothing
# marks 12 as shared yet). The second finds 12 cached in the full group but no state:
# it computes from 0 and saves its state at 12, the branch point. The third hits 12.
SHARED = tuple(range(12))
BRANCH = [SimRequest(SHARED + tuple(range(50 + 10 * i, 54 + 10 * i)), 1, 10 * i)
          for i in range(3)]


@pytest.mark.parametrize("every, hit", [
    (None, 12),   # only the third hits
    (3, 24),      # every 3 blocks = 12 tokens: the first saves 12, both others hit
    (0, 0),
])
def test_shared_prefix_branch_point(every, hit):
    r = simulate(make(every), BRANCH)
    assert r.hit_tokens == hit
    assert r.prefix_hit_rate == pytest.approx(hit / 48)
    assert r.requests_finished == 3 and r.leaked_blocks == 0


def test_bad_interval_is_refused():
    with pytest.raises(InvalidArgumentError, match="-1"):
        make(-1)


# --- draft positions ---------------------------------------------------------------------

def _after_prompt(m, rid="a"):
    m.add_request(rid, list(range(8)))
    assert m.find_cached_prefix(rid) == 0
    assert m.allocate(rid, 8)
    m.commit(rid, 8, [8])  # 9 known tokens, 8 computed


def _saves(m):
    return [op.position for op in m.drain_copy_ops() if op.kind == "save"]


def test_a_checkpoint_reached_by_accepted_drafts_is_cached():
    m = make()
    _after_prompt(m)
    m.drain_copy_ops()
    assert m.allocate("a", 1, 3)  # positions 8..11: 9..11 are drafts, 12 a block boundary
    assert _saves(m) == [12]
    m.commit("a", 4, [9, 10, 11, 12])  # every draft accepted: 12 computed
    m.add_request("b", list(range(13)) + [99])
    assert m.find_cached_prefix("b") == 12


def test_a_checkpoint_of_rejected_drafts_is_tried_again():
    m = make()
    _after_prompt(m)
    m.drain_copy_ops()
    assert m.allocate("a", 1, 3)
    assert _saves(m) == [12]
    m.commit("a", 1, [50])  # drafts rejected: 9 computed, nothing cached
    assert len(m.managers[1].cache) == 0
    assert m.allocate("a", 1, 3)  # positions 9..12 reach 12 again: reserved again
    assert _saves(m) == [12]


# --- checkpoints never take a slot a request needs --------------------------------------

def test_an_unsent_save_gives_its_slot_to_an_admission():
    m = make(slots=3)
    m.add_request("a", list(range(16)))
    m.find_cached_prefix("a")
    assert m.allocate("a", 16)
    m.commit("a", 16, [1])
    m.drain_copy_ops()
    m.add_request("b", list(range(12)) + [7, 7, 7, 7])  # full group: 12 cached, no state
    assert m.find_cached_prefix("b") == 0
    assert m.allocate("b", 16)  # slot 2 of 3 + a save at 12 in slot 3
    assert len(m.requests["b"].saves[1]) == 1
    m.add_request("c", [5] * 16)
    assert m.find_cached_prefix("c") == 0
    assert m.allocate("c", 16)  # would be False if the save kept the last slot
    assert m.requests["b"].saves[1] == []
    assert _saves(m) == []  # the cancelled save is not handed to the engine


class SlotsMachine(RuleBasedStateMachine):
    """Two managers, checkpoints on (default) and off, driven by the same requests. The
    full pool never binds; the recurrent group has 3 state slots. Every allocation must
    succeed or fail alike: checkpoints never cause a wait, a rejection or a preemption."""

    @initialize(spec=st.integers(0, 3))
    def setup(self, spec):
        self.on = make(None, num_blocks=400, slots=3)
        self.off = make(0, num_blocks=400, slots=3)
        self.spec = spec
        self.running: list[int] = []
        self.waiting: list[int] = []
        self.n = 0

    def _both(self, fn):
        a, b = fn(self.on), fn(self.off)
        assert a == b
        return a

    @rule(prefix=st.integers(0, 2), own=st.integers(1, 9))
    def arrive(self, prefix, own):
        rid = self.n
        self.n += 1
        prompt = [prefix] * 4 * (1 + prefix) + list(range(1000 * rid, 1000 * rid + own))
        self._both(lambda m: m.add_request(rid, prompt, max_new_tokens=20))
        self.waiting.append(rid)

    @rule(count=st.integers(1, 3))
    def admit(self, count):
        """One step: admit up to ``count`` waiting requests, then commit them all."""
        batch = self.waiting[:count]

        def go(m):
            done = []
            for rid in batch:
                hit = m.find_cached_prefix(rid)
                n = m.num_tokens(rid) - hit
                if not m.allocate(rid, n):
                    break
                done.append((rid, n))
            m.drain_copy_ops()
            for rid, n in done:
                m.commit(rid, n, [7])
            return [rid for rid, _ in done]
        for rid in self._both(go):
            self.waiting.remove(rid)
            self.running.append(rid)

    @rule(i=st.integers(0, 10), accepted=st.integers(0, 3), drain=st.booleans())
    def step(self, i, accepted, drain):
        if not self.running:
            return
        rid = self.running[i % len(self.running)]
        k = self.spec
        take = min(accepted, k) + 1

        def go(m):
            assert m.allocate(rid, 1, k)
            if drain:
                m.drain_copy_ops()
            pos = m.num_tokens(rid)
            m.commit(rid, take, [pos + j for j in range(take)])
        self._both(go)

    @rule(i=st.integers(0, 10), preempt=st.booleans())
    def leave(self, i, preempt):
        if not self.running:
            return
        rid = self.running.pop(i % len(self.running))
        if preempt:
            self._both(lambda m: m.preempt(rid))
            self.waiting.append(rid)
        else:
            self._both(lambda m: m.free(rid))

    @invariant()
    def same_slots_held(self):
        if hasattr(self, "on"):
            assert self.on.blocks_used()[1] - sum(
                len(r.saves[1]) for r in self.on.requests.values()) == self.off.blocks_used()[1]


TestSlotsMachine = SlotsMachine.TestCase
TestSlotsMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)



def test_the_machine_sees_hits_and_cancellations():
    """The machine above compares something: a fixed run where checkpoints are hit and a
    restore gives its slot back (the third admission of one step needs it: one of the
    first two takes the checkpoint over, the other two copy it before the forward)."""
    sm = SlotsMachine()
    sm.setup(spec=0)
    sm.arrive(prefix=1, own=1)
    sm.admit(count=1)
    sm.arrive(prefix=1, own=1)
    sm.leave(i=0, preempt=False)
    sm.admit(count=1)  # finds 8 tokens in the full group, saves its state there
    sm.leave(i=0, preempt=False)
    for _ in range(3):
        sm.arrive(prefix=1, own=1)
    sm.admit(count=3)  # two restore the checkpoint, the third needs one's slot
    assert sm.on.prefix_hits == 3 * 8 and len(sm.running) == 3  # all three hit 8
    sm.same_slots_held()
