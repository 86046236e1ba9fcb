"""Speculative decoding with a scripted drafter (deterministic accept / partial accept /
reject): greedy output equals plain greedy output token for token, every kept row's logits
equal transformers' (rejected drafts leave no trace: NaN-filled free pages, shuffled
blocks, prefix hits afterwards), the counters say what was accepted; sampled
speculation keeps the target's distribution (chi-square)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from engine_check import hf_greedy, max_logit_diff, options, prompts, run  # noqa: E402

from pagedkv.engine.speculative import (  # noqa: E402
    Proposal,
    ScriptedDrafter,
    SpeculativeEngine,
    accept_greedy,
    accept_sampled,
)
from pagedkv.engine.tiny import tiny_model  # noqa: E402
from pagedkv.errors import InvalidArgumentError  # noqa: E402

NEW = 9


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama-3-8b")


def _spec_run(hf, ps, script, k, **kw):
    engine = SpeculativeEngine(hf, options(spec_tokens=k, **kw), ScriptedDrafter(script))
    return run(hf, ps, options(), new=NEW, engine=engine)


def _corrupt(tokens, every, vocab):
    return [(t + 1) % vocab if i % every == every - 1 else t for i, t in enumerate(tokens)]


@pytest.mark.parametrize("mode", ["accept", "partial", "reject"])
def test_greedy_speculation_equals_plain_greedy(llama, mode):
    v = llama.config.vocab_size
    ps = prompts(v, (7, 12, 3), seed=11)
    want = [hf_greedy(llama, p, NEW) for p in ps]
    script = {
        "accept": {i: w for i, w in enumerate(want)},
        "partial": {i: _corrupt(w, 3, v) for i, w in enumerate(want)},
        "reject": {i: [(t + 1) % v for t in w] for i, w in enumerate(want)},
    }[mode]
    engine = _spec_run(llama, ps, script, k=3, max_batched_tokens=8)
    assert [o.token_ids for o in engine.outputs] == want
    assert max_logit_diff(llama, engine) <= 1e-4
    s = engine.stats
    assert s.verify_passes > 0 and s.drafted > 0
    if mode == "accept":
        assert s.accepted == s.drafted
        assert engine.steps < 2 + NEW  # fewer decode steps than tokens
    elif mode == "reject":
        assert s.accepted == 0 and s.mean_accepted_tokens == 1.0
    else:
        assert 0 < s.accepted < s.drafted


def test_rejected_drafts_leave_no_trace_in_prefix_cache(llama):
    """Rejected drafts' KV lies past the committed tokens: a later request that hits the
    first one's blocks (its prompt + output) gets transformers' logits."""
    v = llama.config.vocab_size
    (a,) = prompts(v, (9,), seed=12)
    want = hf_greedy(llama, a, NEW)
    engine = _spec_run(llama, [a], {0: _corrupt(want, 2, v)}, k=4)
    turn = a + engine.outputs[0].token_ids
    run(llama, [turn + [5, 6]], options(), new=3, engine=engine)
    assert engine.requests[engine.outputs[1].rid].hit_tokens >= 16
    assert max_logit_diff(llama, engine) <= 1e-4


def test_deepseek_v3_target():
    from mla_models import tiny_deepseek_v3

    hf = tiny_deepseek_v3(True)
    v = hf.config.vocab_size
    ps = prompts(v, (6, 10), seed=13)
    want = [hf_greedy(hf, p, NEW) for p in ps]
    engine = _spec_run(hf, ps, {i: _corrupt(w, 4, v) for i, w in enumerate(want)}, k=3)
    assert [o.token_ids for o in engine.outputs] == want
    assert max_logit_diff(hf, engine) <= 1e-4
    assert 0 < engine.stats.accepted < engine.stats.drafted


def test_k_beyond_the_drafter_is_refused_before_any_step(llama):
    with pytest.raises(InvalidArgumentError, match="spec-tokens 4"):
        SpeculativeEngine(llama, options(spec_tokens=4), ScriptedDrafter({}, max_tokens=2))
    with pytest.raises(InvalidArgumentError, match="spec_tokens >= 1"):
        SpeculativeEngine(llama, options(), ScriptedDrafter({}))


def test_accept_greedy_rule():
    logits = torch.full((4, 8), -1.0)
    for row, tok in enumerate([3, 5, 1, 7]):
        logits[row, tok] = 1.0
    assert accept_greedy([3, 5, 1], logits) == [3, 5, 1, 7]
    assert accept_greedy([3, 4, 1], logits) == [3, 5]
    assert accept_greedy([0, 5, 1], logits) == [3]
    assert accept_greedy([], logits[:1]) == [3]


@pytest.mark.parametrize("draft_probs", [False, True])
def test_rejection_sampling_keeps_the_target_distribution(draft_probs):
    """First emitted token over many trials vs the target's p (chi-square, 5 bins): the
    drafter proposes from a different q (one-hot or a full distribution)."""
    p = torch.tensor([[0.4, 0.25, 0.2, 0.1, 0.05], [0.2, 0.2, 0.2, 0.2, 0.2]])
    q = torch.tensor([0.05, 0.05, 0.1, 0.3, 0.5])
    gen = torch.Generator().manual_seed(0)
    trials = 4000
    counts = torch.zeros(5)
    for _ in range(trials):
        if draft_probs:
            d = int(torch.multinomial(q, 1, generator=gen))
            prop = Proposal((d,), q[None])
        else:
            prop = Proposal((3,))
        counts[accept_sampled(prop, p, gen)[0]] += 1
    expected = p[0] * trials
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 18.47  # chi-square, 4 degrees of freedom, p = 0.001


@pytest.mark.parametrize("every", [None, 1])
def test_kimi_linear_target_rolls_its_state_back(every):
    """A recurrent (KDA) + MLA target: rejected drafts advanced the state slots during the
    verify pass; after the rollback the output equals plain greedy, every kept logit row
    equals transformers', and a later request hitting the recurrent checkpoints too."""
    from mla_models import tiny_kimi_linear

    hf = tiny_kimi_linear(seed=4)
    v = hf.config.vocab_size
    ps = prompts(v, (6, 11), seed=14)
    want = [hf_greedy(hf, p, NEW) for p in ps]
    engine = _spec_run(hf, ps, {i: _corrupt(w, 3, v) for i, w in enumerate(want)}, k=3,
                       recurrent_checkpoint_every=every)
    assert [o.token_ids for o in engine.outputs] == want
    assert 0 < engine.stats.accepted < engine.stats.drafted
    turn = ps[1] + engine.outputs[1].token_ids
    run(hf, [turn + [5, 6]], options(), new=3, engine=engine)
    if every:
        assert engine.requests[engine.outputs[2].rid].hit_tokens >= 16
    assert max_logit_diff(hf, engine) <= 1e-4


def test_sampled_speculation_keeps_the_target_distribution():
    """Through the engine: 200 seeded requests, temperature 1, a scripted draft for the
    second token; its marginal equals sum_t1 p(t1) p(t2 | t1) from transformers
    (chi-square over a 6-token vocabulary, p = 0.001)."""
    import transformers

    from pagedkv.engine import SamplingParams

    cfg = transformers.LlamaConfig(vocab_size=6, hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, max_position_embeddings=32)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        hf.lm_head.weight.mul_(40)  # spread the next-token distributions out
    prompt = [1, 4, 2]
    with torch.no_grad():
        p1 = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1].double(), -1)
        p2 = torch.stack([torch.softmax(hf(torch.tensor([prompt + [t]])).logits[0, -1].double(), -1)
                          for t in range(6)])
    expected_p = p1 @ p2
    n = 200
    drafter = ScriptedDrafter({i: [0, 3, 3] for i in range(n)})
    opts = options(spec_tokens=1, max_batched_tokens=256, kv_cache_bytes=1 << 22,
                   record_logits=False, debug_nan=False, checked=False)
    engine = SpeculativeEngine(hf, opts, drafter)
    params = [SamplingParams(max_new_tokens=3, temperature=1.0, seed=i, ignore_eos=True)
              for i in range(n)]
    outs = engine.generate([prompt] * n, params)
    counts = torch.zeros(6, dtype=torch.float64)
    for o in outs:
        counts[o.token_ids[1]] += 1
    assert 0 < engine.stats.accepted < engine.stats.drafted
    keep = expected_p * n >= 5
    expected = expected_p[keep] * n
    chi2 = float(((counts[keep] - expected) ** 2 / expected).sum())
    limits = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}
    assert chi2 < limits[int(keep.sum()) - 1]


@pytest.mark.parametrize("name", ["qwen3-next-80b", "nemotron-h-8b"])
def test_other_recurrent_targets_roll_back_too(name):
    """Gated DeltaNet (Qwen3-Next) and Mamba-2 (Nemotron-H) state slots: partial
    acceptance, checkpoints every block, output equal to plain greedy, logits exact."""
    hf = tiny_model(name)
    v = hf.config.vocab_size
    ps = prompts(v, (6, 11), seed=14)
    want = [hf_greedy(hf, p, NEW) for p in ps]
    engine = _spec_run(hf, ps, {i: _corrupt(w, 3, v) for i, w in enumerate(want)}, k=3,
                       recurrent_checkpoint_every=1)
    assert [o.token_ids for o in engine.outputs] == want
    assert 0 < engine.stats.accepted < engine.stats.drafted
    assert max_logit_diff(hf, engine) <= 1e-4


def _smallest_budget(hf, **kw):
    """The fewest cache bytes the engine accepts: a pool that holds one request of
    max_model_len and nothing more (bisection over EngineOptions.kv_cache_bytes)."""
    from pagedkv.engine import Engine
    from pagedkv.errors import DoesNotFitError

    lo, hi = 1, 1 << 22
    while lo < hi:
        mid = (lo + hi) // 2
        try:
            Engine(hf, options(kv_cache_bytes=mid, **kw))
        except DoesNotFitError:
            lo = mid + 1
        else:
            hi = mid
    return lo


def test_requests_reaching_max_model_len_stop_drafting_instead_of_failing(llama):
    """A speculative decode took lookahead slots past max_model_len; in a pool that holds
    one request of max_model_len and no more, that request could never fit and
    RequestTooLargeError escaped generate (found by random engine runs). The last
    tokens now decode one at a time: every request finishes, output as plain greedy."""
    kw = dict(max_model_len=32, block_size=4, max_batched_tokens=16)
    budget = _smallest_budget(llama, **kw)
    ps = prompts(llama.config.vocab_size, (20, 23), seed=9)
    plain = run(llama, ps, options(kv_cache_bytes=budget, **kw), new=32 - 23)
    # every draft wrong: one token per step, so the longer request decodes at 29, 30, 31
    script = {i: _corrupt(o.token_ids, 1, llama.config.vocab_size)
              for i, o in enumerate(plain.outputs)}
    engine = SpeculativeEngine(llama, options(spec_tokens=3, kv_cache_bytes=budget, **kw),
                               ScriptedDrafter(script))
    spec = run(llama, ps, options(), new=32 - 23, engine=engine)
    assert [o.token_ids for o in spec.outputs] == [o.token_ids for o in plain.outputs]
    assert spec.stats.drafted > 0  # it drafted where there was room
    assert max_logit_diff(llama, spec) <= 1e-4


def test_catch_up_rows_restart_when_a_request_resumes_past_them():
    """A preempted request came back with a prefix hit longer than what it had computed
    (another request cached more of the shared prefix): its first rows start past the
    drafter's catch-up rows. That was an InvalidArgumentError 'catch-up gap' out of
    generate (random engine runs, EAGLE-3 on Mistral); the hit covers the drafter's group
    too, so the rows restart at the hit."""
    from pagedkv.engine.speculative import _keep_rows, _Pending

    pending = {5: _Pending(37, [])}  # caught up to 37 when preempted
    rows = torch.randn(7, 4)
    _keep_rows(pending, 5, 39, rows)  # resumed from a hit of 39
    assert pending[5].start == 39 and len(pending[5].rows) == 7
    assert torch.equal(torch.stack(pending[5].rows), rows)
    _keep_rows(pending, 5, 44, rows[:2])  # a later chunk overlapping the rows' tail
    assert pending[5].start == 39 and len(pending[5].rows) == 7
    assert torch.equal(pending[5].rows[5], rows[0])
    _keep_rows(pending, 5, 10, rows[:1])  # computed again from earlier: restarts
    assert pending[5].start == 10 and len(pending[5].rows) == 1
