"""Kimi-Linear (KDA state slots + NoPE MLA on the paged latent cache) gives transformers'
logits at every computed position: chunked prefill, decode, preemption, prefix hits from
recurrent checkpoints, with NaN-filled free pages and shuffled blocks; and transformers'
greedy tokens."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from engine_check import hf_greedy, max_logit_diff, options, prompts, run  # noqa: E402
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
    ps = prompts(hf.config.vocab_size, (21, 23, 25), seed=3)
    opts = options(kv_cache_bytes=34000, max_model_len=32, max_batched_tokens=8)
    engine = run(hf, ps, opts, new=7)
    assert engine.preemptions > 0
    assert max_logit_diff(hf, engine) <= 1e-4


@pytest.mark.parametrize("every, hits", [(None, [0, 16]), (1, [8, 16])])
def test_logits_with_checkpoint_prefix_hits(hf, every, hits):
    a, b = prompts(hf.config.vocab_size, (13, 6), seed=4)
    opts = options(max_batched_tokens=8, recurrent_checkpoint_every=every)
    engine = run(hf, [a], opts, new=6)
    turn = a + engine.outputs[0].token_ids
    run(hf, [a[:10] + b, turn + b], opts, new=4, engine=engine)
    assert [engine.requests[o.rid].hit_tokens for o in engine.outputs[1:]] == hits
    assert max_logit_diff(hf, engine) <= 1e-4


def test_greedy_tokens_equal_transformers_generate():
    hf = tiny(seed=3, q_lora=24)
    ps = prompts(hf.config.vocab_size, (5, 11), seed=5)
    engine = run(hf, ps, options(max_batched_tokens=6, record_logits=False), new=8)
    for out, p in zip(engine.outputs, ps):
        assert out.token_ids == hf_greedy(hf, p, 8)


def test_per_expert_checkpoint_names_load(tmp_path):
    hf = tiny(seed=2)
    hf.save_pretrained(tmp_path)
    a, = prompts(hf.config.vocab_size, (9,), seed=6)
    engine = run(str(tmp_path), [a], options(), new=3)
    assert max_logit_diff(hf, engine) <= 1e-4
