"""DeepSeek-V3 over the paged MLA latent cache (absorbed form) gives transformers' logits
at every computed position: q-LoRA and plain q projection, YaRN with mscale, interleaved
and rotate-half rope, chunked prefill, decode, prefix hits and preemption, with NaN-filled
free pages and shuffled blocks; and transformers' greedy tokens."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import engine_check as ec  # noqa: E402
from mla_models import tiny_deepseek_v3 as tiny  # noqa: E402


@pytest.mark.parametrize("q_lora,yarn,interleave", [(True, True, True), (False, False, False)])
def test_logits_through_chunks_and_preemption(q_lora, yarn, interleave):
    hf = tiny(q_lora, yarn=yarn, interleave=interleave)
    assert ec.preempted_logit_diff(hf, ec.budget_for(hf, 36)) <= ec.TOL


def test_logits_with_prefix_hits():
    hits, diff = ec.prefix_hits_and_logit_diff(tiny(True))
    assert hits == [8, 12]
    assert diff <= ec.TOL


def test_greedy_tokens_equal_transformers_generate():
    ours, theirs = ec.greedy_tokens(tiny(False, yarn=True), (5, 11))
    assert ours == theirs


def test_per_expert_checkpoint_names_load(tmp_path):
    """save_pretrained writes per-expert tensors; the native model loads them into its
    stacked experts and gives the same logits."""
    hf = tiny(True, seed=2)
    hf.save_pretrained(tmp_path)
    a, = ec.prompts(hf.config.vocab_size, (9,), seed=6)
    engine = ec.run(str(tmp_path), [a], ec.options(), new=3)
    assert ec.max_logit_diff(hf, engine) <= ec.TOL


@pytest.mark.parametrize("q_lora, method", [(True, "group_limited_greedy"), (False, "greedy")])
def test_deepseek_v2_logits_and_greedy(q_lora, method):
    from mla_models import tiny_deepseek_v2

    hf = tiny_deepseek_v2(q_lora, method)
    ps = ec.prompts(hf.config.vocab_size, (13, 6), seed=7)
    engine = ec.run(hf, ps, ec.options(max_batched_tokens=8), new=5)
    assert ec.max_logit_diff(hf, engine) <= ec.TOL
    for out, p in zip(engine.outputs, ps):
        assert out.token_ids == ec.hf_greedy(hf, p, 5)
