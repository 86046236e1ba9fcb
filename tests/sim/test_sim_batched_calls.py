"""The scheduler's batched decode calls (``allocate_batch`` / ``commit_batch``) decide
exactly as one ``allocate`` / ``commit`` per request would (the scheduler with
``batch_decode`` off, and the batched calls as loops of the per-request ones): same steps,
preemptions, hits and per-step block usage."""

from __future__ import annotations

import pytest

from pagedkv.blocks import KVCacheManager
from pagedkv.engine.scheduler import Scheduler
from pagedkv.models import load_model
from pagedkv.plan import PlanOptions, make_plan
from pagedkv.sim import SimOptions, make_workload, simulate


class PerRequest(KVCacheManager):
    """The batched calls as loops of the per-request ones."""

    batch_calls = 0

    def allocate_batch(self, request_ids, num_new_tokens=1, num_lookahead=0):  # noqa: ANN001, ANN201
        PerRequest.batch_calls += 1
        for i, rid in enumerate(request_ids):
            if not self.allocate(rid, num_new_tokens, num_lookahead):
                return i
        return len(request_ids)

    def commit_batch(self, request_ids, new_tokens):  # noqa: ANN001, ANN201
        PerRequest.batch_calls += 1
        for rid, tok in zip(request_ids, new_tokens):
            self.commit(rid, 1, [tok])


@pytest.mark.parametrize("model,budget,max_len,n,opts", [
    ("gemma-3-27b", 3 << 30, 16384, 60, SimOptions(seed=2, max_running=64)),  # preempts
    ("llama-3-8b", 1 << 30, 8192, 60, SimOptions(seed=3, max_running=32)),
    ("kimi-k3", 120 << 30, None, 30, SimOptions(spec_tokens=3, acceptance=0.6, seed=1)),
])
def test_batched_calls_decide_alike(model: str, budget: int, max_len: int | None, n: int,
                                    opts: SimOptions, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = load_model(model)
    plan = make_plan(spec.layers, PlanOptions(budget, max_len or spec.max_position_embeddings))
    reqs = make_workload("chat", n, opts.seed, plan.options.max_model_len)
    PerRequest.batch_calls = 0
    ref = simulate(PerRequest.from_plan(plan, checked=False), reqs, opts)
    assert PerRequest.batch_calls > 0 or opts.spec_tokens
    got = simulate(KVCacheManager.from_plan(plan), reqs, opts)
    assert got.to_json() == ref.to_json()
    assert got.timeline == ref.timeline
    monkeypatch.setattr(Scheduler, "batch_decode", False)  # one call per request
    PerRequest.batch_calls = 0
    old = simulate(PerRequest.from_plan(plan, checked=False), reqs, opts)
    assert PerRequest.batch_calls == 0
    assert old.to_json() == ref.to_json()
    assert old.timeline == ref.timeline
    if model == "gemma-3-27b":
        assert got.preemptions > 0
