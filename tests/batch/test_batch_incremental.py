"""MetadataBuilder (host block tables kept across steps) against build_metadata of the same
requests, over random sequences of admissions, finishes, block appends, rollbacks, window
frees, preemptions and mixed prefill/decode/draft steps; and one host-to-device copy a step."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from test_batch import make_group  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from pagedkv.batch import AttentionGroup, ScheduledRequest, attention_view, build_metadata  # noqa: E402
from pagedkv.batch.incremental import MetadataBuilder  # noqa: E402
from pagedkv.errors import InvalidArgumentError, MetadataError  # noqa: E402
from pagedkv.kvspec import SlidingWindow  # noqa: E402

ARRAYS = ("block_table", "slot_mapping", "query_start_loc", "seq_lens", "positions",
          "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len")
NUM_BLOCKS = 5000


def groups():
    return [
        make_group(0, 4, num_blocks=NUM_BLOCKS),
        make_group(1, 2, offset=1, num_blocks=NUM_BLOCKS),  # EAGLE-style position offset
        make_group(2, 3, num_blocks=NUM_BLOCKS, retention=SlidingWindow(5)),
    ]


def assert_same(got, want):
    assert sorted(got) == sorted(want)
    for gid in want:
        g, w = got[gid], want[gid]
        for name in ARRAYS:
            a, b = getattr(g, name), getattr(w, name)
            assert a.dtype == b.dtype and a.shape == b.shape, (gid, name, a.shape, b.shape)
            assert torch.equal(a, b), (gid, name, a.tolist(), b.tolist())
        for name in ("num_reqs", "num_tokens", "req_ids", "query_lens_host", "seq_lens_host",
                     "num_draft_tokens_host", "block_size", "position_offset", "layer_names",
                     "max_seq_len", "min_query_len", "max_query_len", "batch_size"):
            assert getattr(g, name) == getattr(w, name), (gid, name)


def snapshot(meta):
    """A step's metadata with its tensors cloned out of the builder's reused buffers."""
    return {gid: replace(g, **{name: getattr(g, name).clone() for name in ARRAYS})
            for gid, g in meta.items()}


class Engine:
    """A toy scheduler + block manager driving a MetadataBuilder and a mirror of plain lists."""

    def __init__(self, draw, builder):
        self.draw, self.b = draw, builder
        self.rng = random.Random(draw(st.integers(0, 2**32 - 1)))
        self.live = {}  # req_id -> [computed, {gid: [ids]}]
        self.next_id = 0
        self.preempted = []
        self.pool = list(range(1, NUM_BLOCKS))  # block 0 stands for a freed window block
        self.rng.shuffle(self.pool)

    def fresh(self, n):
        return [self.pool.pop() for _ in range(n)]  # distinct: checked mode refuses shared slots

    def admit(self, req_id=None):
        if req_id is None:
            req_id, self.next_id = f"r{self.next_id}", self.next_id + 1
        computed = self.draw(st.integers(0, 12))  # > 0: a prefix-cache hit
        blocks = {gid: self.fresh(-(-computed // g.block_size)) for gid, g in self.groups.items()}
        blocks = {gid: ids for gid, ids in blocks.items() if ids or self.rng.random() < 0.5}
        self.b.add(req_id, blocks)
        self.live[req_id] = [computed, {gid: list(blocks.get(gid, [])) for gid in self.groups}]

    def grow(self, req_id, new):
        """Append what the next ``new`` tokens need, plus lookahead blocks sometimes."""
        computed, blocks = self.live[req_id]
        for gid, g in self.groups.items():
            need = -(-max(0, computed + new - g.position_offset) // g.block_size)
            extra = self.draw(st.integers(0, 1))
            add = self.fresh(max(0, need - len(blocks[gid])) + extra)
            if add:
                self.b.append_blocks(req_id, {gid: add})
                blocks[gid] += add

    def rollback(self, req_id):
        computed, blocks = self.live[req_id]
        gid = self.rng.choice(list(self.groups))
        g = self.groups[gid]
        keep = -(-max(0, computed - g.position_offset) // g.block_size)
        blocks[gid] = blocks[gid][: self.draw(st.integers(keep, len(blocks[gid])))]
        self.b.set_blocks(req_id, {gid: list(blocks[gid])})

    def window_free(self, req_id):
        """Blocks wholly out of the window go back to the pool; the table holds block 0."""
        blocks = self.live[req_id][1][2]
        out = self.draw(st.integers(0, max(0, len(blocks) - 2)))
        blocks[:out] = [0] * out
        self.b.set_blocks(req_id, {2: list(blocks)})


@st.composite
def scenario(draw):
    b = MetadataBuilder(groups(), rows=1, width=1)  # both capacities must grow
    e = Engine(draw, b)
    e.groups = {g.id: g for g in b.groups}
    steps = []
    for _ in range(draw(st.integers(1, 6))):
        for _ in range(draw(st.integers(0, 3))):
            action = draw(st.sampled_from(["admit", "finish", "preempt", "resume", "rollback", "window"]))
            ids = sorted(e.live)
            if action == "admit" or (not ids and action != "resume"):
                e.admit()
            elif action == "resume" and e.preempted:
                e.admit(e.preempted.pop())
            elif action in ("finish", "preempt") and ids:
                rid = draw(st.sampled_from(ids))
                b.remove(rid)
                del e.live[rid]
                if action == "preempt":
                    e.preempted.append(rid)
            elif action == "rollback" and ids:
                e.rollback(draw(st.sampled_from(ids)))
            elif action == "window" and ids:
                e.window_free(draw(st.sampled_from(ids)))
        order = list(e.live)
        e.rng.shuffle(order)
        order = order[: draw(st.integers(0, len(order)))]
        sched = []
        for rid in order:
            new = draw(st.sampled_from([0, 1, 1, 1, 3, 6]))
            drafts = draw(st.integers(0, new))
            e.grow(rid, new)
            computed, blocks = e.live[rid]
            sched.append(ScheduledRequest(rid, computed, new, {gid: list(ids) for gid, ids in blocks.items()}, drafts))
        tokens = sum(r.num_new_tokens for r in sched)
        widest = max((len(ids) for r in sched for ids in r.block_ids.values()), default=0)
        need = max((-(-max(0, r.num_tokens - g.position_offset) // g.block_size)
                    for r in sched for g in b.groups), default=0)
        kwargs = dict(
            pad_batch_to=draw(st.one_of(st.none(), st.integers(len(sched), len(sched) + 2))),
            pad_tokens_to=draw(st.one_of(st.none(), st.integers(tokens, tokens + 3))),
            max_blocks=draw(st.one_of(st.none(), st.integers(need, widest + 2))),
        )
        steps.append((sched, kwargs, {rid: [c, {g: list(i) for g, i in bl.items()}] for rid, (c, bl) in e.live.items()}))
        got = b.step([r.req_id for r in sched], [r.num_computed_tokens for r in sched],
                     np.array([r.num_new_tokens for r in sched]),
                     [r.num_draft_tokens for r in sched], checked=draw(st.booleans()), **kwargs)
        steps[-1] += (snapshot(got),)  # the builder's buffers are reused by its next step
        for r in sched:  # advance; drafts may be rejected
            e.live[r.req_id][0] += r.num_new_tokens - draw(st.integers(0, r.num_draft_tokens))
    return b, steps


@settings(max_examples=60, deadline=None)
@given(scenario())
def test_builder_steps_equal_build_metadata(case):
    builder, steps = case
    for sched, kwargs, _live, got in steps:
        want = build_metadata(sched, builder.groups, **kwargs)
        assert_same(got, want)
    for rid, (_, blocks) in steps[-1][2].items():
        for gid, ids in blocks.items():
            assert builder.blocks(rid, gid) == tuple(ids)


def test_builder_checked_mode_and_hand_worked_decode():
    group = make_group(0, 4)
    b = MetadataBuilder([group], rows=1, width=1)
    b.add("a", {0: [7, 3]})
    b.add("b", {0: [1]})
    b.append_blocks("b", {0: [2]})
    meta = b.step(["b", "a"], [6, 0], [1, 5], checked=True)[0]
    assert meta.slot_mapping.tolist() == [10, 28, 29, 30, 31, 12]
    assert meta.block_table.tolist() == [[1, 2], [7, 3]]
    assert meta.paged_kv_indices.tolist() == [1, 2, 7, 3]
    b.remove("a")
    b.add("c", {0: [9]})  # reuses a's row: a's second block must not show through
    assert b.step(["c"], [0], [2])[0].block_table.tolist() == [[9]]


def test_builder_refusals():
    b = MetadataBuilder([make_group(0, 4, num_blocks=10)])
    with pytest.raises(MetadataError, match="block id 10"):
        b.add("a", {0: [1, 10]})
    assert "a" not in b and len(b) == 0
    b.add("a", {0: [1]})
    with pytest.raises(InvalidArgumentError, match="already"):
        b.add("a")
    with pytest.raises(InvalidArgumentError, match="groups \\[5\\]"):
        b.append_blocks("a", {5: [1]})
    with pytest.raises(InvalidArgumentError, match="'zz' is not in the builder"):
        b.step(["a", "zz"], [0, 0], [1, 1])
    with pytest.raises(MetadataError, match="needs 2 blocks"):
        b.step(["a"], [4], [1])
    with pytest.raises(InvalidArgumentError, match="2 draft tokens"):
        b.step(["a"], [0], [1], [2])
    with pytest.raises(InvalidArgumentError, match="num_new_tokens has 2 entries"):
        b.step(["a"], [0], [1, 1])
    b.remove("a")
    with pytest.raises(InvalidArgumentError, match="not in the builder"):
        b.remove("a")


class CopyCounter(TorchDispatchMode):
    """Counts copies from host tensors to another device, whatever torch call makes them."""

    def __init__(self):
        super().__init__()
        self.copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.overloadpacket in (torch.ops.aten._to_copy, torch.ops.aten.copy_):
            src = args[1] if func.overloadpacket is torch.ops.aten.copy_ else args[0]
            dst = out
            if src.device.type == "cpu" and dst.device.type != "cpu":
                self.copies += 1
        return out


def test_one_host_to_device_copy_per_step():
    # "meta" stands in for the accelerator: the same code path as CUDA up to the copy
    gs = groups()
    att = AttentionGroup("t", "target", gs[0].layer_names)
    b = MetadataBuilder(gs, device="meta")
    reqs = []
    for i in range(5):
        ids = {g.id: list(range(i * 8, i * 8 + 8)) for g in gs}
        b.add(i, ids)
        reqs.append(ScheduledRequest(i, 9 + i, 1 + (i == 3) * 4, ids))
    for step in range(3):
        with CopyCounter() as counter:
            meta = b.step([r.req_id for r in reqs], [r.num_computed_tokens for r in reqs],
                          [r.num_new_tokens for r in reqs])
            view = attention_view(meta[0], att, causal=True)
        assert counter.copies == 1, step
        assert meta[1].slot_mapping.device.type == "meta"
        with CopyCounter() as counter:
            plain = build_metadata(reqs, gs, device="meta")
            attention_view(plain[0], att, causal=True)
        assert counter.copies == 1
        with CopyCounter() as counter:  # the split row list is copied only when read
            rows = view.decode_reqs
        assert counter.copies == 1 and rows.device.type == "meta" and rows.shape == (4,)


def test_rollback_and_window_free_leave_no_stale_ids():
    group = make_group(0, 2)
    b = MetadataBuilder([group], rows=2, width=2)
    b.add("a", {0: [11, 12, 13, 14]})  # two lookahead blocks for a draft block
    b.add("b", {0: [21, 22, 23, 24]})
    b.set_blocks("a", {0: [11]})  # drafts rejected: the lookahead blocks go back
    b.append_blocks("a", {0: [15]})
    b.set_blocks("b", {0: [0, 0, 23, 24]})  # out-of-window blocks freed
    meta = b.step(["a", "b"], [2, 7], [1, 1])[0]
    assert meta.block_table.tolist() == [[11, 15, 0, 0], [0, 0, 23, 24]]
    assert meta.slot_mapping.tolist() == [30, 49]  # position 2: 15*2+0; position 7: 24*2+1


def test_same_batch_order_after_readmission_reads_the_new_row():
    group = make_group(0, 4)
    b = MetadataBuilder([group], rows=3, width=2)
    for rid, block in (("a", 1), ("b", 2), ("c", 3)):
        b.add(rid, {0: [block]})
    assert b.step(["a", "b"], [0, 0], [1, 1])[0].block_table.tolist() == [[1], [2]]
    b.remove("a")
    b.remove("c")
    b.add("a", {0: [9]})  # preempted and back: another row, another block
    assert b.step(["a", "b"], [0, 0], [1, 1])[0].block_table.tolist() == [[9], [2]]
