"""DeepSeek-V3 over the paged MLA latent cache (absorbed form) gives transformers' logits
at every computed position: q-LoRA and plain q projection, YaRN with mscale, interleaved
and rotate-half rope, chunked prefill, decode, prefix hits and preemption, with NaN-filled
free pages and shuffled blocks; and transformers' greedy tokens."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from engine_check import budget_for, hf_greedy, max_logit_diff, options, prompts, randomize_, run  # noqa: E402

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0}


def tiny(q_lora: bool, *, yarn: bool = True, interleave: bool = True, seed: int = 0):
    import torch

    cfg = transformers.DeepseekV3Config(
        vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        n_shared_experts=1, n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2,
        first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        q_lora_rank=24 if q_lora else None, kv_lora_rank=32, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=12, max_position_embeddings=64,
        rope_interleave=interleave, num_nextn_predict_layers=0,
        rope_parameters=dict(YARN) if yarn else {"rope_type": "default", "rope_theta": 10000.0},
    )
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(cfg).eval()
    randomize_(model, seed + 1)
    with torch.no_grad():  # a correction bias that changes which experts win
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.2)
    return model


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
