"""The simulator and the engine agree on blocks used: a tiny random Kimi-Linear target
(KDA recurrent + MLA) with a DSpark drafter sharing its MLA block table runs through the
real engine (fp32, CPU); the same trace — prompt lengths, max_new_tokens, and the drafts
the engine accepted at each speculative step (``SimRequest.accepted_drafts``) — runs
through ``pagedkv.sim.simulate`` on a fresh manager of the engine's own plan. After every
step's allocation both hold the same blocks in every group (the shared MLA block table
and the recurrent state slots), schedule the same number of steps and preemptions, and
leak nothing at the end."""

from __future__ import annotations

from collections import defaultdict

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from engine_check import hf_greedy, options, prompts, run  # noqa: E402
from mla_models import random_dspark, tiny_kimi_linear  # noqa: E402

from pagedkv.blocks import KVCacheManager  # noqa: E402
from pagedkv.engine.speculative import DSparkDrafter, Proposal, SpeculativeEngine  # noqa: E402
from pagedkv.sim import SimOptions, SimRequest, simulate  # noqa: E402

K = 3  # drafts per step: a DSpark block of 4


class BettingDSpark(DSparkDrafter):
    """DSpark runs as usual (context catch-up, its block's scratch K/V in the lookahead
    slots of the shared table), then bets ``script`` tokens instead of its own, so that
    the trace mixes full, partial and no acceptance (random drafters rarely agree)."""

    def __init__(self, module, script):
        super().__init__(module)
        self.script = script

    def propose(self, engine, chunks, k):
        out = super().propose(engine, chunks, k)
        done = {c.request.rid: c.request.num_generated for c in chunks}
        return {rid: Proposal(tuple(self.script[rid][done[rid]: done[rid] + len(p.tokens)]))
                for rid, p in out.items()}


@pytest.fixture(scope="module")
def kimi():
    return tiny_kimi_linear(seed=4)


def _engine_trace(hf, drafter, ps, new, **kw):
    """Run the engine; return it, the blocks used per group after each step's allocation
    and the drafts accepted per request at each speculative step."""
    opts = options(spec_tokens=K, enable_prefix_caching=False, max_batched_tokens=12,
                   record_logits=False, **kw)
    engine = SpeculativeEngine(hf, opts, drafter)
    sched = engine.scheduler
    schedule, update = sched.schedule, sched.update
    timeline, accepted = [], defaultdict(list)

    def recording_schedule():
        plan = schedule()
        timeline.append(tuple(engine.manager.blocks_used()))
        return plan

    def recording_update(plan, sampled):
        for c in plan.chunks:  # the simulator's condition for one speculative step
            if c.samples and c.num_lookahead and c.request.remaining > 0:
                accepted[c.request.rid].append(len(sampled[c.request.rid]) - 1)
        return update(plan, sampled)

    sched.schedule, sched.update = recording_schedule, recording_update
    run(hf, ps, opts, new=new, engine=engine)
    return engine, timeline, accepted


def _simulate(engine, ps, accepted, new):
    """The same trace through the simulator, on a fresh manager of the engine's plan."""
    mgr = KVCacheManager.from_plan(engine.plan, enable_caching=False, checked=True)
    reqs = [SimRequest(tuple(p), new, 0, tuple(o.token_ids), tuple(accepted[o.rid]))
            for p, o in zip(ps, engine.outputs)]
    return simulate(mgr, reqs, SimOptions(max_running=engine.options.max_running,
                                          spec_tokens=K, acceptance=0.0))


def _bet(tokens, vocab):
    """The greedy tokens with generated tokens 2, 3 and 9 wrong: after the prefill's
    token, drafts [1 2 3] keep 1, [3 4 5] keep none, [4 5 6] keep all (+ bonus 7), ..."""
    return [(t + 1) % vocab if i in (2, 3, 9) else t for i, t in enumerate(tokens)]


# roomy: the three requests run together; one-slot: the recurrent pool holds one
# request's state, so the others wait for admission; preempting: two run, and the MLA
# pool runs short as they grow (the newest is preempted and recomputed later)
CASES = {"roomy": ((6, 11, 3), 8, None), "one-slot": ((6, 11, 3), 8, 26000),
         "preempting": ((3, 4, 5), 16, 42000)}


@pytest.mark.parametrize("case", list(CASES))
def test_kimi_linear_dspark_engine_and_simulator_agree_on_blocks(kimi, case):
    lengths, new, budget = CASES[case]
    vocab = kimi.config.vocab_size
    ps = prompts(vocab, lengths, seed=31)
    want = [hf_greedy(kimi, p, new) for p in ps]
    drafter = BettingDSpark(random_dspark(kimi.config), {i: _bet(w, vocab) for i, w in enumerate(want)})
    kw = {"max_model_len": 24} if budget is None else {"max_model_len": 24, "kv_cache_bytes": budget}
    engine, timeline, accepted = _engine_trace(kimi, drafter, ps, new, **kw)

    # the trace is not trivial: drafts accepted in full, in part and not at all
    if case == "preempting":
        assert engine.manager.preemptions > 0
        counts = {n for seq in accepted.values() for n in seq}
        assert {0, 1, K} <= counts
    else:
        assert engine.manager.preemptions == 0
        assert dict(accepted) == {0: [1, 0, K], 1: [1, 0, K], 2: [1, 0, K]}
    assert [o.token_ids for o in engine.outputs] == want  # lossless all the same
    kinds = tuple(m.group.retention.kind for m in engine.manager.managers)
    assert sorted(kinds) == ["full", "recurrent"], kinds
    mla = {engine.runner.layer_group[s.name] for s in engine.specs
           if s.layout.kind == "mla_latent"}
    assert len(mla) == 1  # one block table for the target's and the drafter's MLA layers
    rec = kinds.index("recurrent")
    running = max(t[rec] for t in timeline)  # one state slot per running request
    assert running == {"roomy": 3, "one-slot": 1, "preempting": 2}[case]

    sim = _simulate(engine, ps, accepted, new)
    assert sim.requests_finished == len(ps) and sim.generated_tokens == new * len(ps)
    assert sim.steps == engine.steps == len(timeline)
    assert sim.preemptions == engine.manager.preemptions
    for step, (ours, theirs) in enumerate(zip(timeline, sim.timeline)):
        assert ours == theirs, f"step {step}: engine {ours}, simulator {theirs} {kinds}"
    assert engine.manager.blocks_used() == [0, 0]
    assert sim.leaked_blocks == 0
