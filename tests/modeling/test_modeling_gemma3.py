"""Gemma 3 text over pagedkv (5:1 local/global, separate RoPE bases with linear scaling on
the global layers, final logit soft-cap) gives transformers' logits and greedy tokens;
a multimodal checkpoint's language-model names load too."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import engine_check as ec  # noqa: E402


def tiny(final_cap=3.0):
    import torch

    cfg = transformers.Gemma3TextConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=96, max_position_embeddings=64,
        sliding_window=5, query_pre_attn_scalar=20, final_logit_softcapping=final_cap,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1000.0, "factor": 4.0},
        })
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(cfg).eval()
    ec.randomize_(model, 2)
    return model


def test_layers_alternate_five_local_one_global():
    from pagedkv.models import layers_from_config

    specs = layers_from_config(tiny().config.to_dict())
    assert [s.attention.window for s in specs] == [5, 5, 5, 5, 5, None]


def test_logits_through_chunks_and_preemption():
    hf = tiny()
    assert ec.preempted_logit_diff(hf, ec.budget_for(hf, 22)) <= ec.TOL


def test_logits_with_prefix_hits_without_final_cap():
    hits, diff = ec.prefix_hits_and_logit_diff(tiny(final_cap=None), turn=False)
    assert hits == [8]
    assert diff <= ec.TOL


def test_greedy_tokens_equal_transformers_generate():
    ours, theirs = ec.greedy_tokens(tiny(), (5, 11, 3))
    assert ours == theirs


@pytest.mark.parametrize("prefix", ["model.language_model.", "language_model.model."])
def test_multimodal_names_map_to_the_language_model(prefix):
    import torch

    from pagedkv.modeling.gemma3 import Gemma3ForCausalLM

    hf = tiny()
    model = Gemma3ForCausalLM(hf.config)
    state = {(prefix + k[len("model."):] if k.startswith("model.") else k): v
             for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    state["model.vision_tower.patch.weight"] = torch.zeros(3)
    model.load_weights(state.items())
    emb = model.model.embed_tokens.weight
    assert torch.equal(emb, hf.model.embed_tokens.weight)
    assert model.lm_head.weight is emb  # tied
