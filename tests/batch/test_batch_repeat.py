"""A decode step of the previous step's rows and shape (new counts given as
``decode_counts``, no drafts, unchecked, groups without position offset): the builders'
``_repeat`` path, against build_metadata step by step over random runs whose steady stretches
are broken by admissions, removals, reorders, window frees (table edits), draft and prefill
steps and checked steps; its errors are the full path's, and nothing it skips leaves a later
step stale."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from test_batch import make_group  # noqa: E402
from test_batch_fastpath import (  # noqa: E402
    BATCH_BUCKETS,
    NUM_BLOCKS,
    TOKEN_BUCKETS,
    WIDTH,
    Run,
    bucket,
    count_carries,
)
from test_batch_incremental import assert_same  # noqa: E402
from test_batch_ondevice import derived_builder  # noqa: E402

from pagedkv.batch import ScheduledRequest, build_metadata  # noqa: E402
from pagedkv.batch.incremental import MetadataBuilder, decode_counts  # noqa: E402
from pagedkv.batch.persistent import PersistentMetadata  # noqa: E402
from pagedkv.errors import InvalidArgumentError, MetadataError  # noqa: E402
from pagedkv.kvspec import SlidingWindow  # noqa: E402


def plain_groups():
    """No position offset; block sizes 4, 3 (not a power of two: divmod) and 16; one a
    sliding window (its freed blocks are table edits)."""
    return [make_group(0, 4, num_blocks=NUM_BLOCKS),
            make_group(1, 3, num_blocks=NUM_BLOCKS, retention=SlidingWindow(5)),
            make_group(2, 16, num_blocks=NUM_BLOCKS)]


@pytest.fixture(params=["plain", "carry", "emulated"])
def mode(request, device, monkeypatch):
    """As test_batch_fastpath's: page lists gathered (the shipped thresholds, at these sizes),
    carried whenever they can be, and carried on the CUDA buffer path emulated on the CPU."""
    if request.param == "emulated" and torch.device(device).type != "cpu":
        pytest.skip("the real device path runs in the plain and carry modes")
    return request.param, count_carries(monkeypatch, always=request.param != "plain")


def count_repeats(builder) -> list[bool]:
    """Per step that tried it: whether the builder's _repeat made the step."""
    seen: list[bool] = []
    real = builder._repeat

    def counted(*args):
        out = real(*args)
        seen.append(out is not None)
        return out
    builder._repeat = counted
    return seen


# (fixtures are per test function, not per example: safe to share across examples)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(0, 2**32 - 1))
def test_repeated_decode_steps_equal_build_metadata(device, mode, seed):
    run = Run(seed, device, emulate=mode[0] == "emulated", make_groups=plain_groups)
    rng = run.rng
    for _ in range(rng.randint(1, 10)):
        run.admit()
    plain, persistent = run.builders  # the plain one padded and as wide as the other
    repeats = [count_repeats(b) for b in run.builders]
    steady = 4  # the last steps: decode steps of the same rows, nothing else
    for step in range(24):
        event = rng.random() if step < 24 - steady else 1.0
        if event < 0.05 and len(run.order) < 12:
            run.admit()
        elif event < 0.1 and len(run.order) > 1:
            rid = run.order.pop(rng.randrange(len(run.order)))
            run.each("remove", rid)
            del run.live[rid]
        elif event < 0.13:
            rng.shuffle(run.order)
        elif event < 0.2:
            run.window_free(rng.choice(run.order))
        mixed = event < 0.3
        batched: dict | None = {} if rng.random() < 0.7 else None
        sched = run.schedule(lambda _, mixed=mixed: rng.choice(
            ["decode", "decode", "draft", "prefill"]) if mixed else "decode", batched)
        n = len(sched)
        ids = [r.req_id for r in sched]
        computed = np.array([r.num_computed_tokens for r in sched], dtype=np.int64)
        if all(r.num_new_tokens == 1 and not r.num_draft_tokens for r in sched):
            new, drafts = decode_counts(n), None
        else:
            new = np.array([r.num_new_tokens for r in sched], dtype=np.int64)
            drafts = [r.num_draft_tokens for r in sched]
        checked = step < 24 - steady and rng.random() < 0.1
        want = run.padded(sched, device)
        tokens = sum(r.num_new_tokens for r in sched)
        assert_same(plain.step(ids, computed, new, drafts, checked=checked, max_blocks=WIDTH,
                               pad_batch_to=bucket(n, BATCH_BUCKETS),
                               pad_tokens_to=bucket(tokens, TOKEN_BUCKETS)), want)
        assert_same(persistent.step(ids, computed, new, drafts, checked=checked), want)
        for r in sched:
            run.settle(r.req_id, r.num_new_tokens, r.num_draft_tokens)
    # the steady steps took the path in both builders (the first after a change, and on two
    # host buffers in turn the second too, refill them through the full path)
    assert all(sum(seen[-steady:]) >= steady - 2 for seen in repeats)


@pytest.mark.parametrize("emulate", [False, True], ids=["in-place", "emulated"])
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(0, 2**32 - 1))
def test_derived_decode_steps_from_decode_counts_equal_build_metadata(device, emulate, seed):
    """The same runs through a builder deriving steady decode steps (the numpy reference on
    the CPU; test_batch_ondevice runs the kernels), given decode_counts: its negative-count
    check is the page check's, as _repeat's."""
    if torch.device(device).type != "cpu":
        pytest.skip("the numpy reference derives on the CPU")
    run = Run(seed, device, make_groups=plain_groups)
    pm = derived_builder(run, device, "numpy", emulate)
    rng = run.rng
    for _ in range(rng.randint(1, 10)):
        run.admit()
    for step in range(16):
        event = rng.random() if step < 12 else 1.0
        if event < 0.05 and len(run.order) < 12:
            run.admit()
        elif event < 0.1:
            run.window_free(rng.choice(run.order))
        mixed = event < 0.25
        sched = run.schedule(lambda _, mixed=mixed: rng.choice(
            ["decode", "draft", "prefill"]) if mixed else "decode", {})
        n = len(sched)
        decode = all(r.num_new_tokens == 1 and not r.num_draft_tokens for r in sched)
        new = decode_counts(n) if decode else [r.num_new_tokens for r in sched]
        got = pm.step(run.order, np.array([r.num_computed_tokens for r in sched]), new,
                      None if decode else [r.num_draft_tokens for r in sched])
        assert_same(got, run.padded(sched, device))
        for r in sched:
            run.settle(r.req_id, r.num_new_tokens, r.num_draft_tokens)
    assert pm.derived_steps >= 2  # (at least the steady steps at the end but their first)


def built(groups, blocks, computed, **kw):
    """build_metadata of requests "a", "b" with these blocks (group 0) and counts."""
    reqs = [ScheduledRequest(rid, c, 1, {0: b}) for rid, c, b in zip("ab", computed, blocks)]
    return build_metadata(reqs, groups, **kw)


@pytest.mark.parametrize("derive", [False, True], ids=["host", "derived"])
@pytest.mark.parametrize("block_size", [4, 3])
def test_repeat_raises_what_the_full_path_raises_and_stays_consistent(block_size, derive):
    """A row lacking the block its new token needs and a negative computed count, in a decode
    step of the last step's rows: the full path's errors (the negative count is caught by the
    page check, not looked for beforehand, by _repeat and by the derived step alike); the
    builder's later steps are still right."""
    groups = [make_group(0, block_size, num_blocks=50)]
    pm = PersistentMetadata(groups, max_blocks=4, batch_buckets=[2], token_buckets=[2],
                            device="cpu", derive_on_device=derive, derive_kernel="numpy")
    seen = count_repeats(pm)
    pm.add("a", {0: [1, 2]})
    pm.add("b", {0: [3]})
    for c in (block_size, block_size + 1):  # the second repeats the first
        assert_same(pm.step(["a", "b"], [c, 0], decode_counts(2)),
                    built(groups, [[1, 2], [3]], [c, 0], pad_batch_to=2, pad_tokens_to=2,
                          max_blocks=4))
    assert (seen, pm.derived_steps) == (([False], 1) if derive else ([False, True], 0))
    # (each right after a step of the same rows: the first reaches the fast path's check)
    with pytest.raises(InvalidArgumentError, match="num_computed_tokens must be >= 0, got -1"):
        pm.step(["a", "b"], [block_size, -1], decode_counts(2))
    pm.step(["a", "b"], [block_size + 1, 0], decode_counts(2))
    with pytest.raises(MetadataError, match=r"request 'a' \(row 0\) needs 3 blocks"):
        pm.step(["a", "b"], [2 * block_size, 1], decode_counts(2))
    # the full path raised both; the step between them was _repeat's on the host (the
    # deriving builder's derived step left no host page lists to carry, and after a failed
    # step it takes the full path)
    assert seen[-3:] == [False, not derive, False] and pm.derived_steps == derive
    pm.append_each(["a"], {0: [4]})
    for c in (2 * block_size, 2 * block_size + 1):
        assert_same(pm.step(["a", "b"], [c, 1], decode_counts(2)),
                    built(groups, [[1, 2, 4], [3]], [c, 1], pad_batch_to=2, pad_tokens_to=2,
                          max_blocks=4))


def test_decode_counts_are_shared_read_only_ones_and_equal_any_other_ones():
    ones = decode_counts(3)
    assert ones is decode_counts(3) and ones.dtype == np.int64 and ones.tolist() == [1, 1, 1]
    with pytest.raises(ValueError):
        ones[0] = 2
    groups = [make_group(0, 2, num_blocks=20)]
    a, b = (MetadataBuilder(groups) for _ in range(2))
    for builder in (a, b):
        for rid, blocks in zip("xyz", ([1], [2, 3], [4, 5])):
            builder.add(rid, {0: blocks})
    assert_same(a.step("xyz", [1, 2, 3], decode_counts(3)), b.step("xyz", [1, 2, 3], np.ones(3)))


def test_append_each_of_a_short_list_widens_the_table():
    """The row-by-row write of a short list past the table's width (memoryviews over the
    table are renewed after it widens)."""
    group = make_group(0, 2, num_blocks=100)
    b = MetadataBuilder([group], rows=2, width=2)
    b.add("a", {0: [1, 2]})
    b.add("b", {0: [3]})
    b.append_each(["b", "a"], {0: [5, 6]})
    b.append_each(["a", "b"], {0: [7, 8]})
    assert b.blocks("a", 0) == (1, 2, 6, 7) and b.blocks("b", 0) == (3, 5, 8)
    assert b._tables[0].ids.shape[1] >= 4
