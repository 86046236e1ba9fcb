"""Kimi-Linear (KDA state slots + NoPE MLA on the paged latent cache) gives transformers'
logits at every computed position: chunked prefill, decode, preemption, prefix hits from
recurrent checkpoints, with NaN-filled free pages and shuffled blocks; and transformers'
greedy tokens."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import engine_check as ec  # noqa: E402
from mla_models import tiny_kimi_linear as tiny  # noqa: E402


@pytest.fixture(scope="module")
def hf():
    return tiny()


def test_layer_kinds(hf):
    from pagedkv.modeling.kimi_linear import KimiDeltaAttention, KimiLinearForCausalLM
    from pagedkv.modeling.mla import MLAAttention

    model = KimiLinearForCausalLM(hf.config)
    kinds = [type(layer.self_attn) for layer in model.model.layers]
    assert kinds == [KimiDeltaAttention, MLAAttention, KimiDeltaAttention]


def test_logits_through_chunks_and_preemption(hf):
    assert ec.preempted_logit_diff(hf, 34000, (21, 23, 25), new=7) <= ec.TOL


@pytest.mark.parametrize("every, hits", [(None, [0, 16]), (1, [8, 16])])
def test_logits_with_checkpoint_prefix_hits(hf, every, hits):
    opts = ec.options(max_batched_tokens=8, recurrent_checkpoint_every=every)
    got, diff = ec.prefix_hits_and_logit_diff(hf, opts, first_new=6)
    assert got == hits
    assert diff <= ec.TOL


def test_greedy_tokens_equal_transformers_generate():
    ours, theirs = ec.greedy_tokens(tiny(seed=3, q_lora=24), (5, 11))
    assert ours == theirs


def test_per_expert_checkpoint_names_load(tmp_path):
    hf = tiny(seed=2)
    hf.save_pretrained(tmp_path)
    a, = ec.prompts(hf.config.vocab_size, (9,), seed=6)
    engine = ec.run(str(tmp_path), [a], ec.options(), new=3)
    assert ec.max_logit_diff(hf, engine) <= ec.TOL
