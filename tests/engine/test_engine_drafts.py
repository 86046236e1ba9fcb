"""Draft tokens through the runner (the hook speculative decoding builds on): a decode
with k drafts in its lookahead slots yields the target's logits for every draft position,
equal to transformers'; committing the accepted drafts plus a bonus token continues
exactly."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from engine_check import hf_greedy, options, prompts  # noqa: E402

from pagedkv.engine import Engine, SamplingParams  # noqa: E402
from pagedkv.engine.tiny import tiny_model  # noqa: E402
from pagedkv.errors import InvalidArgumentError  # noqa: E402


def test_draft_rows_verify_against_transformers():
    hf = tiny_model("llama-3-8b")
    engine = Engine(hf, options(spec_tokens=3, record_logits=False))
    (p,) = prompts(hf.config.vocab_size, (7,), seed=9)
    greedy = hf_greedy(hf, p, 8)
    rid = engine.add_request(p, SamplingParams(max_new_tokens=8, ignore_eos=True))
    sched, runner = engine.scheduler, engine.runner
    plan = sched.schedule()  # the prompt: samples the first token
    out = runner.execute(plan.chunks, engine.manager.drain_copy_ops())
    sched.update(plan, {rid: [int(out.logits[out.rows[0][-1]].argmax())]})
    # drafts: two right tokens, then a wrong one
    drafts = [greedy[1], greedy[2], (greedy[3] + 1) % hf.config.vocab_size]
    plan = sched.schedule()
    (chunk,) = plan.chunks
    assert chunk.num_lookahead >= 3
    with pytest.raises(InvalidArgumentError, match="lookahead"):
        runner.execute(plan.chunks, [], drafts={rid: drafts * 2})
    out = runner.execute(plan.chunks, engine.manager.drain_copy_ops(), drafts={rid: drafts})
    rows = out.logits[list(out.rows[0])]
    seq = p + [greedy[0]] + drafts
    with torch.no_grad():
        ref = hf(torch.tensor([seq])).logits[0, len(p):].float()
    assert rows.shape == ref.shape
    assert float((rows - ref).abs().max()) <= 1e-4
    verdict = rows.argmax(-1).tolist()
    assert verdict[:3] == greedy[1:4]  # drafts 1, 2 accepted; the third replaced
    sched.update(plan, {rid: verdict[:3]})  # accepted drafts + the bonus token
    while sched.has_work():
        engine.step()
    assert engine.requests[rid].output == greedy
