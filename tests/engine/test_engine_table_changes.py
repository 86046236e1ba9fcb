"""The persistent metadata's steady steps read through the block manager's list of changed
requests (``KVCacheManager.watch_tables``; engine/stepmeta.py): a row the list leaves out is
only read where the step's allocation may have grown it, so a change the manager does not
list would leave a stale row. Here the engine's own scheduler and block manager run
random steps without the model (the metadata does not depend on the cache's contents):
admissions, prefix hits, preemption, a sliding-window model, speculative steps whose
drafts are partly or wholly rejected (lookahead blocks given back), aborts, and requests
finishing and coming back under the same id, with and without the runner's ``release``;
every step must equal ``build_metadata`` of the manager's tables at that moment, and
steps with the same requests in the same order must have taken the tracked path. Then
each kind of change made through the manager's own calls, one at a time, right before a
step of the same requests in the same order (where the list is the only thing that can
tell)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from engine_check import assert_built_as_stateless, budget_for, options  # noqa: E402

from pagedkv.engine import Engine, SamplingParams  # noqa: E402
from pagedkv.engine.scheduler import Chunk, Chunks  # noqa: E402
from pagedkv.engine.tiny import tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def models():
    return {name: tiny_model(name) for name in ("llama-3-8b", "gemma-3-27b")}


def assert_as_stateless(runner, chunks, extra, got) -> None:
    """``got`` equals build_metadata of the manager's tables now, padded alike."""
    assert_built_as_stateless(got, [runner.scheduled(c, k) for c, k in zip(chunks, extra)],
                              runner.attn_groups)


def random_run(hf, seed: int, *, spec: int = 0, check: bool, release: bool,
               steps: int = 120, room: int = 120, **kw) -> dict:
    """Random engine steps without the model; returns the sync's counters and how many
    steps repeated the previous step's requests in the same order."""
    rng = random.Random(seed)
    # room for about ``room`` tokens in every layer: four running preempt
    opts = dict(max_running=4, max_batched_tokens=24, max_model_len=48,
                kv_cache_bytes=budget_for(hf, room), spec_tokens=spec, debug_nan=False)
    opts.update(kw)
    eng = Engine(hf, options(**opts))
    sched, runner, mgr = eng.scheduler, eng.runner, eng.manager
    sync = runner.sync
    sync.check = check
    vocab = eng.vocab_size
    stem = [rng.randrange(vocab) for _ in range(20)]  # shared prefixes: prefix hits
    ids = [f"r{i}" for i in range(6)]  # few ids: finished ones come back under the same id
    last = None
    same = 0
    for _ in range(steps):
        live = set(mgr.requests)
        for rid in ids:
            if rid not in live and rng.random() < 0.3:
                n = rng.randrange(1, 16)
                prompt = (stem[:rng.randrange(4, 20)] if rng.random() < 0.5 else [])
                prompt = prompt + [rng.randrange(vocab) for _ in range(n)]
                eng.add_request(prompt, SamplingParams(
                    max_new_tokens=rng.randrange(1, 48 - len(prompt)), ignore_eos=True), rid=rid)
        running = [r.rid for r in sched.running]
        if running and rng.random() < 0.03:
            gone = eng.abort(rng.choice(running))
            assert gone
        plan = sched.schedule()
        if not plan.chunks:
            continue
        mgr.drain_copy_ops()
        extra = [rng.randint(0, min(c.num_lookahead, c.request.remaining - 1))
                 if c.num_lookahead and c.samples else 0 for c in plan.chunks]
        meta, _ = runner.step_metadata(plan.chunks, extra)
        assert_as_stateless(runner, plan.chunks, extra, meta)
        now = tuple(c.request.rid for c in plan.chunks)
        same += now == last
        last = now
        sampled = {c.request.rid: [rng.randrange(vocab) for _ in range(1 + rng.randint(0, k))]
                   for c, k in zip(plan.chunks, extra) if c.samples}
        done = sched.update(plan, sampled)
        if release:
            runner.release(r.rid for r in done)
    return {"same": same, "tracked": sync.tracked, "listed": sync.listed,
            "preemptions": mgr.preemptions, "hits": mgr.prefix_hits,
            "rewritten": sync.rewritten, "appended": sync.appended}


ROOM = 60  # Gemma 3's window layers hold 8 tokens: less room for as many preemptions
SCENARIOS = {
    "llama": dict(name="llama-3-8b"),
    "llama-no-caching": dict(name="llama-3-8b", enable_prefix_caching=False),
    "window": dict(name="gemma-3-27b", room=ROOM),
    "speculative": dict(name="llama-3-8b", spec=3),
    "speculative-window": dict(name="gemma-3-27b", spec=2, room=ROOM),
}


@pytest.mark.parametrize("release", [True, False], ids=["release", "no-release"])
@pytest.mark.parametrize("check", [True, False], ids=["checked", "unchecked"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_random_steps_equal_build_metadata(models, scenario, check, release):
    """Every step of random runs equals build_metadata; unchecked, only that comparison
    would see a stale row (checked, TableSync compares every row with the manager's
    tables itself and raises first)."""
    kw = dict(SCENARIOS[scenario])
    hf = models[kw.pop("name")]
    total = dict.fromkeys(("same", "tracked", "listed", "preemptions", "hits"), 0)
    for seed in range(4):
        out = random_run(hf, seed, check=check, release=release, **kw)
        # a repeated batch takes the tracked path unless the runner dropped a row since
        # (a request finished and its id came back in the same place)
        assert out["tracked"] <= out["same"] and (release or out["tracked"] == out["same"])
        for k in total:
            total[k] += out[k]
    # the runs did what they are for: tracked steps, rows the list sent through the
    # per-request comparison, preemption and (with caching) prefix hits
    assert total["tracked"] > 50 and total["preemptions"] > 0
    # rows the list named on tracked steps: windows moving, rejected drafts (random
    # runs do not bring a finished or preempted request back in the place it left, in
    # the same batch: the tests below do)
    assert total["listed"] > 0 or ("spec" not in scenario and "window" not in scenario)
    assert total["hits"] > 0 or kw.get("enable_prefix_caching") is False


def wide_run(hf, seed: int, *, spec: int = 0, room: int, steps: int = 70) -> dict:
    """Random engine steps of up to 16 running requests out of 24 (a cache of about
    ``room`` tokens per layer: preemption), every step compared with build_metadata; the
    builder's decode steps of the last step's rows (``_repeat``) counted."""
    rng = random.Random(seed)
    eng = Engine(hf, options(max_running=16, max_batched_tokens=64, max_model_len=48,
                             kv_cache_bytes=budget_for(hf, room), spec_tokens=spec,
                             debug_nan=False))
    sched, runner, mgr = eng.scheduler, eng.runner, eng.manager
    runner.sync.check = False  # the comparison with build_metadata must see a stale row
    builder = runner.sync.builder
    repeats: list[bool] = []
    real = builder._repeat

    def counted(*args):
        out = real(*args)
        repeats.append(out is not None)
        return out
    builder._repeat = counted
    vocab = eng.vocab_size
    for _ in range(24):
        n = rng.randrange(1, 24)
        eng.add_request([rng.randrange(vocab) for _ in range(n)], SamplingParams(
            max_new_tokens=rng.randrange(1, 48 - n), ignore_eos=True))
    for _ in range(steps):
        plan = sched.schedule()
        if not plan.chunks:
            break
        mgr.drain_copy_ops()
        # drafts on about half the speculative steps (a step without any may repeat)
        draft = rng.random() < 0.5
        extra = [rng.randint(0, min(c.num_lookahead, c.request.remaining - 1))
                 if draft and c.num_lookahead and c.samples else 0 for c in plan.chunks]
        meta, _ = runner.step_metadata(plan.chunks, extra)
        assert_as_stateless(runner, plan.chunks, extra, meta)
        sampled = {c.request.rid: [rng.randrange(vocab) for _ in range(1 + rng.randint(0, k))]
                   for c, k in zip(plan.chunks, extra) if c.samples}
        sched.update(plan, sampled)
    return {"repeats": sum(repeats), "preemptions": mgr.preemptions,
            "tracked": runner.sync.tracked}


@pytest.mark.parametrize("scenario", ["llama", "window", "speculative"])
def test_wider_batches_with_page_lists_carried_equal_build_metadata(models, scenario,
                                                                    monkeypatch):
    """Batches of up to 16 with the builder's page lists carried over whenever they can be
    (its shipped thresholds leave such small lists to the gather): steady decode stretches
    (the builder's ``_repeat``, the tracked path) between admissions, finishes, preemptions,
    window moves and draft steps; every step equals build_metadata."""
    from pagedkv.batch import incremental

    monkeypatch.setattr(incremental, "_CARRY_PAGES_PER_INSERT", 0)
    monkeypatch.setattr(incremental, "_CARRY_MIN_PAGES", 0)
    name, spec, room = {"llama": ("llama-3-8b", 0, 200), "window": ("gemma-3-27b", 0, 120),
                        "speculative": ("llama-3-8b", 2, 200)}[scenario]
    total = dict.fromkeys(("repeats", "preemptions", "tracked"), 0)
    for seed in range(3):
        for k, v in wide_run(models[name], seed, spec=spec, room=room).items():
            total[k] += v
    assert total["repeats"] > 20 and total["tracked"] > 20 and total["preemptions"] > 0, total


# --- each kind of change through the manager's own calls, then a step of the same requests

def by_hand(hf, **kw):
    """(manager, sync, step, prompt) over an engine's manager and runner, the scheduler
    bypassed; ``step(*(rid, computed, new, drafts, lookahead))`` builds a step (the
    checker off: the comparison with build_metadata is what must see a stale row);
    ``columns=True``: the chunks as a scheduler's ``Chunks``."""
    eng = Engine(hf, options(debug_nan=False, max_batched_tokens=32, **kw))
    mgr, runner = eng.manager, eng.runner
    sync = runner.sync
    sync.check = False
    rng = random.Random(5)

    def step(*rows, columns=False):
        chunks = [Chunk(SimpleNamespace(rid=r), c, n, True, look) for r, c, n, _, look in rows]
        if columns:  # as the scheduler hands them over: with their ids and counts
            chunks = Chunks(chunks, *zip(*[(r, c, n) for r, c, n, _, _ in rows]))
        extra = [d for _, _, _, d, _ in rows]
        assert_as_stateless(runner, chunks, extra, sync.build(chunks, extra))

    def prompt(n):
        return [rng.randrange(eng.vocab_size) for _ in range(n)]

    return mgr, sync, step, prompt


def prefill_two(mgr, step, prompt, n: int) -> None:
    """Requests "a" and "b" with ``n``-token prompts, prefilled in one step and committed."""
    for rid in "ab":
        mgr.add_request(rid, prompt(n))
        assert mgr.allocate(rid, n)
    step(("a", 0, n, 0, 0), ("b", 0, n, 0, 0))
    for rid in "ab":
        mgr.commit(rid, n, [1])


def decode(mgr, rid, look=0):
    """One decode step's allocation for ``rid``: (rid, computed, 1, 0, look)."""
    c = mgr.num_computed(rid)
    assert mgr.allocate(rid, 1, look)
    return (rid, c, 1, 0, look)


@pytest.mark.parametrize("caching", [True, False])
def test_freed_and_added_again_under_the_same_id(models, caching):
    """A request freed and added again under its id (no ``drop``), allocated as far as
    its old table reached: only the list tells that its row is another request's."""
    mgr, sync, step, prompt = by_hand(models["llama-3-8b"], enable_prefix_caching=caching)
    mgr.add_request("a", prompt(7))
    assert mgr.allocate("a", 7)
    step(("a", 0, 7, 0, 0))
    mgr.commit("a", 7, [1])
    step(decode(mgr, "a"))
    mgr.free("a")
    mgr.add_request("a", prompt(7))
    assert mgr.allocate("a", 7)
    step(("a", 0, 7, 0, 0))  # the same ids as the last step
    assert sync.tracked == 2 and sync.listed == 1


@pytest.mark.parametrize("caching", [True, False])
def test_preempted_and_allocated_again(models, caching):
    """b preempted and admitted again (a prefix hit with caching, fresh blocks without:
    not those it gave back, which c took) between two steps of (a, b)."""
    mgr, sync, step, prompt = by_hand(models["llama-3-8b"], enable_prefix_caching=caching)
    prefill_two(mgr, step, prompt, 9)
    step(decode(mgr, "a"), decode(mgr, "b"))
    for rid in "ab":
        mgr.commit(rid, 1, [2])
    mgr.preempt("b")
    mgr.add_request("c", prompt(9))  # c takes the blocks b gave back (not in the step)
    assert mgr.allocate("c", 9)
    # (a lookup, even one that finds nothing, makes the allocation adopt a new list,
    # which the manager lists too: without caching, b is allocated without one)
    hit = mgr.find_cached_prefix("b") if caching else 0
    assert (hit > 0) == caching
    assert mgr.allocate("b", 11 - hit)
    step(decode(mgr, "a"), ("b", hit, 11 - hit, 0, 0))
    assert sync.listed >= 1


def test_lookahead_blocks_given_back_and_replaced(models):
    """Rejected drafts: the commit gives a's lookahead block back, b takes it, and a's
    next lookahead gets another at the same column (the same length as sent)."""
    mgr, sync, step, prompt = by_hand(models["llama-3-8b"], spec_tokens=3)
    for rid, n in (("a", 6), ("b", 7)):
        mgr.add_request(rid, prompt(n))
        assert mgr.allocate(rid, n)
    step(("a", 0, 6, 0, 0), ("b", 0, 7, 0, 0))
    mgr.commit("a", 6, [1])
    mgr.commit("b", 7, [1])
    step(decode(mgr, "a", 3), decode(mgr, "b"))  # a: positions 6..9, a block from 8
    before = list(mgr.block_tables("a")[0])
    mgr.commit("a", 1, [2])  # every draft rejected: 7 computed, the block of 8.. goes back
    mgr.commit("b", 1, [2])
    assert len(mgr.block_tables("a")[0]) == len(before) - 1
    b = decode(mgr, "b")  # b: position 8, in a new block: the one a gave back
    a = decode(mgr, "a", 3)
    after = mgr.block_tables("a")[0]
    assert len(after) == len(before) and after[-1] != before[-1]
    step(a, b)
    assert sync.tracked >= 2 and sync.listed >= 1


def test_window_drops_blocks_between_steady_steps(models):
    """Gemma 3's sliding window (8 tokens, blocks of 4): decode steps of the same two
    requests null the blocks that leave the window (``first_live`` moves)."""
    mgr, sync, step, prompt = by_hand(models["gemma-3-27b"])
    prefill_two(mgr, step, prompt, 5)
    moved = 0
    for t in range(14):
        live = [mgr.requests[r].first_live[:] for r in "ab"]
        step(decode(mgr, "a"), decode(mgr, "b"))
        moved += live != [mgr.requests[r].first_live[:] for r in "ab"]
        for rid in "ab":
            mgr.commit(rid, 1, [t])
    assert moved >= 2 and sync.tracked == 14 and sync.listed > 0


def test_changes_the_manager_did_not_list_are_refused(models):
    """Tables edited behind the manager's back (no list entry): checked mode compares
    every row with the manager's tables and names the request; a row shorter than sent
    where the step reads it is refused even unchecked (there is nothing to build on)."""
    from pagedkv.errors import MetadataError

    mgr, sync, step, prompt = by_hand(models["llama-3-8b"])
    prefill_two(mgr, step, prompt, 7)
    step(decode(mgr, "a"), decode(mgr, "b"))  # a, b: 8 tokens, 2 blocks each
    for rid in "ab":
        mgr.commit(rid, 1, [2])
    ta, tb = mgr.requests["a"].tables[0], mgr.requests["b"].tables[0]
    ta[0], tb[0] = tb[0], ta[0]  # by hand: the list does not name them
    sync.check = True
    with pytest.raises(MetadataError, match="request 'a' group .* did not list"):
        step(decode(mgr, "a"), decode(mgr, "b"))
    del ta[-1]  # shorter by hand, and a step reads a at a block it was not allocated
    sync.check = False
    with pytest.raises(MetadataError, match="fewer than the 3 sent"):
        sync.build([Chunk(SimpleNamespace(rid=r), 9, 4, True) for r in "ab"], [0, 0])


def test_every_watcher_gets_every_change(models):
    """Each ``watch_tables`` list (the runner's TableSync holds one already) gets each
    change from its call on, and only the changes: blocks appended list nothing."""
    mgr, sync, step, prompt = by_hand(models["llama-3-8b"])
    mine = mgr.watch_tables()
    mgr.add_request("a", prompt(5))
    assert mgr.allocate("a", 5)  # a first allocation: no lookup, nothing listed
    mgr.commit("a", 5, [1])
    assert mgr.allocate("a", 1, 3)  # a block appended (positions 5..8): nothing listed
    assert mine == [] and sync._log == []
    later = mgr.watch_tables()
    state = mgr.requests["a"]
    mgr.free("a")
    assert mine == [state] and later == [state] and sync._log == [state]


def test_drafts_past_a_lookahead_told_too_small_are_read_anyway(models):
    """A TableSync told no lookahead over a speculative manager: the step's draft rows
    still bound what is read, so their blocks are sent."""
    mgr, sync, step, prompt = by_hand(models["llama-3-8b"], spec_tokens=3)
    sync.lookahead = 0
    mgr.add_request("a", prompt(7))
    assert mgr.allocate("a", 7)
    step(("a", 0, 7, 0, 0))
    mgr.commit("a", 7, [1])
    a = decode(mgr, "a", 3)  # positions 7..10: a block from 8
    step(("a", a[1], 1, 3, 3))
    assert sync.tracked == 1


def test_checked_mode_refuses_ids_or_counts_that_are_not_the_chunks(models):
    """A scheduler's ``Chunks`` hands the build its ids and counts, which it then reads
    instead of the chunks; checked, a step whose columns differ from its chunks is refused
    before anything changes; the same step with matching columns builds as stateless."""
    from pagedkv.errors import MetadataError

    mgr, sync, step, prompt = by_hand(models["llama-3-8b"])
    prefill_two(mgr, step, prompt, 7)
    step(decode(mgr, "a"), decode(mgr, "b"), columns=True)
    for rid in "ab":
        mgr.commit(rid, 1, [2])
    rows = [decode(mgr, "a"), decode(mgr, "b")]
    chunks = [Chunk(SimpleNamespace(rid=r), c, n, True) for r, c, n, _, _ in rows]
    sync.check = True
    computed = [c for _, c, _, _, _ in rows]
    for bad in (Chunks(chunks, "ab", [computed[0], computed[1] + 1], [1, 1]),
                Chunks(chunks, "ba", computed, [1, 1]),
                Chunks(chunks, "ab", computed, [1, 2])):
        with pytest.raises(MetadataError, match="are not its chunks'"):
            sync.build(bad, [0, 0])
    tracked = sync.tracked
    step(*rows, columns=True)
    assert sync.tracked == tracked + 1  # the refused calls changed nothing: still steady
