"""The reused-buffer fast path (MetadataBuilder and the bucketed PersistentMetadata) against
build_metadata, step by step, over random decode runs: the same batch order for many steps
(cached row lookup, all-decode steps), with drafts and their rollback, prefill chunks mixed
in, admissions, finishes, reorders and window frees; four groups with different block sizes,
one with a position offset and one sliding-window. On the device of PAGEDKV_TEST_DEVICE
(CUDA: the real pinned staging buffers used in turn, event waits and partial copies)."""

from __future__ import annotations

import bisect
import random

import pytest

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from test_batch import make_group  # noqa: E402
from test_batch_incremental import assert_same  # noqa: E402

from pagedkv.batch import ScheduledRequest, build_metadata, incremental  # noqa: E402
from pagedkv.batch.buffers import StepBuffers  # noqa: E402
from pagedkv.batch.incremental import MetadataBuilder  # noqa: E402
from pagedkv.batch.persistent import PersistentMetadata  # noqa: E402
from pagedkv.errors import InvalidArgumentError, MetadataError  # noqa: E402
from pagedkv.kvspec import SlidingWindow  # noqa: E402

NUM_BLOCKS = 4000
WIDTH = 64
BATCH_BUCKETS = [2, 4, 8, 16]
TOKEN_BUCKETS = [4, 16, 64]


def groups():
    return [
        make_group(0, 4, num_blocks=NUM_BLOCKS),
        make_group(1, 2, offset=1, num_blocks=NUM_BLOCKS),
        make_group(2, 3, num_blocks=NUM_BLOCKS, retention=SlidingWindow(5)),
        make_group(3, 16, num_blocks=NUM_BLOCKS),
    ]


class Run:
    """A toy scheduler + block manager feeding both builders the same bookkeeping."""

    def __init__(self, seed: int, device: torch.device | str = "cpu", emulate: bool = False,
                 make_groups=groups) -> None:
        self.rng = random.Random(seed)
        self.groups = make_groups()
        self.builders = [
            MetadataBuilder(self.groups, rows=1, width=1, device=device),
            PersistentMetadata(self.groups, max_blocks=WIDTH, batch_buckets=BATCH_BUCKETS,
                               token_buckets=TOKEN_BUCKETS, device=device, rows=2,
                               derive_on_device=False),  # the full path (ondevice tests: the other)
        ]
        if emulate:  # the CUDA buffer path on the CPU: two host buffers, a separate device one
            for b in self.builders:
                old = b._buffers
                b._buffers = StepBuffers(old.device, old.nbytes if old.fixed else None,
                                         emulate_device=True)
        self.pool = list(range(1, NUM_BLOCKS))  # block 0 stands for a freed window block
        self.rng.shuffle(self.pool)
        self.live: dict[str, list] = {}  # req_id -> [computed, {gid: [ids]}]
        self.order: list[str] = []
        self.next_id = 0

    def each(self, method: str, *args) -> None:
        for b in self.builders:
            getattr(b, method)(*args)

    def admit(self) -> None:
        rid, self.next_id = f"r{self.next_id}", self.next_id + 1
        computed = self.rng.randrange(0, 20)
        blocks = {g.id: [self.pool.pop() for _ in range(-(-computed // g.block_size))]
                  for g in self.groups}
        self.each("add", rid, blocks)
        self.live[rid] = [computed, blocks]
        self.order.append(rid)

    def grow(self, rid: str, new: int, batched: dict | None = None) -> None:
        """Append what ``new`` more tokens need; single blocks go to ``batched`` (group ->
        [(request, block)]) for one ``append_each`` per group when it is given."""
        computed, blocks = self.live[rid]
        extra = {}
        for g in self.groups:
            need = -(-max(0, computed + new - g.position_offset) // g.block_size)
            add = [self.pool.pop() for _ in range(max(0, need - len(blocks[g.id])))]
            if add:
                blocks[g.id] += add
                if batched is not None and len(add) == 1:
                    batched.setdefault(g.id, []).append((rid, add[0]))
                else:
                    extra[g.id] = add
        if extra:
            self.each("append_blocks", rid, extra)

    def settle(self, rid: str, new: int, drafts: int) -> None:
        """Advance by the accepted tokens; rejected drafts give back their lookahead blocks."""
        rejected = self.rng.randint(0, drafts)
        self.live[rid][0] += new - rejected
        computed, blocks = self.live[rid]
        if rejected:
            cut = {}
            for g in self.groups:
                keep = -(-max(0, computed - g.position_offset) // g.block_size)
                if len(blocks[g.id]) > keep:
                    blocks[g.id] = blocks[g.id][:keep]
                    cut[g.id] = list(blocks[g.id])
            if cut:
                self.each("set_blocks", rid, cut)

    def schedule(self, kind_of, batched: dict | None = None) -> list[ScheduledRequest]:
        """Grow every request, in batch order, by its next step (``kind_of(rid)``: "decode",
        "draft" or "prefill"; page openings batched as in :meth:`grow`, then one
        ``append_each`` per group) and return the step's ScheduledRequests."""
        plan = []
        for rid in self.order:
            kind = kind_of(rid)
            drafts = self.rng.randint(1, 3) if kind == "draft" else 0
            new = 1 + drafts if kind != "prefill" else self.rng.randint(2, 6)
            self.grow(rid, new, batched)
            plan.append((rid, new, drafts))
        for gid, pairs in (batched or {}).items():
            self.each("append_each", [r for r, _ in pairs], {gid: [b for _, b in pairs]})
        return [ScheduledRequest(rid, self.live[rid][0], new,
                                 {g: list(b) for g, b in self.live[rid][1].items()}, drafts)
                for rid, new, drafts in plan]

    def padded(self, sched: list[ScheduledRequest], device="cpu"):
        """build_metadata of the step padded as the test PersistentMetadata pads it."""
        tokens = sum(r.num_new_tokens for r in sched)
        return build_metadata(sched, self.groups, pad_batch_to=bucket(len(sched), BATCH_BUCKETS),
                              pad_tokens_to=bucket(tokens, TOKEN_BUCKETS), max_blocks=WIDTH,
                              device=device)

    def window_free(self, rid: str) -> None:
        blocks = self.live[rid][1][2]
        out = self.rng.randint(0, max(0, len(blocks) - 2))
        blocks[:out] = [0] * out
        self.each("set_blocks", rid, {2: list(blocks)})


def bucket(n: int, buckets: list[int]) -> int:
    return buckets[bisect.bisect_left(buckets, n)]


def count_carries(monkeypatch, always: bool) -> dict[str, int]:
    """Counts steps whose page list was carried over and page ids it inserted; ``always``
    drops the shipped thresholds so that tiny test batches carry whenever they can."""
    if always:
        monkeypatch.setattr(incremental, "_CARRY_PAGES_PER_INSERT", 0)
        monkeypatch.setattr(incremental, "_CARRY_MIN_PAGES", 0)
    calls = {"carried": 0, "inserted": 0}
    real = incremental._carry_pages

    def counted(state, edits, pages, *args):
        done = real(state, edits, pages, *args)
        calls["carried"] += done
        calls["inserted"] += done and int((pages != state[1]).sum())
        return done
    monkeypatch.setattr(incremental, "_carry_pages", counted)
    return calls


@pytest.fixture(params=["plain", "carry", "emulated"])
def mode(request, device, monkeypatch):
    """plain: as shipped; carry: page lists carried over whenever they can be (the shipped
    threshold leaves tiny batches on the gather); emulated: carry, on the CUDA buffer path
    emulated on a CPU device (a CUDA test device runs the real one)."""
    if request.param == "emulated" and torch.device(device).type != "cpu":
        pytest.skip("the real device path runs in the plain and carry modes")
    return request.param, count_carries(monkeypatch, always=request.param != "plain")


# (fixtures are per test function, not per example: safe to share across examples)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(0, 2**32 - 1))
def test_fast_path_equals_build_metadata_over_decode_runs(device, mode, seed):
    run = Run(seed, device, emulate=mode[0] == "emulated")
    rng = run.rng
    for _ in range(rng.randint(1, 6)):
        run.admit()
    addresses: dict[tuple[int, int], dict] = {}
    for _ in range(14):
        event = rng.random()
        if event < 0.08 and len(run.order) < 12:
            run.admit()
        elif event < 0.14 and len(run.order) > 1:
            rid = run.order.pop(rng.randrange(len(run.order)))
            run.each("remove", rid)
            del run.live[rid]
        elif event < 0.2:
            rng.shuffle(run.order)
        elif event < 0.26:
            run.window_free(rng.choice(run.order))
        pure_decode = rng.random() < 0.6
        batched: dict | None = {} if rng.random() < 0.5 else None
        sched = run.schedule(
            lambda _, pure=pure_decode: "decode" if pure else rng.choice(
                ["decode", "decode", "draft", "prefill"]), batched)
        args = ([r.req_id for r in sched], np.array([r.num_computed_tokens for r in sched]),
                np.array([r.num_new_tokens for r in sched], dtype=np.int64),
                [r.num_draft_tokens for r in sched])
        checked = rng.random() < 0.2
        plain, persistent = run.builders
        assert_same(plain.step(*args, checked=checked), build_metadata(sched, run.groups,
                                                                        device=device))
        tokens = sum(r.num_new_tokens for r in sched)
        batch_b, token_b = bucket(len(sched), BATCH_BUCKETS), bucket(tokens, TOKEN_BUCKETS)
        got = persistent.step(*args, checked=checked)
        assert_same(got, run.padded(sched, device))
        # a bucket's arrays never move (what a captured CUDA graph relies on)
        # (an empty tensor reports address 0: nothing is read through it)
        ptrs = {(gid, name): getattr(m, name).data_ptr() for gid, m in got.items()
                for name in ("block_table", "slot_mapping", "seq_lens", "paged_kv_indices")
                if getattr(m, name).numel()}
        seen = addresses.setdefault((batch_b, token_b), ptrs)
        assert all(seen[key] == ptr for key, ptr in ptrs.items() if key in seen)
        seen.update(ptrs)
        for r in sched:
            run.settle(r.req_id, r.num_new_tokens, r.num_draft_tokens)


def test_steps_reuse_the_buffers_and_decode_steps_need_no_per_token_arrays():
    group = make_group(0, 4, num_blocks=100)
    b = MetadataBuilder([group], rows=4, width=4)
    b.add("a", {0: [5, 6]})
    b.add("b", {0: [7]})
    first = b.step(["a", "b"], [5, 2], [1, 1])[0]
    assert first.slot_mapping.tolist() == [25, 30]  # a: position 5 -> block 6, offset 1
    assert first.query_len_bounds == (1, 1) and first.max_seq_len == 6
    b.append_blocks("b", {0: [8]})
    second = b.step(["a", "b"], [6, 3], [1, 1])[0]
    assert second.slot_mapping.tolist() == [26, 31]
    assert second.paged_kv_indices.tolist() == [5, 6, 7]
    # the same shape: the same memory, so the first step's tensors now read the second's
    assert first.slot_mapping.data_ptr() == second.slot_mapping.data_ptr()
    assert first.slot_mapping.tolist() == [26, 31]


def test_persistent_refuses_wider_or_larger_steps():
    group = make_group(0, 2, num_blocks=50)
    pm = PersistentMetadata([group], max_blocks=2, batch_buckets=[2], token_buckets=[4],
                            device="cpu")
    pm.add("a", {0: [1, 2, 3]})
    with pytest.raises(InvalidArgumentError, match="max_blocks=2 but a request reads 3"):
        pm.step(["a"], [4], [1])
    with pytest.raises(InvalidArgumentError, match="5 tokens exceed the largest bucket 4"):
        pm.step(["a"], [0], [5])
    meta = pm.step(["a"], [2], [2])[0]  # 3 blocks held, 2 read: the table keeps 2 columns
    assert meta.block_table.tolist() == [[1, 2], [0, 0]]
    assert meta.slot_mapping.tolist() == [4, 5, -1, -1]


def test_wide_fixed_table_reads_only_the_used_columns():
    group = make_group(0, 2, num_blocks=1000)
    pm = PersistentMetadata([group], max_blocks=300, batch_buckets=[4], token_buckets=[8], device="cpu")
    rng = random.Random(3)
    ids = rng.sample(range(1000), 12)
    reqs = [ScheduledRequest("a", 9, 1, {0: ids[:5]}), ScheduledRequest("b", 2, 1, {0: ids[5:7]}),
            ScheduledRequest("c", 0, 3, {0: ids[7:12]})]
    got = pm.step_requests(reqs)
    assert_same(got, build_metadata(reqs, [group], pad_batch_to=4, pad_tokens_to=8, max_blocks=300))
    assert got[0].paged_kv_indices.tolist() == ids[:5] + ids[5:7] + ids[7:9]


def test_append_each_equals_append_blocks_and_refuses_bad_input():
    gs = [make_group(0, 2, num_blocks=100), make_group(1, 4, num_blocks=100)]
    one, many = MetadataBuilder(gs, rows=1, width=1), MetadataBuilder(gs, rows=1, width=1)
    for b in (one, many):
        b.add("a", {0: [1, 2], 1: [3]})
        b.add("b", {0: [4], 1: [14]})
        b.add("c", {0: [5], 1: [6]})
    one.append_blocks("c", {0: [7], 1: [8]})
    one.append_blocks("a", {0: [9], 1: [10]})
    many.append_each(["c", "a"], {0: [7, 9], 1: np.array([8, 10])})
    for rid in ("a", "b", "c"):
        for gid in (0, 1):
            assert many.blocks(rid, gid) == one.blocks(rid, gid)
    assert many.blocks("a", 0) == (1, 2, 9) and many.blocks("c", 1) == (6, 8)
    assert_same(many.step(["a", "b", "c"], [4, 1, 2], [1, 1, 1]),
                one.step(["a", "b", "c"], [4, 1, 2], [1, 1, 1]))
    with pytest.raises(InvalidArgumentError, match="named twice"):
        many.append_each(["a", "a"], {0: [11, 12]})
    with pytest.raises(InvalidArgumentError, match="2 block ids for 1 requests"):
        many.append_each(["a"], {0: [11, 12]})
    with pytest.raises(MetadataError, match="block id 100"):
        many.append_each(["a", "b"], {1: [11, 12], 0: [13, 100]})
    assert many.blocks("a", 1) == (3, 10)  # a refused call changes no group
    for bad in ([13, -1], np.array([13, -1])):  # (a list checked in Python, an array not)
        with pytest.raises(MetadataError, match="request 'b' was given block id -1"):
            many.append_each(["a", "b"], {0: bad})
    with pytest.raises(InvalidArgumentError, match="'zz' is not in the builder"):
        many.append_each(["zz"], {0: [11]})


@pytest.mark.parametrize("ids", [["a", 1], [None, 1], [1.5, 2], [1.5] * 12, [[1, 2], 3],
                                 [-2**70, 1], np.array([1.0, 2.0])])
def test_block_ids_that_are_not_integers_are_refused(ids):
    """A string, None, float or unconvertible id: MetadataError naming the request from
    every entry point (was TypeError / ValueError, or a float truncated to a block id),
    and a refused call changes nothing."""
    g = make_group(0, 2, num_blocks=100)
    b = MetadataBuilder([g], rows=2, width=2)
    b.add("r", {0: [7]})
    calls = [lambda: b.add("s", {0: ids}), lambda: b.append_blocks("r", {0: ids}),
             lambda: b.set_blocks("r", {0: ids})]
    if not isinstance(ids[0], list):  # (a nested list is a count mismatch there)
        calls.append(lambda: b.append_each(["r"], {0: ids[:1]}))
    for call in calls:
        with pytest.raises(MetadataError, match="request"):
            call()
        assert b.blocks("r", 0) == (7,) and "s" not in b
    floats = isinstance(ids[0], float) or isinstance(ids, np.ndarray)
    if not floats:  # (the stateless builder truncates floats; its checked mode refuses them)
        with pytest.raises(MetadataError, match="not an integer"):
            build_metadata([ScheduledRequest("r", 0, 3, {0: ids})], [g])


@pytest.mark.parametrize("n", [3, 70])  # a list up to _SMALL_APPEND ids checked in Python
def test_append_each_from_a_list_of_any_length(n):
    """Short lists of block ids are checked and written without numpy's conversion, long
    ones with it: the same rows, and the same refusal naming the first bad entry."""
    gs = [make_group(0, 2, num_blocks=1000)]
    one, many = MetadataBuilder(gs, rows=1, width=1), MetadataBuilder(gs, rows=1, width=1)
    rids = [f"r{i}" for i in range(n)]
    for b in (one, many):
        for i, rid in enumerate(rids):
            b.add(rid, {0: [i]})
    bad = [100 + i for i in range(n)]
    bad[n // 2], bad[-1] = 1000, -3
    with pytest.raises(MetadataError, match=f"request 'r{n // 2}' was given block id 1000"):
        many.append_each(rids, {0: bad})
    many.append_each(rids[::-1], {0: [100 + i for i in range(n)][::-1]})
    for i, rid in enumerate(rids):
        one.append_blocks(rid, {0: [100 + i]})
        assert many.blocks(rid, 0) == one.blocks(rid, 0) == (i, 100 + i)


def test_refilled_buffers_rewrite_what_changes_with_rows_tokens_or_kind():
    """A step skips rewriting padding rows and decode query starts when its host buffer was
    last filled for the same shape, row count, token count and kind (StepBuffers.refill);
    a step that changes any of them, e.g. 3 token rows that are not 3 decodes, rewrites
    them."""
    gs = [make_group(0, 2, num_blocks=100), make_group(1, 4, offset=1, num_blocks=100)]
    pm = PersistentMetadata(gs, max_blocks=4, batch_buckets=[4], token_buckets=[4], device="cpu")
    blocks = {"a": {0: [1, 2, 3], 1: [11, 12]}, "b": {0: [4, 5, 6], 1: [13, 14]},
              "c": {0: [7, 8, 9], 1: [15, 16]}}
    for rid, ids in blocks.items():
        pm.add(rid, ids)
    abc = ["a", "b", "c"]
    steps = [
        (abc, [3, 2, 1], [1, 1, 1]),
        (abc, [4, 3, 2], [1, 1, 1]),  # the same key: refilled
        (abc, [2, 2, 1], [2, 0, 1]),  # 3 token rows, not a decode step
        (["a", "b"], [2, 2], [2, 1]),  # 3 token rows again, one request fewer
        (abc, [2, 2, 1], [2, 0, 1]),
        (abc, [1, 2, 1], [2, 0, 0]),  # the same requests, one token row fewer
        (abc, [2, 2, 1], [2, 0, 1]),  # then a decode step of as many rows and tokens
        (abc, [3, 2, 1], [1, 1, 1]),
        (["a", "b"], [3, 2], [1, 1]),  # one row fewer: more padding
        (["c", "a", "b"], [1, 3, 2], [1, 1, 1]),
        (["c", "a", "b"], [2, 4, 3], [1, 1, 1]),
    ]
    for ids, computed, new in steps:
        got = pm.step(ids, computed, new)
        reqs = [ScheduledRequest(r, c, q, blocks[r])
                for r, c, q in zip(ids, computed, new, strict=True)]
        assert_same(got, build_metadata(reqs, gs, pad_batch_to=4, pad_tokens_to=4, max_blocks=4))


@pytest.mark.parametrize("emulate", [False, True])
def test_carried_page_lists_equal_build_metadata_in_steady_decode(monkeypatch, emulate):
    """Many decode steps of one unchanged batch (the case the carried page list is for),
    with page openings, a window free and a rollback (table edits: no carry) on the way; the
    insertion path must run, and every step equals build_metadata."""
    calls = count_carries(monkeypatch, always=True)
    run = Run(7, emulate=emulate)
    for _ in range(10):
        run.admit()
    for step in range(40):
        if step == 15:
            run.window_free(run.order[3])
        sched = run.schedule(lambda _: "decode", {} if step % 2 else None)
        args = (run.order, [r.num_computed_tokens for r in sched], [1] * len(sched))
        plain, persistent = run.builders
        assert_same(plain.step(*args), build_metadata(sched, run.groups))
        assert_same(persistent.step(*args), run.padded(sched))
        for r in sched:
            run.settle(r.req_id, 1, 0)
        if step == 25:  # a rollback: the row's entries change, the next step gathers
            rid = run.order[5]
            run.live[rid][0] -= 3
            computed, blocks = run.live[rid]
            cut = {g.id: blocks[g.id][: -(-max(0, computed - g.position_offset) // g.block_size)]
                   for g in run.groups}
            for g in run.groups:
                blocks[g.id] = cut[g.id]
            run.each("set_blocks", rid, cut)
    assert calls["carried"] > 100 and calls["inserted"] > 50, calls


def test_copy_bytes_cover_the_used_pages_in_granules():
    """copy_bytes: what the step's one copy covers (on CPU: what a CUDA step would copy), up
    to the last group's used pages, rounded up to the 4 KiB granule within the buffer."""
    group = make_group(0, 4, num_blocks=4000)
    pm = PersistentMetadata([group], max_blocks=300, batch_buckets=[64], device="cpu")
    assert pm.copy_bytes == 0
    for i in range(40):
        pm.add(i, {0: list(range(i * 90, i * 90 + 90))})
    meta = pm.step(list(range(40)), [300] * 40, [1] * 40)[0]
    pages_end = (meta.paged_kv_indices.data_ptr() - meta.slot_mapping.data_ptr()
                 + 4 * meta.paged_kv_indices.numel())  # slots are the buffer's first array
    assert meta.paged_kv_indices.numel() == 40 * 76
    assert pm.copy_bytes == -(-pages_end // 4096) * 4096 <= pm.nbytes
