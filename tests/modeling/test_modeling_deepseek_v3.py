"""DeepSeek-V3 over the paged MLA latent cache (absorbed form) gives transformers' logits
at every computed position: q-LoRA and plain q projection, YaRN with mscale, interleaved
and rotate-half rope, chunked prefill, decode, prefix hits and preemption, with NaN-filled
free pages and shuffled blocks; and transformers' greedy tokens."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from engine_check import budget_for, hf_greedy, max_logit_diff, options, prompts, run  # noqa: E402
from mla_models import tiny_deepseek_v3 as tiny  # noqa: E402


@pytest.mark.parametrize("q_lora,yarn,interleave", [(True, True, True), (False, False, False)])
def test_logits_through_chunks_and_preemption(q_lora, yarn, interleave):
    hf = tiny(q_lora, yarn=yarn, interleave=interleave)
    a, b, c = prompts(hf.config.vocab_size, (13, 6, 19), seed=3)
    opts = options(kv_cache_bytes=budget_for(hf, 36), max_model_len=32, max_batched_tokens=8)
    engine = run(hf, [a, b, c], opts, new=6)
    assert engine.preemptions > 0
    assert max_logit_diff(hf, engine) <= 1e-4


def test_logits_with_prefix_hits():
    hf = tiny(True)
    a, b = prompts(hf.config.vocab_size, (13, 6), seed=4)
    opts = options(max_batched_tokens=8)
    engine = run(hf, [a], opts, new=3)
    turn = a + engine.outputs[0].token_ids
    run(hf, [a[:10] + b, turn + b], opts, new=4, engine=engine)
    hits = [engine.requests[o.rid].hit_tokens for o in engine.outputs[1:]]
    assert hits == [8, 12]
    assert max_logit_diff(hf, engine) <= 1e-4


def test_greedy_tokens_equal_transformers_generate():
    hf = tiny(False, yarn=True)
    ps = prompts(hf.config.vocab_size, (5, 11), seed=5)
    engine = run(hf, ps, options(max_batched_tokens=6, record_logits=False), new=8)
    for out, p in zip(engine.outputs, ps):
        assert out.token_ids == hf_greedy(hf, p, 8)


def test_per_expert_checkpoint_names_load(tmp_path):
    """save_pretrained writes per-expert tensors; the native model loads them into its
    stacked experts and gives the same logits."""
    hf = tiny(True, seed=2)
    hf.save_pretrained(tmp_path)
    a, = prompts(hf.config.vocab_size, (9,), seed=6)
    engine = run(str(tmp_path), [a], options(), new=3)
    assert max_logit_diff(hf, engine) <= 1e-4


@pytest.mark.parametrize("q_lora, method", [(True, "group_limited_greedy"), (False, "greedy")])
def test_deepseek_v2_logits_and_greedy(q_lora, method):
    from mla_models import tiny_deepseek_v2

    hf = tiny_deepseek_v2(q_lora, method)
    ps = prompts(hf.config.vocab_size, (13, 6), seed=7)
    engine = run(hf, ps, options(max_batched_tokens=8), new=5)
    assert max_logit_diff(hf, engine) <= 1e-4
    for out, p in zip(engine.outputs, ps):
        assert out.token_ids == hf_greedy(hf, p, 5)
