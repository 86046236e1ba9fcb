"""Kimi-Linear (KDA state slots + NoPE MLA on the paged latent cache) gives transformers'
logits at every computed position: chunked prefill, decode, preemption, prefix hits from
recurrent checkpoints, with NaN-filled free pages and shuffled blocks; and transformers'
greedy tokens."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from engine_check import hf_greedy, max_logit_diff, options, prompts, randomize_, run  # noqa: E402


def tiny(seed: int = 0, q_lora: int | None = None):
    import torch

    cfg = transformers.KimiLinearConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        num_experts=8, num_experts_per_token=2, num_shared_experts=1, num_expert_group=2,
        topk_group=1, routed_scaling_factor=2.0, q_lora_rank=q_lora, kv_lora_rank=32,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
        linear_attn_config={"num_heads": 2, "head_dim": 16, "short_conv_kernel_size": 4,
                            "full_attn_layers": [2], "kda_layers": [1, 3]},
        pad_token_id=0, bos_token_id=1, eos_token_id=None,  # generate: no EOS suppression
    )
    torch.manual_seed(seed)
    model = transformers.KimiLinearForCausalLM(cfg).eval()
    randomize_(model, seed + 1)
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.2)
    return model


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
