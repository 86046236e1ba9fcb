"""The scheduler over a real block manager (standard library only): the token budget per
step, chunked prefill, stop tokens, and aborts at any step leave no block behind."""

from __future__ import annotations

import pytest

from pagedkv.blocks import KVCacheManager
from pagedkv.engine import Request, SamplingParams, Scheduler
from pagedkv.engine.scheduler import Chunks
from pagedkv.errors import InvalidArgumentError
from pagedkv.models import layers_from_config
from pagedkv.plan import PlanOptions, make_plan

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "intermediate_size": 96, "vocab_size": 100, "max_position_embeddings": 64,
          "torch_dtype": "bfloat16"}


def scheduler(budget_tokens=40, step_tokens=8, **kw):
    layers = layers_from_config(CONFIG)
    plan = make_plan(layers, PlanOptions(budget_bytes=256 * budget_tokens, max_model_len=24,
                                         block_size=4, max_batched_tokens=step_tokens))
    return Scheduler(KVCacheManager.from_plan(plan, checked=True), **kw)


def drive(s, reqs, abort_at=None, victim=None, token=7):
    """Run to the end, sampling ``token``; returns the step plans."""
    for r in reqs:
        s.add(r)
    plans = []
    while s.has_work():
        if abort_at is not None and len(plans) == abort_at:
            s.abort(victim)
        plan = s.schedule()
        assert_columns(plan.chunks)
        plans.append(plan)
        s.update(plan, {c.request.rid: [token] for c in plan.chunks if c.samples})
    return plans


def assert_columns(chunks):
    """The plan's ids and counts (``Chunks``, what the metadata build reads) are its
    chunks'."""
    assert type(chunks) is Chunks
    assert chunks.rids == tuple(c.request.rid for c in chunks)
    assert chunks.computed == tuple(c.num_computed for c in chunks)
    assert chunks.new == tuple(c.num_new_tokens for c in chunks)


def requests(n=3, prompt=13, new=5):
    return [Request(i, tuple(range(10 * i, 10 * i + prompt)), SamplingParams(max_new_tokens=new))
            for i in range(n)]


def test_budget_and_chunked_prefill():
    s = scheduler()
    reqs = requests()
    plans = drive(s, reqs)
    assert all(0 < p.num_tokens <= 8 for p in plans)
    first = [c.num_new_tokens for p in plans for c in p.chunks if c.request.rid == 0][:2]
    assert first == [8, 5]  # 13 prompt tokens over two steps
    assert all(r.output == [7] * 5 and r.finish_reason == "length" for r in reqs)
    assert sum(s.mgr.blocks_used()) == 0


def test_stop_token_finishes_early():
    s = scheduler(eos_token_ids=[7])
    reqs = requests(n=1)
    drive(s, reqs)
    assert reqs[0].output == [7] and reqs[0].finish_reason == "stop"
    s = scheduler(eos_token_ids=[7])
    reqs = [Request(0, tuple(range(5)), SamplingParams(max_new_tokens=3, ignore_eos=True))]
    drive(s, reqs)
    assert reqs[0].output == [7, 7, 7]


def test_preemption_under_a_small_cache():
    s = scheduler(budget_tokens=28)
    reqs = requests(n=3, prompt=9, new=8)
    plans = drive(s, reqs)
    assert any(p.preempted for p in plans)
    assert all(len(r.output) == 8 for r in reqs)
    assert sum(s.mgr.blocks_used()) == 0


@pytest.mark.parametrize("step", range(8))
def test_abort_at_any_step(step):
    s = scheduler(budget_tokens=28)
    reqs = requests(n=3, prompt=9, new=6)
    drive(s, reqs, abort_at=step, victim=1)
    assert reqs[1].finish_reason == "abort" and len(reqs[1].output) < 6
    assert [len(r.output) for r in (reqs[0], reqs[2])] == [6, 6]
    assert sum(s.mgr.blocks_used()) == 0 and not s.mgr.requests


def test_chunks_columns_cover_decode_runs_prefills_and_preemptions():
    """Every plan of a run with chunked prefills, batched decodes and preemptions carries
    its chunks' ids and counts (``drive`` checks each plan); ``Chunks`` refuses columns
    of another length."""
    s = scheduler(budget_tokens=28)
    plans = drive(s, requests(n=3, prompt=9, new=8))
    assert any(p.preempted for p in plans)
    assert any(len(p.chunks) > 1 and all(c.num_new_tokens == 1 for c in p.chunks)
               for p in plans)  # a batched decode run
    assert any(c.num_new_tokens > 1 for p in plans for c in p.chunks)  # prefill chunks
    with pytest.raises(InvalidArgumentError, match="2 chunks with 1 ids"):
        Chunks(plans[0].chunks[:1] * 2, [0], [0, 0], [1, 1])


def test_batched_decodes_stop_and_reach_limits_as_one_by_one():
    """Requests decoding together (one token each, the common case ``update`` keeps
    without its general path) still stop at their eos (unless ignoring it), at their own
    stop token, at ``max_new_tokens`` and at the scheduler's ``max_model_len``; and as
    with ``batch_decode`` off (the general path for every token), step by step."""
    script = {0: {3: 7}, 1: {2: 7}, 2: {1: 7, 4: 9}}  # rid -> {output index: token}
    results = []
    for batch_decode in (True, False):
        s = scheduler(budget_tokens=120, eos_token_ids=[7], max_model_len=20)
        s.batch_decode = batch_decode
        reqs = [Request(0, tuple(range(5)), SamplingParams(max_new_tokens=10)),
                Request(1, tuple(range(5, 10)), SamplingParams(max_new_tokens=6, ignore_eos=True)),
                Request(2, tuple(range(10, 15)),
                        SamplingParams(max_new_tokens=10, ignore_eos=True, stop_token_ids=(9,))),
                Request(3, tuple(range(15, 20)), SamplingParams(max_new_tokens=19)),
                Request(4, tuple(range(20, 23)), SamplingParams(max_new_tokens=14))]
        for r in reqs:
            s.add(r)
        steps = []
        while s.has_work():
            plan = s.schedule()
            sampled = {c.request.rid: [script.get(c.request.rid, {}).get(len(c.request.output), 3)]
                       for c in plan.chunks if c.samples}
            done = s.update(plan, sampled)
            steps.append(([(c.request.rid, c.num_new_tokens) for c in plan.chunks],
                          [r.rid for r in done]))
        assert [r.output for r in reqs] == [[3, 3, 3, 7], [3, 3, 7, 3, 3, 3],
                                            [3, 7, 3, 3, 9], [3] * 15, [3] * 14]
        assert [r.finish_reason for r in reqs] == ["stop", "length", "stop", "length", "length"]
        assert not s.mgr.requests and sum(s.mgr.blocks_used()) == 0
        # each request finished in a step with another decode (a run of them)
        ends = [chunks for chunks, done in steps for _ in done]
        assert [rid for _, done in steps for rid in done] == [0, 2, 1, 3, 4]
        assert all(sum(n == 1 for _, n in c) > 1 for c in ends)
        results.append(steps)
    assert results[0] == results[1]
