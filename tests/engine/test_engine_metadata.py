"""The engine's metadata through its persistent builder (the default) against the stateless
``build_metadata`` path: every step's arrays equal ``build_metadata`` of the manager's
tables at that moment (padded to the same buckets: no stale row after admissions,
finishes, preemption, window frees, rejected drafts), and the generated tokens and every
recorded logit row equal the stateless engine's; a steady decode run takes the builder's
fast path and never the stateless one."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from engine_check import assert_built_as_stateless, hf_greedy, options, prompts, run  # noqa: E402

from pagedkv.engine import Engine, SamplingParams  # noqa: E402
from pagedkv.engine.speculative import ScriptedDrafter, SpeculativeEngine  # noqa: E402
from pagedkv.engine.tiny import tiny_model  # noqa: E402
from pagedkv.errors import InvalidArgumentError  # noqa: E402


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama-3-8b")


def check_every_step(engine) -> list[int]:
    """Wrap the runner's persistent build: each step's metadata must equal build_metadata of
    the manager's tables now, padded as the step was. Returns the list of checked steps'
    batch sizes (filled as the engine runs)."""
    runner = engine.runner
    sync = runner.sync
    assert sync is not None
    build = sync.build
    seen: list[int] = []

    def checked(chunks, extra):
        got = build(chunks, extra)
        assert_built_as_stateless(got, [runner.scheduled(c, k) for c, k in zip(chunks, extra)],
                                  runner.attn_groups)
        seen.append(len(chunks))
        return got

    sync.build = checked
    return seen


def same_outputs(a, b) -> None:
    """Tokens and every recorded logit row of two runs, exactly."""
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    for oa, ob in zip(a.outputs, b.outputs):
        rows_a, rows_b = a.logits[oa.rid], b.logits[ob.rid]
        assert [p for p, _ in rows_a] == [p for p, _ in rows_b]
        for (p, x), (_, y) in zip(rows_a, rows_b):
            assert torch.equal(x, y), (oa.rid, p, float((x - y).abs().max()))


def both(hf, ps, new, make=Engine, **kw):
    """(persistent run, stateless run) of the same prompts and options; the persistent one
    checked step by step."""
    eng = make(hf, options(**kw))
    steps = check_every_step(eng)
    persistent = run(hf, ps, options(**kw), new=new, engine=eng)
    stateless = run(hf, ps, options(**kw), new=new,
                    engine=make(hf, options(metadata="stateless", **kw)))
    assert stateless.runner.sync is None and persistent.runner.sync is not None
    assert len(steps) >= persistent.steps  # (a recompute after a rollback checks too)
    return persistent, stateless


@pytest.mark.parametrize("scenario", ["admissions", "preemption", "window", "mla", "hybrid"])
def test_persistent_engine_equals_stateless_step_by_step(llama, scenario):
    """Admissions over many steps (2 running at most, chunked prefill, requests finishing
    at different steps), preemption (a cache too small), a windowed model (blocks freed
    behind its window), MLA, and a recurrent hybrid."""
    hf = {"admissions": llama, "preemption": llama, "window": tiny_model("gemma-3-27b"),
          "mla": tiny_model("deepseek-v3"), "hybrid": tiny_model("qwen3-next-80b")}[scenario]
    lengths = (13, 6, 19, 3, 9)
    kw = dict(max_batched_tokens=8)
    if scenario == "admissions":
        kw.update(max_running=2)
    if scenario == "preemption":
        kw.update(kv_cache_bytes=1 << 14, max_model_len=32)
        lengths = (13, 6, 19)
    if scenario == "window":
        kw.update(max_model_len=64)
    ps = prompts(hf.config.vocab_size, lengths, seed=3)
    a, b = both(hf, ps, new=8 if scenario != "window" else 24, **kw)
    same_outputs(a, b)
    sync = a.runner.sync
    assert sync.added >= len(ps)
    if scenario == "preemption":
        assert a.preemptions > 0 and a.preemptions == b.preemptions
        assert sync.removed >= len(ps) + a.preemptions
    if scenario == "window":
        assert sync.rewritten > 0  # window frees rewrote rows
    assert len(sync.builder) == 0  # every finished request left the builder


@pytest.mark.parametrize("mode", ["partial", "reject"])
def test_speculative_persistent_equals_stateless_and_greedy(llama, mode):
    """Drafts verified through the persistent path (rejected drafts give their lookahead
    blocks back): output equal to plain greedy and to the stateless engine, every step's
    metadata equal to build_metadata."""
    v = llama.config.vocab_size
    ps = prompts(v, (7, 12, 3), seed=11)
    want = [hf_greedy(llama, p, 9) for p in ps]
    if mode == "partial":
        script = {i: [(t + 1) % v if j % 3 == 2 else t for j, t in enumerate(w)]
                  for i, w in enumerate(want)}
    else:
        script = {i: [(t + 1) % v for t in w] for i, w in enumerate(want)}

    def make(hf, opts):
        return SpeculativeEngine(hf, opts, ScriptedDrafter(script))

    a, b = both(llama, ps, 9, make=make, spec_tokens=3, max_batched_tokens=8)
    assert [o.token_ids for o in a.outputs] == want
    same_outputs(a, b)
    assert a.stats.drafted > a.stats.accepted and a.stats.accepted == b.stats.accepted


def test_recurrent_rollback_recompute_equals_stateless():
    """A recurrent target's verify pass, rollback and recompute (a second runner call in
    the step, on a subset of the requests) through the persistent path."""
    hf = tiny_model("qwen3-next-80b")
    v = hf.config.vocab_size
    ps = prompts(v, (6, 11), seed=14)
    want = [hf_greedy(hf, p, 9) for p in ps]
    script = {i: [(t + 1) % v if j % 3 == 2 else t for j, t in enumerate(w)]
              for i, w in enumerate(want)}

    def make(hf, opts):
        return SpeculativeEngine(hf, opts, ScriptedDrafter(script))

    a, b = both(hf, ps, 9, make=make, spec_tokens=3, recurrent_checkpoint_every=1)
    assert [o.token_ids for o in a.outputs] == want
    same_outputs(a, b)


def test_steady_decode_takes_the_fast_path_never_the_stateless_one(llama, monkeypatch):
    """Three requests admitted together then decoding together: no row is ever rewritten
    (appends only), the stateless builder is never called, and with the device derivation
    on (its numpy form on a CPU device) every decode step after the first is derived."""
    import pagedkv.engine.runner as runner_module

    def refuse(*args, **kwargs):
        raise AssertionError("the persistent engine called build_metadata")

    ps = prompts(llama.config.vocab_size, (5, 7, 6), seed=2)
    new = 14
    want = run(llama, ps, options(metadata="stateless", max_batched_tokens=32), new=new)
    monkeypatch.setattr(runner_module, "build_metadata", refuse)
    for derive in (False, True):
        eng = Engine(llama, options(max_batched_tokens=32, derive_on_device=derive))
        got = run(llama, ps, options(), new=new, engine=eng)
        same_outputs(got, want)
        sync = eng.runner.sync
        # added once, never rewritten, removed when they finished
        assert (sync.added, sync.rewritten, sync.removed, len(sync.builder)) == (3, 0, 3, 0)
        assert sync.appended > 0  # blocks of 4 tokens: decode steps opened blocks
        # one prefill step, one decode step on the full path (its predecessor was not a
        # decode step), then every decode step derived; the last step finishes all three
        assert eng.steps == new
        assert sync.builder.derived_steps == (new - 2 if derive else 0)


def test_unknown_metadata_mode_is_refused(llama):
    with pytest.raises(InvalidArgumentError, match="metadata must be one of"):
        Engine(llama, options(metadata="fast"))


def test_sampled_requests_agree_too(llama):
    """Seeded sampling: the same tokens through both paths."""
    ps = prompts(llama.config.vocab_size, (4, 9), seed=6)
    params = [SamplingParams(max_new_tokens=6, temperature=0.8, top_p=0.9, seed=i)
              for i in range(2)]
    outs = [Engine(llama, options(metadata=m)).generate(ps, params)
            for m in ("persistent", "stateless")]
    assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]


class _State:
    """What TableSync reads of the block manager's per-request state."""

    def __init__(self, tables):
        self.tables = tables
        self.first_live = [0] * len(tables)


def stand_in(hf):
    """A TableSync over a tiny model's first attention group (a Llama's full one, Gemma 3's
    sliding-window one) fed from stand-in request states;
    returns (sync, states, step, need, free): ``step(*(rid, computed, new, drafts))``
    builds a step and compares it with build_metadata, ``need(rid, end)`` allocates blocks
    for positions [0, end) from a shuffled pool ``free``."""
    import random
    from types import SimpleNamespace

    from pagedkv.batch import ScheduledRequest
    from pagedkv.engine.scheduler import Chunk
    from pagedkv.engine.stepmeta import TableSync

    g = Engine(hf, options()).runner.attn_groups[0]
    groups = [g]
    free = list(range(1, g.num_blocks))
    random.Random(0).shuffle(free)
    states = {}
    sync = TableSync(groups, SimpleNamespace(requests=states), [g.id], device="cpu",
                     max_batch=4, max_tokens=16, max_model_len=64)

    def step(*rows):
        chunks = [Chunk(SimpleNamespace(rid=r), c, n - d, True, d) for r, c, n, d in rows]
        got = sync.build(chunks, [d for *_, d in rows])
        reqs = [ScheduledRequest(r, c, n, {g.id: states[r].tables[0]}, d) for r, c, n, d in rows]
        assert_built_as_stateless(got, reqs, groups)

    def need(rid, end):
        t = states[rid].tables[0]
        t += [free.pop() for _ in range(-(-end // g.block_size) - len(t))]

    return sync, states, step, need, free


WINDOWED = ["llama-3-8b", "gemma-3-27b"]  # a full group; a sliding-window group


@pytest.mark.parametrize("name", WINDOWED)
def test_table_sync_sees_every_kind_of_table_change(name):
    """Each way the block manager changes a table, made by hand on stand-in request
    states with blocks from a shuffled pool: every step equals build_metadata of the
    tables as they are (a change missed leaves a stale entry, and the step differs). The
    window's move only on the window group: a full group has no null block to put in a
    dropped one's place, so TableSync does not look for one there."""
    sync, states, step, need, free = stand_in(tiny_model(name))
    window = name.startswith("gemma")
    bs = sync.groups[0][2]
    states["a"], states["b"] = _State([[]]), _State([[]])
    need("a", 6), need("b", 3)
    step(("a", 0, 6, 0), ("b", 0, 3, 0))  # prefill chunks: added
    need("a", 7 + 3), need("b", 4)
    step(("a", 6, 4, 3), ("b", 3, 1, 0))  # a: one token + 3 drafts in lookahead blocks
    assert (sync.added, sync.rewritten) == (2, 0)
    ta = states["a"].tables[0]
    free.insert(0, ta.pop())  # a's commit of 1 gives its lookahead block back...
    need("a", 8 + 3)  # ...the next step's lookahead gets another: same length, new entry
    need("b", 5)
    step(("a", 7, 4, 3), ("b", 4, 1, 0))
    assert sync.rewritten == 1
    del ta[-(-8 // bs):]  # a commits 1 of them (8 computed): the lookahead block goes back
    step(("a", 7, 1, 0))  # the rollback's recompute of its kept token: a shorter row
    assert (sync.rewritten, sync.removed) == (2, 1)  # b, not in the step, left
    need("a", 9), need("b", 6)
    step(("a", 8, 1, 0), ("b", 5, 1, 0))
    assert sync.added == 3
    if window:
        states["a"].tables[0][0] = free.pop()  # a window dropping a block (null stand-in)
        states["a"].first_live[0] = 1
    need("a", 10), need("b", 7)
    step(("a", 9, 1, 0), ("b", 6, 1, 0))
    assert sync.rewritten == 2 + window
    states["b"].tables[0] = [free.pop() for _ in states["b"].tables[0]]  # a new list (a hit)
    need("a", 11), need("b", 8)
    step(("b", 7, 1, 0), ("a", 10, 1, 0))  # reordered too
    assert sync.rewritten == 3 + window
    del states["a"]  # a finished: only b this step; a's row is gone
    need("b", 9)
    step(("b", 8, 1, 0))
    assert len(sync.builder) == 1 and sync.removed == 2
    states["a"] = _State([[free.pop()]])  # the same id again: a fresh row
    need("b", 10)
    step(("a", 0, 2, 0), ("b", 9, 1, 0))
    assert len(sync.builder) == 2 and sync.added == 4
    states["a"] = _State([[free.pop()]])  # replaced while both run: removed, added
    need("b", 11)
    step(("a", 0, 2, 0), ("b", 10, 1, 0))
    assert (sync.added, sync.removed) == (5, 3)


def test_table_sync_refuses_draft_counts_not_one_per_chunk(llama):
    from types import SimpleNamespace

    from pagedkv.engine.scheduler import Chunk

    sync, states, _, need, _ = stand_in(llama)
    states["a"], states["b"] = _State([[]]), _State([[]])
    need("a", 2), need("b", 2)
    chunks = [Chunk(SimpleNamespace(rid=r), 0, 2, True) for r in "ab"]
    with pytest.raises(InvalidArgumentError, match="1 draft counts for 2 chunks"):
        sync.build(chunks, [0])
    assert len(sync.builder) == 0  # refused before anything was sent


@pytest.mark.parametrize("name", WINDOWED)
def test_table_sync_steady_steps_see_every_change_too(name):
    """The same requests in the same order take a batch-wide check (no per-request
    Python); each change it must not wave through, on such a step: a lookahead block
    past the blocks a commit keeps (its entry must be kept for comparing), that block
    given back and another put in its place, a new list, a window's move, a row that
    got shorter without a kept entry (outside the manager's contract; still seen), and a
    lone request replaced under its id.
    The window's move only on the window group (see the test above)."""
    sync, states, step, need, free = stand_in(tiny_model(name))
    window = name.startswith("gemma")
    states["a"], states["b"] = _State([[]]), _State([[]])
    need("a", 6), need("b", 3)
    step(("a", 0, 6, 0), ("b", 0, 3, 0))
    need("a", 7), need("b", 4)
    step(("a", 6, 1, 0), ("b", 3, 1, 0))
    need("a", 8), need("b", 5)
    step(("a", 7, 1, 0), ("b", 4, 1, 0))  # steady: b opened a block
    assert (sync.added, sync.rewritten, sync.appended) == (2, 0, 1)
    need("a", 8 + 3), need("b", 6)
    step(("a", 8, 4, 3), ("b", 5, 1, 0))  # a's lookahead block is one a commit keeps (3 of 4)
    need("a", 9 + 3 + 1), need("b", 7)
    step(("a", 9, 4, 3), ("b", 6, 1, 0))  # positions 9..12: block 3 is past ceil(10 / 4)
    ta = states["a"].tables[0]
    free.insert(0, ta.pop())  # a commits 1 (10 computed): block 3 goes back...
    need("a", 11), need("b", 8)  # ...and 10 needs only 3 blocks: a shorter row
    step(("a", 10, 1, 0), ("b", 7, 1, 0))
    assert sync.rewritten == 1
    need("a", 12 + 3), need("b", 9)
    step(("a", 11, 4, 3), ("b", 8, 1, 0))  # positions 11..14: block 3 past ceil(12 / 4)
    free.insert(0, ta.pop())  # a commits 1 (12 computed): block 3 goes back, and the
    need("a", 13), need("b", 10)  # decode at 12 gets another in its place: same length
    step(("a", 12, 1, 0), ("b", 9, 1, 0))
    assert sync.rewritten == 2
    need("a", 14), need("b", 11)
    step(("a", 13, 1, 0), ("b", 10, 1, 0))  # steady again
    states["b"].tables[0] = [free.pop() for _ in states["b"].tables[0]]  # a new list
    need("a", 15), need("b", 12)
    step(("a", 14, 1, 0), ("b", 11, 1, 0))
    assert sync.rewritten == 3
    need("a", 16), need("b", 13)
    step(("a", 15, 1, 0), ("b", 12, 1, 0))
    if window:
        ta[0] = free.pop()  # a window dropping a block (null stand-in)
        states["a"].first_live[0] = 1
    need("a", 17), need("b", 14)
    step(("a", 16, 1, 0), ("b", 13, 1, 0))
    assert sync.rewritten == 3 + window
    need("a", 18), need("b", 15)
    step(("a", 17, 1, 0), ("b", 14, 1, 0))
    del ta[-1]  # a's last block gone, nothing kept to compare it with
    step(("a", 15, 1, 0), ("b", 15, 1, 0))
    assert sync.rewritten == 4 + window
    assert (sync.added, sync.removed) == (2, 0)
    need("a", 17)
    step(("a", 16, 1, 0))  # b left: a alone
    need("a", 18)
    step(("a", 17, 1, 0))  # a alone, steady
    assert (sync.added, sync.removed, sync.rewritten) == (2, 1, 4 + window)
    # a replaced under its id (finished and added again) by a state as far along, its
    # table as long: only the state object tells
    states["a"] = _State([[free.pop() for _ in ta]])
    step(("a", 17, 1, 0))
    assert (sync.added, sync.removed) == (3, 2)


# (Triton's interpreter converts a one-element array to a scalar in its own code)
@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
@pytest.mark.parametrize("name", ["llama-3-8b", "deepseek-v3"])
def test_triton_kernels_read_padded_steps_alike(name):
    """The Triton backend's GQA and MLA kernels (the interpreter on CPU) over the bucket-
    padded persistent steps: the same tokens and logits as over the stateless steps."""
    from pagedkv.ops import use_backend
    from pagedkv.ops.backend import triton_available

    if not triton_available():
        pytest.skip("the Triton backend is not available here")
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        pytest.skip("CPU tensors need Triton's interpreter (on CUDA: the test below)")
    hf = tiny_model(name)
    ps = prompts(hf.config.vocab_size, (9, 5, 3), seed=3)
    with use_backend("triton"):
        a, b = [run(hf, ps, options(metadata=m, max_batched_tokens=8), new=4)
                for m in ("persistent", "stateless")]
    same_outputs(a, b)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("name", ["llama-3-8b", "deepseek-v3"])
def test_engine_on_the_test_device_derives_steps_and_matches_transformers(device, backend, name):
    """CUDA only (PAGEDKV_TEST_DEVICE=cuda): the engine with its default metadata path
    (steady decode steps derived on the device by the Triton kernel) generates the stateless
    engine's tokens, takes derived steps, and its logits stay within the engine tests'
    tolerance of transformers' dense forward on the same device."""
    if device.type != "cuda":
        pytest.skip("derived steps on the device need CUDA (CPU runs are the tests above)")
    from engine_check import TOL

    from pagedkv import ops

    hf = tiny_model(name).to(device)
    ps = prompts(hf.config.vocab_size, (5, 17, 33, 9, 60, 3), seed=3)
    kw = dict(device=str(device), max_model_len=128, block_size=16, kv_cache_bytes=1 << 24,
              checked=False)
    with ops.use_backend(backend):
        got = run(hf, ps, options(**kw), new=24)
        want = run(hf, ps, options(metadata="stateless", **kw), new=24)
    assert got.runner.sync.builder.derived_steps > 0
    assert [o.token_ids for o in got.outputs] == [o.token_ids for o in want.outputs]
    for out in got.outputs:
        seq = out.prompt_token_ids + out.token_ids
        with torch.no_grad():
            ref = hf(torch.tensor([seq], device=device)).logits[0].float()
        for p, row in got.logits[out.rid]:
            diff = float((row.to(device) - ref[p]).abs().max())
            assert diff <= TOL, (out.rid, p, diff)
